"""OpenAI compatibility as agent frameworks use it (issue 39, item 0): streaming, top-k
log-probs, when tool calls are parsed, model names; the real ``openai`` client, the OpenAI
Agents SDK and LangChain's ``ChatOpenAI`` as clients.

The embedded engine's ``/v1`` routes and the agent gateway run as real uvicorn servers on
127.0.0.1 over the tiny chat model of tests/test_agents_openai.py (after the generation
prompt it prefers one token that reads as a whole Hermes tool call, then the end of turn).
Pinned here: a streamed answer is the unstreamed one chunk by chunk (text, log-probs, tool
calls, ``finish_reason``, the usage chunk, ``[DONE]``), a gateway session streams token by
token (its chunks arrive while the engine is held mid-turn) and records the same trajectory
whether its program streams or not; ``top_logprobs`` / ``logprobs=k`` are the
engine's own log-softmax (the sampled token's log-prob is among them, bit for bit, and they
match ``transformers``); a request without ``tools`` never gets ``tool_calls``; ``model``
picks the base model or a LoRA adapter, and an unknown name is ``NotFoundError``.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_agents_openai import IM_END, TOOL, TOOL_TEXT, save_chat_model

from rl_core.agents.chat import ChatTokens
from rl_core.agents.env import EpisodeLimits
from rl_core.agents.gateway import AgentGateway
from rl_core.agents.gateway_stream import LiveText
from rl_core.data.records import Record
from rl_core.engine.core import EmbeddedEngine
from rl_core.engine.openai_stream import text_pieces
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.server import ServerThread, create_app
from rl_core.rollout.inprocess import InProcessPlane

pytestmark = pytest.mark.timeout(300)

WAIT = 60.0
USER = [{"role": "user", "content": "What is 6*7?"}]
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8)
LIMITS = EpisodeLimits(max_turns=4, max_tokens=200, timeout_s=60)
TASK = Record("r0", "What is 6*7?", "#### 42")


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("compat") / "model")


@pytest.fixture(scope="module")
def served(model_dir: Path):
    """The engine's own server and an ``openai`` client of its /v1 routes."""
    engine = EmbeddedEngine(model_dir, control_timeout_s=30)
    server = ServerThread(create_app(engine)).start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                           timeout=WAIT)
    try:
        yield engine, server, client
    finally:
        client.close()
        server.stop()
        engine.close()


@pytest.fixture(scope="module")
def gateway(model_dir: Path):
    plane = InProcessPlane(model_dir, max_running_requests=16)
    gw = AgentGateway(plane, ChatTokens(plane.engine.tokenizer)).start()
    try:
        yield gw
    finally:
        gw.close()
        plane.close()


