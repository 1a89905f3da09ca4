"""Multi-role episodes (self-play, proposer/solver, debate): a chain per role, one policy or
an adapter per role (``train.lora.per_role``: :func:`role_adapters`).

An environment declares its roles with a class attribute (``roles = ("proposer", "solver")``);
``reset(task)`` opens the first role's conversation, and each ``step(turn)`` may answer with a
:class:`RoleStep`: ``role`` names who acts next (its chain gets the ``observation``: its first
messages when it has not spoken yet), ``rewards`` credits roles by name (``reward`` goes to the
role that just acted). An environment without ``roles`` is one role and never comes here.

:class:`RoleEpisodeRunner` plays them batched by turn, like
:class:`~rl_core.agents.EpisodeRunner`, and returns one :class:`~rl_core.types.Sample` per role
per episode (that role's prompt and turns, ``loss_mask`` on its own tokens only,
``meta["role"]``), laid out task-major, then role, then episode: each (task, role) is a
contiguous group of ``n``, so GRPO's group statistics (:func:`rl_core.grpo.advantages_for`) are
per role without new math. An environment class may define ``step_rewards(envs)``: rewards that
depend on the whole step's episodes (the self-play frontier: environments/selfplay.py), one
``{role: reward}`` per episode, added after all have finished. Held-out evaluation (``step`` < 0)
gets the last role's samples only: one per attempt (docs/agents.md, 'Multi-role episodes and
self-play'). Never imports Prefect or MLflow.
"""

from __future__ import annotations

import importlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rl_core.agents.chat import ChatTokens
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
from rl_core.agents.trajectory import Trajectory
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams, sample_seed
from rl_core.interfaces import RolloutPlane
from rl_core.training.lora import role_adapter_names
from rl_core.types import Sample

__all__ = ["RoleEpisodeRunner", "RoleStep", "declared_roles", "role_adapters", "role_metrics",
           "role_runner"]

log = logging.getLogger(__name__)


@dataclass
class RoleStep(StepResult):
    """A :class:`~rl_core.agents.StepResult` that names who acts next and credits roles."""

    role: str | None = None  # who acts next (None: the role that just acted)
    rewards: dict[str, float] = field(default_factory=dict)  # per role, on top of ``reward``


def declared_roles(spec: str | None) -> tuple[tuple[str, ...], Any]:
    """The roles ``agent.env`` declares (its class's ``roles``) and that class; ``((), None)``
    for a one-role environment (the builtins, or no ``roles`` attribute)."""
    if not spec or ":" not in spec or spec.split(":", 1)[0] in ("verifiers", "openenv"):
        return (), None
    module, _, attr = spec.partition(":")
    target = getattr(importlib.import_module(module), attr)
    roles = tuple(getattr(target, "roles", ()) or ())
    if roles and (len(set(roles)) != len(roles) or not all(isinstance(r, str) and r
                                                           for r in roles)):
        raise ValueError(f"agent.env={spec!r}: roles must be distinct non-empty names, got {roles}")
    return (roles, target) if len(roles) > 1 else ((), None)


def role_adapters(cfg: Any) -> dict[str, str]:  # noqa: ANN401 (an ExperimentConfig)
    """``train.lora.per_role``: each role of ``agent.env`` -> its adapter's name
    (``<train.lora.name>-<role>``); {} when off. An ``agent.env`` without roles is an error."""
    lora = cfg.train.lora
    if not (lora.enabled and lora.per_role):
        return {}
    roles, _ = declared_roles(cfg.agent.env)
    if not roles:
        raise ValueError(f"train.lora.per_role=true trains an adapter per role, but agent.env="
                         f"{cfg.agent.env!r} declares no roles (a class attribute `roles` of two "
                         "names or more; docs/agents.md)")
    return role_adapter_names(lora, roles)


def role_runner(agent: Any, plane: RolloutPlane, chat: ChatTokens,  # noqa: ANN401 (AgentConfig)
                make_env: Callable[[], Environment], limits: EpisodeLimits
                ) -> RoleEpisodeRunner | None:  # fmt: skip
    """A :class:`RoleEpisodeRunner` when ``agent.env`` declares several roles, else None."""
    roles, target = declared_roles(agent.env)
    if not roles:
        return None
    if agent.score_final_answer:
        raise ValueError(f"agent.env={agent.env!r} declares roles {roles}: its rewards are "
                         "per role, and reward.fn would score every role's last turn; set "
                         "agent.score_final_answer=false")
    return RoleEpisodeRunner(plane, chat, make_env, roles, limits,
                             retries=agent.episode_retries,
                             step_rewards=getattr(target, "step_rewards", None))


