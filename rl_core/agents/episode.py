"""Multi-turn episodes on a rollout plane: one :class:`~rl_core.types.Sample` per episode.

:class:`EpisodeRunner` plays episodes batched by turn: one plane call per round, then every
environment at once, each call bounded by ``env_timeout_s``. Samples are token-exact (model
turns ``loss_mask`` 1, observations 0; ``text`` is the last model turn, ``meta["episode"]`` the
trace); a failed environment is retried from ``reset`` up to ``retries`` times, then recorded as
``failed`` (an infrastructure failure, masked out of the step); a :class:`CircuitBreaker` holds
the calls while the environment fails; seeds replay (docs/agents.md, 'What an episode is').
Each next prompt is compared with the template's rendering of the conversation; where they
differ (a reasoning template), ``template_mismatch`` keeps the recorded tokens or starts a new
segment (docs/agents.md, 'Reasoning templates'). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rl_core.agents.chat import TEMPLATE_MISMATCH, ChatTokens
from rl_core.agents.env import (
    Environment,
    EnvironmentFailure,
    EpisodeLimits,
    Message,
    StepResult,
    Turn,
    bounded_calls,
    check_messages,
)
from rl_core.agents.pacing import CircuitBreaker
from rl_core.agents.trajectory import Trajectory
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams, sample_seed
from rl_core.interfaces import RolloutPlane
from rl_core.secrets import RedactFilter
from rl_core.types import Sample

__all__ = ["EpisodeRunner", "episode_metrics"]

log = logging.getLogger(__name__)
log.addFilter(RedactFilter())  # environment errors may quote what they were given (keys, URLs)


@dataclass(eq=False)
class _Episode(Trajectory):
    """One episode in progress: its chain (:class:`Trajectory`) and where it stands."""

    key: tuple[int, Record, int]  # (group, task, sample index)
    make_env: Callable[[], Environment]
    attempt: int = 0
    env: Environment | None = None
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    finish: str = ""  # done | max_turns | max_tokens | timeout | failed
    started: float = 0.0  # monotonic, for the bounds
    started_at: float = 0.0  # wall clock, for traces
    messages: list[Message] = field(default_factory=list)  # the conversation so far

    def __post_init__(self) -> None:
        Trajectory.__init__(self)


class EpisodeRunner:
    """Runs episodes of ``make_env`` environments on ``plane`` (see the module docstring)."""

    def __init__(self, plane: RolloutPlane, chat: ChatTokens, make_env: Callable[[], Environment],
                 limits: EpisodeLimits | None = None, *, retries: int = 1,
                 breaker: CircuitBreaker | None = None,
                 template_mismatch: str = "keep_prefix") -> None:
        if template_mismatch not in TEMPLATE_MISMATCH:
            raise ValueError(f"template_mismatch={template_mismatch!r}: one of {TEMPLATE_MISMATCH}")
        self.template_mismatch = template_mismatch
        self.plane, self.chat, self.make_env = plane, chat, make_env
        self.limits = limits or EpisodeLimits()
        self.retries = retries
        self.breaker = breaker or CircuitBreaker(enabled=False)

    def run(self, records: Sequence[Record], *, n: int, params: SamplingParams, step: int,
            seed: int) -> list[Sample]:
        """``n`` episodes of each task, groups contiguous and prompt-major (as
        :func:`rl_core.grpo.rollout_groups` lays out single-turn samples)."""
        episodes = [_Episode((g, rec, j), self.make_env)
                    for g, rec in enumerate(records) for j in range(n)]
        self._start(episodes)
        running = [e for e in episodes if not e.finish]
        while running:
            self._model_turn(running, params, step, seed)
            self._env_turn([e for e in running if not e.finish])
            self._start([e for e in running if e.finish == "retry"])
            running = [e for e in running if not e.finish]
        return [self._sample(e, step) for e in episodes]

    # ------------------------------------------------------------------ the rounds

    def _call(self, episodes: list[_Episode], fn: Callable[[_Episode], Any]) -> list[Any]:
        """``fn(e)`` for every episode, as many at once as the breaker admits (all while it is
        closed; one probe at a time, after its cool-down, while it is open); each outcome is
        recorded in the breaker."""
        out: list[Any] = [None] * len(episodes)
        todo = list(range(len(episodes)))
        while todo:
            k = self.breaker.admit(len(todo))
            admitted, todo = todo[:k], todo[k:]
            for i, r in zip(admitted, self._call_now([episodes[i] for i in admitted], fn),
                            strict=True):
                out[i] = r
                self.breaker.record(isinstance(r, EnvironmentFailure), str(r)[:200])
        return out

    def _call_now(self, episodes: list[_Episode], fn: Callable[[_Episode], Any]) -> list[Any]:
        """``fn(e)`` for every episode concurrently, bounded (:func:`bounded_calls`)."""
        return bounded_calls(episodes, fn, self.limits.env_timeout_s)

    def _start(self, episodes: list[_Episode]) -> None:
        """Reset each episode's environment, retrying those whose reset fails."""
        while episodes:
            self._reset(episodes)
            episodes = [e for e in episodes if e.finish == "retry"]

    def _reset(self, episodes: list[_Episode]) -> None:
        def reset(e: _Episode) -> list[Message]:
            e.env = e.make_env()
            return check_messages(e.env.reset(e.key[1]), "reset()")

        for e, out in zip(episodes, self._call(episodes, reset), strict=True):
            e.started, e.started_at, e.finish = time.monotonic(), time.time(), ""
            if isinstance(out, EnvironmentFailure):
                self._fail(e, "reset", out)
                continue
            try:
                ids, text = self.chat.prompt(out)
                e.prompt_ids, e.images = self.chat.with_images(ids, out)
                e.rendered, e.root, e.history, e.messages = text, len(e.prompt_ids), 0, list(out)
            except ValueError as exc:
                self._fail(e, "reset", EnvironmentFailure("malformed", str(exc)))
                continue
            e.trace.append({"attempt": e.attempt, "role": "reset", "messages": _traced(out),
                            "tokens": len(e.prompt_ids)})

    def _model_turn(self, episodes: list[_Episode], params: SamplingParams, step: int,
                    seed: int) -> None:
        lim = self.limits
        prompts, sps = [], []
        for e in episodes:
            g, rec, j = e.key
            budget = lim.max_tokens - e.used
            prompts.append(e.prompt_ids + e.ids)
            sps.append(replace(params, max_new_tokens=max(1, min(params.max_new_tokens, budget)),
                               seed=sample_seed(seed, step, f"{rec.id}#{e.attempt}.{e.turns}", j)))
        t0 = time.monotonic()
        pictured = any(e.images for e in episodes)
        # Session affinity: every turn of an attempt to one engine (its prefix stays cached).
        keys = [f"{step}:{e.key[1].id}:{e.key[2]}#{e.attempt}" for e in episodes]
        outs = self.plane.generate(prompts, sps, routing_keys=keys, **(
            {"images": [tuple(e.images) for e in episodes]} if pictured else {}))
        seconds = time.monotonic() - t0
        for e, s in zip(episodes, outs, strict=True):
            e.model_turn(s)
            e.trace.append({"attempt": e.attempt, "role": "assistant", "text": s.text,
                            "tokens": len(s.completion_ids), "seconds": seconds,
                            "weight_version": s.weight_version,
                            "finish_reason": s.finish_reason.get("type"),
                            # which engine served the turn, and how much of it was cached
                            "engine": s.meta.get("base_url"),
                            "cached_tokens": int(s.meta.get("cached_tokens") or 0)})
            if e.used >= lim.max_tokens:
                e.finish = "max_tokens"

    def _env_turn(self, episodes: list[_Episode]) -> None:
        def step(e: _Episode) -> StepResult:
            assert e.env is not None
            result = e.env.step(Turn(e.text, e.last_turn, e.finish_reason, e.turns - 1))
            if not isinstance(result, StepResult):
                raise EnvironmentFailure("malformed", f"step() returned {type(result).__name__}, "
                                         "expected rl_core.agents.StepResult")
            check_messages(result.observation, "step() observation")
            return result

        t0 = time.monotonic()
        results = self._call(episodes, step)
        seconds = time.monotonic() - t0
        lim = self.limits
        for e, r in zip(episodes, results, strict=True):
            if isinstance(r, EnvironmentFailure):
                self._fail(e, "step", r)
                continue
            e.reward += float(r.reward)
            e.info.update(r.info)
            e.trace.append({"attempt": e.attempt, "role": "environment", "reward": r.reward,
                            "done": r.done, "seconds": seconds,
                            "messages": _traced(r.observation),
                            **{k: v for k, v in r.info.items() if k == "tool_calls"}})
            if r.done:
                e.finish = "done"
            elif e.turns >= lim.max_turns:
                e.finish = "max_turns"
            elif time.monotonic() - e.started > lim.timeout_s:
                e.finish = "timeout"
            else:
                try:
                    obs, images, rendered, split = self._next_prompt(e, r.observation or [])
                except Exception as exc:  # noqa: BLE001 (the template refused these messages)
                    self._fail(e, "step", EnvironmentFailure("malformed", str(exc)))
                    continue
                if (max(0, len(obs) - e.root) if split else e.used + len(obs)) >= lim.max_tokens:
                    e.finish = "max_tokens"  # no room for the observation and another turn
                    continue
                e.trace[-1]["tokens"] = len(obs)
                if split:
                    e.trace[-1]["segment"] = len(e.segments) + 1  # the new segment's prompt
                    e.split(obs, rendered, images)
                else:
                    e.observe(obs, images)
                    e.rendered = rendered

    def _next_prompt(self, e: _Episode, observation: list[Message]
                     ) -> tuple[list[int], list[bytes], str | None, bool]:
        """What follows the last model turn: (ids, their images, the chain's text after them,
        whether they start a new segment). The recorded chain plus the template's tokens for
        ``observation``, unless the template renders the conversation differently and
        ``template_mismatch`` is ``new_sample``: then the whole conversation's rendering."""
        chat = self.chat
        if not observation:  # the next turn follows this one: no longer a chat of messages,
            e.rendered = None  # so nothing is compared from here on
            return [], [], None, False
        e.messages += [{"role": "assistant", "content": chat.content(e.last_turn)}, *observation]
        obs, obs_text = chat.observation(observation, e.last_turn)
        if e.rendered is None:
            return (*chat.with_images(obs, observation), None, False)
        chain = e.rendered + chat.decode(e.last_turn) + obs_text
        full = chat.render(e.messages, generation_prompt=True)
        e.checks += 1
        if chain != full:  # re-rendering would not give the tokens the model saw
            e.mismatches += 1
            e.trace[-1]["template_mismatch"] = True
            if self.template_mismatch == "new_sample":
                ids, images = chat.with_images(chat.encode(full), e.messages)
                return ids, images, full, True
        obs, images = chat.with_images(obs, observation)
        return obs, images, chain, False

    def _fail(self, e: _Episode, where: str, failure: EnvironmentFailure) -> None:
        message = f"attempt {e.attempt + 1}: {where}: {failure.kind}: {failure}"
        e.errors.append(message)
        log.warning("episode %s:%s %s", e.key[1].id, e.key[2], message)
        if e.attempt < self.retries:  # start over: a fresh environment and fresh seeds
            e.attempt += 1
            e.restart(e.prompt_ids)
            e.turns, e.reward, e.info, e.finish = 0, 0.0, {}, "retry"
            e.checks = e.mismatches = 0
        else:
            e.finish = "failed"  # recorded, trained on nothing

    def _sample(self, e: _Episode, step: int) -> Sample:
        _, rec, j = e.key
        tool_calls = sum(t.get("tool_calls", 0) for t in e.trace
                         if t["role"] == "environment" and t["attempt"] == e.attempt)
        sample = e.to_sample(
            step=step, record_id=rec.id, answer=rec.answer, index=j, group=e.key[0],
            failed=e.finish == "failed", env_reward=e.reward, finish=e.finish,
            fallback_prompt=self.chat.encode(self.chat.tokenizer.eos_token or " "),
            attempts=e.attempt + 1, errors=e.errors, tool_calls=tool_calls, info=e.info,
            trace=e.trace, seconds=time.monotonic() - e.started, started_at=e.started_at)
        sample.prompt, sample.columns = rec.question, dict(rec.columns)
        return sample


