"""Hostile and malformed requests against the embedded engine's real HTTP server.

What this file is for: the "bad input / HTTP" part of the reliability suite
(docs/reliability.md). One uvicorn server over a tiny engine serves the whole module; every
test sends it requests a careless or hostile client could send — invalid JSON, JSON that
is not standard, bodies over the size limit (declared and chunked), huge ``n``,
``max_new_tokens``, seeds and token ids, wrong types in every field, concurrent aborts —
and checks that each gets a 4xx with a message, never a 5xx or a hang, and that the server
stays healthy with nothing left queued. A hypothesis property drives the ``/generate``
request schema with generated bodies.

What it must never do: download anything, start more than one engine, or take long (the
module runs in about 15 s; hypothesis is derandomized so CI sees the same examples).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TINY_VOCAB
from engine_helpers import save_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_core.engine.core import EmbeddedEngine
from rl_core.engine.server import ServerThread, create_app

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_BYTES = 256 * 1024  # small limits: oversized bodies stay cheap to send
MAX_SAMPLES = 32
CONTEXT = 256  # tiny_qwen2's max_position_embeddings
WAIT = 30.0


class Engine:
    """The module's engine, its server and a client."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = EmbeddedEngine(model_dir, control_timeout_s=20)
        app = create_app(self.engine, max_request_bytes=MAX_BYTES, max_request_samples=MAX_SAMPLES)
        self.server = ServerThread(app).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=WAIT)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.engine.close()

    def post(self, path: str, body: Any = None, *, raw: bytes | None = None) -> httpx.Response:
        if raw is None:
            raw = json.dumps(body).encode()
        return self.client.post(path, content=raw, headers={"content-type": "application/json"})

    def assert_healthy(self) -> None:
        """Answers /health_generate, and nothing is left running or waiting."""
        assert self.client.get("/health_generate").status_code == 200
        self.assert_drained()

    def assert_drained(self) -> None:
        """Nothing running or waiting (a finished request leaves the batch just after its
        answer is sent, hence the short wait)."""
        deadline = time.monotonic() + WAIT
        while True:
            load = self.engine.load()
            if load["num_running_reqs"] == load["num_waiting_reqs"] == 0:
                return
            assert time.monotonic() < deadline, f"requests left behind: {load}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Engine]:
    e = Engine(save_tiny_model(tmp_path_factory.mktemp("fuzz") / "m"))
    yield e
    e.close()


@pytest.fixture
def fresh(srv: Engine) -> Iterator[Engine]:
    """The shared server, unpaused and with every request aborted after the test."""
    yield srv
    srv.engine.abort(abort_all=True)
    srv.engine.resume()
    srv.engine.resume_memory()


def _message(r: httpx.Response) -> str:
    body = r.json()
    if "error" in body:
        return body["error"]["message"]
    return body["message"]


# --------------------------------------------------------------------- hostile requests