@dataclass(eq=False)
class _Play:
    """One multi-role episode in progress."""

    key: tuple[int, Record, int]  # (task index, task, episode index)
    roles: tuple[str, ...]
    attempt: int = 0
    env: Any = None
    acting: str = ""
    chains: dict[str, Trajectory] = field(default_factory=dict)
    messages: dict[str, list[Message]] = field(default_factory=dict)  # per role, before it spoke
    rewards: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)
    finish: str = ""  # done | max_turns | max_tokens | timeout | failed | retry
    turns: int = 0
    started: float = 0.0

    def clear(self) -> None:
        self.chains = {r: Trajectory() for r in self.roles}
        self.messages = {r: [] for r in self.roles}
        self.rewards = dict.fromkeys(self.roles, 0.0)
        self.info, self.turns, self.acting, self.env = {}, 0, self.roles[0], None


class RoleEpisodeRunner:
    """Runs multi-role episodes on ``plane`` (see the module docstring)."""

    def __init__(self, plane: RolloutPlane, chat: ChatTokens, make_env: Callable[[], Environment],
                 roles: Sequence[str], limits: EpisodeLimits | None = None, *, retries: int = 1,
                 step_rewards: Callable[[list[Any]], list[dict[str, float]]] | None = None) -> None:
        if len(roles) < 2:
            raise ValueError(f"a multi-role episode needs two roles or more, got {tuple(roles)}")
        self.plane, self.chat, self.make_env = plane, chat, make_env
        self.roles, self.limits, self.retries = tuple(roles), limits or EpisodeLimits(), retries
        self.step_rewards = step_rewards

    def run(self, records: Sequence[Record], *, n: int, params: SamplingParams, step: int,
            seed: int) -> list[Sample]:
        """One sample per role of ``n`` episodes of each task: task-major, then role, then
        episode (each (task, role) a contiguous group of ``n``); ``step`` < 0 (evaluation):
        the last role's samples only, task-major."""
        plays = [_Play((g, rec, j), self.roles) for g, rec in enumerate(records) for j in range(n)]
        self._start(plays)
        running = [p for p in plays if not p.finish]
        while running:
            self._model_turn(running, params, step, seed)
            self._env_turn([p for p in running if not p.finish])
            self._start([p for p in running if p.finish == "retry"])
            running = [p for p in running if not p.finish]
        if self.step_rewards is not None:
            self._add_step_rewards(plays)
        roles = self.roles[-1:] if step < 0 else self.roles
        return [self._sample(plays[g * n + j], role, self.roles.index(role), step)
                for g in range(len(records)) for role in roles for j in range(n)]

    # ------------------------------------------------------------------ the rounds

    def _calls(self, plays: list[_Play], fn: Callable[[_Play], Any]) -> list[Any]:
        """``fn(p)`` for every episode at once, bounded (:func:`bounded_calls`)."""
        return bounded_calls(plays, fn, self.limits.env_timeout_s)

    def _start(self, plays: list[_Play]) -> None:
        def reset(p: _Play) -> list[Message]:
            p.clear()
            p.env = self.make_env()
            return check_messages(p.env.reset(p.key[1]), "reset()")

        while plays:
            for p, out in zip(plays, self._calls(plays, reset), strict=True):
                p.started, p.finish = time.monotonic(), ""
                if isinstance(out, EnvironmentFailure):
                    self._fail(p, "reset", out)
                    continue
                try:
                    self._address(p, p.roles[0], out)
                except ValueError as exc:
                    self._fail(p, "reset", EnvironmentFailure("malformed", str(exc)))
                    continue
                p.trace.append({"attempt": p.attempt, "role": "reset", "actor": p.roles[0],
                                "messages": out, "tokens": len(p.chains[p.roles[0]].prompt_ids)})
            plays = [p for p in plays if p.finish == "retry"]

    def _address(self, p: _Play, role: str, messages: list[Message]) -> int:
        """``messages`` to ``role``'s chain: its prompt while it has not spoken, else the
        template's tokens after its last turn. Returns how many tokens were added."""
        chain = p.chains[role]
        if chain.turns == 0:  # not spoken yet: its prompt is all it was told
            p.messages[role] += messages
            if not p.messages[role]:
                return 0
            before = len(chain.prompt_ids)
            chain.restart(self.chat.prompt_ids(p.messages[role]))
            return len(chain.prompt_ids) - before
        if not messages:
            return 0
        ids = self.chat.observation_ids(messages, chain.last_turn)
        chain.observe(ids)
        return len(ids)

    def _model_turn(self, plays: list[_Play], params: SamplingParams, step: int,
                    seed: int) -> None:
        lim = self.limits
        prompts, sps = [], []
        for p in plays:
            _, rec, j = p.key
            chain = p.chains[p.acting]
            prompts.append(chain.prompt_ids + chain.ids)
            sps.append(replace(params, max_new_tokens=max(1, min(params.max_new_tokens,
                                                                 lim.max_tokens - len(chain.ids))),
                               seed=sample_seed(seed, step, f"{rec.id}#{p.attempt}.{p.turns}", j)))
        keys = [f"{step}:{p.key[1].id}:{p.key[2]}#{p.attempt}" for p in plays]
        t0 = time.monotonic()
        outs = self._generate(plays, prompts, sps, keys)
        seconds = time.monotonic() - t0
        for p, s in zip(plays, outs, strict=True):
            chain = p.chains[p.acting]
            chain.model_turn(s)
            p.turns += 1
            p.trace.append({"attempt": p.attempt, "role": "assistant", "actor": p.acting,
                            "text": s.text, "tokens": len(s.completion_ids), "seconds": seconds,
                            "weight_version": s.weight_version,
                            "finish_reason": s.finish_reason.get("type")})
            if len(chain.ids) >= lim.max_tokens:
                p.finish = "max_tokens"

    def _generate(self, plays: list[_Play], prompts: list[list[int]],
                  sps: list[SamplingParams], keys: list[str]) -> list[Sample]:
        """One sample per acting role's prompt. With per-role adapters (the plane's
        ``role_adapters``, set by their weight sync: docs/lora.md) each role's turns are one
        request batch sent to its adapter (the plane's ``lora_name`` while it runs)."""
        adapters = getattr(self.plane, "role_adapters", None)
        if not adapters:
            return self.plane.generate(prompts, sps, routing_keys=keys)
        outs: list[Any] = [None] * len(plays)
        before = self.plane.lora_name
        try:
            for role in self.roles:
                idx = [i for i, p in enumerate(plays) if p.acting == role]
                if not idx:
                    continue
                self.plane.lora_name = adapters[role]
                got = self.plane.generate([prompts[i] for i in idx], [sps[i] for i in idx],
                                          routing_keys=[keys[i] for i in idx])
                for i, s in zip(idx, got, strict=True):
                    outs[i] = s
        finally:
            self.plane.lora_name = before
        return outs

    def _env_turn(self, plays: list[_Play]) -> None:
        def step(p: _Play) -> StepResult:
            chain = p.chains[p.acting]
            result = p.env.step(Turn(chain.text, chain.last_turn, chain.finish_reason,
                                     p.turns - 1))
            if not isinstance(result, StepResult):
                raise EnvironmentFailure("malformed", f"step() returned {type(result).__name__}, "
                                         "expected rl_core.agents.StepResult")
            check_messages(result.observation, "step() observation")
            nxt, rewards = getattr(result, "role", None), getattr(result, "rewards", {}) or {}
            unknown = sorted({nxt} - {None, *self.roles} | set(rewards) - set(self.roles))
            if unknown:
                raise EnvironmentFailure("malformed", f"step() named role(s) {unknown}; the "
                                         f"environment's roles are {self.roles}")
            return result

        lim = self.limits
        for p, r in zip(plays, self._calls(plays, step), strict=True):
            if isinstance(r, EnvironmentFailure):
                self._fail(p, "step", r)
                continue
            p.rewards[p.acting] += float(r.reward)
            for role, value in (getattr(r, "rewards", {}) or {}).items():
                p.rewards[role] += float(value)
            p.info.update(r.info)
            nxt = getattr(r, "role", None) or p.acting
            p.trace.append({"attempt": p.attempt, "role": "environment", "reward": r.reward,
                            "rewards": dict(getattr(r, "rewards", {}) or {}), "next": nxt,
                            "done": r.done, "messages": list(r.observation)})
            if r.done:
                p.finish = "done"
            elif p.turns >= lim.max_turns:
                p.finish = "max_turns"
            elif time.monotonic() - p.started > lim.timeout_s:
                p.finish = "timeout"
            else:
                try:
                    self._address(p, nxt, r.observation or [])
                except Exception as exc:  # noqa: BLE001 (the template refused these messages)
                    self._fail(p, "step", EnvironmentFailure("malformed", str(exc)))
                    continue
                chain = p.chains[nxt]
                if not chain.prompt_ids:
                    self._fail(p, "step", EnvironmentFailure(
                        "malformed", f"role {nxt!r} is to act but was never given messages"))
                elif len(chain.ids) >= lim.max_tokens:
                    p.finish = "max_tokens"
                else:
                    p.acting = nxt

    def _fail(self, p: _Play, where: str, failure: EnvironmentFailure) -> None:
        message = f"attempt {p.attempt + 1}: {where}: {failure.kind}: {failure}"
        p.errors.append(message)
        log.warning("episode %s:%s %s", p.key[1].id, p.key[2], message)
        if p.attempt < self.retries:
            p.attempt += 1
            p.finish = "retry"
        else:
            p.finish = "failed"

    def _add_step_rewards(self, plays: list[_Play]) -> None:
        """The environment class's ``step_rewards`` over every episode of the step (None
        for a failed one), added to each episode's roles."""
        envs = [None if p.finish == "failed" else p.env for p in plays]
        extra = self.step_rewards(envs)  # type: ignore[misc]
        if len(extra) != len(plays):
            raise ValueError(f"step_rewards returned {len(extra)} entries for {len(plays)} "
                             "episodes")
        for p, rewards in zip(plays, extra, strict=True):
            if p.finish != "failed":
                for role, value in (rewards or {}).items():
                    p.rewards[role] += float(value)

    def _sample(self, p: _Play, role: str, r: int, step: int) -> Sample:
        g, rec, j = p.key
        chain, failed = p.chains[role], p.finish == "failed"
        prompt = list(chain.prompt_ids) or self.chat.encode(self.chat.tokenizer.eos_token or " ")
        mask = [0] * len(chain.ids) if failed else list(chain.mask)
        reward = 0.0 if failed else p.rewards[role]
        episode = {"status": "failed" if failed else "ok",
                   "finish": "failed" if failed else p.finish, "turns": chain.turns,
                   "episode_turns": p.turns, "attempts": p.attempt + 1, "errors": list(p.errors),
                   "env_reward": reward, "tool_calls": 0, "info": dict(p.info),
                   "masked_tokens": len(mask) - sum(mask), "trace": p.trace,
                   "seconds": time.monotonic() - p.started}
        return Sample(prompt, list(chain.ids), list(chain.logps), dict(chain.finish_reason),
                      chain.version, chain.text, loss_mask=mask, uid=f"{step}:{rec.id}:{role}:{j}",
                      group=g * len(self.roles) + r, record_id=rec.id, answer=rec.answer,
                      prompt=rec.question, columns=dict(rec.columns), reward=reward,
                      versions=list(chain.versions), meta={"episode": episode, "role": role},
                      valid=not failed)


def role_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per role: ``role/<name>/reward_mean`` (the environment's rewards of its valid samples),
    ``role/<name>/tokens_mean`` (its model tokens) and ``role/<name>/spoke_frac`` (episodes in
    which it acted); nothing for one-role samples."""
    by_role: dict[str, list[Sample]] = {}
    for s in samples:
        if "role" in s.meta:
            by_role.setdefault(s.meta["role"], []).append(s)
    out: dict[str, float] = {}
    for role, group in by_role.items():
        rewards = [float(s.meta["episode"]["env_reward"]) for s in group if s.valid] or [0.0]
        out[f"role/{role}/reward_mean"] = statistics.fmean(rewards)
        out[f"role/{role}/tokens_mean"] = statistics.fmean(sum(s.loss_mask or []) for s in group)
        out[f"role/{role}/spoke_frac"] = statistics.fmean(
            float(s.meta["episode"]["turns"] > 0) for s in group)
    return out