def collect_chat(stream: Any) -> dict[str, Any]:
    """A streamed chat completion put back together, as clients do."""
    content, calls, out = [], {}, {"logprobs": [], "finish": None, "usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for c in chunk.choices:
            content.append(c.delta.content or "")
            for part in c.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += part.id or ""
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            if c.logprobs is not None:
                out["logprobs"] += c.logprobs.content or []
            out["finish"] = c.finish_reason or out["finish"]
    out["content"], out["calls"] = "".join(content), [calls[i] for i in sorted(calls)]
    return out


# ---------------------------------------------------------------------------- engine /v1


@pytest.mark.parametrize("tools", [[CALCULATOR], None])
def test_engine_stream_is_the_unstreamed_answer(served, tools) -> None:
    _, _, client = served
    kw = dict(model="model", messages=USER, temperature=0, max_tokens=8, logprobs=True,
              top_logprobs=3, **({"tools": tools} if tools else {}))
    whole = client.chat.completions.create(**kw)
    got = collect_chat(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    (c,) = whole.choices
    assert got["content"] == c.message.content == TOOL_TEXT
    assert got["finish"] == c.finish_reason == ("tool_calls" if tools else "stop")
    want = [{"name": t.function.name, "arguments": t.function.arguments}
            for t in c.message.tool_calls or []]
    assert len(want) == (1 if tools else 0)
    assert [{k: v for k, v in x.items() if k != "id"} for x in got["calls"]] == want
    assert all(x["id"].startswith("call_") for x in got["calls"])  # each request its own ids
    assert [t.model_dump() for t in got["logprobs"]] == [
        t.model_dump() for t in c.logprobs.content]
    assert got["usage"].model_dump() == whole.usage.model_dump()
    # without include_usage, no usage chunk; the raw stream ends in [DONE]
    with httpx.Client(base_url=served[1].url, timeout=WAIT) as http:
        raw = http.post("/v1/chat/completions", json={**kw, "stream": True}).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_engine_completions_stream_and_top_logprobs(served) -> None:
    engine, _, client = served
    kw = dict(model="model", prompt="hello", max_tokens=10, seed=4, logprobs=5)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, tops, finish, usage = "", [], [], None, None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
            finish = c.finish_reason or finish
    assert text == whole.text and finish == whole.finish_reason and usage.completion_tokens
    assert tokens == whole.logprobs.token_logprobs and tops == whole.logprobs.top_logprobs
    for lp, token, top in zip(whole.logprobs.token_logprobs, whole.logprobs.tokens, tops,
                              strict=True):
        assert len(top) == 5 and max(top.values()) >= lp
        if token in top:  # the engine's own log-softmax: the same float, not a recomputation
            assert top[token] == lp


def test_text_pieces_and_many_choices_stream_in_order(served) -> None:
    engine, _, client = served
    tok = engine.tokenizer
    ids = tok.encode("héllo 日本")  # byte-level: a character spans tokens
    pieces = text_pieces(tok, ids, "héllo 日本")
    assert len(pieces) == len(ids) and "".join(pieces) == "héllo 日本"
    assert pieces[:3] == ["h", "", "é"]  # the character goes with the token completing it
    assert "".join(text_pieces(tok, [*ids, IM_END], "héllo 日")) == "héllo 日"  # cut at a stop
    kw = dict(model="model", prompt=[[104, 105], [111, 107]], n=2, max_tokens=5, seed=9)
    whole = client.completions.create(**kw).choices
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in whole} and len(texts) == 4


def test_chat_top_logprobs_are_the_engines_log_softmax(served) -> None:
    engine, _, client = served
    r = client.chat.completions.create(
        model="model", messages=USER, max_tokens=6, seed=2, logprobs=True, top_logprobs=4,
        extra_body={"return_token_ids": True})
    (c,) = r.choices
    prompt, ids = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)  # temperature 1: log_softmax(logits / 1)
    tok = engine.tokenizer
    for k, entry in enumerate(c.logprobs.content):
        values = [a.logprob for a in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        best = logp[k].topk(4)
        torch.testing.assert_close(torch.tensor(values), best.values, atol=1e-4, rtol=0)
        assert [a.token for a in entry.top_logprobs] == [
            tok.decode([i], skip_special_tokens=False) for i in best.indices.tolist()]
        assert all(a.bytes == list(a.token.encode()) for a in entry.top_logprobs)
        chosen = [a.logprob for a in entry.top_logprobs if a.token == entry.token]
        assert chosen in ([], [entry.logprob])  # bit for bit the sampled token's log-prob
        assert math.isclose(entry.logprob, float(logp[k, ids[k]]), abs_tol=1e-4)


def test_tool_calls_only_when_tools_are_offered(served) -> None:
    _, _, client = served
    kw = dict(model="model", messages=USER, temperature=0, max_tokens=8)
    offered = client.chat.completions.create(**kw, tools=[CALCULATOR]).choices[0]
    assert offered.finish_reason == "tool_calls" and len(offered.message.tool_calls) == 1
    for extra in ({}, {"tools": [CALCULATOR], "tool_choice": "none"}):
        plain = client.chat.completions.create(**kw, **extra).choices[0]
        assert plain.message.content == TOOL_TEXT  # the text as generated ...
        assert plain.message.tool_calls is None and plain.finish_reason == "stop"  # ... only


def test_model_names_select_the_base_or_an_adapter(served, model_dir: Path) -> None:
    engine, server, client = served
    ids = [m.id for m in client.models.list().data]
    assert ids == [engine.model_path]
    kw = dict(messages=USER, temperature=0, max_tokens=4, extra_body={"return_token_ids": True})
    by_path = client.chat.completions.create(model=engine.model_path, **kw).choices[0]
    by_dir = client.chat.completions.create(model="model", **kw).choices[0]
    assert by_path.model_extra["token_ids"] == by_dir.model_extra["token_ids"] == [TOOL, IM_END]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", **kw)
    assert info.value.body["param"] == "model" and "gpt-4o" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    # an adapter on lm_head that favours "!" (33) everywhere
    hidden = engine.model.config.hidden_size
    a = torch.ones(1, hidden) / hidden**0.5
    b = torch.zeros(engine.vocab_size, 1)
    b[33] = 400.0
    engine.load_lora_adapter("bang", tensors={"lm_head.lora_A.weight": a,
                                              "lm_head.lora_B.weight": b},
                             config={"r": 1, "lora_alpha": 1})
    try:
        assert [m.id for m in client.models.list().data] == [engine.model_path, "bang"]
        lora = client.chat.completions.create(model="bang", **kw).choices[0]
        prompt = lora.model_extra["prompt_token_ids"]
        gen = httpx.post(f"{server.url}/generate", timeout=WAIT, json={
            "input_ids": prompt, "lora_path": "bang",
            "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).json()
        assert lora.model_extra["token_ids"] == gen["output_ids"] != [TOOL, IM_END]
        base = client.chat.completions.create(model="model", **kw).choices[0]
        assert base.model_extra["token_ids"] == [TOOL, IM_END]  # the base is the base again
    finally:
        engine.unload_lora_adapter("bang")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="bang", **kw)


# ---------------------------------------------------------------------------- the gateway


def same_samples(x: Any, y: Any) -> None:
    assert x.prompt_ids == y.prompt_ids and x.completion_ids == y.completion_ids
    assert x.loss_mask == y.loss_mask and x.logprobs == y.logprobs and x.text == y.text
    ex, ey = x.meta["episode"], y.meta["episode"]
    assert (ex["turns"], ex["tool_calls"]) == (ey["turns"], ey["tool_calls"])


def run_session(gateway: AgentGateway, program: Any, params: SamplingParams = SAMPLED,
                seed: int = 3) -> Any:
    """``program(base_url)`` in a fresh session of the same episode; its sample."""
    session = gateway.open_session(TASK, params=params, limits=LIMITS, seed=seed)
    try:
        program(session.base_url)
    finally:
        gateway.discard([session])
    return session.sample()


def openai_agent(stream: bool, turns: int = 3) -> Any:
    """A multi-turn tool-using loop with the ``openai`` client, streamed or not."""
    def program(base_url: str) -> None:
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=WAIT)
        messages: list[dict[str, Any]] = [*USER]
        for k in range(turns):
            kw = dict(model="policy", messages=messages, tools=[CALCULATOR], logprobs=True)
            if stream:
                got = collect_chat(client.chat.completions.create(
                    **kw, stream=True, stream_options={"include_usage": True}))
                assert got["usage"] is not None and got["finish"]
                content, calls = got["content"], got["calls"]
            else:
                msg = client.chat.completions.create(**kw).choices[0].message
                content = msg.content
                calls = [{"id": c.id, "name": c.function.name,
                          "arguments": c.function.arguments} for c in msg.tool_calls or []]
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls] or None})
            if calls:
                messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                                 "content": f"42 ({k})"})
            else:
                messages.append({"role": "user", "content": f"go on ({k})"})
    return program


