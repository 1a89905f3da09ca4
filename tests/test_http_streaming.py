"""Live token streaming on the HTTP rollout plane (issue 39): ``/generate`` with
``"stream": true`` (SGLang's server-sent events), the client's per-token hooks, the gateway's
live path over an :class:`HttpPlane`, and a client that leaves before its stream starts.

One embedded engine (the tiny chat model of tests/test_agents_openai.py) is served from a
thread of this process (a launcher that serves it in-thread: no engine process to start), so
a test can hold the engine between decode steps (``engine.on_step``) and see chunks arrive
while the turn is still being generated. The real ``sglang-router`` in front of it relays
the stream (one router process, started by its test only). A stream that breaks mid-way is
pinned against a small fake server.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from test_agents_openai import save_chat_model
from test_rollout_client import FAST, ThreadServer

from rl_core.agents.chat import ChatTokens
from rl_core.agents.env import EpisodeLimits
from rl_core.agents.gateway import AgentGateway
from rl_core.agents.gateway_stream import TokenFeed, live_response
from rl_core.data.records import Record
from rl_core.engine.core import EmbeddedEngine
from rl_core.engine.routes_openai import OpenAIError, parse_openai_request
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.server import ServerThread, create_app
from rl_core.errors import RolloutError
from rl_core.rollout.client import SyncSGLangClient
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.pool import EnginePool
from rl_core.rollout.wire import StreamedGenerate

pytestmark = pytest.mark.timeout(120)

WAIT = 60.0
PROMPT = [257, 117, 115, 101, 114, 10, 104, 105, 258, 10, 257, 97, 10]  # ChatML-ish bytes
SP = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
USER = [{"role": "user", "content": "What is 6*7?"}]
LIMITS = EpisodeLimits(max_turns=4, max_tokens=200, timeout_s=60)
TASK = Record("r0", "What is 6*7?", "#### 42")
LONG = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)


class _Alive:
    """The in-thread engine's stand-in for a process (it lives as long as the test module)."""

    returncode = None
    pid = os.getpid()

    def poll(self) -> None:
        return None


class ThreadLauncher:
    """An :class:`EnginePool` launcher that serves one engine from a thread of this process."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.server = engine, None

    def spawn(self, index: int, port: int, log_path: Path) -> tuple[Any, str, int]:
        self.server = ServerThread(create_app(self.engine), port=port).start()
        return _Alive(), "127.0.0.1", self.server.port

    def stop(self, proc: Any, timeout_s: float) -> None:
        if self.server is not None:
            self.server.stop()

    kill = stop


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(engine, plane over it, gateway over the plane)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = save_chat_model(tmp_path_factory.mktemp("stream") / "model")
    engine = EmbeddedEngine(model, control_timeout_s=30)
    pool = EnginePool(None, 1, launcher=ThreadLauncher(engine), monitor=False,
                      log_dir=tmp_path_factory.mktemp("logs"), startup_timeout_s=60,
                      client_kwargs=FAST)
    plane = HttpPlane(pool, request_batch_size=4, timeout_s=WAIT).start()
    gateway = AgentGateway(plane, ChatTokens(engine.tokenizer)).start()
    try:
        yield engine, plane, gateway
    finally:
        gateway.close()
        plane.close()
        engine.close()
        torch.set_num_threads(threads)


def url_of(plane: HttpPlane) -> str:
    return plane.pool.engine_urls[0]


def events(text: str) -> list[Any]:
    """A server-sent event stream's data, ``[DONE]`` kept as the string."""
    out = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def without_latency(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "meta_info": {k: v for k, v in item["meta_info"].items()
                                  if k != "e2e_latency"}}


# ---------------------------------------------------------------------------- /generate


