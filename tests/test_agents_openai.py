"""The OpenAI-compatible endpoint on the rollout plane, driven by the real ``openai`` package.

The embedded engine's ``/v1`` routes (rl_core/engine/routes_openai.py) and the agent gateway's
per-episode sessions (rl_core/agents/gateway.py) run as real uvicorn servers on 127.0.0.1; the
gateway sits in front of the in-process plane and of an HttpPlane over an embedded engine
process. Pinned here: chat, completions, models, log-probs, Hermes tool calls, refusals in
OpenAI's error shape; many concurrent multi-turn episodes batched through one worker; every
episode sample token-exact (each model turn is the tokens and log-probs ``transformers`` and
the sampler give for the gateway's seed, each observation the chat template's ids, the mask
1 on model tokens only); programs that raise or hang cost their episode, never the call;
history rewrites; limits; replays with the same seed give the same samples.

The model is a tiny Qwen2 built here with a ChatML template and a byte-level tokenizer: its
layers barely touch the residual stream, so its next token depends mostly on the last one
(a bigram table set in ``lm_head``). After the generation prompt's ``\\n`` it prefers one
added token that reads as a whole Hermes tool call, after that token the end of turn: greedy
chat answers with a tool call, sampled chat with a mix of text, tool calls and stops.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from engine_helpers import hf_reference

from rl_core.agents import EpisodeRunner
from rl_core.agents.chat import ChatTokens
from rl_core.agents.env import EpisodeLimits
from rl_core.agents.gateway import AgentGateway, request_seed
from rl_core.agents.programs import run_programs
from rl_core.data.records import Record
from rl_core.engine.core import EmbeddedEngine
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.server import ServerThread, create_app
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool

pytestmark = pytest.mark.timeout(300)

VOCAB, HIDDEN = 260, 272
PAD, IM_START, IM_END, TOOL = 256, 257, 258, 259
NEWLINE = 10
TOOL_TEXT = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n'
             "</tool_call>")
TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') "
    "| map(attribute='name') | join(', ')) + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') "
    "+ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)
LIMITS = EpisodeLimits(max_turns=4, max_tokens=200, timeout_s=60)
RECORDS = [Record(f"r{i}", f"question {i}", f"#### {i}") for i in range(8)]
WAIT = 60.0


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = dict(zip(keep, map(chr, keep), strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def save_chat_model(path: Path) -> Path:
    """The module docstring's model: token ``b`` < 256 is byte ``b``; then <|endoftext|>,
    <|im_start|>, <|im_end|> (EOS) and the tool-call token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    vocab = {c: b for b, c in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(TOOL_TEXT, special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=IM_END, pad_token_id=PAD, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    table = torch.full((VOCAB, VOCAB), -10.0)  # table[a, b]: the logit of b after a
    text = [*range(32, 127), NEWLINE]
    table[:, text] = 0.5 * torch.randn(VOCAB, len(text), generator=gen)
    table[:, IM_END] = 2.0
    table[NEWLINE, TOOL] = 4.0
    table[TOOL, IM_END] = 6.0
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :VOCAB] = torch.eye(VOCAB)
        for layer in model.model.layers:  # a little context, far less than the table
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        model.lm_head.weight.zero_()
        # RMSNorm maps the one-hot embedding to sqrt(HIDDEN) * e_a.
        model.lm_head.weight[:, :VOCAB] = table.T / HIDDEN**0.5
    model.save_pretrained(path)
    fast.save_pretrained(path)
    GenerationConfig(eos_token_id=IM_END, pad_token_id=PAD).save_pretrained(path)
    return path


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One torch thread: on 2 cores, a second OpenMP thread fights the servers' threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def ref(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def served(model_dir: Path):
    """The embedded engine's own server, and an ``openai`` client of its /v1 routes."""
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
def local(model_dir: Path):
    """The gateway over the in-process plane."""
    plane = InProcessPlane(model_dir, max_running_requests=64)
    gateway = AgentGateway(plane, ChatTokens(plane.engine.tokenizer)).start()
    try:
        yield gateway
    finally:
        gateway.close()
        plane.close()


@pytest.fixture(scope="module")
def remote(model_dir: Path, tmp_path_factory):
    """The gateway over an HttpPlane: one embedded engine process behind SGLang's API."""
    pool = EnginePool(embedded_engine_command(model_dir, num_threads=1), 1,
                      log_dir=tmp_path_factory.mktemp("engines"), router=False,
                      health_interval_s=0.5, health_timeout_s=10, failure_threshold=2,
                      startup_timeout_s=120)
    plane = HttpPlane(pool, request_batch_size=16, timeout_s=WAIT).start()
    gateway = AgentGateway(plane, ChatTokens(local_tokenizer(model_dir))).start()
    try:
        yield gateway
    finally:
        gateway.close()
        plane.close()


def local_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# ---------------------------------------------------------------------------- programs


class Log:
    """What programs saw, per session: every response's ids (``return_token_ids``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_session: dict[str, list[dict[str, Any]]] = {}

    def add(self, response: Any) -> None:
        choice = response.choices[0]
        sid = response.id.split("-")[1]  # chatcmpl-<sid>-<request>
        extra = choice.model_extra or {}
        entry = {"prompt": extra.get("prompt_token_ids"), "ids": extra.get("token_ids"),
                 "logprobs": [t.logprob for t in (choice.logprobs.content or [])]
                 if choice.logprobs else None, "message": choice.message}
        with self.lock:
            self.by_session.setdefault(sid, []).append(entry)


def multi_turn(log: Log | None = None, turns: int = 3) -> Callable[[Any, Record], float]:
    """An agent: ask, append the answer and a tool result (or a user nudge), ask again."""

    def program(client: Any, task: Record) -> float:
        messages = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": task.question}]
        for k in range(turns):
            r = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=8, logprobs=True,
                temperature=0.3,  # overridden by the gateway: the run's sampling rules
                extra_body={"return_token_ids": True})
            if log is not None:
                log.add(r)
            msg = r.choices[0].message
            messages.append({"role": "assistant", "content": msg.content})
            # No tools offered, so no calls parsed: the program reads the Hermes text itself.
            if msg.tool_calls or "<tool_call>" in (msg.content or ""):
                messages.append({"role": "tool", "tool_call_id": f"call-{k}",
                                 "content": f"42 (call {k})"})
            else:
                messages.append({"role": "user", "content": f"and then? ({k})"})
        return 0.5

    return program


def first_messages(task: Record) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": task.question}]


# ---------------------------------------------------------------------------- checks


def check_layout(samples: list, records: list[Record], n: int, step: int) -> None:
    """EpisodeRunner.run's layout and meta["episode"] keys."""
    assert len(samples) == len(records) * n
    for k, s in enumerate(samples):
        g, j = divmod(k, n)
        assert (s.uid, s.group, s.record_id, s.answer) == (
            f"{step}:{records[g].id}:{j}", g, records[g].id, records[g].answer)
        assert set(s.meta["episode"]) == EPISODE_KEYS
        assert len(s.loss_mask) == len(s.completion_ids) == len(s.logprobs) == len(s.versions)


EPISODE_KEYS = {"status", "finish", "turns", "attempts", "errors", "env_reward", "tool_calls",
                "info", "masked_tokens", "trace", "seconds", "started_at", "template_checks",
                "template_mismatches", "segments"}


def check_token_exact(sample: Any, chat: ChatTokens, ref: Any, step: int, seed: int,
                      log: Log | None = None) -> None:
    """The sample is the prompt, then per request the observation ids (mask 0, log-prob 0)
    and the engine's turn (mask 1): the tokens and log-probs ``transformers`` and the sampler
    give for the gateway's seed, and what the program was answered."""
    ep = sample.meta["episode"]
    task = Record(sample.record_id, "", "")
    trace = [t for t in ep["trace"] if t["attempt"] == ep["attempts"] - 1]
    prompts = [t for t in trace if t["role"] == "prompt"]
    assert sample.prompt_ids == chat.prompt_ids(prompts[-1]["messages"])
    chain = prompts[-1]["chain"]
    seen = log.by_session[prompts[-1]["session"]] if log is not None else None
    pos, last_turn = 0, []
    ids, mask, logps = sample.completion_ids, sample.loss_mask, sample.logprobs
    for t in trace:
        if t["role"] == "observation" and t["request"] > prompts[-1]["request"]:
            obs = chat.observation_ids(t["messages"], last_turn)
            assert ids[pos : pos + len(obs)] == obs
            assert mask[pos : pos + len(obs)] == [0] * len(obs)
            assert logps[pos : pos + len(obs)] == [0.0] * len(obs)
            pos += len(obs)
        elif t["role"] == "assistant" and t["chain"] == chain:
            turn = ids[pos : pos + t["tokens"]]
            assert mask[pos : pos + len(turn)] == [1] * len(turn)
            context = sample.prompt_ids + ids[:pos]
            assert t["seed"] == request_seed(seed, step, task.id, int(sample.uid.split(":")[2]),
                                             t["attempt"], t["request"])
            params = SamplingParams(temperature=PARAMS.temperature, seed=t["seed"])
            tokens, logp = hf_reference(ref, context, turn, params)
            assert turn == tokens, "a model turn is not what the engine samples for its seed"
            torch.testing.assert_close(torch.tensor(logps[pos : pos + len(turn)]), logp,
                                       atol=1e-4, rtol=0)
            if seen is not None:
                answer = seen[t["request"]]
                assert answer["prompt"] == context and answer["ids"] == turn
                assert answer["logprobs"] == logps[pos : pos + len(turn)]
            pos, last_turn = pos + len(turn), turn
    assert pos == len(ids)


# ---------------------------------------------------------------------------- engine /v1


def test_engine_models_and_greedy_tool_call(served, ref) -> None:
    engine, _, client = served
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_path]
    r = client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "What is 6*7?"}], temperature=0,
        logprobs=True, tools=[{"type": "function", "function": {"name": "calculator",
                                                                 "parameters": {}}}],
        extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == TOOL_TEXT  # the content keeps the text as generated
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6*7"}
    extra = choice.model_extra
    assert extra["token_ids"] == [TOOL, IM_END]
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 6*7?"}],
                                     tools=[{"type": "function", "function": {
                                         "name": "calculator", "parameters": {}}}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nTools: calculator")  # tools were rendered
    assert extra["prompt_token_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    _, logp = hf_reference(ref, extra["prompt_token_ids"], [TOOL, IM_END],
                           SamplingParams(temperature=0.0))
    got = [t.logprob for t in choice.logprobs.content]
    torch.testing.assert_close(torch.tensor(got), logp, atol=1e-4, rtol=0)
    assert [t.token for t in choice.logprobs.content] == [TOOL_TEXT, "<|im_end|>"]
    assert r.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert r.usage.completion_tokens == 2 and r.usage.total_tokens == r.usage.prompt_tokens + 2
    assert r.object == "chat.completion" and r.model == "model"


def test_engine_chat_n_seeds_and_max_tokens(served, ref) -> None:
    _, _, client = served
    kw = dict(model="model", messages=[{"role": "user", "content": "tell me"}], n=3, seed=11,
              max_tokens=5, logprobs=True, extra_body={"return_token_ids": True})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    for j, (x, y) in enumerate(zip(a.choices, b.choices, strict=True)):
        ids = x.model_extra["token_ids"]
        assert ids == y.model_extra["token_ids"]  # same seed, same samples
        tokens, logp = hf_reference(ref, x.model_extra["prompt_token_ids"], ids,
                                    SamplingParams(temperature=1.0, seed=11 + j))
        assert ids == tokens  # choice j is seeded seed + j, as SGLang seeds n > 1
        torch.testing.assert_close(torch.tensor([t.logprob for t in x.logprobs.content]),
                                   logp, atol=1e-4, rtol=0)
        assert len(ids) <= 5
        # no tools offered: a <tool_call> in the text stays text, never a tool call
        assert x.finish_reason == ("length" if ids[-1] != IM_END else "stop")
        assert x.message.tool_calls is None
    assert a.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in a.choices)