def test_gateway_records_the_same_trajectory_streamed_or_not(gateway) -> None:
    for seed in (3, 4):
        whole = run_session(gateway, openai_agent(stream=False), seed=seed)
        streamed = run_session(gateway, openai_agent(stream=True), seed=seed)
        same_samples(whole, streamed)
        assert whole.meta["episode"]["turns"] == 3 and sum(whole.loss_mask) > 0


def test_openai_agents_sdk_runs_and_streams(gateway) -> None:
    import agents  # the dev extra installs it: a missing one fails, not skips
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return "42" if expression == "6*7" else "?"

    def program(stream: bool, tools: bool) -> Any:
        out: dict[str, Any] = {}

        def run(base_url: str) -> None:
            client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                                        timeout=WAIT)
            agent = agents.Agent(
                name="calc", instructions="Use the calculator.",
                model=agents.OpenAIChatCompletionsModel(model="policy", openai_client=client),
                tools=[calculator] if tools else [], tool_use_behavior="stop_on_first_tool")

            async def go() -> Any:
                if not stream:
                    return (await agents.Runner.run(agent, "What is 6*7?")).final_output
                result = agents.Runner.run_streamed(agent, "What is 6*7?")
                out["events"] = [e.type async for e in result.stream_events()]
                return result.final_output

            out["final"] = asyncio.run(go())

        return run, out

    for tools in (False, True):
        (a, a_out), (b, b_out) = program(False, tools), program(True, tools)
        whole, streamed = run_session(gateway, a, GREEDY), run_session(gateway, b, GREEDY)
        same_samples(whole, streamed)
        # without tools the Hermes text is the answer (no ModelBehaviorError: no calls parsed)
        assert a_out["final"] == b_out["final"] == ("42" if tools else TOOL_TEXT)
        assert "raw_response_event" in b_out["events"]
        assert whole.meta["episode"]["tool_calls"] == (1 if tools else 0)