def test_generate_streams_sglangs_cumulative_events(stack) -> None:
    _, plane, _ = stack
    body = {"input_ids": PROMPT, "sampling_params": SP, "return_logprob": True,
            "top_logprobs_num": 2, "rid": "one"}
    with httpx.Client(base_url=url_of(plane), timeout=WAIT) as http:
        whole = http.post("/generate", json=body).json()
        r = http.post("/generate", json={**body, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = events(r.text)
        assert got[-1] == "[DONE]" and len(got) >= 2
        *partial, last = got[:-1]
        # the last event is the unstreamed answer; the others grow towards it
        assert without_latency(last) == without_latency(whole)
        meta = whole["meta_info"]
        for ev in partial:
            k = len(ev["output_ids"])
            assert ev["meta_info"]["finish_reason"] is None and "index" not in ev
            assert ev["output_ids"] == whole["output_ids"][:k]
            assert ev["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"][:k]
            assert ev["meta_info"]["output_top_logprobs"] == meta["output_top_logprobs"][:k]
        # a batch (and n > 1) streams too: each event names its request's index
        batch = {"input_ids": [PROMPT, PROMPT[:5]], "sampling_params": {**SP, "n": 2},
                 "return_logprob": True, "rid": "b"}
        answers = http.post("/generate", json=batch).json()
        got = events(http.post("/generate", json={**batch, "stream": True}).text)
        assert got[-1] == "[DONE]"
        final = {ev["index"]: ev for ev in got[:-1] if ev["meta_info"]["finish_reason"]}
        assert sorted(final) == [0, 1, 2, 3]
        assert [without_latency({k: v for k, v in final[i].items() if k != "index"})
                for i in range(4)] == [without_latency(a) for a in answers]
        # refused before the stream starts: an ordinary 400
        r = http.post("/generate", json={"input_ids": [5, 999], "stream": True})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_aborts_its_request(stack) -> None:
    engine, plane, _ = stack
    aborted, held, release = threading.Event(), threading.Event(), threading.Event()
    original = engine.abort

    def abort(rid: Any = None, abort_all: bool = False) -> int:
        if rid == ["gone"]:
            aborted.set()
        return original(rid, abort_all)

    def hold(step: int) -> None:
        if step == hold.at:
            held.set()
            release.wait(WAIT)

    hold.at = engine.stats["decode_steps"] + 2
    engine.abort, engine.on_step = abort, hold
    try:
        body = {"input_ids": PROMPT, "sampling_params": {**SP, "max_new_tokens": 64},
                "rid": "gone", "stream": True}
        with httpx.Client(base_url=url_of(plane), timeout=WAIT) as http, \
                http.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream (the client goes)
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["meta_info"]["finish_reason"] is None
            assert held.wait(WAIT)
        assert aborted.wait(WAIT)  # the server saw the client go and aborted its request
    finally:
        release.set()
        engine.abort, engine.on_step = original, None


# ---------------------------------------------------------------------------- the client


def test_client_hooks_see_every_token_and_the_result_is_the_unstreamed_one(stack) -> None:
    _, plane, _ = stack
    with SyncSGLangClient(url_of(plane), **FAST) as client:
        whole = client.generate(PROMPT, SP, top_logprobs_num=2)
        seen: list[tuple[int, float, Any]] = []
        streamed = client.generate(PROMPT, SP, top_logprobs_num=2,
                                   on_token=lambda *t: seen.append(t))
        assert [t for t, _, _ in seen] == whole.completion_ids == streamed.completion_ids
        assert [lp for _, lp, _ in seen] == whole.logprobs == streamed.logprobs
        assert [top for _, _, top in seen] == whole.meta["output_top_logprobs"]
        assert streamed.finish_reason == whole.finish_reason
        drop = ("id", "e2e_latency")
        assert ({k: v for k, v in streamed.meta.items() if k not in drop}
                == {k: v for k, v in whole.meta.items() if k not in drop})
        # a batch: only the prompts with a hook need one; all come back as unstreamed
        firsts: list[int] = []
        batch = client.generate_batch([PROMPT, PROMPT[:5]], SP,
                                      on_token=[lambda t, lp, top: firsts.append(t), None])
        plain = client.generate_batch([PROMPT, PROMPT[:5]], SP)
        assert firsts == batch[0].completion_ids == plain[0].completion_ids
        assert [s.logprobs for s in batch] == [s.logprobs for s in plain]
    # the plane: the same samples (weight version included), the hooks fed per prompt
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=s) for s in (1, 2, 3)]
    prompts = [PROMPT, PROMPT[:7], PROMPT[:4]]
    hooked: list[list[int]] = [[], [], []]
    hooks = [lambda t, lp, top, i=i: hooked[i].append(t) for i in range(3)]
    streamed = plane.generate(prompts, params, on_token=[hooks[0], None, hooks[2]])
    whole = plane.generate(prompts, params)
    assert [s.completion_ids for s in streamed] == [s.completion_ids for s in whole]
    assert [s.logprobs for s in streamed] == [s.logprobs for s in whole]
    assert [s.weight_version for s in streamed] == [s.weight_version for s in whole]
    assert hooked == [whole[0].completion_ids, [], whole[2].completion_ids]