def _traced(messages: Sequence[Message]) -> list[Message]:
    """Messages as the trace keeps them (JSON): an image part as its size and sha256."""
    import hashlib

    def part(p: dict[str, Any]) -> dict[str, Any]:
        if p.get("type") != "image":
            return p
        data = p["image"] if isinstance(p["image"], bytes) else str(p["image"]).encode()
        return {"type": "image", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    return [m if isinstance(m.get("content"), str) else
            {**m, "content": [part(p) for p in m["content"]]} for m in messages]


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-step agent metrics: failure rate, tool use, turns, masked share of tokens."""
    eps = [s.meta["episode"] for s in samples if "episode" in s.meta]
    if not eps:
        return {}
    tokens = sum(len(s.completion_ids) for s in samples) or 1
    n = len(eps)
    return {
        "episode_failed_frac": sum(e["status"] == "failed" for e in eps) / n,
        "episode_retried_frac": sum(e["attempts"] > 1 for e in eps) / n,
        "episode_turns_mean": sum(e["turns"] for e in eps) / n,
        "episode_tool_call_frac": sum(e["tool_calls"] > 0 for e in eps) / n,
        "episode_tool_calls_mean": sum(e["tool_calls"] for e in eps) / n,
        "episode_masked_token_frac": sum(e["masked_tokens"] for e in eps) / tokens,
        # prompts whose template rendering differed from the recorded chain, of those compared
        "agent/template_mismatch_frac": sum(e.get("template_mismatches", 0) for e in eps)
        / max(1, sum(e.get("template_checks", 0) for e in eps)),
        **{f"episode_finish_{k}_frac": sum(e["finish"] == k for e in eps) / n
           for k in ("done", "max_turns", "max_tokens", "timeout")},
    }
