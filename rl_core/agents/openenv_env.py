"""The OpenEnv connector: an OpenEnv (``openenv-core``) environment as a grpoflow environment.

``agent.env: openenv:<package.module:EnvClass>`` or ``openenv:http://host:port`` (openenv-core
0.3.0; :func:`openenv_factory`): the environment's ``reset``/``step`` give observations, rewards
and ``done``, the model's turn is the action; the class runs in-process or behind OpenEnv's HTTP
app. Actions, observations, ``env_args``: docs/agents.md, 'Environment hubs'; failures and the
event loop: :mod:`rl_core.agents.connectors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import socket
import threading
import typing
import uuid
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from rl_core.agents.connectors import ROLES, hub_loop, message_text, require_hub, wait_on_hub
from rl_core.agents.env import EnvironmentFailure, Message, StepResult, Turn
from rl_core.data.records import Record

__all__ = ["OpenEnvEnv", "OpenEnvFactory", "openenv_factory"]

_TEXT_FIELDS = ("content", "message", "text", "prompt", "observation")


def _environment_types(cls: type) -> tuple[type | None, type | None]:
    """(action class, observation class) from ``class E(Environment[Act, Obs, State])``."""
    from openenv.core.env_server import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if (len(args) >= 2 and isinstance(args[0], type) and issubclass(args[0], Action)
                    and isinstance(args[1], type) and issubclass(args[1], Observation)):
                return args[0], args[1]
    return None, None


class _InvalidActionError(ValueError):
    """The model's turn is not an action the environment accepts."""


class _InProcess:
    """The OpenEnv environment object in this process (one per episode)."""

    def __init__(self, cls: type, action_cls: type, kwargs: dict[str, Any]) -> None:
        self.env, self.action_cls = cls(**kwargs), action_cls
        self.closed = False

    def reset(self, **kw: Any) -> dict[str, Any]:  # noqa: ANN401
        from openenv.core.env_server import serialize_observation

        return serialize_observation(self.env.reset(**_accepted(self.env.reset, kw)))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        from openenv.core.env_server import deserialize_action, serialize_observation
        from pydantic import ValidationError

        try:
            typed = deserialize_action(action, self.action_cls)
        except ValidationError as e:
            raise _InvalidActionError(str(e)) from e
        return serialize_observation(self.env.step(typed))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.env.close()


