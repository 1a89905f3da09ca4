"""The `verifiers` connector: a verifiers environment as a grpoflow environment.

``agent.env: verifiers:<id>`` (verifiers 0.4.0, ``verifiers.v1``; :func:`verifiers_factory`):
the env runs unchanged, and grpoflow is only its model, through a chat-completions bridge on
127.0.0.1 (each model call becomes an observation, grpoflow's next turn its response).
``env_args``, the task mapping, tool calls, limits: docs/agents.md, 'Environment hubs';
failures and the event loop: :mod:`rl_core.agents.connectors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import secrets
import sys
import threading
import time
import uuid
import weakref
from typing import Any

from rl_core.agents.connectors import ROLES, hub_loop, message_text, require_hub, wait_on_hub
from rl_core.agents.env import EnvironmentFailure, Message, StepResult, Turn
from rl_core.agents.tools import Tool, hermes_system_prompt, parse_tool_calls
from rl_core.data.records import Record

__all__ = ["VerifiersEnv", "VerifiersFactory", "verifiers_factory"]

log = logging.getLogger(__name__)


def _plugin_id(env_id: str) -> str:
    """The id verifiers' loader imports. It imports ids as top-level modules (hub ids are
    installed packages), so a dotted module path (``environments.vf_calculator``) is imported
    here and aliased under its last name, once, refusing to shadow another module."""
    parts = env_id.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return env_id  # a hub id (`owner/name@version`) or an installed top-level module
    module = importlib.import_module(env_id)
    alias = parts[-1]
    existing = sys.modules.setdefault(alias, module)
    if existing is not module:
        raise ValueError(f"agent.env=verifiers:{env_id}: verifiers imports environments by "
                         f"top-level name, and {alias!r} is already the module "
                         f"{getattr(existing, '__file__', existing)!r}; rename the environment")
    return alias


class _Call:
    """One model call the verifiers env made, waiting for grpoflow's turn."""

    def __init__(self, body: dict[str, Any], reply: asyncio.Future[dict[str, Any]]) -> None:
        self.body, self.reply = body, reply


class _Channel:
    """One episode's model calls, as the bridge receives them (lives on the hub loop)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.calls: asyncio.Queue[_Call] = asyncio.Queue()  # not yet taken by grpoflow
        self.open_calls: set[_Call] = set()  # not yet answered
        self.closed = False

    def close(self, reason: str) -> None:
        """No more calls; those still unanswered fail, so the env's program stops waiting."""
        self.closed = True
        for call in list(self.open_calls):
            if not call.reply.done():
                call.reply.set_exception(ConnectionAbortedError(reason))


