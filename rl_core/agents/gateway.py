"""Black-box agents on the rollout plane: an OpenAI-compatible endpoint per episode.

:class:`AgentGateway` serves ``/sessions/{sid}/v1`` in front of any ``RolloutPlane``; a session
records its episode token-exactly in EpisodeRunner's layout and owns the sampling (the run's
settings, replayable seeds, ``max_tokens`` clamped to the episode's budget). A streamed request
gets its chunks as the plane samples the tokens where the plane reports each one
(agents/gateway_stream.py), else the finished turn as events; either way the turn is recorded
from the finished generation, so the trajectory is the same. Top-k alternatives come from the
plane and go to the client only. A session serves one model, the policy, under any ``model``
name. A request that extends the
conversation is compared with the template's rendering of its messages; where they differ (a
reasoning template), ``template_mismatch`` keeps the recorded tokens or starts a new segment
(docs/agents.md, 'Reasoning templates').
:func:`~rl_core.agents.programs.run_programs` plays ``program(client, task) -> reward`` on it
(docs/agents.md, 'Black-box agents').
Never imports Prefect or MLflow; never re-tokenizes a model turn; never calls the plane from
more than one thread; never waits without a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl_core.agents.batcher import Batcher, Done, plane_takes, request_error
from rl_core.agents.chat import TEMPLATE_MISMATCH, ChatTokens
from rl_core.agents.env import EpisodeLimits
from rl_core.agents.gateway_stream import TokenFeed, consume, live_response
from rl_core.agents.trajectory import Trajectory
from rl_core.data.records import Record
from rl_core.engine.protocol import MAX_REQUEST_BYTES
from rl_core.engine.routes_openai import (
    OpenAIError,
    OpenAIRequest,
    chat_choice,
    completion_choice,
    completion_text,
    envelope,
    openai_error,
    parse_openai_request,
    read_openai_body,
    respond,
)
from rl_core.engine.sampling import SamplingParams, sample_seed
from rl_core.engine.server import ServerThread
from rl_core.interfaces import RolloutPlane
from rl_core.types import Sample

__all__ = ["AgentGateway", "GatewaySession", "request_seed"]

log = logging.getLogger(__name__)

def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def request_seed(seed: int, step: int, record_id: str, index: int, attempt: int,
                 request: int) -> int:
    """The sampling seed of request ``request`` (0-based) of an episode: what EpisodeRunner
    uses for its turn of the same number, so a replayed episode samples the same tokens."""
    return sample_seed(seed, step, f"{record_id}#{attempt}.{request}", index)


# ---------------------------------------------------------------------------- sessions

@dataclass
class _Plan:
    """How one request's prompt relates to the session's chain."""

    prompt: list[int]  # what the engine is asked to continue
    extend: bool  # True: the chain's ids + ``obs``; False: a new chain from ``prompt``
    obs: list[int]
    messages: list[dict[str, Any]]  # the new messages (all of them for a new chain or segment)
    conv: list[tuple[str, Any]] | None = None  # chat: the request's messages, by role/content
    setup: str = ""  # chat: tools and template arguments the chain was rendered with
    text_prompt: str | None = None  # completions with a text prompt
    note: str = ""  # why a new chain started
    rendered: str | None = None  # chat: the chain's text once the prompt is in it
    checked: bool = False  # compared with the template's rendering of the messages
    mismatch: bool = False  # ... and it differed
    split: bool = False  # a new segment from that rendering (template_mismatch: new_sample)
    used: int = 0  # tokens counted against agent.max_tokens before the turn


def _keys(messages: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in messages]


class GatewaySession(Trajectory):
    """One episode's endpoint and the trajectory it records (made by
    :meth:`AgentGateway.open_session`; ``base_url`` is what an ``openai`` client takes)."""

    def __init__(self, gateway: AgentGateway, sid: str, task: Record | None, *, index: int,
                 group: int, attempt: int, step: int, seed: int, params: SamplingParams,
                 limits: EpisodeLimits) -> None:
        self.gateway, self.sid, self.task = gateway, sid, task
        self.index, self.group, self.attempt = index, group, attempt
        self.step, self.seed, self.params, self.limits = step, seed, params, limits
        self.url = f"{gateway.url}/sessions/{sid}"
        self.opened, self.opened_at = time.monotonic(), time.time()  # the latter for traces
        self.deadline = self.opened + limits.timeout_s
        self.closed, self.close_reason = False, ""
        self.lock = threading.Lock()  # state, between the server's loop and the runner
        self._busy = False  # a request is in progress (touched on the server's loop only)
        # Futures of handlers waiting on a generation, set when the session closes.
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        Trajectory.__init__(self)  # the chain: its prompt and everything after it
        self.conv: list[tuple[str, Any]] | None = None
        self.setup = ""
        self.text_so_far: str | None = None
        self.chains = self.refused = self.tool_calls = 0
        self.limit = ""  # the first episode limit hit: max_turns | max_tokens

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def record_id(self) -> str:
        return self.task.id if self.task is not None else ""

    def close(self, reason: str = "closed") -> None:
        """Refuse every later request; a generation in flight is not recorded (its handler
        answers 410 at once)."""
        with self.lock:
            if not self.closed:
                self.closed, self.close_reason = True, reason
            wakers = list(self._wakers)
        for loop, fut in wakers:
            with contextlib.suppress(RuntimeError):  # the server's loop is gone
                loop.call_soon_threadsafe(_wake, fut)

    # -- request handling (the server's event loop) -------------------------------------

    def _check_open(self) -> None:
        if not self.closed and time.monotonic() > self.deadline:
            self.closed = True
            self.close_reason = f"the episode ran past agent.timeout_s={self.limits.timeout_s:g}s"
        if self.closed:
            raise OpenAIError(f"session {self.sid} is closed ({self.close_reason}); the episode "
                              "is over", 410, code="session_closed")

    def _refuse(self, limit: str, message: str) -> OpenAIError:
        self.limit = self.limit or limit
        self.refused += 1
        self.trace.append({"attempt": self.attempt, "role": "refused", "reason": limit,
                           "request": self.turns})
        return OpenAIError(message, 400, code=limit)

    def _plan_chat(self, req: OpenAIRequest) -> _Plan:
        chat = self.gateway.chat
        keys = _keys(req.messages)
        setup = json.dumps([req.tools, req.template_kwargs], sort_keys=True, default=str)
        n = len(self.conv or [])
        note = "first request" if not self.chains else "history rewritten"
        template = {"tools": req.tools, "template_kwargs": req.template_kwargs}
        if self.conv and setup == self.setup and len(keys) > n and keys[:n] == self.conv:
            new = req.messages[n:]
            try:
                obs, obs_text = chat.observation(new, self.last_turn, **template)
                full = chat.render(req.messages, generation_prompt=True, **template)
            except Exception as e:  # noqa: BLE001 (a template that loses earlier turns, or
                # cannot render these messages: the full render below says which)
                note = f"the chat template cannot extend this conversation: {e}"
            else:
                chain = None if self.rendered is None else self.rendered + obs_text
                if chain == full or self.gateway.template_mismatch == "keep_prefix":
                    return _Plan(self.prompt_ids + self.ids + obs, True, obs, new, keys, setup,
                                 rendered=chain, checked=True, mismatch=chain != full,
                                 used=self.used + len(obs))
                prompt = chat.encode(full)  # new_sample: go on from the template's rendering
                return _Plan(prompt, True, [], req.messages, keys, setup, rendered=full,
                             checked=True, mismatch=True, split=True,
                             used=max(0, len(prompt) - self.root))
        try:
            prompt, text = chat.prompt(req.messages, **template)
        except Exception as e:  # the template's own checks (role order, fields)
            raise OpenAIError(f"the chat template could not render these messages: "
                              f"{type(e).__name__}: {e}", param="messages") from None
        return _Plan(prompt, False, [], req.messages, keys, setup, note=note, rendered=text)

    def _plan_completion(self, req: OpenAIRequest) -> _Plan:
        tok = self.gateway.chat.tokenizer
        prompt = req.prompts[0]
        note = "first request" if not self.chains else "history rewritten"
        if isinstance(prompt, list):
            full = self.prompt_ids + self.ids
            if self.chains and len(prompt) >= len(full) and prompt[: len(full)] == full:
                obs = list(prompt[len(full):])
                return _Plan(list(prompt), True, obs, [], used=self.used + len(obs))
            return _Plan(list(prompt), False, [], [], note=note)
        if self.text_so_far is not None and prompt.startswith(self.text_so_far):
            obs = list(tok(prompt[len(self.text_so_far):], add_special_tokens=False)["input_ids"])
            return _Plan(self.prompt_ids + self.ids + obs, True, obs, [], text_prompt=prompt,
                         used=self.used + len(obs))
        return _Plan(list(tok.encode(prompt)), False, [], [], text_prompt=prompt, note=note)

    def _prepare(self, req: OpenAIRequest) -> tuple[_Plan, SamplingParams, int]:
        """Check the episode's limits, plan the prompt and the request's sampling."""
        self._check_open()
        lim = self.limits
        if self.turns >= lim.max_turns:
            raise self._refuse("max_turns", f"the episode allows agent.max_turns="
                               f"{lim.max_turns} model requests and has used them all")
        plan = self._plan_chat(req) if req.kind == "chat" else self._plan_completion(req)
        used = plan.used
        budget = lim.max_tokens - used
        if budget < 1:
            raise self._refuse("max_tokens", f"the episode's token budget (agent.max_tokens="
                               f"{lim.max_tokens}, model and observation tokens after the "
                               f"prompt) is spent: {used} tokens")
        p = self.params
        # The run's max_new_tokens caps a turn, as it caps EpisodeRunner's; the agent may ask
        # for less.
        asked = p.max_new_tokens if req.max_tokens is None else min(req.max_tokens,
                                                                   p.max_new_tokens)
        number = self.turns
        params = replace(
            p, max_new_tokens=max(1, min(asked, budget)), stop=[*p.stop, *req.stop],
            stop_token_ids=[*p.stop_token_ids, *req.stop_token_ids],
            ignore_eos=p.ignore_eos or req.ignore_eos,
            seed=request_seed(self.seed, self.step, self.record_id, self.index, self.attempt,
                              number))
        return plan, params, number

    def _record(self, plan: _Plan, req: OpenAIRequest, done: Done, text: str,
                number: int, calls: int, seed: int | None, seconds: float) -> None:
        s = done.sample
        if not plan.extend:
            self.chains += 1
            self.restart(plan.prompt, plan.rendered)
            self.setup = plan.setup
            self.trace.append({"attempt": self.attempt, "role": "prompt", "request": number,
                               "session": self.sid, "chain": self.chains, "note": plan.note,
                               "messages": plan.messages, "tokens": len(plan.prompt)})
        elif plan.split:
            self.split(plan.prompt, plan.rendered)
            self.trace.append({"attempt": self.attempt, "role": "prompt", "request": number,
                               "session": self.sid, "chain": self.chains,
                               "segment": len(self.segments) + 1, "note": "the chat template "
                               "renders the conversation differently from the recorded tokens: "
                               "a new segment", "messages": plan.messages,
                               "tokens": len(plan.prompt)})
        elif plan.obs or plan.messages:
            self.observe(plan.obs)
            self.rendered = plan.rendered
            self.trace.append({"attempt": self.attempt, "role": "observation",
                               "request": number, "messages": plan.messages,
                               "tokens": len(plan.obs), **({"template_mismatch": True}
                                                           if plan.mismatch else {})})
        self.checks += plan.checked
        self.mismatches += plan.mismatch
        ids = self.model_turn(s, text)
        self.tool_calls += calls
        if req.kind == "chat":
            self.conv = [*(plan.conv or []), ("assistant", text)]
            self.text_so_far = None
            self.rendered = None if self.rendered is None else (
                self.rendered + self.gateway.chat.decode(ids))
        else:
            self.conv = self.rendered = None
            self.text_so_far = None if plan.text_prompt is None else plan.text_prompt + text
        self.trace.append({
            "attempt": self.attempt, "role": "assistant", "request": number,
            "chain": self.chains, "text": text, "tokens": len(ids),
            "prompt_tokens": len(plan.prompt), "seconds": seconds,
            "queued_s": done.queued_s, "generate_s": done.generate_s, "batch": done.batch,
            "weight_version": s.weight_version, "seed": seed,
            "finish_reason": s.finish_reason.get("type"), "tool_calls": calls})
        if self.used >= self.limits.max_tokens:
            self.limit = self.limit or "max_tokens"

    # -- the episode's sample -------------------------------------------------------------

    def sample(self, *, failed: bool = False, errors: Sequence[str] = (), env_reward: float = 0.0,
               attempts: int | None = None, trace: list[dict[str, Any]] | None = None,
               started: float | None = None) -> Sample:
        """The recorded chain as EpisodeRunner's :class:`~rl_core.types.Sample` (``failed``:
        nothing is trained on and the reward is 0)."""
        with self.lock:
            chat, rec = self.gateway.chat, self.task
            sample = self.to_sample(
                step=self.step, record_id=self.record_id, index=self.index, group=self.group,
                answer=rec.answer if rec is not None else "", failed=failed,
                env_reward=0.0 if failed else env_reward, finish=self.limit or "done",
                fallback_prompt=chat.encode(chat.tokenizer.eos_token or " "),
                attempts=self.attempt + 1 if attempts is None else attempts, errors=errors,
                tool_calls=self.tool_calls, trace=list(self.trace) if trace is None else trace,
                info={"history_rewrites": max(0, self.chains - 1), "refused_requests": self.refused},
                seconds=time.monotonic() - (self.opened if started is None else started),
                started_at=self.opened_at)
            if rec is not None:
                sample.prompt, sample.columns = rec.question, dict(rec.columns)
            return sample


# ---------------------------------------------------------------------------- the gateway

class AgentGateway:
    """OpenAI-compatible sessions in front of ``plane``. ``start()`` binds ``host:port`` (0: a
    free port); ``batch_wait_s``/``max_batch`` shape the worker's batches; ``request_timeout_s``
    bounds one request's wait; bodies over ``max_request_bytes`` get 413; ``template_mismatch``
    (``keep_prefix`` | ``new_sample``): what a session does when the template renders its
    conversation differently from the recorded tokens."""

    def __init__(self, plane: RolloutPlane, chat: ChatTokens, *, host: str = "127.0.0.1",
                 port: int = 0, model_name: str = "grpoflow-policy", batch_wait_s: float = 0.01,
                 max_batch: int = 256, request_timeout_s: float = 600.0,
                 max_request_bytes: int = MAX_REQUEST_BYTES, max_sessions: int = 4096,
                 template_mismatch: str = "keep_prefix") -> None:
        if max_batch < 1 or max_sessions < 1 or not request_timeout_s > 0 or batch_wait_s < 0:
            raise ValueError("AgentGateway: max_batch and max_sessions must be >= 1, "
                             "request_timeout_s > 0 and batch_wait_s >= 0")
        if template_mismatch not in TEMPLATE_MISMATCH:
            raise ValueError(f"template_mismatch={template_mismatch!r}: one of {TEMPLATE_MISMATCH}")
        self.template_mismatch = template_mismatch
        self.plane, self.chat, self.model_name = plane, chat, model_name
        self.request_timeout_s, self.max_sessions = request_timeout_s, max_sessions
        self._batcher = Batcher(plane, batch_wait_s, max_batch)
        # what the plane can do beyond sampling: top-k alternatives, each token as sampled
        self._tops = plane_takes(plane, "top_logprobs")
        self._live = plane_takes(plane, "on_token")
        self._sessions: dict[str, GatewaySession] = {}
        self._lock = threading.Lock()
        self._server = ServerThread(self._app(max_request_bytes), host=host, port=port)
        self._started = False

    @property
    def url(self) -> str:
        if not self._started:
            raise RuntimeError("the gateway is not started: call start() first")
        return self._server.url

    @property
    def stats(self) -> dict[str, int]:
        """Batches run, requests served, the largest batch."""
        return dict(self._batcher.stats)

    def start(self, timeout: float = 30.0) -> AgentGateway:
        self._batcher.start()
        self._server.start(timeout)
        self._started = True
        log.info("agent gateway on %s", self._server.url)
        return self

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.close("the gateway shut down")
        if self._started:
            self._server.stop()
        self._batcher.close()

    def __enter__(self) -> AgentGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_session(self, task: Record | None = None, *, index: int = 0, group: int = 0,
                     attempt: int = 0, step: int = 0, seed: int = 0,
                     params: SamplingParams | None = None,
                     limits: EpisodeLimits | None = None) -> GatewaySession:
        """A new episode endpoint for ``task`` (sample ``index`` of group ``group``)."""
        sid = uuid.uuid4().hex
        session = GatewaySession(self, sid, task, index=index, group=group, attempt=attempt,
                                 step=step, seed=seed, params=params or SamplingParams(),
                                 limits=limits or EpisodeLimits())
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise RuntimeError(f"the agent gateway holds {self.max_sessions} sessions "
                                   "(max_sessions): discard finished ones")
            self._sessions[sid] = session
        return session

    def discard(self, sessions: Sequence[GatewaySession]) -> None:
        """Close and forget ``sessions`` (later requests to them get 404)."""
        with self._lock:
            for s in sessions:
                self._sessions.pop(s.sid, None)
        for s in sessions:
            s.close()

    # -- HTTP ---------------------------------------------------------------------------

    def _app(self, max_request_bytes: int) -> FastAPI:
        app = FastAPI(title="grpoflow agent gateway (OpenAI-compatible sessions)")
        app.state.max_request_bytes = max_request_bytes

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
            return openai_error(f"{exc.detail}: the gateway serves /sessions/{{sid}}/v1/"
                                "chat/completions, /completions and /models", exc.status_code)

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request) -> Response:
            return await self._handle(sid, request, "chat")

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(sid: str, request: Request) -> Response:
            return await self._handle(sid, request, "completions")

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> Response:
            try:
                self._session(sid)
            except OpenAIError as e:
                return e.response()
            return JSONResponse({"object": "list", "data": [
                {"id": self.model_name, "object": "model", "created": 0,
                 "owned_by": "grpoflow"}]})

        @app.get("/health")
        async def health() -> Response:
            with self._lock:
                open_sessions = sum(not s.closed for s in self._sessions.values())
            return JSONResponse({"sessions": open_sessions, **self.stats})

        return app

    def _session(self, sid: str) -> GatewaySession:
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            raise OpenAIError(f"no session {sid!r}: it was never opened or is finished; each "
                              "episode gets its own session URL", 404, code="session_not_found")
        return session

    async def _handle(self, sid: str, request: Request, kind: str) -> Response:
        t0 = time.monotonic()
        try:
            session = self._session(sid)
            req = parse_openai_request(await read_openai_body(request), kind)
            if req.n != 1 or not req.single:
                raise OpenAIError("a session records one trajectory: ask for one completion "
                                  "of one prompt per request (n=1); more samples are more "
                                  "episodes", param="n")
            if req.top_logprobs and not self._tops:
                raise OpenAIError("top-k alternatives are not available through this rollout "
                                  "plane (it returns the sampled tokens' log-probs only): leave "
                                  "top_logprobs / logprobs=k out", param="top_logprobs"
                                  if req.kind == "chat" else "logprobs",
                                  code="unsupported_parameter")
            # One request of a session at a time, so each extends what the last recorded.
            # The flag is only touched on the server's event loop: no lock needed.
            end = min(t0 + self.request_timeout_s, session.deadline)
            while session._busy:
                if session.closed or time.monotonic() > end:
                    with session.lock:
                        session._check_open()
                    raise OpenAIError(f"session {sid} was busy with another request for "
                                      f"request_timeout_s={self.request_timeout_s:g}s", 504,
                                      code="timeout")
                await asyncio.sleep(0.05)  # rare: an agent's concurrent requests, one session
            session._busy = True
            response: Response | None = None
            try:
                response = await self._generate(session, req, t0)
                return response
            finally:  # a live stream frees the session when it ends
                if not getattr(response, "holds_session", False):
                    session._busy = False
        except OpenAIError as e:
            return e.response()

    async def _generate(self, session: GatewaySession, req: OpenAIRequest,
                        t0: float) -> Response:
        with session.lock:
            plan, params, number = session._prepare(req)
        loop = asyncio.get_running_loop()
        # stream=true on a plane that reports each token: the chunks go out as it samples
        feed = TokenFeed(loop) if req.stream and self._live else None
        future = self._batcher.submit(plan.prompt, params, top=req.top_logprobs, hook=feed)
        waiting = asyncio.wrap_future(future)
        # Consumed here if nobody waits for it any more (the handler gave up).
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        end = min(t0 + self.request_timeout_s, session.deadline)
        # Wait for the generation, the session's close or the deadline, whichever is first,
        # without polling: periodic wake-ups of many handlers steal the cores the engine's
        # OpenMP threads spin on.
        closed: asyncio.Future = loop.create_future()
        waker = (loop, closed)
        with session.lock:
            session._wakers.append(waker)

        async def outcome(timeout: float) -> Done:
            if not session.closed:
                await asyncio.wait({waiting, closed}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                with session.lock:
                    session._check_open()
                raise OpenAIError(f"no generation within request_timeout_s="
                                  f"{self.request_timeout_s:g}s", 504, code="timeout")
            try:
                return waiting.result()
            except OpenAIError:
                raise
            except Exception as e:
                if request_error(e):
                    raise OpenAIError(f"the rollout plane refused the request: {e}",
                                      code="invalid_request") from None
                raise OpenAIError(f"the rollout plane failed: {type(e).__name__}: {e}", 502,
                                  code="rollout_failed") from None

        tok = self.chat.tokenizer
        head = envelope(req, f"{session.sid}-{number}", req.model or self.model_name, [], 0, 0)

        def finish(done: Done) -> tuple[dict[str, Any], list[int]]:
            """Check and record the turn; its response body and completion ids."""
            s = done.sample
            if s.aborted:  # a weight update cut it short: not a turn of this policy
                raise OpenAIError(f"the generation was aborted "
                                  f"({s.finish_reason.get('message')}); the episode cannot go "
                                  "on", 503, code="aborted")
            text = completion_text(tok, s.completion_ids, s.finish_reason,
                                   skip_special_tokens=req.skip_special_tokens)
            # top-k alternatives go to the client only; the trajectory never holds them
            top = s.meta.get("output_top_logprobs") if req.top_logprobs else None
            if req.kind == "chat":
                choice = chat_choice(0, tok, s.completion_ids, s.logprobs, s.finish_reason, req,
                                     key=str(params.seed), prompt_ids=plan.prompt, text=text,
                                     top=top)
                calls = len(choice["message"].get("tool_calls") or [])
            else:
                choice = completion_choice(0, tok, s.completion_ids, s.logprobs, s.finish_reason,
                                           req, prompt_ids=plan.prompt, text=text, top=top)
                calls = 0
            with session.lock:
                session._check_open()  # closed meanwhile: these tokens are not the episode's
                session._record(plan, req, done, text, number, calls, params.seed,
                                time.monotonic() - t0)
            body = envelope(req, f"{session.sid}-{number}", head["model"], [choice],
                            len(plan.prompt), len(s.completion_ids), s.weight_version)
            return {**body, "created": head["created"]}, list(s.completion_ids)

        def release() -> None:
            with session.lock:
                session._wakers.remove(waker)
            session._busy = False

        live = False
        try:
            if feed is None:
                done = await outcome(max(0.0, end - time.monotonic()))
            else:
                first = asyncio.ensure_future(feed.queue.get())
                turn = asyncio.ensure_future(outcome(max(0.0, end - time.monotonic())))
                turn.add_done_callback(consume)
                await asyncio.wait({first, turn}, return_when=asyncio.FIRST_COMPLETED)
                if first.done():  # a token before the turn is over: stream it as it goes
                    turn.cancel()
                    response = await live_response(
                        feed, first.result(), req, tok, head, params.stop, outcome, finish, end,
                        release)
                    live = response.holds_session = True  # type: ignore[attr-defined]
                    return response
                first.cancel()
                done = turn.result()
            body, ids = finish(done)
            # stream=true without a token hook: the finished turn as events
            return respond(req, body, tok, [ids])
        finally:
            if not live:
                with session.lock:
                    session._wakers.remove(waker)
