"""Chaos: the GRPO flow keeps training while engines die, engines hang and rewards misbehave.

Faults 1, 2 and 7 of docs/reliability.md, injected into a real training run (the demo on
CPU, two embedded engines behind the real ``sglang-router``, a real Prefect API):

* an engine process SIGKILLed mid-step: restarted and re-synced, the step completes;
* an engine SIGSTOPped (accepts connections, never answers): the health monitor's bound
  fires and the engine is replaced;
* the reward function raises, hangs past ``reward.timeout_s`` or allocates past
  ``reward.memory_limit_mb`` (tests/chaos_rewards.py): the sample scores 0, the step goes on,
  ``reward_errors`` / ``reward_timeouts`` count exactly what was injected.

Every run must finish every step with a clean sample ledger (each step's groups exactly
once, each with ``n_samples`` samples, no prompt consumed twice) and every engine back in
service at the last step's ``weight_version``.

The short variant runs in ``make test`` (a fixed plan: one kill, one hang, reward
faults on fixed call numbers). The soak (``-m soak`` or ``GRPOFLOW_SOAK=1``) runs ``GRPOFLOW_SOAK_STEPS`` (200)
steps with faults at random (seeded) and a clean run of the same config and seed; the chaos
run's final held-out accuracy must stay within ``SOAK_BAND`` of the clean run's.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from chaos import EngineChaos, engine_processes
from chaos_rewards import LOG_ENV, PLAN_ENV, parse_plan, seeded_plan

import flows.grpo_train
from rl_core.planes import get_planes
from rl_core.rollout.pool import EnginePool

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")
SEED = 1234
SOAK_BAND = 0.10  # chaos pass@1 >= clean pass@1 - this (300 held-out examples)


def _overrides(tmp: Path, cache: Path, run_name: str, steps: int, *extra: str) -> list[str]:
    return [
        f"storage.root={tmp}", f"storage.cache_dir={cache}", f"run_name={run_name}",
        f"seed={SEED}", f"train.steps={steps}", "tracking.backend=none",
        "rollout.engine=embedded", "rollout.num_engines=2", "rollout.engine_threads=1", "rollout.health_interval_s=1",
        "train.num_threads=1", *extra,
    ]  # fmt: skip


CHAOS_REWARD = [
    "reward.fn=chaos_rewards:chaos_gsm8k", "reward.timeout_s=2", "reward.memory_limit_mb=512",
]  # fmt: skip


def _train(
    overrides: list[str], monkeypatch: pytest.MonkeyPatch, chaos: EngineChaos | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the flow in this process; returns its summary and the engines' state at the end
    of training (before the planes are torn down: restarts, in service, weight_version)."""
    from flows.grpo_train import grpo_train

    seen: dict[str, Any] = {}
    real_tear_down = flows.grpo_train.tear_down

    def tear_down(handle) -> None:  # noqa: ANN001
        if chaos is not None:
            chaos.stop()
        pool = get_planes(handle).rollout.pool
        # The pool must settle by itself: every engine back, none awaiting weights.
        deadline = time.monotonic() + 120
        while not all(e.in_service for e in pool.engines) and time.monotonic() < deadline:
            time.sleep(0.5)
        seen.update(
            restarts=[e.restarts for e in pool.engines],
            in_service=[e.in_service for e in pool.engines],
            pool_version=pool.weight_version,
            versions=[pool.client.weight_version(url=e.url) if e.in_service else None
                      for e in pool.engines],  # an engine out of service cannot say
        )
        real_tear_down(handle)

    monkeypatch.setattr(flows.grpo_train, "tear_down", tear_down)
    try:
        if chaos is None:
            summary = grpo_train(config=DEMO, overrides=overrides, show_progress=False)
        else:
            with chaos:
                summary = grpo_train(config=DEMO, overrides=overrides, show_progress=False)
    finally:
        monkeypatch.setattr(flows.grpo_train, "tear_down", real_tear_down)
    return summary, seen


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_ledger(
    run_dir: Path, steps: int, groups: int, n: int, *, one_epoch: bool = True,
    max_staleness: int = 0,
) -> dict[int, list[str]]:
    """Every step once; each step trains ``groups`` prompts once, each with samples 0..n-1;
    no sample twice; every trained sample at most ``max_staleness`` versions old (0: made by
    the previous step's weights, from that step's batch) and never one marked stale or
    unused; (``one_epoch``: the run stays in its first epoch) no prompt trained twice.
    Returns step -> record ids trained."""
    rows = _rows(run_dir / "samples.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step lost or repeated"
    uids = [s["uid"] for r in rows for s in r["samples"]]
    assert len(uids) == len(set(uids)), "a sample is in the ledger twice"
    prompts: dict[int, list[str]] = {}
    for r in rows:
        step = r["step"]
        by_group: dict[str, list[int]] = {}
        for s in r["samples"]:
            if not s["trained"]:
                assert max_staleness and (s.get("stale") or s.get("unused")), s
                continue
            assert not s.get("stale") and not s.get("unused"), s
            at, record, j = s["uid"].split(":")
            age = step - 1 - s["weight_version"]  # the oldest token's version
            if max_staleness:
                assert int(at) <= step + max_staleness and 0 <= age <= max_staleness, (step, s)
            else:
                assert int(at) == step, f"step {step} holds a sample of step {at}"
                assert age == 0, s  # on-policy: the previous step's weights
            by_group.setdefault(record, []).append(int(j))
        assert len(by_group) == groups, f"step {step}: {len(by_group)} groups, want {groups}"
        for record, js in by_group.items():
            assert sorted(js) == list(range(n)), f"step {step} group {record}: samples {js}"
        prompts[step] = sorted(by_group)
    consumed = Counter(p for ps in prompts.values() for p in ps)
    assert not one_epoch or max(consumed.values()) == 1, "a prompt was consumed twice"
    return prompts


def _reward_faults(log: Path) -> Counter:
    if not log.is_file():
        return Counter()
    return Counter(line.split()[-1] for line in log.read_text().splitlines() if line.strip())


def _check_engines(seen: dict[str, Any], steps: int, chaos: EngineChaos,
                   plane_restarts: int = 0) -> None:
    assert not chaos.count("injector-error"), chaos.faults
    assert seen["in_service"] == [True, True], seen
    assert seen["pool_version"] == str(steps) and seen["versions"] == [str(steps)] * 2, seen
    # each fault is repaired by one restart (an extra one only if a probe timed out); a
    # rebuild of the planes (a step whose retries were spent) starts a new pool, whose
    # counters hold only the restarts after it
    if plane_restarts == 0:
        assert sum(seen["restarts"]) >= len(chaos.faults), (seen, chaos.faults)


def _check_rewards(run_dir: Path, log: Path, summary: dict[str, Any]) -> Counter:
    """Every planned fault happened (the run made more calls than the plan's last number),
    and the run counted exactly those."""
    injected = _reward_faults(log)
    planned = Counter(parse_plan(os.environ[PLAN_ENV]).values())
    assert injected == planned, (injected, planned)
    metrics = _rows(run_dir / "metrics.jsonl")
    evals = _rows(run_dir / "evals.jsonl")  # evaluations score with the run's reward too
    errors = sum(m["reward_errors"] for m in metrics) + sum(e["reward_errors"] for e in evals)
    timeouts = sum(m["reward_timeouts"] for m in metrics) + sum(e["reward_timeouts"] for e in evals)
    assert injected["raise"] and injected["hang"] and injected["oom"], injected
    if summary["plane_restarts"] == 0:  # a rebuilt plane scores redone steps again
        assert errors == injected["raise"] + injected["oom"], (errors, injected)
        assert timeouts == injected["hang"], (timeouts, injected)
    return injected


@pytest.mark.timeout(120)
def test_an_engine_hung_during_a_weight_update_is_taken_out_and_replaced(tmp_path: Path) -> None:
    """The monitor cannot probe while a weight update holds the pool: the update itself
    takes a silent engine out, so its retry moves the others and the monitor replaces it."""
    import signal
    import sys

    from test_router import FAKE_ENGINE

    from rl_core.weight_sync import WeightSyncError

    def push(urls: list[str], version: str) -> None:
        for url in urls:
            p.client.update_weights_from_disk("/ckpt", version, url=url)

    p = EnginePool(
        lambda i, port: [sys.executable, "-c", FAKE_ENGINE, str(port)], 2, log_dir=tmp_path,
        resync=lambda url: push([url], p.weight_version), monitor=False, health_timeout_s=1,
        failure_threshold=2, stop_timeout_s=1, startup_timeout_s=60,
    )  # fmt: skip
    def update(version: str, timeout_s: float = 60) -> None:
        with p.paused(timeout_s=timeout_s) as urls:
            push(urls, version)
            p.weight_version = version

    with p:
        hung, good = p.engines
        update("1")
        os.kill(hung.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="pause_generation .* did not finish within 3"):
            update("2", timeout_s=3)
        assert time.monotonic() - t0 < 10  # the pause's bound, not a control call's 120 s
        assert not hung.in_service and good.in_service
        assert p.client.weight_version(url=good.url) == "1"  # resumed, not half-updated
        update("2", timeout_s=10)  # the task's retry: the others move
        assert p.check_health() == [0]  # the monitor's next pass replaces the hung engine
        assert hung.in_service and hung.restarts == 1
        assert [p.client.weight_version(url=e.url) for e in p.engines] == ["2", "2"]


STREAM = ["rollout.streaming=true", "rollout.max_staleness=2", "rollout.partial_tokens=8"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_training_survives_engine_kills_hangs_and_reward_faults(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, monkeypatch, mode: str
) -> None:
    """The synchronous loop, and the stream (rounds of partial rollouts in flight across
    weight updates: a kill or a hang lands on half-generated samples, every wait bounded)."""
    steps, groups, n = 4, 8, 4
    run_dir = tmp_path / "chaos"
    log = tmp_path / "reward-faults.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    # by call number (16 evaluation calls, then 4 x 8 x 4 training calls): one of each kind, in
    # the steps the engine faults land in too; each hang costs reward.timeout_s
    monkeypatch.setenv(PLAN_ENV, "40:raise,70:hang,75:oom,140:raise")
    overrides = _overrides(
        tmp_path, tiny_cache, "chaos", steps, f"train.prompts_per_step={groups}",
        f"rollout.n_samples={n}", "rollout.timeout_s=60", "rollout.weight_sync_timeout_s=45",
        # a hung engine replaced after 2 x 5 s probes (the defaults, 3 x 20 s, take a minute)
        "rollout.health_timeout_s=5", "rollout.health_failure_threshold=2",
        "checkpoint.every=4", "eval.every=0", "eval.num_examples=16", "eval.pass_k_examples=0", *CHAOS_REWARD,
        *(STREAM if mode == "stream" else ()),
    )  # fmt: skip
    chaos = EngineChaos(run_dir / "metrics.jsonl", seed=SEED, num_engines=2, last_step=steps,
                        plan={2: "kill", 3: "hang"})  # fmt: skip
    t0 = time.monotonic()
    summary, seen = _train(overrides, monkeypatch, chaos)
    seconds = time.monotonic() - t0

    assert [f.kind for f in chaos.faults] == ["kill", "hang"], chaos.faults
    check_ledger(run_dir, steps, groups, n, max_staleness=2 if mode == "stream" else 0)
    if mode == "stream":  # samples were in flight across updates, the faults among them
        assert any(m["partial_sample_frac"] > 0 for m in _rows(run_dir / "metrics.jsonl"))
    _check_engines(seen, steps, chaos)
    injected = _check_rewards(run_dir, log, summary)
    assert not engine_processes(), "an engine outlived the run"
    print(f"chaos run: {steps} steps in {seconds:.0f}s; engine faults {chaos.faults}; "
          f"reward faults {dict(injected)}; restarts {seen['restarts']}; "
          f"plane restarts {summary['plane_restarts']}")  # fmt: skip


@pytest.mark.soak
@pytest.mark.timeout(6 * 3600)
def test_soak_chaos_run_learns_like_a_clean_run(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, monkeypatch
) -> None:
    """GRPOFLOW_SOAK_STEPS (default 200) steps of the demo with engine kills and hangs at
    random (the product's monitor settings) and seeded reward faults, against a clean run."""
    steps = int(os.environ.get("GRPOFLOW_SOAK_STEPS", "200"))
    groups, n = 16, 8
    common = [f"train.prompts_per_step={groups}", f"rollout.n_samples={n}",
              "rollout.timeout_s=120", f"checkpoint.every={max(steps // 4, 1)}",
              f"eval.every={max(steps // 4, 1)}", "eval.num_examples=300",
              "eval.pass_k_examples=0"]  # fmt: skip
    clean, _ = _train(_overrides(tmp_path, tiny_cache, "clean", steps, *common), monkeypatch)

    log = tmp_path / "reward-faults.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    calls = steps * groups * n  # training calls; 2%, 0.5% and 2% of them misbehave
    monkeypatch.setenv(PLAN_ENV, seeded_plan(SEED, calls, {
        "raise": calls // 50, "hang": calls // 200, "oom": calls // 50}))
    run_dir = tmp_path / "chaos"
    chaos = EngineChaos(run_dir / "metrics.jsonl", seed=SEED, num_engines=2, last_step=steps,
                        gap_s=(20.0, 60.0), p_hang=0.5)  # fmt: skip
    overrides = _overrides(tmp_path, tiny_cache, "chaos", steps, *common, *CHAOS_REWARD)
    summary, seen = _train(overrides, monkeypatch, chaos)

    assert chaos.count("kill") and chaos.count("hang"), chaos.faults
    # 200 steps of 16 prompts go past the first epoch (3000 prompts): compare with the clean
    # run instead; the prompts drawn do not depend on what happened
    prompts = check_ledger(run_dir, steps, groups, n, one_epoch=False)
    assert prompts == check_ledger(Path(clean["run_dir"]), steps, groups, n, one_epoch=False)
    _check_engines(seen, steps, chaos, summary["plane_restarts"])
    injected = _check_rewards(run_dir, log, summary)
    a, b = clean["last_eval"]["pass_at_1"], summary["last_eval"]["pass_at_1"]
    print(f"soak: {steps} steps; clean pass@1 {clean['first_eval']['pass_at_1']:.3f} -> "
          f"{a:.3f}; chaos -> {b:.3f}; engine faults {len(chaos.faults)} "
          f"({chaos.count('kill')} kills, {chaos.count('hang')} hangs); reward faults "
          f"{dict(injected)}; restarts {seen['restarts']}")  # fmt: skip
    assert b >= a - SOAK_BAND, f"chaos pass@1 {b:.3f} vs clean {a:.3f} (band {SOAK_BAND})"