def test_engine_completions(served, ref) -> None:
    _, _, client = served
    r = client.completions.create(model="model", prompt="hello", max_tokens=6, seed=3, logprobs=0,
                                  extra_body={"return_token_ids": True})
    (c,) = r.choices
    ids = c.model_extra["token_ids"]
    assert c.model_extra["prompt_token_ids"] == list(b"hello")
    tokens, logp = hf_reference(ref, list(b"hello"), ids, SamplingParams(seed=3))
    assert ids == tokens
    torch.testing.assert_close(torch.tensor(c.logprobs.token_logprobs), logp, atol=1e-4,
                               rtol=0)
    assert "".join(c.logprobs.tokens).startswith(c.text) and r.object == "text_completion"
    # Token ids in, a batch of prompts, n per prompt: prompt-major choices.
    r = client.completions.create(model="model", prompt=[[104, 105], [111, 107]], n=2,
                                  max_tokens=4, seed=5, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [[104, 105]] * 2 + [
        [111, 107]] * 2
    # A stop string ends the text before it (the ids keep what was generated): a seed whose
    # 12 tokens are plain text, and one of its characters as the stop string.
    for seed in range(40):
        full = client.completions.create(model="model", prompt="hello", max_tokens=12, seed=seed,
                                         extra_body={"return_token_ids": True}).choices[0]
        if full.finish_reason == "length" and max(full.model_extra["token_ids"]) < 256 and (
                stop := full.text[5]).isalnum():
            break
    else:
        pytest.fail("no seed in 0..39 gave 12 plain-text tokens")
    cut = client.completions.create(model="model", prompt="hello", max_tokens=12, seed=seed,
                                    stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.matched_stop == stop
    assert cut.text == full.text[: full.text.find(stop)]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream=true
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ({"extra_body": {"mystery_knob": 1}}, "mystery_knob"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
])
def test_engine_refuses_in_openais_error_shape(served, kwargs, param) -> None:
    _, _, client = served
    body = {"model": "model", "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    err = info.value.body
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_engine_refusals_on_the_wire(served) -> None:
    engine, server, _ = served
    with httpx.Client(base_url=server.url, timeout=WAIT) as http:
        r = http.post("/v1/completions", json={"model": "model", "prompt": "x", "logprobs": 21})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                   "code"}
        r = http.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": "model", "prompt": "x", "max_tokens": 600})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    small = ServerThread(create_app(engine, max_request_bytes=2000)).start()
    try:
        client = openai.OpenAI(base_url=f"{small.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="model", messages=[
                {"role": "user", "content": "x" * 5000}])
        assert info.value.status_code == 413
    finally:
        small.stop()