BIG = 2**70
HOSTILE = [
    # (path, body or raw bytes, expected status, fragment of the message)
    ("/generate", b"{not json", 400, "invalid JSON"),
    ("/generate", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ("/generate", b'{"input_ids": [5], "sampling_params": {"top_p": NaN}}', 400, "NaN"),
    (
        "/generate",
        b'{"input_ids": [5], "sampling_params": {"temperature": -Infinity}}',
        400,
        "Infinity",
    ),  # fmt: skip
    ("/generate", b'{"input_ids": [5], "rid": "\xff\xfe"}', 400, "utf-8"),
    ("/generate", b"", 400, "empty body"),
    ("/generate", b'"just a string"', 400, "must be a JSON object"),
    ("/generate", {"input_ids": [5], "sampling_params": {"n": BIG}}, 400, "at most 32"),
    ("/generate", {"input_ids": [[5]] * 33}, 400, "at most 32"),
    (
        "/generate",
        {"input_ids": [5] * 8, "sampling_params": [{"n": 5}] * 8},
        400,
        "should be equal",
    ),  # fmt: skip
    ("/generate", {"input_ids": [[5]] * 8, "sampling_params": {"n": 5}}, 400, "8 prompts x n=5"),
    (
        "/generate",
        {"input_ids": [5], "sampling_params": {"max_new_tokens": BIG}},
        400,
        "maximum context length",
    ),  # fmt: skip
    (
        "/generate",
        {"input_ids": [5], "sampling_params": {"sampling_seed": BIG}},
        400,
        "64-bit",
    ),  # fmt: skip
    ("/generate", {"input_ids": [5], "sampling_params": {"sampling_seed": -BIG}}, 400, "64-bit"),
    (
        "/generate",
        {"input_ids": [5], "sampling_params": {"sampling_seed": 2**63 - 1, "n": 2}},
        400,
        "seed + j",
    ),  # fmt: skip
    ("/generate", {"input_ids": [BIG]}, 400, "outside the vocabulary"),
    ("/generate", {"input_ids": [-1]}, 400, "outside the vocabulary"),
    ("/generate", {"input_ids": [TINY_VOCAB]}, 400, "outside the vocabulary"),
    ("/generate", {"input_ids": [5.0]}, 400, "list of token ids"),
    ("/generate", {"input_ids": [True]}, 400, "list of token ids"),
    ("/generate", {"input_ids": [5] * CONTEXT}, 400, "longer than the model"),
    (
        "/generate",
        {"input_ids": [5], "logprob_start_len": BIG, "return_logprob": True},
        400,
        "logprob_start_len",
    ),  # fmt: skip
    ("/generate", {"input_ids": [[5], [6]], "rid": ["a", "a"]}, 400, "appears twice"),
    ("/generate", {"input_ids": [5], "rid": 5}, 400, "rid should be a string"),
    ("/generate", {"input_ids": [5], "sampling_params": "fast"}, 400, "sampling_params"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop": [1]}}, 400, "stop"),
    ("/generate", {"input_ids": [5], "sampling_params": {"top_k": -BIG}}, 400, "top_k"),
    ("/generate", {"text": [1, 2]}, 400, "text must be"),
    ("/abort_request", {"rid": [[1]]}, 400, "rid must be"),
    ("/pause_generation", {"mode": ["abort"]}, 400, "mode must be"),
    ("/release_memory_occupation", {"tags": [["kv_cache"]]}, 400, "tags must be"),
    ("/release_memory_occupation", {"tags": ["no_such_tag"]}, 400, "unknown memory tags"),
    ("/destroy_weights_update_group", {"group_name": ["x"]}, 400, "group_name must be"),
    ("/update_weights_from_disk", {"model_path": "/"}, 400, "safetensors"),
    (
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 99999, "rank_offset": 1, "world_size": 2},
        400,
        "out of range",
    ),  # fmt: skip
    ("/update_weight_version", {"new_version": {"v": 1}}, 400, "new_version"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    HOSTILE,
    ids=[f"{i}-{case[0].strip('/')}" for i, case in enumerate(HOSTILE)],
)
def test_hostile_requests_get_4xx_and_the_server_stays_healthy(
    fresh: Engine, path: str, body: Any, status: int, fragment: str
) -> None:
    tokens = fresh.engine.stats["tokens"]
    r = fresh.post(path, raw=body) if isinstance(body, bytes) else fresh.post(path, body)
    assert r.status_code == status, r.text
    assert fragment in _message(r)
    assert fresh.engine.stats["tokens"] == tokens  # nothing was generated for it
    fresh.assert_healthy()


def test_oversized_bodies_get_413_before_they_are_read(fresh: Engine) -> None:
    huge = {"input_ids": [5], "text_padding": "x" * (MAX_BYTES + 1)}
    r = fresh.post("/generate", huge)
    assert r.status_code == 413
    assert f"limit of {MAX_BYTES} bytes" in _message(r)

    # A chunked body declares no length: it is cut off while it streams.
    def chunks() -> Iterator[bytes]:
        yield b'{"input_ids": [5], "pad": "'
        for _ in range(64):
            yield b"y" * 8192
        yield b'"}'

    r = fresh.client.post("/generate", content=chunks())
    assert r.status_code == 413 and "exceeds the limit" in _message(r)
    # A declared length over the limit is answered from the header alone: the client has
    # sent no byte of the body when the 413 arrives.
    head = _raw_exchange(fresh, b"Content-Length: 1000000000\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert _raw_exchange(fresh, b"Content-Length: lots\r\n").startswith(b"HTTP/1.1 400")
    # The limit is per request: a normal one right after is served.
    ok = fresh.post("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) <= 2
    fresh.assert_healthy()


def _raw_exchange(srv: Engine, headers: bytes) -> bytes:
    """Send a POST /generate head (no body) on a raw socket; return what comes back."""
    with socket.create_connection((srv.server.host, srv.server.port), timeout=WAIT) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + headers
            + b"\r\n"
        )
        return sock.recv(4096)


def test_limits_are_validated() -> None:
    for kw in ({"max_request_bytes": 0}, {"max_request_samples": -1}, {"max_request_bytes": 1.5}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            create_app(None, **kw)


def test_huge_top_k_means_no_top_k(fresh: Engine) -> None:
    params = {"max_new_tokens": 4, "sampling_seed": 7}
    plain = fresh.post("/generate", {"input_ids": [5, 6], "sampling_params": params}).json()
    for top_k in (TINY_VOCAB, 10**9, 2**80):
        body = {"input_ids": [5, 6], "sampling_params": {**params, "top_k": top_k}}
        r = fresh.post("/generate", body)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == plain["output_ids"]


# ------------------------------------------------------------------ concurrent aborts


def test_concurrent_aborts_pauses_and_generation(fresh: Engine) -> None:
    """Long generations, with aborts by rid prefix, abort_all, pauses and continues fired
    from other threads at once: every call answers, no request is lost, nothing leaks."""
    results: dict[str, httpx.Response] = {}
    errors: list[BaseException] = []

    def call(key: str, path: str, body: Any) -> None:
        try:
            results[key] = fresh.post(path, body)
        except BaseException as e:  # surfaced below
            errors.append(e)

    gens = [
        threading.Thread(
            target=call,
            args=(
                f"gen{i}",
                "/generate",
                {
                    "input_ids": [[5, 6, 7], [8, 9]],
                    "rid": [f"job{i}-a", f"job{i}-b"],
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "n": 1},
                },
            ),
        )
        for i in range(6)
    ]
    for t in gens:
        t.start()
    deadline = time.monotonic() + WAIT
    while True:  # every sequence queued or running before the first control call
        load = fresh.engine.load()
        if load["num_running_reqs"] >= 1 and load["num_running_reqs"] + load[
            "num_waiting_reqs"
        ] == 2 * len(gens):
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.002)
    controls = [
        ("abort1", "/abort_request", {"rid": "job1"}),
        ("abort2", "/abort_request", {"rid": ["job2-a", "job3"]}),
        ("abort_missing", "/abort_request", {"rid": "nobody"}),
        ("pause", "/pause_generation", {"mode": "retract"}),
        ("continue", "/continue_generation", {}),
        ("abort_all", "/abort_request", {"abort_all": True}),
        ("flush", "/flush_cache", None),
    ]
    threads = [threading.Thread(target=call, args=c) for c in controls]
    for t in threads:
        t.start()
    for t in threads + gens:
        t.join(WAIT)
        assert not t.is_alive()
    assert not errors, errors
    fresh.engine.resume()  # whatever order pause and continue ran in
    for key, _, _ in controls:
        assert results[key].status_code in (200, 400), (key, results[key].text)  # 400: flush
    for i in range(6):
        r = results[f"gen{i}"]
        assert r.status_code == 200, r.text
        items = r.json()
        assert [it["meta_info"]["id"] for it in items] == [f"job{i}-a", f"job{i}-b"]
        for it in items:
            reason = it["meta_info"]["finish_reason"]["type"]
            assert reason in ("abort", "length")
            assert len(it["output_ids"]) <= 200
    fresh.assert_healthy()
    again = fresh.post("/generate", {"input_ids": [5], "rid": "job1-a",
                                     "sampling_params": {"max_new_tokens": 3}})  # fmt: skip
    assert again.status_code == 200  # aborted ids are free again


# --------------------------------------------------------------- property: the schema

_JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_ANY_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Integers a client may send: the edges of the int32/int64 ranges the engine packs values
# into, small ones, and anything at all.
_EDGES = [2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, -(2**64), 10**30]
_HOSTILE = st.one_of(
    st.sampled_from(_EDGES),
    st.integers(-3, 300),
    st.sampled_from(_EDGES),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    _ANY_JSON,
)

# A well-formed request first ...
_PROMPT = st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=6)
_VALID_SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(0, 6)},
    optional={
        "n": st.integers(1, 3),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(-1, 80).filter(bool),
        "min_p": st.floats(0, 1),
        "sampling_seed": st.integers(0, 2**62),
        "stop": st.lists(st.text(max_size=3), max_size=2),
        "stop_token_ids": st.lists(st.integers(0, TINY_VOCAB - 1), max_size=3),
        "ignore_eos": st.booleans(),
    },
)
_VALID = st.fixed_dictionaries(
    {"input_ids": st.one_of(_PROMPT, st.lists(_PROMPT, min_size=1, max_size=3))},
    optional={
        "sampling_params": _VALID_SAMPLING,
        "rid": st.text(min_size=1, max_size=6),
        "return_logprob": st.booleans(),
        "logprob_start_len": st.integers(-1, 1),
    },
)
# ... then one or two of its fields (or new ones) set to anything a client could send.
_TOP_KEYS = ["input_ids", "text", "rid", "return_logprob", "logprob_start_len", "stream",
             "sampling_params", "return_text_in_logprobs", "input_embeds"]  # fmt: skip