class _Bridge:
    """The OpenAI-compatible chat-completions endpoint the verifiers env calls as its model
    provider: on 127.0.0.1, a random token required, one channel per episode (by model name)."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.token = secrets.token_urlsafe(16)
        self.channels: dict[str, _Channel] = {}
        self.url = ""
        self._runner: Any = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        for channel in list(self.channels.values()):
            channel.close("grpoflow closed the connector")
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: Any) -> Any:  # noqa: ANN401 (aiohttp types)
        from aiohttp import web

        def error(status: int, message: str) -> Any:  # noqa: ANN401
            return web.json_response({"error": {"message": message, "type": "grpoflow"}},
                                     status=status)

        if request.headers.get("x-grpoflow-bridge") != self.token:
            return error(401, "not a grpoflow episode")
        body = await request.json()
        channel = self.channels.get(str(body.get("model")))
        if channel is None or channel.closed:
            return error(409, f"no grpoflow episode is playing model {body.get('model')!r}")
        call = _Call(body, asyncio.get_running_loop().create_future())
        channel.open_calls.add(call)
        channel.calls.put_nowait(call)
        try:
            # grpoflow answers when the batch's next model turn is done; bounded so an episode
            # grpoflow abandoned cannot hold the env forever.
            reply = await asyncio.wait_for(asyncio.shield(call.reply), self.idle_timeout_s)
        except TimeoutError:
            return error(504, f"grpoflow gave no model turn within {self.idle_timeout_s:g}s "
                         "(agent.env_args.idle_timeout_s)")
        except ConnectionAbortedError as e:
            return error(503, f"the grpoflow episode ended: {e}")
        finally:
            channel.open_calls.discard(call)
        if not body.get("stream"):
            return web.json_response(reply)
        # verifiers' own SSE rendering of a whole completion: one chunk, then [DONE].
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        choice = reply["choices"][0]
        delta = dict(choice["message"])
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
        chunk = {**{k: v for k, v in reply.items() if k != "choices"},
                 "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta,
                              "finish_reason": choice["finish_reason"]}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _VerifiersHub:
    """The loaded verifiers ``Env`` of one factory, its bridge and serving resources."""

    def __init__(self, env: Any, env_id: str, idle_timeout_s: float) -> None:  # noqa: ANN401
        self.env, self.env_id = env, env_id
        self.bridge = _Bridge(idle_timeout_s)
        self._stack = contextlib.AsyncExitStack()
        self.template: Any = None

    async def start(self) -> None:
        await self.bridge.start()
        self._stack.push_async_callback(self.bridge.stop)
        await self._stack.enter_async_context(self.env.serving())

    async def stop(self) -> None:
        await self._stack.aclose()

    def task_for(self, record: Record) -> Any:  # noqa: ANN401 (a verifiers Task)
        taskset = self.env.taskset
        if self.template is None:
            # The taskset's own first task carries its system prompt and settings; a taskset
            # that yields nothing leaves a bare task of its type.
            self.template = next(iter(taskset), None) or type(taskset).task_type()(
                type(taskset).task_type().data_type()(), taskset.config.task)
        fields = type(self.template.data).model_fields
        update: dict[str, Any] = {"idx": None, "id": record.id, "name": record.id,
                                  "prompt": record.question}
        for name, value in (("answer", record.answer), ("question", record.question)):
            if name in fields:
                update[name] = value
        return self.template.with_data(**update)

    async def play(self, channel: _Channel, task: Any) -> Any:  # noqa: ANN401 (an Episode)
        import verifiers.v1 as vf

        ctx = vf.ModelContext(model=channel.model, client=vf.EvalClientConfig(
            base_url=self.bridge.url, api_key_var="GRPOFLOW_VF_BRIDGE_KEY",
            headers={"x-grpoflow-bridge": self.bridge.token}))
        self.bridge.channels[channel.model] = channel
        try:
            return await self.env.run_episode(task, ctx)
        finally:
            self.bridge.channels.pop(channel.model, None)
            channel.close("the verifiers episode ended")


class VerifiersFactory:
    """Makes a :class:`VerifiersEnv` per episode; all share one loaded verifiers ``Env``,
    started (bridge, serving resources) on the first episode."""

    def __init__(self, env_id: str, *, taskset: dict[str, Any] | None = None,
                 agent: dict[str, Any] | None = None, env: dict[str, Any] | None = None,
                 max_turns: int | None = None, render_tools: bool = True,
                 call_timeout_s: float = 30.0, idle_timeout_s: float = 600.0,
                 start_timeout_s: float = 120.0) -> None:
        vf = require_hub("verifiers.v1", f"verifiers:{env_id}")
        from verifiers.v1.configs.agent import agent_config_fields

        self.env_id, self.render_tools = env_id, render_tools
        self.call_timeout_s, self.start_timeout_s = call_timeout_s, start_timeout_s
        self.idle_timeout_s = idle_timeout_s
        try:
            raw: dict[str, Any] = {**(env or {}),
                                   "taskset": {**(taskset or {}), "id": _plugin_id(env_id)}}
            for name, seat in agent_config_fields(vf.resolve_env_config(raw)).items():
                over = {**dict(raw.get(name) or {}), **(agent or {})}
                # grpoflow runs on this machine: seats run in the local subprocess runtime
                # unless configured otherwise (verifiers' default is a remote sandbox).
                if "runtime" not in seat.model_fields_set:
                    over.setdefault("runtime", {"type": "subprocess"})
                if max_turns is not None:
                    over.setdefault("max_turns", max_turns)
                raw[name] = over
            self._env = vf.load_environment(vf.resolve_env_config(raw))
        except Exception as e:
            raise ValueError(f"agent.env=verifiers:{env_id}: cannot load the verifiers "
                             f"environment: {type(e).__name__}: {e}") from e
        self._hub: _VerifiersHub | None = None
        self._lock = threading.Lock()

    def __call__(self) -> VerifiersEnv:
        return VerifiersEnv(self)

    def hub(self) -> _VerifiersHub:
        """The started hub (bridge up, env serving), started once."""
        with self._lock:
            if self._hub is None:
                hub = _VerifiersHub(self._env, self.env_id, self.idle_timeout_s)
                try:
                    wait_on_hub(hub.start(), self.start_timeout_s, f"verifiers env {self.env_id!r} start",
                          "start_timeout_s")
                except EnvironmentFailure:
                    raise
                except Exception as e:
                    raise EnvironmentFailure("error", f"verifiers env {self.env_id!r} could not "
                                             f"start: {type(e).__name__}: {e}") from e
                self._hub = hub
            return self._hub

    def close(self) -> None:
        """Stop the bridge and the env's serving resources (idempotent)."""
        with self._lock:
            hub, self._hub = self._hub, None
        if hub is not None:
            with contextlib.suppress(Exception):
                wait_on_hub(hub.stop(), self.start_timeout_s, f"verifiers env {self.env_id!r} stop",
                      "start_timeout_s")


