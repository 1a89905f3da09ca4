"""Rollout overlapping training (``rollout.max_staleness``) and DAPO's dynamic sampling.

- The staleness bound holds: with ``max_staleness=1`` every step from the second on trains
  on samples of the previous-but-one weights (exactly one version old), never older; TIS is
  on by default; the rollouts drawn ahead are in the checkpoint, so a resume regenerates them
  and the run consumes the same prompts as an uninterrupted one (none skipped or repeated).
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
         "train.num_threads=1", "rollout.engine_threads=1"]  # fmt: skip


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
    assert all("tis_mean" in m or "tis_max" in m for m in metrics), sorted(metrics[0])
    state = json.loads((run / "checkpoints" / "step-000002" / "state.json").read_text())
    assert [p[0] for p in state["sampler"]["pending"]] == [3]  # drawn ahead, not trained

    # Resume from step 2 in a copy of the run: the batch drawn ahead for step 3 is
    # regenerated (from the step-2 weights, so it is fresh), and steps 3-4 consume exactly
    # the prompts the uninterrupted run did.
    copy = tmp_path / "stale-resumed" / "checkpoints" / "step-000002"
    shutil.copytree(run / "checkpoints" / "step-000002", copy)
    resumed = _run(tmp_path, tiny_cache, "stale-resumed", "train.steps=4",
                   "rollout.max_staleness=1", "checkpoint.every=2", resume="always")  # fmt: skip
    assert resumed["resumed_from_step"] == 2

    def prompts(rows: list[dict]) -> list[str]:
        return [r["uid"] for r in rows]

    again = _ledger(Path(resumed["run_dir"]))
    for step in (3, 4):
        assert prompts(again[step]) == prompts(ledger[step]), step
    assert {r["weight_version"] for r in again[3]} == {2}  # regenerated after the resume


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