def test_langchain_chat_openai_invoke_and_stream(gateway) -> None:
    import langchain_openai as lc  # the dev extra installs it

    def program(stream: bool, tools: bool) -> Any:
        out: dict[str, Any] = {}

        def run(base_url: str) -> None:
            llm = lc.ChatOpenAI(base_url=base_url, api_key="x", model="policy", max_retries=0,
                                timeout=WAIT, stream_usage=True)
            if tools:
                llm = llm.bind_tools([CALCULATOR])
            if stream:
                msg = None
                for part in llm.stream("What is 6*7?"):
                    msg = part if msg is None else msg + part
            else:
                msg = llm.invoke("What is 6*7?")
            out["content"], out["calls"] = msg.content, msg.tool_calls
            out["usage"] = msg.usage_metadata

        return run, out

    for tools in (False, True):
        (a, a_out), (b, b_out) = program(False, tools), program(True, tools)
        whole, streamed = run_session(gateway, a, GREEDY), run_session(gateway, b, GREEDY)
        same_samples(whole, streamed)
        assert a_out["content"] == b_out["content"] == TOOL_TEXT
        want = [{"name": "calculator", "args": {"expression": "6*7"}}] if tools else []
        for got in (a_out["calls"], b_out["calls"]):
            assert [{"name": c["name"], "args": c["args"]} for c in got] == want
        assert a_out["usage"]["output_tokens"] == b_out["usage"]["output_tokens"] == 2


class PlainPlane:
    """A plane that only samples (no top-k alternatives, no per-token hook)."""

    def __init__(self, plane: InProcessPlane) -> None:
        self.plane = plane

    def generate(self, prompts: Any, params: Any) -> list:
        return self.plane.generate(prompts, params)


