"""Tenants sampling at once share the engine's batches (issue 38): two tenants' sample jobs,
submitted together on the Tinker scheduler's sampling threads, run in one engine decode batch
(rows of both adapters in one step) with each tenant's samples equal to its samples alone, and
neither adapter is unloaded while the other's request is in flight (``max_loaded_adapters`` 1).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from conftest import EOS_ID
from engine_helpers import save_tiny_model

from grpoflow.tinker.futures import FutureStore, Result, Scheduler
from rl_core.tinker import AdamParams, Datum, SamplingParams
from rl_core.tinker.backend import MAX_LORAS_PER_BATCH, LoraBackend

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, TARGET = [5, 6, 7], [20, 21, 22, 23, EOS_ID]
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)


def ce_datum(prompt: list[int], target: list[int]) -> Datum:
    full = prompt + target
    weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(target), np.float32)
    return Datum(full[:-1], {"target_tokens": np.array(full[1:]), "weights": weights})


def test_two_tenants_share_a_decode_batch_and_sample_as_alone(tmp_path, monkeypatch):
    assert MAX_LORAS_PER_BATCH >= 2
    backend = LoraBackend({"tiny": save_tiny_model(tmp_path / "m", seed=0)}, num_threads=1)
    sched = Scheduler(["tiny"], FutureStore(), sample_threads=2)
    try:
        dirs = []
        for i, target in enumerate((TARGET, [30, 31, 32, EOS_ID])):
            backend.create_model(f"t{i}", "tiny", 4, seed=i)
            backend.forward_backward(f"t{i}", [ce_datum(PROMPT, target)], "cross_entropy")
            backend.optim_step(f"t{i}", AdamParams(learning_rate=5e-2))
            backend.save_sampler_weights(f"t{i}", tmp_path / f"a{i}")
            dirs.append(tmp_path / f"a{i}")
        monkeypatch.setattr(backend, "max_loaded_adapters", 1)  # in use: never unloaded
        alone = [backend.sample("tiny", d, PROMPT, 2, PARAMS) for d in dirs]
        assert [s.tokens for s in alone[0]] != [s.tokens for s in alone[1]]

        engine = backend._base("tiny").sampler.get()
        seen: list[list[str | None]] = []
        engine.on_step = lambda n: seen.append([s.req.lora for s in engine._running])
        submitted, cond = [0], threading.Condition()
        submit_all = engine.submit_all

        def counting(reqs):  # the event the test waits on: both tenants' requests queued
            futures = submit_all(reqs)
            with cond:
                submitted[0] += 1
                cond.notify_all()
            return futures

        monkeypatch.setattr(engine, "submit_all", counting)
        engine.pause("in_place")  # both requests wait, then start in one prefill
        rids = [sched.submit("tiny", lambda d=d: Result(json={"seqs": backend.sample(
            "tiny", d, PROMPT, 2, PARAMS)}), concurrent=True) for d in dirs]
        with cond:
            assert cond.wait_for(lambda: submitted[0] == 2, timeout=60)
        assert sched.queue_depth("tiny") == 0  # both jobs running at once
        engine.resume()

        async def results() -> list[Result | None]:
            return [await sched.store.wait(r, 120.0) for r in rids]

        together = [r.json["seqs"] for r in asyncio.run(results())]
        names = {n for step in seen for n in step}
        assert len(names) == 2 and None not in names
        assert any(len(set(step)) == 2 for step in seen)  # one decode step, both adapters
        assert engine.stats["max_batch"] >= 4  # 2 tenants x 2 samples
        for got, want in zip(together, alone, strict=True):
            assert [s.tokens for s in got] == [s.tokens for s in want]
            for g, w in zip(got, want, strict=True):
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    finally:
        sched.close()
        backend.close()


def test_engine_processes_take_rollout_max_loras_per_batch():
    """rollout.max_loras_per_batch reaches the embedded engine processes' and SGLang's
    ``--max-loras-per-batch`` (no flag for the embedded default, 1)."""
    from pathlib import Path

    from rl_core.config import load_config
    from rl_core.planes import rollout_engine_spec
    from rl_core.rollout.launch import embedded_engine_command, sglang_launch

    demo = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")

    def flag(cmd: list[str]) -> str | None:
        i = cmd.index("--max-loras-per-batch") if "--max-loras-per-batch" in cmd else -1
        return cmd[i + 1] if i >= 0 else None

    assert flag(embedded_engine_command("m")(0, 1)) is None
    assert flag(embedded_engine_command("m", max_loras_per_batch=3)(0, 1)) == "3"
    over = ["rollout.engine=embedded", "rollout.max_loras_per_batch=4"]
    command, _ = rollout_engine_spec(load_config(demo, over), "m").command()
    assert flag(command(0, 1)) == "4"
    lora = ["train.lora.rank=4"]
    assert flag(sglang_launch(load_config(demo, lora), "m").extra_args) == "1"
    launch = sglang_launch(load_config(demo, [*lora, "rollout.max_loras_per_batch=4"]), "m")
    assert flag(launch.extra_args) == "4"