def _abandon(loop: asyncio.AbstractEventLoop, channel: _Channel, task: asyncio.Task) -> None:
    """An episode grpoflow stopped playing (finished on its side, failed, or dropped): end the
    verifiers side too, so nothing waits on a model turn that will never come."""
    def stop() -> None:
        channel.close("grpoflow stopped the episode")
        task.cancel()

    with contextlib.suppress(RuntimeError):  # the loop is gone at interpreter exit
        loop.call_soon_threadsafe(stop)


class VerifiersEnv:
    """One episode of a verifiers env, as a grpoflow environment (see the module docstring)."""

    def __init__(self, factory: VerifiersFactory) -> None:
        self.factory = factory
        self.name = f"verifiers env {factory.env_id!r}"
        self._channel: _Channel | None = None
        self._task: asyncio.Task | None = None
        self._call: _Call | None = None
        self._history: list[dict[str, Any]] = []  # the last call's messages
        self._calls = 0

    # -------------------------------------------------------------- the protocol

    def reset(self, task: Record) -> list[Message]:
        hub = self.factory.hub()
        try:
            vf_task = hub.task_for(task)
        except Exception as e:
            raise EnvironmentFailure("error", f"{self.name}: cannot make a task of record "
                                     f"{task.id!r}: {type(e).__name__}: {e}") from e
        channel = _Channel(f"grpoflow/{uuid.uuid4().hex}")

        async def start() -> asyncio.Task:
            return asyncio.ensure_future(hub.play(channel, vf_task))

        self._channel = channel
        self._task = wait_on_hub(start(), self.factory.call_timeout_s, self.name)
        weakref.finalize(self, _abandon, hub_loop(), channel, self._task)
        call = self._next()
        if call is None:
            self._finish()  # raises the episode's own errors, if it has any
            raise EnvironmentFailure("malformed", f"{self.name} ended its episode before "
                                     "asking the model anything")
        messages = [self._message(m, "its first model call") for m in call.body["messages"]]
        tools = call.body.get("tools") or []
        if tools and self.factory.render_tools:
            messages = _with_tool_prompt(messages, tools)
        self._accept(call)
        return messages

    def step(self, turn: Turn) -> StepResult:
        if self._call is None:
            raise EnvironmentFailure("malformed", f"{self.name}: step() without a model call "
                                     "waiting (reset first)")
        call, self._call = self._call, None
        reply = _completion(call.body, turn)
        assistant = reply["choices"][0]["message"]
        hub_loop().call_soon_threadsafe(_resolve, call.reply, reply)
        nxt = self._next()
        if nxt is None:
            return self._finish()
        messages = nxt.body.get("messages") or []
        before = len(self._history)
        if (len(messages) <= before or _strip(messages[:before]) != _strip(self._history)
                or messages[before].get("role") != "assistant"):
            raise EnvironmentFailure(
                "malformed", f"{self.name}: model call {self._calls} does not continue the "
                "episode's conversation (it rewrote earlier messages, or several agents share "
                "the policy); grpoflow trains one conversation per episode")
        if message_text(messages[before].get("content")) != message_text(assistant.get("content")):
            log.debug("%s re-sent the model's turn with other text; grpoflow trains on the "
                      "tokens it sampled", self.name)
        observation = [self._message(m, f"model call {self._calls}")
                       for m in messages[before + 1:]]
        self._accept(nxt)
        tools = sum(m["role"] == "tool" for m in observation)
        return StepResult(observation, info={"tool_calls": tools})

    # -------------------------------------------------------------- helpers

    def _accept(self, call: _Call) -> None:
        self._call, self._history = call, list(call.body.get("messages") or [])
        self._calls += 1

    def _message(self, m: Any, where: str) -> Message:  # noqa: ANN401
        role = m.get("role") if isinstance(m, dict) else None
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise EnvironmentFailure("malformed", f"{self.name}: {where} has a message with "
                                     f"role {role!r}; expected one of {list(ROLES)}")
        return {"role": role, "content": message_text(m.get("content"))}

    def _next(self) -> _Call | None:
        """The env's next model call, or None when its episode ended first."""
        channel, task = self._channel, self._task
        assert channel is not None and task is not None

        async def wait() -> _Call | None:
            get = asyncio.ensure_future(channel.calls.get())
            done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            get.cancel()
            return None

        return wait_on_hub(wait(), self.factory.call_timeout_s, self.name)

    def _finish(self) -> StepResult:
        assert self._task is not None
        try:
            episode = self._task.result()
        except BaseException as e:  # the env's run raised (verifiers records most errors)
            raise EnvironmentFailure("error", f"{self.name}: {type(e).__name__}: {e}") from e
        errors = list(episode.errors) + [err for t in episode.traces for err in t.errors]
        if not episode.ok:
            detail = "; ".join(f"{err.type}: {err.message}" for err in errors[-3:]) or "not ok"
            raise EnvironmentFailure("error", f"{self.name} failed its episode: {detail}")
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        rewards = {k: r.value for t in traces for k, r in t.rewards.items() if r is not None}
        metrics = {k: v for t in traces for k, v in t.metrics.items() if v is not None}
        stops = [t.stop_condition for t in traces if t.stop_condition]
        return StepResult(reward=float(sum(t.reward for t in traces)), done=True,
                          info={"env_rewards": rewards, "env_metrics": metrics,
                                "env_stop": stops[-1] if stops else None})


