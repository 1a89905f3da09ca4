"""SGLang native-protocol conformance: what any server behind grpoflow's rollout client must do.

Each test states a protocol fact from the reference (shared/reference/sglang-protocol.md
§1–2) and checks it over HTTP only: response shapes of ``/generate`` (single, batch, ``n``),
log-prob tuples, ``finish_reason`` shapes, ``weight_version`` propagation, abort, pause and
continue, ``flush_cache``, the info/load endpoints and their older spellings, and 400s for bad
requests. Runs against the embedded server by default, or any server named by
``GRPOFLOW_SGLANG_URL`` (see conftest.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

WAIT = 120.0
PROMPT = [5, 6, 7, 8]


def _generate(client: httpx.Client, **body: Any) -> Any:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _in_background(client: httpx.Client, body: dict[str, Any]) -> Callable[[], httpx.Response]:
    box: list[httpx.Response] = []
    t = threading.Thread(
        target=lambda: box.append(client.post("/generate", json=body)), daemon=True
    )
    t.start()

    def result() -> httpx.Response:
        t.join(WAIT)
        assert box, "/generate did not answer"
        return box[0]

    return result


def _load(client: httpx.Client) -> dict[str, Any]:
    loads = client.get("/v1/loads", params={"include": "core"}).json()["loads"]
    return {
        "running": sum(x["num_running_reqs"] for x in loads),
        "waiting": sum(x["num_waiting_reqs"] for x in loads),
    }


def _error_message(r: httpx.Response) -> str:
    """SGLang answers errors as {"error": {"message"}}, {"error": str} or {"message"}."""
    body = r.json()
    err = body.get("error")
    if isinstance(err, dict):
        return str(err["message"])
    return str(err if err is not None else body["message"])


def _check_logprob_items(items: Any, token_ids: list[int]) -> None:
    assert isinstance(items, list) and len(items) == len(token_ids)
    for item, tid in zip(items, token_ids, strict=True):
        assert len(item) == 3 and item[1] == tid and item[2] is None
        assert isinstance(item[0], float) and item[0] <= 0.0


@pytest.fixture
def resumed(client):
    """Whatever a test paused or left queued, the next test finds the server generating."""
    yield client
    client.post("/abort_request", json={"abort_all": True})
    client.post("/continue_generation", json={})


# ----------------------------------------------------------------- health and info


def test_health_endpoints_answer_200(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_both_spellings(client, path):
    info = client.get(path).json()
    assert info["is_generation"] is True
    assert isinstance(info["model_path"], str) and "tokenizer_path" in info
    assert isinstance(info["weight_version"], str)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_both_spellings(client, path):
    info = client.get(path).json()
    for key in ("tp_size", "dp_size", "pp_size"):
        assert isinstance(info[key], int) and info[key] >= 1
    assert info["disaggregation_mode"] == "null"
    assert isinstance(info["version"], str) and "internal_states" in info


def test_loads_report_running_and_waiting(client):
    body = client.get("/v1/loads", params={"include": "core"}).json()
    assert isinstance(body["loads"], list) and body["loads"]
    for load in body["loads"]:
        assert {"dp_rank", "num_running_reqs", "num_waiting_reqs"} <= load.keys()


def test_legacy_load_and_weight_version_endpoints_if_served(client):
    """``/get_load`` and ``/get_weight_version`` are gone (404) in newer SGLang; if a server
    still has them, their shapes must be the old ones."""
    r = client.get("/get_load")
    assert r.status_code in (200, 404)
    if r.status_code == 200:
        assert isinstance(r.json(), list) and {"num_reqs", "num_waiting_reqs"} <= r.json()[0].keys()
    r = client.get("/get_weight_version")
    assert r.status_code in (200, 404)
    if r.status_code == 200:
        assert r.json()["weight_version"] == client.get("/model_info").json()["weight_version"]


# ---------------------------------------------------------------------- /generate


def test_generate_single_response_shape(client):
    out = _generate(
        client,
        input_ids=PROMPT,
        sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        return_logprob=True,
        rid="conformance-single",
    )
    assert isinstance(out, dict) and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert meta["id"] == "conformance-single"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    assert out["output_ids"] == [item[1] for item in meta["output_token_logprobs"]]
    _check_logprob_items(meta["output_token_logprobs"], out["output_ids"])
    assert isinstance(meta["cached_tokens"], int) and isinstance(meta["weight_version"], str)
    assert isinstance(meta["e2e_latency"], float)


def test_generate_batch_is_a_list_in_request_order(client):
    prompts = [[5], [6, 7], [8, 9, 10]]
    outs = _generate(
        client,
        input_ids=prompts,
        sampling_params={"max_new_tokens": 3, "ignore_eos": True},
        rid=["b0", "b1", "b2"],
    )
    assert [o["meta_info"]["id"] for o in outs] == ["b0", "b1", "b2"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [1, 2, 3]
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in outs)


def test_n_samples_are_prompt_major(client):
    outs = _generate(
        client,
        input_ids=[[5, 6], [7, 8, 9]],
        sampling_params={"max_new_tokens": 4, "n": 2, "temperature": 1.0, "ignore_eos": True},
    )
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 2, 3, 3]
    single = _generate(client, input_ids=[5, 6], sampling_params={"max_new_tokens": 2, "n": 2})
    assert isinstance(single, list) and len(single) == 2


def test_prompt_logprobs_from_logprob_start_len(client):
    k = 1
    out = _generate(
        client,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=k,
    )
    items = out["meta_info"]["input_token_logprobs"]
    assert [it[1] for it in items] == PROMPT[k:]
    assert items[0][0] is None
    assert all(isinstance(it[0], float) and it[0] <= 0 for it in items[1:])


def test_scoring_with_max_new_tokens_zero_reproduces_greedy_logprobs(client, logprob_atol):
    gen = _generate(
        client,
        input_ids=PROMPT,
        sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
        return_logprob=True,
    )
    score = _generate(
        client,
        input_ids=PROMPT + gen["output_ids"],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(PROMPT) - 1,
    )
    assert score["output_ids"] == []
    assert score["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = [it[0] for it in score["meta_info"]["input_token_logprobs"][1:]]
    rolled = [it[0] for it in gen["meta_info"]["output_token_logprobs"]]
    assert len(scored) == len(rolled) == 5
    assert max(abs(a - b) for a, b in zip(scored, rolled, strict=True)) <= logprob_atol


def _first_new_token(ids: list[int], start: int = 2) -> int:
    for i in range(start, len(ids)):
        if ids[i] not in ids[:i]:
            return i
    raise AssertionError(f"no token in {ids} first appears at position >= {start}")


def test_stop_token_ids_finish_shape_includes_the_matched_token(client):
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    free = _generate(client, input_ids=PROMPT, sampling_params=greedy)["output_ids"]
    pos = _first_new_token(free)
    out = _generate(
        client,
        input_ids=PROMPT,
        sampling_params={**greedy, "stop_token_ids": [free[pos]]},
        return_logprob=True,
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[pos]}
    assert out["output_ids"] == free[: pos + 1]
    _check_logprob_items(out["meta_info"]["output_token_logprobs"], free[: pos + 1])


def test_stop_string_finish_shape_and_trimmed_text(client):
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    free = _generate(client, input_ids=PROMPT, sampling_params=greedy)
    text = free["text"]
    stop = next((text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip()), None)
    assert stop, f"no usable stop string in {text!r}"
    out = _generate(client, input_ids=PROMPT, sampling_params={**greedy, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    kept = _generate(
        client, input_ids=PROMPT, sampling_params={**greedy, "stop": [stop], "no_stop_trim": True}
    )
    assert kept["text"].endswith(stop)


# ------------------------------------------------------------------ weight version


def test_weight_version_reaches_model_info_and_every_response(client):
    before = client.get("/model_info").json()["weight_version"]
    try:
        r = client.post(
            "/update_weight_version", json={"new_version": "conf-7", "abort_all_requests": False}
        )
        assert r.status_code == 200
        assert r.json()["success"] is True and r.json()["new_version"] == "conf-7"
        assert client.get("/model_info").json()["weight_version"] == "conf-7"
        out = _generate(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})
        assert out["meta_info"]["weight_version"] == "conf-7"
    finally:
        client.post("/update_weight_version", json={"new_version": before})


# --------------------------------------------------------------- abort and pause


def test_abort_running_request_returns_partial_output(resumed, context_length):
    n = min(context_length - len(PROMPT) - 1, 3000)
    pending = _in_background(
        resumed,
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True,
            "rid": "conformance-abort",
        },
    )
    _wait_for(lambda: _load(resumed)["running"] >= 1, "the request to run")
    time.sleep(0.05)
    assert resumed.post("/abort_request", json={"rid": "conformance-abort"}).status_code == 200
    r = pending()
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "message" in meta["finish_reason"]
    assert meta["completion_tokens"] < n
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def test_pause_in_place_holds_new_requests_until_continue(resumed):
    r = resumed.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    pending = _in_background(
        resumed, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    )
    _wait_for(
        lambda: _load(resumed)["waiting"] + _load(resumed)["running"] >= 1, "a queued request"
    )
    time.sleep(0.2)
    assert _load(resumed)["waiting"] + _load(resumed)["running"] >= 1  # still not done
    r = resumed.post("/continue_generation", json={})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    out = pending().json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_abort_while_paused_aborts_the_queued_request(resumed):
    assert resumed.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    pending = _in_background(
        resumed, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "rid": "queued-x"}
    )
    _wait_for(lambda: _load(resumed)["waiting"] >= 1, "a queued request")
    assert resumed.post("/flush_cache").status_code == 400  # not while requests wait
    assert resumed.post("/abort_request", json={"rid": "queued-x"}).status_code == 200
    fr = pending().json()["meta_info"]["finish_reason"]
    assert fr["type"] == "abort"
    assert resumed.post("/continue_generation", json={}).status_code == 200


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_are_accepted(resumed, mode):
    r = resumed.post("/pause_generation", json={"mode": mode})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    r = resumed.post("/continue_generation", json={})
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}


def test_flush_cache_on_an_idle_server(client):
    _wait_for(lambda: _load(client) == {"running": 0, "waiting": 0}, "an idle server")
    assert client.get("/flush_cache").status_code == 200
    assert client.post("/flush_cache").status_code == 200


def test_abort_all_answers_200(client):
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200


# -------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": []},
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**9}},
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}},
        {"input_ids": PROMPT, "sampling_params": {"temperature": -1.0}},
    ],
    ids=["empty", "too-long", "negative-max-new-tokens", "negative-temperature"],
)
def test_bad_generate_requests_get_400_and_the_server_keeps_serving(client, body):
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert _error_message(r)
    assert client.get("/health_generate").status_code == 200


def test_prompt_longer_than_the_context_gets_400(client, context_length):
    r = client.post("/generate", json={"input_ids": [5] * (context_length + 1)})
    assert r.status_code == 400 and "context length" in _error_message(r)
