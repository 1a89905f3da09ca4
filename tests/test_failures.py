"""Failures are not rewards (docs/agents.md): an infrastructure failure (an environment, a
program or a reward function that failed after its retries) is masked out of its group's
statistics and the loss, never scored 0; the circuit breaker holds calls while an environment
fails and lets it recover; the agent-program cap follows the engines' load.

Every fault is injected deterministically (the n-th call fails), and the breaker's clock and
waits are injected: nothing here depends on timing.
"""

from __future__ import annotations

import importlib
import itertools
import threading
from pathlib import Path

import pytest
import torch

from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner, StepResult, Turn
from rl_core.agents.kind import AgentEpisodes
from rl_core.agents.pacing import AdaptiveConcurrency, CircuitBreaker, EnvironmentUnavailableError
from rl_core.algorithms.advantages import group_advantages
from rl_core.config import AgentConfig
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import advantages_for, score_samples, split_informative_groups, summarize_samples
from rl_core.rewards import RewardRunner
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.types import Batch, Sample

TASKS = [Record(f"t{i}", f"What is {i} + 1?", f"#### {i + 1}") for i in range(2)]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)


def test_masked_advantages_are_the_valid_samples_own() -> None:
    gen = torch.Generator().manual_seed(0)
    for mode in ("grpo", "drgrpo"):
        for _ in range(20):
            rewards = torch.rand(12, generator=gen).round(decimals=1)
            valid = torch.rand(12, generator=gen) > 0.3
            adv = group_advantages(rewards, 4, mode, valid=valid)
            for g in range(3):
                sl = slice(4 * g, 4 * g + 4)
                v = valid[sl]
                assert torch.all(adv[sl][~v] == 0)  # masked: no advantage, whatever its reward
                if int(v.sum()) >= 2:  # the valid ones: as if the failures were never drawn
                    own = group_advantages(rewards[sl][v], int(v.sum()), mode)
                    assert torch.allclose(adv[sl][v], own, atol=1e-6)
                elif mode == "grpo":
                    assert torch.all(adv[sl] == 0)
    # All valid: bit for bit the unmasked estimator.
    r = torch.tensor([1.0, 0.0, 0.5, 0.0])
    assert torch.equal(group_advantages(r, 4, valid=torch.ones(4, dtype=torch.bool)),
                       group_advantages(r, 4))


def _sample(i: int, answer: str, text: str = "#### 1") -> Sample:
    return Sample([1, 2], [3, 4, 5], [-0.5, -0.5, -0.5], uid=f"1:{answer}:{i}", group=i // 4,
                  record_id=answer, answer=answer, text=text)


def reward_failing_on_the_second(completion: str, answer: str) -> float:
    """A reward whose sandbox dies on one sample (its completion says so)."""
    if completion == "crash":
        raise RuntimeError("sandbox died")
    return 1.0 if completion == "#### 1" else 0.0


def test_reward_failures_are_masked_not_scored_zero() -> None:
    texts = ["#### 1", "crash", "#### 2", "#### 2"]  # one right, one crash, two wrong
    samples = [_sample(i, "1", t) for i, t in enumerate(texts)]
    with RewardRunner("tests.test_failures:reward_failing_on_the_second", isolate=False) as rr:
        result = score_samples(samples, rr, step=1)
    assert result.num_errors == 1
    assert [s.valid for s in samples] == [True, False, True, True]
    assert [s.outcome for s in samples] == ["success", "infra_failure", "task_failure",
                                            "task_failure"]
    adv = advantages_for(samples, 4, "grpo")
    # The baseline is the three real rewards' (1, 0, 0), not four with a fake 0.
    assert torch.allclose(adv[[0, 2, 3]], group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3))
    assert adv[1] == 0
    batch = Batch.from_samples(samples, adv, 0)
    assert batch.response_mask[1].sum() == 0 and batch.response_mask[0].sum() == 3
    m = summarize_samples(samples, 4)
    assert m["outcome/infra_failure_frac"] == 0.25 and m["outcome/success_frac"] == 0.25
    assert m["reward_mean"] == pytest.approx(1 / 3)  # over the scored samples
    assert samples[1].ledger_row(trained=True)["valid"] is False
    # Dynamic sampling reads only real rewards: (1, fake 0) is informative, (fake 0, 0) not.
    a, b = _sample(0, "x", "#### 1"), _sample(1, "x", "crash")
    b.valid, a.reward = False, 0.0
    kept, dropped = split_informative_groups([a, b], 2)
    assert kept == [] and dropped == [a, b]