# ---------------------------------------------------------------------------- the gateway


def test_many_concurrent_multi_turn_episodes_are_token_exact(local, ref) -> None:
    log = Log()
    before = local.stats
    t0 = time.monotonic()
    samples = run_programs(local, multi_turn(log), RECORDS, n=3, params=PARAMS, step=3, seed=7,
                           limits=LIMITS, retries=0, concurrency=24)
    seconds = time.monotonic() - t0
    check_layout(samples, RECORDS, 3, 3)
    stats = local.stats
    assert stats["requests"] - before["requests"] == 24 * 3
    assert stats["max_batch"] > 4, "concurrent agents were not batched"
    assert seconds < 60
    for s in samples:
        ep = s.meta["episode"]
        assert (ep["status"], ep["finish"], ep["turns"], ep["attempts"]) == ("ok", "done", 3, 1)
        assert s.reward == ep["env_reward"] == 0.5
        assert ep["info"] == {"history_rewrites": 0, "refused_requests": 0}
        assert ep["masked_tokens"] == len(s.loss_mask) - sum(s.loss_mask) > 0
        assert set(s.versions) == {0} and s.weight_version == 0
        turns = [t for t in ep["trace"] if t["role"] == "assistant"]
        assert s.text == turns[-1]["text"]
        assert ep["tool_calls"] == sum(t["tool_calls"] for t in turns)
        check_token_exact(s, local.chat, ref, 3, 7, log)
    # tool calls are parsed only when a request offers tools, and these offer none
    assert not any(s.meta["episode"]["tool_calls"] for s in samples)
    assert any(t["role"] == "observation" and t["messages"][0]["role"] == "tool"
               for s in samples for t in s.meta["episode"]["trace"])
    assert len({tuple(s.completion_ids) for s in samples}) > 12  # seeds differ per episode