def test_the_real_router_relays_the_stream(stack, tmp_path) -> None:
    from rl_core.rollout.router import RouterProcess

    _, plane, _ = stack
    with RouterProcess([url_of(plane)], log_dir=tmp_path, policy="round_robin") as router, \
            SyncSGLangClient(router.url, **FAST) as client:
        whole = client.generate(PROMPT, SP)
        seen: list[int] = []
        streamed = client.generate(PROMPT, SP, on_token=lambda t, lp, top: seen.append(t))
    assert seen == streamed.completion_ids == whole.completion_ids
    assert streamed.logprobs == whole.logprobs and streamed.meta["base_url"] == router.url


def _flaky_engine(second: list[int]) -> tuple[FastAPI, dict[str, int]]:
    """A /generate that streams two tokens and breaks its connection the first time, then
    streams ``second`` to the end."""
    app, calls = FastAPI(), {"n": 0}

    def event(ids: list[int], done: bool) -> str:
        meta = {"id": "x", "finish_reason": {"type": "length", "length": len(ids)} if done
                else None, "output_token_logprobs": [[-0.5, t, None] for t in ids]}
        return f"data: {json.dumps({'text': '', 'output_ids': ids, 'meta_info': meta})}\n\n"

    @app.post("/generate")
    async def generate() -> StreamingResponse:
        calls["n"] += 1
        first = calls["n"] == 1

        async def body():
            if first:
                yield event([1], False)
                yield event([1, 2], False)
                raise RuntimeError("the engine died mid-stream")  # the connection breaks
            for k in range(1, len(second)):
                yield event(second[:k], False)
            yield event(second, True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app, calls


@pytest.mark.parametrize(("second", "same"), [([1, 2, 3], True), ([1, 5, 3], False)])
def test_a_broken_stream_is_retried_and_hooks_never_see_a_token_twice(second, same) -> None:
    """The retry's tokens the hook already saw are checked, not shown again; a retry that
    sampled other tokens than were streamed cannot go on (RolloutError, not retried)."""
    app, calls = _flaky_engine(second)
    seen: list[int] = []
    with ThreadServer(app) as srv, SyncSGLangClient(srv.url, **FAST) as client:
        if same:
            s = client.generate([3], {}, on_token=lambda t, lp, top: seen.append(t))
            assert s.completion_ids == [1, 2, 3] and seen == [1, 2, 3]
        else:
            with pytest.raises(RolloutError, match="position 1"):
                client.generate([3], {}, on_token=lambda t, lp, top: seen.append(t))
            assert seen == [1, 2]
    assert calls["n"] == 2


def test_log_probs_sent_as_deltas_are_gathered() -> None:
    """SGLang versions that send ``output_token_logprobs`` as deltas beside cumulative ids."""
    seen: list[tuple[int, float]] = []
    reader, acc = StreamedGenerate([lambda t, lp, top: seen.append((t, lp))], single=True), {}
    first = {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}}
    second = {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-2.0, 2, None]]}}
    reader._tokens(0, first, acc)
    reader._tokens(0, second, acc)
    assert seen == [(1, -1.0), (2, -2.0)]
    assert second["meta_info"]["output_token_logprobs"] == [[-1.0, 1, None], [-2.0, 2, None]]


# ---------------------------------------------------------------------------- the gateway