def test_gateway_top_logprobs_need_a_plane_with_them_and_any_model_name_goes(gateway) -> None:
    with AgentGateway(PlainPlane(gateway.plane), gateway.chat) as plain:
        session = plain.open_session(TASK, params=GREEDY, limits=LIMITS)
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="policy", prompt="x", max_tokens=2, logprobs=2)
        assert info.value.body["param"] == "logprobs"
        # without a token hook, stream=true still works: the finished turn as events
        got = collect_chat(client.chat.completions.create(
            model="policy", messages=USER, logprobs=True, stream=True))
        assert got["content"] == TOOL_TEXT and len(got["logprobs"]) == 2
    session = gateway.open_session(TASK, params=GREEDY, limits=LIMITS)
    try:
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        r = client.completions.create(model="policy", prompt="x", max_tokens=2, logprobs=2)
        assert all(len(alts) == 2 for alts in r.choices[0].logprobs.top_logprobs)
        # the session serves one model, the policy: a program's own model name is kept
        r = client.chat.completions.create(model="gpt-4o", messages=USER, logprobs=True)
        assert r.model == "gpt-4o" and r.choices[0].logprobs.content
    finally:
        gateway.discard([session])


LONG = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_gateway_streams_token_by_token(gateway, kind) -> None:
    """Generation held after its 4th token (the engine's step hook): the client has the
    first 3 tokens' chunks (each goes out when the next is sampled) before the turn is over;
    released, the stream ends as the unstreamed answer and records the same trajectory."""
    engine, held, release, seen = gateway.plane.engine, threading.Event(), threading.Event(), []

    def hold(step: int) -> None:  # decode step 3: 4 tokens sampled
        if step == hold.at:
            held.set()
            seen.append(release.wait(WAIT))  # True: released by the test, not the timeout

    def ask(stream: bool) -> tuple[Any, Any]:
        session = gateway.open_session(TASK, params=LONG, limits=LIMITS, seed=1)
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        kw: dict[str, Any] = {"model": "policy", "stream": stream, "max_tokens": 8}
        try:
            if kind == "chat":
                out = client.chat.completions.create(
                    messages=USER, tools=[CALCULATOR], logprobs=True, top_logprobs=2, **kw)
            else:
                out = client.completions.create(prompt="What is", logprobs=2, **kw)
            if not stream:
                return out, session
            entries, text, finish = [], [], None
            for chunk in out:
                for c in chunk.choices:
                    piece = c.delta.content if kind == "chat" else c.text
                    text.append(piece or "")
                    lp = c.logprobs
                    if lp is not None:
                        entries += (lp.content if kind == "chat" else [
                            (t, v, a) for t, v, a in zip(lp.tokens, lp.token_logprobs,
                                                         lp.top_logprobs, strict=True)])
                    finish = c.finish_reason or finish
                if len(entries) == 3 and not release.is_set():
                    # generation stops after the 4th token until the test releases it, so
                    # these chunks came while the turn was being generated
                    assert held.wait(WAIT)
                    release.set()
            return ("".join(text), entries, finish), session
        finally:
            gateway.discard([session])

    whole, plain = ask(False)
    hold.at = engine.stats["decode_steps"] + 3
    engine.on_step = hold
    try:
        (text, entries, finish), streamed = ask(True)
    finally:
        engine.on_step = None
    assert seen == [True]
    (c,) = whole.choices
    if kind == "chat":
        assert text == c.message.content and finish == c.finish_reason
        assert [e.model_dump() for e in entries] == [e.model_dump() for e in c.logprobs.content]
    else:
        lp = c.logprobs
        assert text == c.text and finish == c.finish_reason
        assert entries == list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    assert len(entries) == 8
    same_samples(plain.sample(), streamed.sample())


def test_live_text_holds_back_stop_strings_and_the_last_token(gateway) -> None:
    tok = gateway.chat.tokenizer
    ids = tok.encode("ab STOP cd", add_special_tokens=False)
    live = LiveText(tok, ["STOP"])
    sent = "".join(live.push(t) for t in ids)
    assert sent == "ab "  # "S", "ST", "STO" might begin the stop string; then it is there
    assert live.rest("ab ") == ""
    live = LiveText(tok, ["P c"])  # a stop string within the text decoded so far
    assert "".join(live.push(t) for t in ids) == "ab STO"
    assert live.rest("ab STO") == ""
    live = LiveText(tok, [])
    assert "".join(live.push(t) for t in ids) == "ab STOP c"  # one token behind
    assert live.rest("ab STOP cd") == "d"
