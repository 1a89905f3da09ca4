"""The rollout plane the GRPO loop uses by default: embedded engine processes over HTTP.

:class:`~rl_core.rollout.remote.HttpRollout` drives real engine processes
(``python -m rl_core.rollout.server``), and with two of them the real ``sglang-router``.
Pinned here: it samples exactly what the in-process engine samples for the same seeds;
weight sync from a real trainer bumps the version and is verified by checksum; a sync that
delivers other weights, and an engine that serves a stale version, fail loudly; an engine
that dies is restarted, re-synced and serves the current weights again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import save_tiny_model
from safetensors.torch import save_file

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.data import Record
from rl_core.grpo import rollout_groups
from rl_core.rollout.local import LocalEngine
from rl_core.rollout.pool import EnginePool
from rl_core.rollout.remote import HttpRollout, embedded_engine_command, sampling_payload
from rl_core.rollout.sampler import SamplingParams
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.weight_sync import WeightSyncError, weights_checksum

pytestmark = pytest.mark.timeout(300)

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, seed=None)
RECORDS = [Record(id=f"r{i}", question=f"q{i}", answer="1") for i in range(3)]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _rollout(model: Path, tmp: Path, n: int = 1, **kw) -> HttpRollout:  # noqa: ANN003
    pool = EnginePool(
        embedded_engine_command(model, num_threads=1),
        n,
        log_dir=tmp / "engines",
        router=n > 1,
        router_policy="round_robin",
        health_interval_s=0.5,
        health_timeout_s=10,
        failure_threshold=2,
        startup_timeout_s=120,
        client_kwargs={"backoff_base_s": 0.05, "backoff_max_s": 0.5},
        **kw,
    )
    return HttpRollout(pool, model, staging_dir=tmp / "staging", request_batch_size=4).start()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def one(model_dir: Path, tmp_path_factory):
    r = _rollout(model_dir, tmp_path_factory.mktemp("one"))
    try:
        yield r
    finally:
        r.close()


def _trainer(model_dir: Path) -> TorchTrainer:
    return TorchTrainer(
        model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), temperature=1.0, max_response_len=8
    )


def test_sampling_params_travel_as_sglang_spells_them() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3, stop=["x"], seed=11)
    assert sampling_payload(p) == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 5, "min_p": 0.0, "max_new_tokens": 3,
        "ignore_eos": False, "stop": ["x"], "sampling_seed": 11,
    }  # fmt: skip


def test_http_samples_equal_the_in_process_engine(one: HttpRollout, model_dir: Path) -> None:
    """Same seeds, same samples: the HTTP path changes transport, not results."""
    torch.set_num_threads(1)
    local = LocalEngine(model_dir)
    for params in (PARAMS, SamplingParams(temperature=0.0, max_new_tokens=8)):
        kw = dict(n=4, params=params, step=3, seed=7)
        a = rollout_groups(one, RECORDS, PROMPTS, **kw)
        b = rollout_groups(local, RECORDS, PROMPTS, **kw)
        assert [s.output_ids for s in a] == [s.output_ids for s in b]
        assert [s.uid for s in a] == [s.uid for s in b]
        for x, y in zip(a, b, strict=True):
            assert x.finish_reason == y.finish_reason
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    # different sampling seeds give different groups (the test above can fail)
    c = rollout_groups(one, RECORDS, PROMPTS, n=4, params=PARAMS, step=4, seed=7)
    assert [s.output_ids for s in c] != [s.output_ids for s in a]


def test_sync_from_a_trainer_is_versioned_and_verified(
    one: HttpRollout, model_dir: Path
) -> None:
    trainer = _trainer(model_dir)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = [c.output_ids for c in one.generate(PROMPTS, greedy)]

    metrics = one.sync_from(trainer, 5)
    assert metrics["sync_bytes"] > 0 and metrics["sync_seconds"] > 0
    assert one.weight_version == 5
    url = one.pool.engine_urls[0]
    assert one.pool.client.weight_version(url=url) == "5"
    assert one.pool.client.weights_checksum(url=url) == weights_checksum(
        trainer.export_weights()
    )
    after = [c.output_ids for c in one.generate(PROMPTS, greedy)]
    local = LocalEngine(model_dir)
    local.update_weights(trainer.export_weights(), 5)
    assert after == [c.output_ids for c in local.generate(PROMPTS, greedy)]
    assert after != before
    # only the newest version stays staged (restarted engines re-sync from it)
    assert [p.name for p in one.staging_dir.iterdir()] == ["v000005"]


def test_a_sync_that_delivers_other_weights_fails_loudly(
    one: HttpRollout, model_dir: Path
) -> None:
    trainer = _trainer(model_dir)
    good = trainer.export_weights()
    corrupt = {k: v.clone() for k, v in good.items()}
    name = next(iter(corrupt))
    corrupt[name].view(-1)[0] += 1.0  # one weight off: what a broken bucket would deliver

    def write(path: Path) -> None:
        trainer.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in corrupt.items()}, path / "model.safetensors")

    with pytest.raises(WeightSyncError, match="checksum .* but the trainer exported"):
        one.push_weights(write, 6, weights_checksum(good))


def test_a_stale_engine_cannot_slip_samples_into_a_step(one: HttpRollout) -> None:
    one.weight_version = 9
    one.pool.client.update_weight_version("8", url=one.pool.engine_urls[0])
    with pytest.raises(WeightSyncError, match="weight_version 8, expected 9"):
        one.generate(PROMPTS, PARAMS)
    one.pool.client.update_weight_version("9", url=one.pool.engine_urls[0])
    assert len(one.generate(PROMPTS, PARAMS)) == 3


def test_two_engines_behind_the_router_share_work_and_survive_a_kill(
    model_dir: Path, tmp_path: Path
) -> None:
    r = _rollout(model_dir, tmp_path, n=2)
    try:
        assert r.urls == [r.pool.url]
        trainer = _trainer(model_dir)
        r.sync_from(trainer, 1)
        out = r.generate(PROMPTS * 8, PARAMS)
        assert len(out) == 24
        steps = [
            r.pool.client.server_info(url=u)["internal_states"][0]["decode_steps"]
            for u in r.pool.engine_urls
        ]
        assert all(s > 0 for s in steps), steps

        victim = r.pool.engines[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        # the client fails over to the other engine: nothing is lost
        assert len(r.generate(PROMPTS * 4, PARAMS)) == 12
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (victim.restarts and victim.in_service):
            time.sleep(0.2)
        assert victim.in_service, f"engine not back; see {victim.log_path}"
        # back at the current version with the trainer's weights
        assert r.pool.client.weight_version(url=victim.url) == "1"
        r.verify(weights_checksum(trainer.export_weights()))
    finally:
        r.close()
    assert all(not e.alive for e in r.pool.engines)


def test_distributed_sync_broadcasts_to_every_engine_and_brings_back_a_killed_one(
    model_dir: Path, tmp_path: Path
) -> None:
    """``weight_sync=distributed``: a gloo group trainer (rank 0) + two engines; each sync
    is one broadcast per tensor, posted to the engines in buckets (10 kB here, so several),
    verified against the checksum of what was sent. A killed
    engine restarts on the base model and waits out of service; the next generate (the
    trainer still holds the synced weights) re-opens the group and re-broadcasts."""
    pool = EnginePool(
        embedded_engine_command(model_dir, num_threads=1), 2, log_dir=tmp_path / "engines",
        router=False, health_interval_s=0.5, health_timeout_s=10, failure_threshold=2,
        startup_timeout_s=120, client_kwargs={"backoff_base_s": 0.05, "backoff_max_s": 0.5},
    )  # fmt: skip
    r = HttpRollout(
        pool, model_dir, staging_dir=tmp_path / "staging", request_batch_size=4,
        weight_sync="distributed", weight_sync_timeout_s=60, weight_sync_bucket_mb=0.01,
    ).start()  # fmt: skip
    trainer = _trainer(model_dir)
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            metrics = r.sync_from(trainer, version)
            expected = weights_checksum(trainer.export_weights())
            for url in pool.engine_urls:
                assert pool.client.weight_version(url=url) == str(version)
                assert pool.client.weights_checksum(url=url) == expected
        assert metrics["sync_bytes"] == 2 * sum(
            t.numel() * t.element_size() for t in trainer.export_weights().values()
        )
        assert r.weight_sync_buckets > 2 and metrics["sync_buckets"] == r.weight_sync_buckets
        first_group = r._group[0]
        assert not list(r.staging_dir.glob("v*")), "nothing is staged on disk"
        local = LocalEngine(model_dir)
        local.update_weights(trainer.export_weights(), 2)
        want = [c.output_ids for c in local.generate(PROMPTS, greedy)]
        assert [c.output_ids for c in r.generate(PROMPTS, greedy)] == want

        victim = pool.engines[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not victim.awaiting_weights:
            time.sleep(0.2)
        assert victim.awaiting_weights and not victim.in_service, victim
        assert pool.in_service_urls() == [pool.engines[0].url]
        # the next rollout brings it back first: same version, the trainer's weights
        assert [c.output_ids for c in r.generate(PROMPTS * 4, greedy)] == want * 4
        assert victim.in_service and r._group[0] != first_group
        assert pool.client.weight_version(url=victim.url) == "2"
        r.verify(weights_checksum(trainer.export_weights()))
        assert pool.client.server_info(url=victim.url)["internal_states"][0]["decode_steps"] > 0
    finally:
        r.close()
        trainer.close_weight_broadcast()
    assert all(not e.alive for e in pool.engines)


def test_colocated_engines_release_memory_for_training_and_take_it_back_to_sync(
    model_dir: Path, tmp_path: Path
) -> None:
    """Time-shared devices: after the rollout the engine frees weights and KV cache; the
    monitor does not mistake it for a dead engine; the sync takes the weights back first and
    the engine serves the trainer's new weights. Sampling never runs on released engines."""
    r = _rollout(model_dir, tmp_path)
    try:
        url = r.pool.engine_urls[0]
        trainer = _trainer(model_dir)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))

        def released() -> dict:
            return r.pool.client.server_info(url=url)["internal_states"][0]["memory_released"]

        r.release_memory()
        assert r.memory_released == {"weights", "kv_cache"}
        assert released() == {"weights": True, "kv_cache": True}
        time.sleep(2.5)  # five monitor passes at 0.5 s, failure threshold 2
        assert r.pool.engines[0].restarts == 0 and r.pool.engines[0].in_service
        r.resume_memory(["weights"])  # what LocalPlanes.sync_weights does
        r.sync_from(trainer, 1)
        r.resume_memory(["kv_cache"])
        assert released() == {"weights": False, "kv_cache": False} and not r.memory_released
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        local = LocalEngine(model_dir)
        local.update_weights(trainer.export_weights(), 1)
        want = [c.output_ids for c in local.generate(PROMPTS, greedy)]
        assert [c.output_ids for c in r.generate(PROMPTS, greedy)] == want
        r.release_memory()  # a rollout on released engines takes the memory back first
        assert [c.output_ids for c in r.generate(PROMPTS, greedy)] == want
        assert not r.memory_released
    finally:
        r.close()


def test_engines_die_with_the_process_that_started_them(model_dir: Path, tmp_path: Path) -> None:
    """An engine started with --parent-pid exits when that process is gone (SIGKILLed flows
    leave no orphans)."""
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from rl_core.rollout.remote import embedded_engine_command\n"
        "from rl_core.rollout.sglang_launcher import start_process, wait_healthy\n"
        f"cmd = embedded_engine_command({str(model_dir)!r}, num_threads=1)(0, int(sys.argv[1]))\n"
        f"p = start_process(cmd, {str(tmp_path / 'engine.log')!r})\n"
        "wait_healthy(f'http://127.0.0.1:{sys.argv[1]}', timeout_s=120, proc=p)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    from engine_helpers import free_port

    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(free_port())], stdout=subprocess.PIPE, text=True
    )
    try:
        engine_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _alive(engine_pid)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(engine_pid):
            time.sleep(0.2)
        assert not _alive(engine_pid), "the engine outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Running and not a zombie (an exited orphan waits for init to reap it)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text(errors="replace")
    except FileNotFoundError:
        return False