def test_gateway_streams_live_over_the_http_plane_and_records_the_same(stack) -> None:
    """Generation held after its 4th token: the ``openai`` client has 3 tokens' chunks
    before the turn is over; released, the stream ends as the unstreamed answer and the
    session records the same trajectory as an unstreamed one."""
    engine, _, gateway = stack
    held, release, seen = threading.Event(), threading.Event(), []

    def hold(step: int) -> None:
        if step == hold.at:
            held.set()
            seen.append(release.wait(WAIT))

    def ask(stream: bool) -> tuple[Any, Any]:
        session = gateway.open_session(TASK, params=LONG, limits=LIMITS, seed=1)
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        try:
            out = client.chat.completions.create(model="policy", messages=USER, logprobs=True,
                                                 max_tokens=8, stream=stream)
            if not stream:
                return out.choices[0], session
            entries, text = [], []
            for chunk in out:
                for c in chunk.choices:
                    text.append(c.delta.content or "")
                    entries += c.logprobs.content if c.logprobs is not None else []
                if len(entries) == 3 and not release.is_set():
                    assert held.wait(WAIT)  # these chunks came while the turn was held
                    release.set()
            return ("".join(text), entries), session
        finally:
            gateway.discard([session])

    whole, plain = ask(False)
    hold.at = engine.stats["decode_steps"] + 3
    engine.on_step = hold
    try:
        (text, entries), streamed = ask(True)
    finally:
        engine.on_step = None
    assert seen == [True]
    assert text == whole.message.content
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.logprobs.content]
    x, y = plain.sample(), streamed.sample()
    assert (x.prompt_ids, x.completion_ids, x.logprobs, x.loss_mask) == (
        y.prompt_ids, y.completion_ids, y.logprobs, y.loss_mask)


def test_a_client_gone_before_the_stream_starts_frees_the_session(stack) -> None:
    """The gateway's app called directly (ASGI): the body, then at once ``http.disconnect``.
    Starlette then cancels the stream before its first byte (cancelled at its first send,
    which yields here as uvicorn's does while a full socket buffer drains: the body, a
    generator, never starts, so its ``finally`` never runs); the session must still be free
    for the next request (it answered 504 after request_timeout_s before). The engine is
    held after its first decode step, so the turn is live (tokens came, it is not over)."""
    engine, _, gateway = stack
    release = threading.Event()

    def hold(step: int) -> None:
        if step == hold.at:
            release.wait(WAIT)

    hold.at = engine.stats["decode_steps"] + 1
    session = gateway.open_session(TASK, params=LONG, limits=LIMITS, seed=1)
    app = gateway._app(2**20)
    body = json.dumps({"model": "policy", "messages": USER, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "root_path": "",
             "path": f"/sessions/{session.sid}/v1/chat/completions", "raw_path": b"",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent: list[dict[str, Any]] = []

    async def call() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            await asyncio.sleep(0)  # a server whose send yields (uvicorn's, while it drains)

        await app(scope, receive, send)

    engine.on_step = hold
    try:
        asyncio.run(asyncio.wait_for(call(), WAIT))
        assert not any(m.get("body") for m in sent), sent  # gone before the body's first byte
        assert not session._busy and not session.turns
        release.set()
        engine.on_step = None
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        r = client.chat.completions.create(model="policy", messages=USER, max_tokens=4)
        assert r.choices[0].finish_reason and session.turns == 1
    finally:
        release.set()
        engine.on_step = None
        gateway.discard([session])


def test_live_response_releases_once_however_its_stream_ends(stack) -> None:
    """Unit: a live turn's response whose client is gone before the body starts, and one
    whose stream runs to an error event: ``release`` runs exactly once either way."""
    engine, _, _ = stack
    req = parse_openai_request({"messages": USER, "stream": True}, "chat")
    head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    async def scenario(gone: bool) -> tuple[int, list[bytes]]:
        released, body = [], []

        async def outcome(timeout: float) -> Any:
            raise OpenAIError("the session closed", 410)

        resp = await live_response(TokenFeed(asyncio.get_running_loop()), (104, -0.1, None),
                                   req, engine.tokenizer, head, [], outcome,
                                   lambda done: ({}, []), 1e18, lambda: released.append(1))
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if not gone:
                await never.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            body.append(message.get("body", b""))
            await asyncio.sleep(0)  # a server whose send yields (uvicorn's, while it drains)

        await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return len(released), body

    assert asyncio.run(scenario(gone=True)) == (1, [b""])  # the headers only
    n, body = asyncio.run(scenario(gone=False))
    assert n == 1 and b"the session closed" in b"".join(body) and body[-2] == b"data: [DONE]\n\n"
