"""The agent side of a GRPO step: episodes instead of single completions, and their scores.

:class:`AgentEpisodes` plays ``n`` episodes per task, of an environment (``agent.env``) or a
black-box program (``agent.program``), adds ``reward.fn``'s score of the final answer
(``agent.score_final_answer``) and keeps the failure budget (``agent.max_failed_steps``:
:class:`EpisodeFailureError`); docs/agents.md. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from rl_core.agents import ChatTokens, EpisodeRunner, environment_factory, limits_from_config
from rl_core.agents.episode import episode_metrics
from rl_core.agents.pacing import AdaptiveConcurrency, CircuitBreaker, plane_loads
from rl_core.agents.roles import RoleEpisodeRunner, role_metrics, role_runner
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.interfaces import RolloutPlane
from rl_core.rewards import RewardResult, Scorer
from rl_core.types import Sample

__all__ = ["AgentEpisodes", "EpisodeFailureError"]


class EpisodeFailureError(RuntimeError):
    """Too many episodes failed in ``steps`` consecutive steps (``agent.max_failed_steps``)."""

    def __init__(self, steps: int, frac: float, last_error: str) -> None:
        self.steps, self.frac, self.last_error = steps, frac, last_error
        super().__init__(
            f"more than agent.max_failed_frac of the episodes failed in {steps} consecutive "
            f"steps (agent.max_failed_steps={steps}; last step: {frac:.0%}); last error: "
            f"{last_error}. Fix the environment or agent program (run one episode by hand: "
            "docs/agents.md), raise agent.env_timeout_s / agent.timeout_s if it timed out, or "
            "set agent.max_failed_steps=0 to carry on")

    def __reduce__(self):  # picklable across process boundaries (Prefect results, Ray)
        return (type(self), (self.steps, self.frac, self.last_error))


class AgentEpisodes:
    """Episodes on ``plane`` as ``agent`` configures them (see the module docstring)."""

    def __init__(self, agent: Any, plane: RolloutPlane, tokenizer: Any,  # noqa: ANN401
                 vision: Any = None) -> None:  # noqa: ANN401
        self.cfg, self.plane = agent, plane
        self.chat = ChatTokens(tokenizer, vision)  # vision: image observations (docs/vlm.md)
        self.limits = limits_from_config(agent)
        self.runner: EpisodeRunner | RoleEpisodeRunner | None = None
        self.gateway: Any = None
        self.factory: Any = None
        self.failed_streak = 0
        b, c = agent.breaker, agent.concurrency
        self.breaker = CircuitBreaker(failure_rate=b.failure_rate, window=b.window,
                                      min_calls=min(b.min_calls, b.window),
                                      cooldown_s=b.cooldown_s, max_pause_s=b.max_pause_s,
                                      enabled=b.enabled)
        self.concurrency = AdaptiveConcurrency(
            plane_loads(plane), start=c.max_episodes, lo=min(c.min_episodes, c.max_episodes),
            hi=c.max_episodes, max_waiting=c.max_waiting, kv_high=c.kv_high, enabled=c.adaptive)
        if agent.env is not None:
            self.factory = environment_factory(agent, tokenizer)
            # an environment that declares roles: a sample per role (docs/agents.md)
            self.runner = role_runner(agent, plane, self.chat, self.factory, self.limits) or \
                EpisodeRunner(plane, self.chat, self.factory, self.limits,
                              retries=agent.episode_retries, breaker=self.breaker,
                              template_mismatch=agent.template_mismatch)
        else:
            from rl_core.agents.gateway import AgentGateway

            module, _, attr = agent.program.partition(":")
            self.program = getattr(importlib.import_module(module), attr)
            self.gateway = AgentGateway(plane, self.chat,
                                        template_mismatch=agent.template_mismatch).start()

    def episodes(self, records: Sequence[Record], prompt_ids: Sequence[Sequence[int]] = (), *,
                 n: int, params: SamplingParams, step: int, seed: int) -> list[Sample]:
        """``n`` episodes of each task, groups contiguous (as single-turn rollouts); the
        environment or program writes the prompt (``prompt_ids`` is not read)."""
        if self.runner is not None:
            return self.runner.run(records, n=n, params=params, step=step, seed=seed)
        from rl_core.agents.programs import run_programs

        return run_programs(self.gateway, self.program, records, n=n, params=params, step=step,
                            seed=seed, limits=self.limits, retries=self.cfg.episode_retries,
                            concurrency=self.concurrency, breaker=self.breaker)

    def score(self, samples: Sequence[Sample], rewards: Scorer, *, pass_threshold: float,
              step: int | None = None, budget: bool = True) -> RewardResult:
        """Set each episode's ``reward`` and ``correct``: the environment's reward, plus
        ``reward.fn``'s score of the final answer when ``agent.score_final_answer`` (a failed
        episode scores 0 and is not ``valid``: docs/agents.md, 'Failures are not rewards').
        The result holds the episodes' rewards and the reward function's
        failure counts, if it ran."""
        result = None
        if self.cfg.score_final_answer:
            result = rewards.score([s.text for s in samples], [s.answer for s in samples],
                                   step=step, budget=budget,
                                   record_ids=[s.record_id for s in samples],
                                   prompts=[s.prompt for s in samples],
                                   columns=[s.columns for s in samples])
        for i, s in enumerate(samples):
            ep = s.meta["episode"]
            # An episode whose environment or program failed after its retries, or whose final
            # answer the reward function could not score, is an infrastructure failure: not a
            # reward of 0 (masked out of its group's statistics and the loss).
            s.valid = ep["status"] != "failed" and not (result is not None and result.failed
                                                        and result.failed[i])
            if ep["status"] == "failed":
                s.reward, s.correct = 0.0, False
            elif result is not None:
                s.reward = float(ep["env_reward"]) + float(result.scores[i])
                s.correct = bool(result.correct[i])
            else:
                s.reward = float(ep["env_reward"])
                s.correct = bool(ep["info"].get("correct", s.reward >= pass_threshold))
            ep["outcome"] = s.outcome
        out = RewardResult([s.reward for s in samples], [s.correct for s in samples],
                           failed=[not s.valid for s in samples])
        if result is not None:
            out.num_errors, out.num_timeouts, out.errors = (result.num_errors,
                                                            result.num_timeouts, result.errors)
            out.failed_streak, out.last_error = result.failed_streak, result.last_error
            out.components = result.components
        return out

    def check(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The episodes' metrics (:func:`episode_metrics`) and the failure budget."""
        pacing = {**self.breaker.metrics(),
                  **(self.concurrency.metrics() if self.gateway is not None else {})}
        return {**episode_metrics(samples), **role_metrics(samples), **pacing,
                **self.check_failures(samples)}

    def check_failures(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Count the step against ``agent.max_failed_steps``; raise when the budget is spent."""
        failed = [s for s in samples if s.meta["episode"]["status"] == "failed"]
        frac = len(failed) / max(len(samples), 1)
        self.failed_streak = self.failed_streak + 1 if failed and frac > self.cfg.max_failed_frac \
            else 0
        limit = self.cfg.max_failed_steps
        if limit and self.failed_streak >= limit:
            raise EpisodeFailureError(limit, frac, failed[-1].meta["episode"]["errors"][-1])
        return {"episode_failed_streak": float(self.failed_streak)}

    def close(self) -> None:
        """Stop the gateway, or what the environment factory serves (a hub's servers)."""
        if self.gateway is not None:
            self.gateway.close()
        close = getattr(self.factory, "close", None)
        if close is not None:
            close()