def _resolve(future: asyncio.Future, value: Any) -> None:  # noqa: ANN401
    if not future.done():
        future.set_result(value)


def _strip(messages: list[Any]) -> list[tuple[Any, str]]:
    """Messages compared as (role, text): a harness may re-serialize what it re-sends."""
    return [(m.get("role"), message_text(m.get("content"))) if isinstance(m, dict) else (None, "")
            for m in messages]


def _with_tool_prompt(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """The offered tools described in the system message, in the Hermes format Qwen-style chat
    templates render (grpoflow renders messages only)."""
    described = [Tool(f.get("name", ""), f.get("description", ""), f.get("parameters", {}),
                      fn=lambda: "") for t in tools if isinstance(f := t.get("function"), dict)]
    prompt = hermes_system_prompt(described)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"},
                *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _completion(body: dict[str, Any], turn: Turn) -> dict[str, Any]:
    """The chat completion a model call gets for grpoflow's turn. Offered tools: the turn's
    Hermes tool calls become OpenAI tool calls (a malformed one leaves the turn plain text)."""
    text, calls = turn.text, []
    parsed = parse_tool_calls(text) if body.get("tools") else []
    if parsed and all(c.error is None for c in parsed):
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                 for c in parsed]
        head = text.split("<tool_call>", 1)[0].strip()
        text = head
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else "length" if turn.truncated else "stop"
    n = len(turn.token_ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": str(body.get("model")),
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}}


def verifiers_factory(env_id: str, **kwargs: Any) -> VerifiersFactory:  # noqa: ANN401
    """``agent.env: verifiers:<env_id>``: a factory of :class:`VerifiersEnv` episodes.
    ``env_id``: a taskset id or a dotted module path; ``kwargs``: ``agent.env_args``
    (docs/agents.md, 'Environment hubs')."""
    return VerifiersFactory(env_id, **kwargs)
