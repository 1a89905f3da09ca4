"""Multi-turn episodes: environments, tools, and the runner that turns them into samples.

Submodules: ``env`` (the :class:`Environment` protocol, limits, failures), ``chat``
(token-exact conversations), ``tools`` (Hermes tool calls, the builtin tools), ``tool_env`` (the
builtin tool-use environment), ``code_env`` (write code, hidden tests, feedback), ``episode``
(:class:`EpisodeRunner`). :func:`environment_factory` turns ``agent.env`` into a factory of
fresh environments. Never imports Prefect or MLflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rl_core.agents.chat import ChatTokens
from rl_core.agents.env import (
    Environment,
    EnvironmentFailure,
    EpisodeLimits,
    Message,
    StepResult,
    Turn,
)
from rl_core.agents.episode import EpisodeRunner, episode_metrics
from rl_core.agents.tool_env import ToolEnv
from rl_core.agents.tools import (
    Tool,
    ToolCall,
    hermes_system_prompt,
    parse_tool_calls,
    resolve_tools,
)

__all__ = ["ChatTokens", "Environment", "EnvironmentFailure", "EpisodeLimits", "EpisodeRunner",
           "Message", "StepResult", "Tool", "ToolCall", "ToolEnv", "Turn", "environment_factory",
           "episode_metrics", "hermes_system_prompt", "limits_from_config", "parse_tool_calls"]


def limits_from_config(agent: Any) -> EpisodeLimits:  # noqa: ANN401 (an AgentConfig)
    return EpisodeLimits(agent.max_turns, agent.max_tokens, agent.timeout_s, agent.env_timeout_s)


def environment_factory(agent: Any, tokenizer: Any = None) -> Callable[[], Environment]:  # noqa: ANN401
    """A callable making one fresh environment per episode, as ``agent.env`` names it."""
    spec, kwargs = agent.env, dict(agent.env_args)
    if spec == "tools":
        tools = resolve_tools(agent.tools)
        template = str(getattr(tokenizer, "chat_template", "") or "")
        prompt = agent.system_prompt
        if prompt is None and "tools" not in template:
            prompt = hermes_system_prompt(list(tools.values()))
        return lambda: ToolEnv(tools, prompt, **kwargs)
    if spec == "code":  # checks the sandbox now: no bubblewrap fails the run at start-up
        from rl_core.agents.code_env import code_factory

        return code_factory(agent.env_timeout_s, **kwargs)
    if spec.startswith("verifiers:"):
        from rl_core.agents.verifiers_env import verifiers_factory

        return verifiers_factory(spec.removeprefix("verifiers:"), **kwargs)
    if spec.startswith("openenv:"):
        from rl_core.agents.openenv_env import openenv_factory

        return openenv_factory(spec.removeprefix("openenv:"), **kwargs)
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"agent.env={spec!r}: use `tools`, `code`, `verifiers:<id>`, "
                         "`openenv:<package.module:Class>` or `package.module:factory`")
    factory = getattr(importlib.import_module(module), attr)
    return lambda: factory(**kwargs)