_SAMPLING_KEYS = ["max_new_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                  "sampling_seed", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "frequency_penalty", "regex", "no_stop_trim", "bogus"]  # fmt: skip
_MUTATION = st.tuples(
    st.sampled_from(_TOP_KEYS + [f"sampling_params.{k}" for k in _SAMPLING_KEYS]), _HOSTILE
)


def _mutate(body: dict[str, Any], mutations: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, value in mutations:
        if key.startswith("sampling_params."):
            sp = body.get("sampling_params")
            body["sampling_params"] = sp = dict(sp) if isinstance(sp, dict) else {}
            sp[key.split(".", 1)[1]] = value
        else:
            body[key] = value
    return body


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(base=_VALID, mutations=st.lists(_MUTATION, min_size=1, max_size=2))
def test_generate_schema_property(
    srv: Engine, base: dict[str, Any], mutations: list[tuple[str, Any]]
) -> None:
    """Whatever the body, /generate answers 200 with SGLang's shape or a 4xx with a
    message; never a 5xx, never a hang, and nothing is left queued."""
    body = _mutate(base, mutations)
    r = srv.post("/generate", body)
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.headers["content-type"].startswith("text/event-stream"):  # "stream": true
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", r.text
        payload = [p for p in map(json.loads, events[:-1]) if p["meta_info"]["finish_reason"]]
    else:
        payload = r.json()
    if r.status_code == 400:
        assert _message(r)
    else:
        items = payload if isinstance(payload, list) else [payload]
        for it in items:
            assert all(0 <= t < TINY_VOCAB for t in it["output_ids"])
            reason = it["meta_info"]["finish_reason"]
            assert reason["type"] in ("length", "stop"), reason
    srv.assert_drained()


def test_server_is_healthy_after_the_fuzzing(srv: Engine) -> None:
    srv.assert_healthy()
    r = srv.post("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and 1 <= len(r.json()["output_ids"]) <= 3