# ---------------------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="module")
def plane(demo_model: Path):
    plane = InProcessPlane(demo_model)
    yield plane
    plane.close()


class FlakyEnv:
    """Fails (ConnectionError) while a shared counter of calls says so: ``fails(n)`` of the
    n-th call (0-based, across every environment of a test) decides."""

    def __init__(self, fails, counter: itertools.count, lock: threading.Lock) -> None:
        self.fails, self.counter, self.lock = fails, counter, lock

    def _call(self) -> None:
        with self.lock:
            n = next(self.counter)
        if self.fails(n):
            raise ConnectionError(f"environment server unreachable (call {n})")

    def reset(self, task: Record) -> list[dict]:
        self._call()
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        self._call()
        return StepResult([], reward=len(turn.text) % 3 / 2, done=True)


def _envs(fails):
    counter, lock = itertools.count(), threading.Lock()
    return lambda: FlakyEnv(fails, counter, lock)


class Clock:
    """An injected clock: ``wait`` advances it instead of sleeping, and records each wait."""

    def __init__(self) -> None:
        self.now, self.waits = 0.0, []

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def test_failed_episodes_are_masked_out_of_their_group(plane, demo_model: Path,
                                                       tokenizer) -> None:
    # The first reset (call 0, whichever episode's) fails, and so does that episode's retry
    # (call 4: the only call of the second round); the other three episodes succeed.
    agents = AgentEpisodes(AgentConfig(env="tests.test_failures:FlakyEnv", episode_retries=1,
                                       score_final_answer=False), plane, tokenizer)
    agents.runner.make_env = _envs(lambda n: n in (0, 4))
    samples = agents.episodes(TASKS[:1], n=4, params=PARAMS, step=1, seed=0)
    with RewardRunner("gsm8k") as rr:
        result = agents.score(samples, rr, pass_threshold=1.0, step=1)
    valid = [s.valid for s in samples]
    assert sorted(valid) == [False, True, True, True] and result.failed == [not v for v in valid]
    bad = valid.index(False)
    assert samples[bad].meta["episode"]["outcome"] == "infra_failure"
    assert samples[bad].meta["episode"]["status"] == "failed"
    ok = [i for i in range(4) if valid[i]]
    rewards = torch.tensor([samples[i].reward for i in ok])
    adv = advantages_for(samples, 4, "grpo")
    assert adv[bad] == 0 and torch.allclose(adv[ok], group_advantages(rewards, 3))
    metrics = summarize_samples(samples, 4)
    assert metrics["outcome/infra_failure_frac"] == 0.25


def test_the_breaker_holds_calls_while_the_environment_fails_and_probes_it_back(
        plane, tokenizer) -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_rate=1.0, window=4, min_calls=4, cooldown_s=2.0,
                             max_pause_s=60.0, clock=clock, wait=clock.wait)
    # The first round of resets (calls 0-3) all fail: the breaker opens; the retries' first
    # call is a probe (after the cool-down), which succeeds and lets the others through.
    runner = EpisodeRunner(plane, ChatTokens(tokenizer), _envs(lambda n: n < 4),
                           EpisodeLimits(max_turns=2, max_tokens=64), retries=2, breaker=breaker)
    samples = runner.run(TASKS[:1], n=4, params=PARAMS, step=1, seed=0)
    assert clock.waits == [2.0] and breaker.opened == 1 and not breaker.open
    assert all(s.meta["episode"]["status"] == "ok" for s in samples)
    assert [s.meta["episode"]["attempts"] for s in samples] == [2, 2, 2, 2]
    assert breaker.metrics() == {"agent/breaker_open": 0.0, "agent/breaker_opened": 1.0,
                                 "agent/breaker_paused_s": 2.0}