def test_replay_gives_the_same_samples(local) -> None:
    kw = dict(n=2, params=PARAMS, step=1, seed=5, limits=LIMITS, retries=0)
    a = run_programs(local, multi_turn(), RECORDS[:4], **kw)
    b = run_programs(local, multi_turn(), RECORDS[:4], concurrency=3, **kw)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.loss_mask for s in a] == [s.loss_mask for s in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs),
                                   atol=1e-5, rtol=0)
    c = run_programs(local, multi_turn(), RECORDS[:4], **{**kw, "seed": 6})
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]


def test_gateway_over_http_plane_matches_in_process(remote, local, ref) -> None:
    """In front of an engine behind SGLang's HTTP API (as in front of real SGLang): the same
    episodes, token for token, as in front of the in-process engine."""
    log = Log()
    kw = dict(n=2, params=PARAMS, step=2, seed=9, limits=LIMITS, retries=0)
    over_http = run_programs(remote, multi_turn(log, turns=2), RECORDS[:3], **kw)
    in_process = run_programs(local, multi_turn(turns=2), RECORDS[:3], **kw)
    check_layout(over_http, RECORDS[:3], 2, 2)
    assert [s.completion_ids for s in over_http] == [s.completion_ids for s in in_process]
    for s in over_http:
        assert s.meta["episode"]["status"] == "ok"
        check_token_exact(s, remote.chat, ref, 2, 9, log)


TOPK_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)


