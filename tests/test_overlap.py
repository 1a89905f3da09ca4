"""Rollout overlapping training (``rollout.max_staleness``) and DAPO's dynamic sampling.

- The staleness bound holds: with ``max_staleness=1`` every step from the second on trains
  on samples of the previous-but-one weights (exactly one version old), never older, and the
  histogram of sample ages says so; TIS is on by default; the prompt batches drawn ahead and
  the rollouts generated for them are in the checkpoint.
- Overlapped runs are deterministic (``max_staleness=2``): a run resumed from a checkpoint
  takes back the rollouts generated ahead and ends with the samples and weights of the
  uninterrupted run, bit for bit.
- Dynamic sampling never trains on a zero-variance group: the ledger marks them (and the
  surplus groups) as not trained, and the trained groups of each step all carry gradient.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from flows.grpo_train import grpo_train
from rl_core.config import load_config
from rl_core.grpo import split_informative_groups
from rl_core.types import Sample

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")
SMALL = ["train.prompts_per_step=8", "rollout.n_samples=4", "eval.every=0",
         "eval.num_examples=8", "eval.pass_k_examples=0", "tracking.backend=none",
         "train.num_threads=1", "rollout.engine_threads=1",
         "rollout.engine=embedded"]  # overlap needs engine processes  # fmt: skip


def _run(tmp: Path, cache: Path, name: str, *extra: str, resume: str = "never") -> dict:
    overrides = [f"storage.root={tmp}", f"storage.cache_dir={cache}", f"run_name={name}",
                 *SMALL, *extra]  # fmt: skip
    return grpo_train(config=DEMO, overrides=overrides, show_progress=False, resume=resume)


def _ledger(run_dir: Path) -> dict[int, list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return {r["step"]: r["samples"] for r in rows}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _sample(reward: float, i: int) -> Sample:
    return Sample(
        uid=str(i), group=0, record_id="r", prompt_ids=[1], completion_ids=[2], logprobs=[-1.0],
        finish_reason={"type": "stop"}, text="", answer="", weight_version=0, reward=reward,
    )  # fmt: skip


def test_informative_groups_are_the_ones_whose_rewards_differ() -> None:
    rewards = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1]  # groups of 3: equal, mixed, equal, mixed
    samples = [_sample(r, i) for i, r in enumerate(rewards)]
    kept, dropped = split_informative_groups(samples, 3)
    assert [s.uid for s in kept] == ["3", "4", "5", "9", "10", "11"]
    assert [s.uid for s in dropped] == ["0", "1", "2", "6", "7", "8"]


def test_staleness_needs_the_engines_busy_and_turns_tis_on() -> None:
    cfg = load_config(DEMO, ["rollout.max_staleness=1"])
    assert cfg.algorithm.tis_cap == 2.0
    assert load_config(DEMO, ["rollout.max_staleness=1", "algorithm.tis_cap=null"]).algorithm.tis_cap is None
    assert load_config(DEMO).algorithm.tis_cap is None
    with pytest.raises(ValueError, match="release_memory_while_training=false"):
        load_config(DEMO, ["rollout.max_staleness=1", "rollout.release_memory_while_training=true"])


def test_one_step_off_policy_bound_holds_and_resume_consumes_the_same_prompts(
    prefect_harness, tiny_cache: Path, tmp_path: Path
) -> None:
    straight = _run(tmp_path, tiny_cache, "stale", "train.steps=4", "rollout.max_staleness=1",
                    "checkpoint.every=2")  # fmt: skip
    run = Path(straight["run_dir"])
    ledger = _ledger(run)
    assert sorted(ledger) == [1, 2, 3, 4]
    for step, rows in ledger.items():
        versions = {r["weight_version"] for r in rows}
        # step 1 has nothing to overlap with; afterwards, generated while step-1 trained
        assert versions == ({0} if step == 1 else {step - 2}), (step, versions)
    metrics = _metrics(run)
    assert [m["staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [(m["staleness_frac/0"], m["staleness_frac/1"]) for m in metrics] == [
        (1.0, 0.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)]  # the histogram of sample ages
    assert all("tis_mean" in m or "tis_max" in m for m in metrics), sorted(metrics[0])
    ckpt = run / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert [p[0] for p in state["sampler"]["pending"]] == [3]  # drawn ahead, not trained
    buffer = json.loads((ckpt / "rollouts.json").read_text())  # ... and generated
    assert [row["step"] for row in buffer] == [3]
    assert [s["uid"] for s in buffer[0]["samples"]] == [r["uid"] for r in ledger[3]]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "model" / "model.safetensors")


def test_an_overlapped_run_resumed_from_a_checkpoint_repeats_bit_for_bit(
    prefect_harness, tiny_cache: Path, tmp_path: Path
) -> None:
    """max_staleness=2: a run resumed from the step-2 checkpoint of another takes back the
    rollouts generated ahead (steps 3 and 4), generates step 5 as the uninterrupted run did,
    and ends with the same samples and weights (so the overlapped steps repeat bit for bit:
    their engines' scheduling does not leak into the samples)."""
    import torch

    args = ["train.steps=5", "rollout.max_staleness=2", "checkpoint.every=2", "checkpoint.keep_last=3"]
    first = Path(_run(tmp_path, tiny_cache, "first", *args)["run_dir"])
    a = _weights(first)

    copy = tmp_path / "resumed" / "checkpoints" / "step-000002"
    shutil.copytree(first / "checkpoints" / "step-000002", copy)
    resumed = _run(tmp_path, tiny_cache, "resumed", *args, resume="always")
    assert resumed["resumed_from_step"] == 2
    again, ledger = _ledger(Path(resumed["run_dir"])), _ledger(first)
    for step in (3, 4, 5):
        assert again[step] == ledger[step], f"step {step} differs after the resume"
    c = _weights(Path(resumed["run_dir"]))
    assert all(torch.equal(a[k], c[k]) for k in a), "the resumed run ends with other weights"


def test_dynamic_sampling_never_trains_on_a_zero_variance_group(
    prefect_harness, tiny_cache: Path, tmp_path: Path
) -> None:
    out = _run(tmp_path, tiny_cache, "dapo", "train.steps=3", "algorithm.dynamic_sampling=true",
               "algorithm.dynamic_sampling_max_rounds=3")  # fmt: skip
    run = Path(out["run_dir"])
    metrics = _metrics(run)
    for step, rows in _ledger(run).items():
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            groups[r["uid"].rsplit(":", 1)[0]].append(r)
        trained = [g for g in groups.values() if g[0]["trained"]]
        assert all(len({r["trained"] for r in g}) == 1 for g in groups.values())
        assert all(len({r["reward"] for r in g}) > 1 for g in trained), step
        assert len(trained) <= 8
        m = metrics[step - 1]
        assert m["dynamic_sampling_kept_groups"] == len(trained)
        assert (m["dynamic_sampling_zero_var_groups"] + m["dynamic_sampling_surplus_groups"]
                == len(groups) - len(trained))  # fmt: skip
        assert len(groups) == 8 * m["dynamic_sampling_rounds"]
    assert any(m["dynamic_sampling_zero_var_groups"] > 0 for m in metrics)