class _Remote:
    """An OpenEnv server session over its WebSocket (one per episode)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        from openenv.core import GenericEnvClient

        self.timeout_s = timeout_s
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout_s,
                                       message_timeout_s=timeout_s)

    def _run(self, coro: Coroutine[Any, Any, Any]) -> dict[str, Any]:
        try:
            result = wait_on_hub(coro, self.timeout_s + 5, "the OpenEnv server")
        except RuntimeError as e:  # the server's answer to a bad message
            if "VALIDATION_ERROR" in str(e):
                raise _InvalidActionError(str(e)) from e
            raise
        return {"observation": result.observation, "reward": result.reward,
                "done": result.done}

    def reset(self, **kw: Any) -> dict[str, Any]:  # noqa: ANN401
        return self._run(self.client.reset(**kw))

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return self._run(self.client.step(action))

    async def aclose(self) -> None:
        """End the session: the protocol's ``close`` message, then wait for the *server* to
        close the socket (when the client closes first, as ``client.close()`` does, OpenEnv
        0.3.0's server fails its own close and logs an ASGI error for every episode)."""
        ws, self.client._ws = self.client._ws, None
        if ws is None:
            return
        try:
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), 5.0)
        finally:
            await ws.close()

    def close(self) -> None:
        # Not waited for: it may run from a finalizer on the runner's thread; bounded above.
        with contextlib.suppress(RuntimeError):  # the loop is gone at interpreter exit
            asyncio.run_coroutine_threadsafe(self.aclose(), hub_loop())


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` declares (all with ``**kwargs``), as OpenEnv's server
    filters them."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


class _Server:
    """OpenEnv's own HTTP app for an environment class, served by uvicorn on 127.0.0.1."""

    def __init__(self, cls: type, action_cls: type, observation_cls: type,
                 kwargs: dict[str, Any], max_sessions: int) -> None:
        import functools

        from openenv.core.env_server import create_fastapi_app

        factory = functools.partial(cls, **kwargs) if kwargs else cls
        self.app = create_fastapi_app(factory, action_cls, observation_cls,
                                      max_concurrent_envs=max_sessions)
        self.url = ""
        self._server: Any = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # an ephemeral port, known before the server starts
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                     lifespan="on"))
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: its exception says why
                self._task.result()
                raise RuntimeError("uvicorn exited before it started")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)


class OpenEnvFactory:
    """Makes an :class:`OpenEnvEnv` per episode (see :func:`openenv_factory`)."""

    def __init__(self, spec: str, *, transport: str = "inprocess",
                 env_kwargs: dict[str, Any] | None = None,
                 reset_args: dict[str, Any] | None = None, action_field: str | None = None,
                 observation_field: str | None = None, observation_role: str = "user",
                 system_prompt: str | None = None, max_sessions: int | None = None,
                 call_timeout_s: float = 30.0) -> None:
        require_hub("openenv.core", f"openenv:{spec}")
        if observation_role not in ROLES:
            raise ValueError(f"agent.env_args.observation_role={observation_role!r}: use one of "
                             f"{list(ROLES)}")
        if transport not in ("inprocess", "http"):
            raise ValueError(f"agent.env_args.transport={transport!r}: use `inprocess` (the "
                             "environment object in this process) or `http` (OpenEnv's server)")
        self.spec, self.name = spec, f"OpenEnv env {spec!r}"
        self.env_kwargs, self.reset_args = dict(env_kwargs or {}), dict(reset_args or {})
        self.observation_field, self.observation_role = observation_field, observation_role
        self.system_prompt, self.call_timeout_s = system_prompt, call_timeout_s
        self.url: str | None = None
        self.cls: type | None = None
        self.action_cls: type | None = None
        self._server: _Server | None = None
        self._sessions: weakref.WeakSet[_Remote] = weakref.WeakSet()
        self._lock = threading.Lock()
        if "://" in spec:  # a server already running
            self.url, self.transport = spec, "http"
            schema = self._remote_schema()
        else:
            module, sep, attr = spec.partition(":")
            if not sep:
                raise ValueError(f"agent.env=openenv:{spec}: use `openenv:package.module:Class` "
                                 "(an OpenEnv Environment) or `openenv:http://host:port`")
            from openenv.core.env_server import Environment

            self.cls = getattr(importlib.import_module(module), attr)
            if not (isinstance(self.cls, type) and issubclass(self.cls, Environment)):
                raise ValueError(f"agent.env=openenv:{spec} is {self.cls!r}, not a subclass of "
                                 "openenv.core.env_server.Environment")
            self.action_cls, self.observation_cls = _environment_types(self.cls)
            if self.action_cls is None or self.observation_cls is None:
                raise ValueError(f"agent.env=openenv:{spec}: cannot tell its action and "
                                 "observation types; declare the class as Environment[Action"
                                 "Type, ObservationType, StateType]")
            self.transport = transport
            schema = self.action_cls.model_json_schema()
            # A step's episodes play at once, each its own instance (OpenEnv's opt-in):
            if not getattr(self.cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
                raise ValueError(
                    f"agent.env=openenv:{spec}: {self.cls.__name__} does not declare "
                    "SUPPORTS_CONCURRENT_SESSIONS = True, and grpoflow plays many episodes "
                    "at once, each with its own instance; declare it if its instances share no "
                    "mutable state")
            self.max_sessions = max_sessions or 4096
        required = [f for f in schema.get("required", []) if f != "metadata"]
        if action_field is None and len(required) == 1:
            action_field = required[0]
        if action_field is not None and action_field not in schema.get("properties", {}):
            raise ValueError(f"agent.env_args.action_field={action_field!r}: {self.name}'s "
                             f"action has fields {sorted(schema.get('properties', {}))}")
        self.action_field = action_field

    def _remote_schema(self) -> dict[str, Any]:
        import httpx

        try:
            base = (self.url or "").replace("ws://", "http://", 1).replace("wss://", "https://", 1)
            response = httpx.get(f"{base.rstrip('/')}/schema", timeout=self.call_timeout_s)
            response.raise_for_status()
            return response.json()["action"]
        except Exception as e:
            raise ValueError(f"agent.env=openenv:{self.spec}: cannot read the server's action "
                             f"schema at {self.url}/schema: {type(e).__name__}: {e}") from e

    def __call__(self) -> OpenEnvEnv:
        return OpenEnvEnv(self)

    def session(self) -> _InProcess | _Remote:
        """A fresh environment session: an object here, or a session on the server."""
        if self.transport == "inprocess":
            assert self.cls is not None and self.action_cls is not None
            return _InProcess(self.cls, self.action_cls, self.env_kwargs)
        with self._lock:
            if self.url is None:
                assert self.cls is not None and self.action_cls is not None
                server = _Server(self.cls, self.action_cls, self.observation_cls,
                                 self.env_kwargs, self.max_sessions)
                wait_on_hub(server.start(), max(self.call_timeout_s, 30.0), f"{self.name} server",
                      "call_timeout_s")
                self._server, self.url = server, server.url
        remote = _Remote(self.url, self.call_timeout_s)
        self._sessions.add(remote)
        return remote

    def close(self) -> None:
        """End the sessions still open and stop the server this factory started, if any
        (idempotent)."""
        with self._lock:
            server, self._server = self._server, None
            sessions = list(self._sessions)
            if server is not None:
                self.url = None

        async def stop() -> None:
            await asyncio.gather(*(r.aclose() for r in sessions), return_exceptions=True)
            if server is not None:
                await server.stop()

        with contextlib.suppress(Exception):
            wait_on_hub(stop(), 20.0, f"{self.name} shutdown")


def _close_session(session: _InProcess | _Remote) -> None:
    with contextlib.suppress(Exception):
        session.close()


class OpenEnvEnv:
    """One episode of an OpenEnv environment, as a grpoflow environment."""

    def __init__(self, factory: OpenEnvFactory) -> None:
        self.factory, self.name = factory, factory.name
        self._session: _InProcess | _Remote | None = None

    def reset(self, task: Record) -> list[Message]:
        f = self.factory
        kwargs = {**f.reset_args, "episode_id": f"{task.id}-{uuid.uuid4().hex[:12]}",
                  "question": task.question, "answer": task.answer, "task_id": task.id}
        try:
            out = self._call(lambda: self._open().reset(**kwargs), "reset()")
        except _InvalidActionError as e:
            raise EnvironmentFailure("malformed", f"{self.name}: reset() refused its "
                                     f"arguments: {e}") from e
        if out.get("done"):
            raise EnvironmentFailure("malformed", f"{self.name}: reset() returned an episode "
                                     "that is already done")
        system = [{"role": "system", "content": f.system_prompt}] if f.system_prompt else []
        return [*system, *self._messages(out.get("observation") or {})]

    def step(self, turn: Turn) -> StepResult:
        if self._session is None:
            raise EnvironmentFailure("malformed", f"{self.name}: step() before reset()")
        try:
            action = self._action(turn.text)
            out = self._call(lambda: self._session.step(action), "step()")
        except _InvalidActionError as e:
            self.close()
            return StepResult(done=True, info={"invalid_action": str(e)[:500]})
        observation = out.get("observation") or {}
        done = bool(out.get("done"))
        info = {"tool_calls": observation["tool_calls"]} if isinstance(
            observation.get("tool_calls"), int) else {}
        result = StepResult(self._messages(observation), float(out.get("reward") or 0.0), done,
                            info)
        if done:
            self.close()
        return result

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            _close_session(session)

    def _open(self) -> _InProcess | _Remote:
        self.close()  # a second reset starts a fresh session
        self._session = self.factory.session()
        # Ends the session when grpoflow drops the episode (max_turns, a failure, ...).
        weakref.finalize(self, _close_session, self._session)
        return self._session

    def _call(self, fn: Callable[[], dict[str, Any]], where: str) -> dict[str, Any]:
        try:
            return fn()
        except (EnvironmentFailure, _InvalidActionError):
            raise
        except Exception as e:
            raise EnvironmentFailure("error", f"{self.name}: {where}: {type(e).__name__}: "
                                     f"{e}") from e

    def _action(self, text: str) -> dict[str, Any]:
        if self.factory.action_field is not None:
            return {self.factory.action_field: text}
        try:
            action = json.loads(text)
        except json.JSONDecodeError as e:
            raise _InvalidActionError(f"the action is not a JSON object ({e.msg})") from e
        if not isinstance(action, dict):
            raise _InvalidActionError("the action is not a JSON object")
        return action

    def _messages(self, observation: dict[str, Any]) -> list[Message]:
        f = self.factory
        listed = observation.get("messages")
        if isinstance(listed, list) and f.observation_field is None:
            out = []
            for m in listed:
                if not (isinstance(m, dict) and m.get("role") in ROLES):
                    raise EnvironmentFailure("malformed", f"{self.name}: observation message "
                                             f"{str(m)[:120]!r} needs a role in {list(ROLES)}")
                out.append({"role": m["role"], "content": message_text(m.get("content"))})
            return out
        role = observation.get("role")
        role = role if role in ROLES else f.observation_role
        names = [f.observation_field] if f.observation_field else list(_TEXT_FIELDS)
        for name in names:
            if isinstance(observation.get(name), str):
                return [{"role": role, "content": observation[name]}]
        if f.observation_field:
            raise EnvironmentFailure(
                "malformed", f"{self.name}: the observation has no text field "
                f"{f.observation_field!r} (it has {sorted(observation)})")
        return [{"role": role, "content": json.dumps(observation, sort_keys=True, default=str)}]


def openenv_factory(spec: str, **kwargs: Any) -> OpenEnvFactory:  # noqa: ANN401
    """``agent.env: openenv:<spec>``: a factory of :class:`OpenEnvEnv` episodes. ``spec``:
    ``package.module:Class`` or a running server's URL; ``kwargs``: ``agent.env_args``
    (docs/agents.md, 'Environment hubs')."""
    return OpenEnvFactory(spec, **kwargs)