def top_k_turns(base_url: str, k: int) -> list[Any]:
    """A chat turn and a completion (its prompt the chat's tokens so far) with ``k``
    alternatives per token (none: k=0)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=WAIT)
    tops = {"logprobs": True, "top_logprobs": k} if k else {"logprobs": True}
    extra = {"return_token_ids": True, "ignore_eos": True}
    chat = client.chat.completions.create(model="model", messages=USER, temperature=0, max_tokens=5,
                                          **tops, extra_body=extra).choices[0]
    prompt = [*chat.model_extra["prompt_token_ids"], *chat.model_extra["token_ids"], 33]
    text = client.completions.create(model="model", prompt=prompt, temperature=0, max_tokens=5,
                                     logprobs=k, extra_body=extra).choices[0]
    return [chat, text]


def test_gateway_top_logprobs_are_the_engines(served, local, remote) -> None:
    """``top_logprobs`` (chat) and ``logprobs=k`` (completions) through a session, on the
    in-process and the HTTP plane: the engine's own route's numbers for the same greedy
    request; the recorded trajectory is the one a session without them records."""
    _, server, _ = served
    want = top_k_turns(f"{server.url}/v1", 4)
    assert all(len(t.logprobs.content if i == 0 else t.logprobs.top_logprobs) == 5
               for i, t in enumerate(want))
    for gateway in (local, remote):
        samples = []
        for k in (4, 0):
            session = gateway.open_session(RECORDS[0], params=TOPK_PARAMS, limits=LIMITS, seed=5)
            try:
                got = top_k_turns(session.base_url, k)
            finally:
                gateway.discard([session])
            samples.append(session.sample())
            if not k:
                break
            for g, w in zip(got, want, strict=True):
                assert g.model_extra["prompt_token_ids"] == w.model_extra["prompt_token_ids"]
                assert g.model_extra["token_ids"] == w.model_extra["token_ids"]
            (chat, text), (wchat, wtext) = got, want
            for e, we in zip(chat.logprobs.content, wchat.logprobs.content, strict=True):
                assert [a.token for a in e.top_logprobs] == [a.token for a in we.top_logprobs]
                torch.testing.assert_close(torch.tensor([a.logprob for a in e.top_logprobs]),
                                           torch.tensor([a.logprob for a in we.top_logprobs]),
                                           atol=1e-5, rtol=0)
                assert abs(e.logprob - we.logprob) <= 1e-5
            for alts, walts in zip(text.logprobs.top_logprobs, wtext.logprobs.top_logprobs,
                                   strict=True):
                assert len(alts) == 4 and list(alts) == list(walts)
                torch.testing.assert_close(torch.tensor(list(alts.values())),
                                           torch.tensor(list(walts.values())), atol=1e-5, rtol=0)
        with_k, without = samples
        assert with_k.prompt_ids == without.prompt_ids
        assert with_k.completion_ids == without.completion_ids
        assert with_k.logprobs == without.logprobs and with_k.loss_mask == without.loss_mask


def test_failing_and_hanging_programs_cost_their_episode_only(local) -> None:
    release = threading.Event()
    flaky_seen: set[str] = set()
    late: list[Any] = []

    def program(client: Any, task: Record) -> float | None:
        kind = task.question
        if kind == "raise":
            raise ValueError("the agent crashed")
        if kind == "flaky" and task.id not in flaky_seen:
            flaky_seen.add(task.id)
            client.chat.completions.create(model="model", messages=[
                {"role": "user", "content": "x"}], max_tokens=3)
            raise RuntimeError("first attempt dies after one request")
        if kind == "hang":
            client.chat.completions.create(model="model", messages=[
                {"role": "user", "content": "x"}], max_tokens=3)
            release.wait(30)  # hung far past timeout_s: abandoned, then let go at the end
            try:
                client.chat.completions.create(model="model", messages=[
                    {"role": "user", "content": "x"}], max_tokens=3)
            except openai.APIStatusError as e:
                late.append(e.status_code)
            return 1.0
        if kind == "bad":
            return "not a reward"  # type: ignore[return-value]
        multi_turn(turns=2)(client, task)
        return None

    tasks = [Record(f"t{i}", kind, "1") for i, kind in enumerate(
        ["ok", "raise", "flaky", "hang", "bad", "ok"])]
    limits = EpisodeLimits(max_turns=4, max_tokens=200, timeout_s=2.0)
    t0 = time.monotonic()
    samples = run_programs(local, program, tasks, n=1, params=PARAMS, step=0, seed=1,
                           limits=limits, retries=1)
    seconds = time.monotonic() - t0
    assert seconds < 2 * limits.timeout_s + 3, "a hung program held up the call"
    check_layout(samples, tasks, 1, 0)
    status = {s.record_id: s.meta["episode"] for s in samples}
    for rid in ("t0", "t5"):
        assert status[rid]["status"] == "ok" and status[rid]["env_reward"] == 0.0
        assert status[rid]["attempts"] == 1 and status[rid]["turns"] == 2
    assert status["t2"]["status"] == "ok" and status["t2"]["attempts"] == 2
    assert "RuntimeError: first attempt dies" in status["t2"]["errors"][0]
    for rid, why in (("t1", "ValueError: the agent crashed"), ("t3", "timeout"),
                     ("t4", "TypeError")):
        ep = status[rid]
        assert ep["status"] == "failed" and ep["finish"] == "failed" and ep["attempts"] == 2
        assert len(ep["errors"]) == 2 and all(why in e for e in ep["errors"])
    hung = next(s for s in samples if s.record_id == "t3")
    assert hung.reward == 0.0 and hung.loss_mask == [0] * len(hung.completion_ids)
    assert len(hung.completion_ids) > 0  # what it generated is recorded, trained on nothing
    release.set()  # the abandoned threads come back: their sessions are gone
    deadline = time.monotonic() + 10
    while len(late) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert late == [404, 404]


def test_history_rewrite_keeps_the_final_chain(local, ref) -> None:
    def program(client: Any, task: Record) -> float:
        first = [{"role": "user", "content": "first try"}]
        client.chat.completions.create(model="model", messages=first, max_tokens=4)
        # The agent drops the answer and starts over: a new chain.
        second = [{"role": "system", "content": "again"}, {"role": "user", "content": "retry"}]
        b = client.chat.completions.create(model="model", messages=second, max_tokens=4)
        # Echoing the reply with an edit also rewrites; echoing it as is extends.
        edited = [*second, {"role": "assistant", "content": b.choices[0].message.content + "!"},
                  {"role": "user", "content": "more"}]
        client.chat.completions.create(model="model", messages=edited, max_tokens=4)
        final = edited[:2] + [{"role": "user", "content": "final"}]
        c = client.chat.completions.create(model="model", messages=final, max_tokens=4)
        client.chat.completions.create(model="model", messages=[
            *final, {"role": "assistant", "content": c.choices[0].message.content},
            {"role": "tool", "content": "7"}], max_tokens=4)
        return 1.0

    limits = EpisodeLimits(max_turns=5, max_tokens=200, timeout_s=60)  # every request counts
    (s,) = run_programs(local, program, RECORDS[:1], n=1, params=PARAMS, step=0, seed=3,
                        limits=limits, retries=0)
    ep = s.meta["episode"]
    assert ep["status"] == "ok" and ep["turns"] == 5
    assert ep["info"]["history_rewrites"] == 3
    chat = local.chat
    assert s.prompt_ids == chat.prompt_ids([{"role": "system", "content": "again"},
                                            {"role": "user", "content": "retry"},
                                            {"role": "user", "content": "final"}])
    assert [t["note"] for t in ep["trace"] if t["role"] == "prompt"] == [
        "first request", "history rewritten", "history rewritten", "history rewritten"]
    check_token_exact(s, chat, ref, 0, 3)
    assert sum(1 for t in ep["trace"] if t["role"] == "assistant" and t["chain"] == 4) == 2


def test_limits_clamp_and_refuse(local) -> None:
    seen: dict[str, Any] = {}

    def program(client: Any, task: Record) -> float:
        messages = first_messages(task)
        for k in range(5):
            try:
                r = client.chat.completions.create(model="model", messages=messages,
                                                   max_tokens=100, extra_body={
                                                       "return_token_ids": True})
            except openai.BadRequestError as e:
                seen.setdefault(task.id, []).append(e.body["code"])
                return 0.0
            seen.setdefault(task.id, []).append(len(r.choices[0].model_extra["token_ids"]))
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"go on {k}"}]
        return 1.0

    turns = EpisodeLimits(max_turns=2, max_tokens=400, timeout_s=30)
    (s,) = run_programs(local, program, [Record("a", "q", "1")], n=1, params=PARAMS, step=0,
                        seed=2, limits=turns, retries=0)
    assert seen["a"][-1] == "max_turns" and s.meta["episode"]["finish"] == "max_turns"
    assert s.meta["episode"]["turns"] == 2 and s.meta["episode"]["info"]["refused_requests"] == 1
    # A per-turn cap of 8 (the run's) and a budget of 20 tokens after the prompt.
    tokens = EpisodeLimits(max_turns=10, max_tokens=20, timeout_s=30)
    clamp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    (s,) = run_programs(local, program, [Record("b", "q", "1")], n=1, params=clamp, step=0,
                        seed=2, limits=tokens, retries=0)
    assert seen["b"][0] == 8  # the run's max_new_tokens, not the agent's 100
    assert seen["b"][-1] == "max_tokens" and s.meta["episode"]["finish"] == "max_tokens"
    assert len(s.completion_ids) <= 20


def test_session_routes_and_refusals(local) -> None:
    session = local.open_session(RECORDS[0], params=PARAMS, limits=LIMITS)
    try:
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        assert [m.id for m in client.models.list().data] == ["grpoflow-policy"]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="model", messages=[{"role": "user", "content": "x"}],
                                           n=2)
        assert info.value.body["param"] == "n"
        # Completions: token ids that extend the recorded ids are observations (mask 0).
        a = client.completions.create(model="model", prompt=[104, 105], max_tokens=3,
                                      extra_body={"return_token_ids": True}).choices[0]
        a_ids = a.model_extra["token_ids"]
        grown = [104, 105, *a_ids, 33, 33]
        b = client.completions.create(model="model", prompt=grown, max_tokens=3, logprobs=0,
                                      extra_body={"return_token_ids": True}).choices[0]
        b_ids = b.model_extra["token_ids"]
        assert b.model_extra["prompt_token_ids"] == grown
        s = session.sample()
        assert s.prompt_ids == [104, 105] and s.completion_ids == [*a_ids, 33, 33, *b_ids]
        assert s.loss_mask == [1] * len(a_ids) + [0, 0] + [1] * len(b_ids)
        assert s.logprobs[len(a_ids) + 2:] == b.logprobs.token_logprobs
        # A text prompt starts a chain; text that extends what it was answered grows it.
        c = client.completions.create(model="model", prompt="ab", max_tokens=3,
                                      extra_body={"return_token_ids": True}).choices[0]
        c_ids = c.model_extra["token_ids"]
        d = client.completions.create(model="model", prompt="ab" + c.text + " ok", max_tokens=3,
                                      extra_body={"return_token_ids": True}).choices[0]
        assert d.model_extra["prompt_token_ids"] == [97, 98, *c_ids, *b" ok"]
    finally:
        local.discard([session])
    s = session.sample()
    ep = s.meta["episode"]
    assert ep["turns"] == 4 and ep["info"]["history_rewrites"] == 1
    assert s.prompt_ids == [97, 98]
    assert s.completion_ids == [*c_ids, *b" ok", *d.model_extra["token_ids"]]
    assert s.loss_mask == [1] * len(c_ids) + [0, 0, 0] + [1] * len(d.model_extra["token_ids"])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="model", messages=[{"role": "user", "content": "x"}])
    raw = httpx.post(f"{local.url}/nowhere", json={})
    assert raw.status_code == 404 and "message" in raw.json()["error"]


def test_episode_samples_match_episode_runner_format(local) -> None:
    """A gateway sample and an EpisodeRunner sample carry the same fields, so the loss,
    the ledger and the metrics treat them alike."""
    from rl_core.agents import StepResult

    class Once:
        def reset(self, task: Record) -> list[dict[str, str]]:
            return first_messages(task)

        def step(self, turn: Any) -> StepResult:
            return StepResult(done=True, reward=0.5)

    runner = EpisodeRunner(local.plane, local.chat, Once, LIMITS)
    (ours,) = run_programs(local, multi_turn(turns=1), RECORDS[:1], n=1, params=PARAMS,
                           step=4, seed=8, limits=LIMITS, retries=0)
    (theirs,) = runner.run(RECORDS[:1], n=1, params=PARAMS, step=4, seed=8)
    assert set(ours.meta["episode"]) == set(theirs.meta["episode"])
    assert (ours.uid, ours.group, ours.record_id, ours.answer) == (
        theirs.uid, theirs.group, theirs.record_id, theirs.answer)
    # The same seed rule: the first turn of either is the same sample.
    assert ours.prompt_ids == theirs.prompt_ids
    assert ours.completion_ids == theirs.completion_ids
    assert ours.loss_mask == theirs.loss_mask and ours.versions == theirs.versions


USER = [{"role": "user", "content": "hi"}]
HOSTILE_CHAT: list[Any] = [
    [], "text", None, {"messages": []}, {"messages": "hi"}, {"messages": [None]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "assistant", "content": None}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]},
    {"messages": USER, "max_tokens": 0},
    {"messages": USER, "max_tokens": "8"}, {"messages": USER, "max_completion_tokens": -1},
    {"messages": USER, "n": 10**9}, {"messages": USER, "seed": 2**80},
    {"messages": USER, "seed": 1.5},
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    {"messages": USER, "top_p": 0}, {"messages": USER, "top_k": 0},
    {"messages": USER, "min_p": 2}, {"messages": USER, "stop": [1]},
    {"messages": USER, "stop": [""]}, {"messages": USER, "stop_token_ids": "x"},
    {"messages": USER, "logprobs": "yes"}, {"messages": USER, "tools": "calculator"},
    {"messages": USER, "top_logprobs": 3}, {"messages": USER, "model": 5},
    {"messages": USER, "stream_options": {"include_usage": True}},
    {"messages": USER, "tools": [{"type": "function"}]}, {"messages": USER, "tool_choice": 3},
    {"messages": USER, "chat_template_kwargs": {"tokenize": True}},
    {"messages": USER, "chat_template_kwargs": []}, {"messages": USER, "logit_bias": {"1": 5}},
    {"messages": USER, "response_format": {"type": "json_object"}},
]
HOSTILE_COMPLETIONS: list[Any] = [
    {}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1, 3]}, {"prompt": [10**12]},
    {"prompt": [True, 1]}, {"prompt": {"a": 1}}, {"prompt": [[1], "x", 3]},
    {"prompt": "x", "logprobs": 21}, {"prompt": "x", "logprobs": True},
    {"prompt": "x", "stream": "yes"}, {"prompt": "x", "stream_options": {"include_usage": 1}},
    {"prompt": "x", "echo": True}, {"prompt": "x", "suffix": "y"}, {"prompt": "x", "best_of": 3},
    {"prompt": [5] * 600},
]
# Past the context: the engine refuses; the gateway clamps max_tokens to the episode's budget.
TOO_LONG = [("/chat/completions", {"messages": USER, "max_tokens": 10**30}),
            ("/completions", {"prompt": "x", "max_tokens": 10**30})]


@pytest.mark.parametrize("where", ["engine", "gateway"])
def test_hostile_bodies_get_4xx_and_the_servers_stay_healthy(served, local, where) -> None:
    session = local.open_session(RECORDS[0], params=PARAMS, limits=LIMITS)
    base = f"{served[1].url}/v1" if where == "engine" else session.base_url
    try:
        with httpx.Client(base_url=base, timeout=WAIT) as http:
            for route, bodies in (("/chat/completions", HOSTILE_CHAT),
                                  ("/completions", HOSTILE_COMPLETIONS)):
                for body in bodies:
                    r = (http.post(route, content=body) if isinstance(body, bytes)
                         else http.post(route, json=body))
                    assert 400 <= r.status_code < 500, (route, body, r.status_code, r.text)
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            for route, body in TOO_LONG:
                r = http.post(route, json=body)
                assert r.status_code == (200 if where == "gateway" else 400), r.text
            r = http.post("/chat/completions", json={"messages": USER, "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        local.discard([session])
    assert session.sample().meta["episode"]["turns"] == (3 if where == "gateway" else 0)


class GatedPlane:
    """The real in-process plane, held at the door of each generation until released (so a
    test can act while a request is in flight)."""

    def __init__(self, plane: InProcessPlane) -> None:
        self.plane, self.entered, self.release = plane, threading.Event(), threading.Event()

    def generate(self, prompts: Any, params: Any) -> list:
        self.entered.set()
        assert self.release.wait(WAIT)
        return self.plane.generate(prompts, params)


def test_closing_or_timing_out_a_session_refuses_its_requests(local) -> None:
    gated = GatedPlane(local.plane)
    with AgentGateway(gated, local.chat) as gateway:
        session = gateway.open_session(RECORDS[0], params=PARAMS, limits=LIMITS)
        client = openai.OpenAI(base_url=session.base_url, api_key="x", max_retries=0,
                               timeout=WAIT)
        errors: list[Any] = []

        def ask() -> None:
            try:
                client.chat.completions.create(model="model", messages=USER)
            except openai.APIStatusError as e:
                errors.append((e.status_code, e.body["code"], time.monotonic()))

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        assert gated.entered.wait(WAIT)
        closed_at = time.monotonic()
        session.close("the runner gave up")
        asking.join(WAIT)
        assert errors and errors[0][:2] == (410, "session_closed")
        assert errors[0][2] - closed_at < 2.0  # answered at once, not at the deadline
        gated.release.set()  # the generation finishes, and is not the episode's
        deadline = time.monotonic() + 10
        while gateway.stats["requests"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        sample = session.sample()
        assert sample.meta["episode"]["turns"] == 0 and sample.completion_ids == []
        # Past the episode's deadline: refused before generating.
        short = gateway.open_session(RECORDS[0], params=PARAMS,
                                     limits=EpisodeLimits(timeout_s=0.2))
        time.sleep(0.3)
        late = openai.OpenAI(base_url=short.base_url, api_key="x", max_retries=0, timeout=WAIT)
        with pytest.raises(openai.APIStatusError) as info:
            late.chat.completions.create(model="model", messages=USER)
        assert info.value.status_code == 410 and "agent.timeout_s" in info.value.body["message"]