def test_the_breaker_gives_up_after_max_pause_and_a_retry_probes_again() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_rate=0.5, window=4, min_calls=2, cooldown_s=1.0,
                       max_pause_s=10.0, clock=clock, wait=clock.wait)
    assert b.admit(5) == 5
    b.record(False)
    b.record(True, "refused")
    assert b.open and b.rate == 0.5
    waits = []
    with pytest.raises(EnvironmentUnavailableError, match="agent.breaker.max_pause_s.*refused"):
        while True:
            assert b.admit(5) == 1  # one probe at a time
            waits.append(clock.waits[-1])
            b.record(True, "refused")  # the probe fails too
    assert waits == [1.0, 2.0, 2.5, 2.5] and b.open  # doubling, capped at max_pause_s / 4
    assert b.admit(3) == 1 and clock.waits[-1] == 1.0  # a retried step: a fresh pause
    b.record(False)
    assert not b.open and b.admit(3) == 3
    assert CircuitBreaker(enabled=False).admit(7) == 7


def test_adaptive_concurrency_halves_under_pressure_and_grows_back() -> None:
    clock, state = Clock(), {"waiting": 0.0, "token_usage": 0.1}
    cap = AdaptiveConcurrency(lambda: [dict(state)], start=8, lo=2, hi=10, max_waiting=1,
                              kv_high=0.8, interval_s=1.0, clock=clock)
    assert cap.update(8) == 9  # saturated, engines keep up: +1
    assert cap.update(9) == 9  # read at most every interval_s
    clock.now += 1
    state["waiting"] = 5
    assert cap.update(9) == 4  # a queue: halve
    clock.now += 1
    state.update(waiting=0, token_usage=0.95)
    assert cap.update(4) == 2  # a full KV cache: halve, not below lo
    clock.now += 1
    state["token_usage"] = 0.2
    assert cap.update(1) == 2  # not saturated: stays
    assert cap.metrics() == {"agent/concurrency_cap": 2.0, "agent/concurrency_shrunk": 2.0}
    fixed = AdaptiveConcurrency(lambda: [{"waiting": 99}], start=3, hi=6, enabled=False)
    assert fixed.update(6) == 6


def test_the_engine_reports_the_load_the_cap_reads(plane) -> None:
    (row,) = plane.loads()
    assert set(row) == {"waiting", "running", "token_usage"} and row["waiting"] == 0


_BACKEND_UP = threading.Event()


def flaky_program(client, task: Record) -> float:
    """An agent program whose tool backend is down until ``_BACKEND_UP`` is set."""
    if not _BACKEND_UP.is_set():
        raise ConnectionError("tool backend unreachable")
    out = client.chat.completions.create(model="policy", max_tokens=4,
                                         messages=[{"role": "user", "content": task.question}])
    return 1.0 if out.choices[0].message.content else 0.0


def test_programs_pause_on_the_breaker_and_recover(plane, tokenizer) -> None:
    # One attempt at a time (a fixed cap of 1): episodes 0 and 1 fail while the backend is
    # down, which opens the breaker; the outage ends during its pause (the injected wait), the
    # probe (episode 2) succeeds and closes it, and the two retries go through.
    cfg = AgentConfig(program="tests.test_failures:flaky_program", episode_retries=2,
                      max_tokens=32, breaker={"failure_rate": 1.0, "window": 2, "min_calls": 2,
                                              "cooldown_s": 3.0},
                      concurrency={"adaptive": False, "max_episodes": 1, "min_episodes": 1})
    agents = AgentEpisodes(cfg, plane, tokenizer)
    clock = Clock()
    agents.breaker._clock = clock

    # The program runs from the module as agent.program names it (pytest may have imported
    # this file under another name): its flag is the one to set.
    backend_up = importlib.import_module("tests.test_failures")._BACKEND_UP

    def outage_ends(seconds: float) -> None:
        clock.wait(seconds)
        backend_up.set()

    agents.breaker._wait = outage_ends
    backend_up.clear()
    try:
        samples = agents.episodes(TASKS[:1], n=3, params=PARAMS, step=1, seed=0)
    finally:
        agents.close()
    assert all(s.meta["episode"]["status"] == "ok" for s in samples)
    assert [s.meta["episode"]["attempts"] for s in samples] == [2, 2, 1]
    assert clock.waits == [3.0] and agents.breaker.opened == 1 and not agents.breaker.open
    metrics = agents.check(samples)
    assert metrics["agent/breaker_opened"] == 1.0 and metrics["agent/concurrency_cap"] >= 1
