"""Tests for rl_core.engine.server: the real uvicorn server over the embedded engine, via httpx.

Embedded-specific checks live here (outputs are the samples ``transformers`` and the sampler
draw for the same seeds, see ``engine_helpers.hf_reference``; the engine's ``on_step``
hook pauses generation at an exact step so aborts are deterministic; weight updates change
outputs to the new weights' and ``/weights_checksum`` to theirs); protocol shapes that a real
SGLang server must also satisfy are in tests/conformance/.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import EOS_ID
from engine_helpers import (
    bucket_meta,
    hf_reference,
    save_tiny_model,
    start_trainer_broadcast,
    wait_ready,
)
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_core.engine.core import EmbeddedEngine
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.server import ServerThread, build_server, create_app, main
from rl_core.host import free_port
from rl_core.weight_sync import weights_checksum

pytestmark = pytest.mark.usefixtures("one_thread")

WAIT = 60.0


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server")
    return save_tiny_model(root / "m0", seed=0), save_tiny_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def refs(dirs):
    return tuple(AutoModelForCausalLM.from_pretrained(d).eval() for d in dirs)


@pytest.fixture(scope="module")
def tok(dirs):
    return AutoTokenizer.from_pretrained(dirs[0])


class Served:
    """An engine, its server and an httpx client, for one test module."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = EmbeddedEngine(model_dir, control_timeout_s=30)
        self.server = ServerThread(create_app(self.engine)).start()
        self.client = httpx.Client(base_url=self.server.url, timeout=WAIT)

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.engine.close()

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.client.post(path, json=body, **kw)

    def in_background(self, path: str, body: Any) -> Callable[[], httpx.Response]:
        """POST from a thread; returns a function that joins it and gives the response."""
        box: list[Any] = []
        t = threading.Thread(target=lambda: box.append(self.post(path, body)), daemon=True)
        t.start()

        def result() -> httpx.Response:
            t.join(WAIT)
            assert box, f"{path} did not answer within {WAIT} s"
            return box[0]

        return result

    def pause_after(self, steps: int) -> None:
        """Pause in place once ``steps`` more decode steps have run (on the engine thread)."""
        eng = self.engine
        start = eng.stats["decode_steps"]

        def hook(n: int) -> None:
            if n >= start + steps and not eng.paused:
                eng.pause("in_place")

        eng.on_step = hook

    def wait(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)


@pytest.fixture(scope="module")
def srv(dirs) -> Iterator[Served]:
    s = Served(dirs[0])
    yield s
    s.close()


@pytest.fixture
def clean(srv) -> Iterator[Served]:
    """The shared server, left running and unpaused whatever the test did."""
    yield srv
    srv.engine.on_step = None
    srv.engine.abort(abort_all=True)
    srv.engine.resume()
    srv.engine.resume_memory()


def _ref(model, prompt: list[int], out: dict[str, Any], params: SamplingParams) -> list[float]:
    """Check a /generate answer against :func:`engine_helpers.hf_reference`; its log-probs."""
    tokens, logprobs = hf_reference(model, prompt, out["output_ids"], params)
    assert out["output_ids"] == tokens
    return logprobs.tolist()


def _check_logprob_items(items: list[list[Any]], ids: list[int]) -> list[float]:
    assert [it[1] for it in items] == ids
    assert all(len(it) == 3 and it[2] is None and isinstance(it[0], float) for it in items)
    return [it[0] for it in items]


# ------------------------------------------------------------------- info endpoints


def test_health_info_and_load_endpoints(srv, dirs):
    c = srv.client
    assert c.get("/health").status_code == 200
    assert c.get("/health_generate").status_code == 200
    info = c.get("/model_info").json()
    assert info == c.get("/get_model_info").json()
    assert info["model_path"] == str(dirs[0]) and info["is_generation"] is True
    assert info["weight_version"] == "default" and info["architectures"] == ["Qwen2ForCausalLM"]
    server = c.get("/server_info").json()
    assert server == c.get("/get_server_info").json()
    assert (server["tp_size"], server["dp_size"], server["pp_size"], server["ep_size"]) == (
        1,
        1,
        1,
        1,
    )
    assert server["disaggregation_mode"] == "null" and server["port"] == srv.server.port
    assert c.get("/get_weight_version").json() == {"weight_version": "default"}
    loads = c.get("/v1/loads", params={"include": "core"}).json()["loads"]
    assert loads[0]["dp_rank"] == 0 and loads[0]["num_running_reqs"] == 0
    assert c.get("/v1/loads", params={"include": "bogus"}).status_code == 400
    assert c.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]


def test_health_answers_503_until_an_engine_is_attached(srv):
    app = create_app(None)
    loading = ServerThread(app).start()
    try:
        with httpx.Client(base_url=loading.url, timeout=WAIT) as c:
            assert c.get("/health").status_code == 503
            assert c.get("/health_generate").status_code == 503
            r = c.post("/generate", json={"input_ids": [5]})
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
            app.state.engine = srv.engine
            assert c.get("/health_generate").status_code == 200
    finally:
        loading.stop()


# ------------------------------------------------------------------------ generate


def test_generate_matches_the_sampler_with_sglang_shapes(srv, refs):
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0.8, "max_new_tokens": 9, "sampling_seed": 17},
        "return_logprob": True,
        "rid": "one",
    }
    r = srv.post("/generate", body)
    assert r.status_code == 200
    out = r.json()
    meta = out["meta_info"]
    params = SamplingParams(temperature=0.8, max_new_tokens=9, seed=17)
    expected = _ref(refs[0], [5, 6, 7], out, params)
    ids = out["output_ids"]
    assert meta["id"] == "one"
    lps = _check_logprob_items(meta["output_token_logprobs"], ids)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(expected), atol=1e-5, rtol=0)
    if ids[-1] == EOS_ID:
        assert meta["finish_reason"] == {"type": "stop", "matched": EOS_ID}
    else:
        assert meta["finish_reason"] == {"type": "length", "length": 9} and len(ids) == 9
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(ids)
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    assert meta["input_token_logprobs"] == [] and meta["e2e_latency"] > 0
    assert isinstance(out["text"], str)
    # Without return_logprob, no logprob keys.
    plain = srv.post("/generate", {**body, "return_logprob": False, "rid": "two"}).json()
    assert plain["output_ids"] == ids and "output_token_logprobs" not in plain["meta_info"]


def test_batch_and_n_are_prompt_major_with_per_sample_seeds(srv, refs):
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13]]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 5, "n": 2, "sampling_seed": 100, "ignore_eos": True},
        "rid": ["a", "b", "c"],
        "return_logprob": True,
    }
    outs = srv.post("/generate", body).json()
    assert [o["meta_info"]["id"] for o in outs] == ["a_0", "a_1", "b_0", "b_1", "c_0", "c_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 1, 1, 4, 4]
    for k, o in enumerate(outs):
        p = SamplingParams(max_new_tokens=5, seed=100 + k % 2, ignore_eos=True)
        _ref(refs[0], prompts[k // 2], o, p)
        assert len(o["output_ids"]) == 5
    assert outs[0]["output_ids"] != outs[1]["output_ids"]

    # A single prompt with n > 1 is a list; per-item sampling params and logprob flags.
    single = srv.post(
        "/generate",
        {"input_ids": [9], "sampling_params": {"n": 3, "max_new_tokens": 2}, "rid": "s"},
    )
    assert [o["meta_info"]["id"] for o in single.json()] == ["s_0", "s_1", "s_2"]
    mixed = srv.post(
        "/generate",
        {
            "input_ids": prompts[:2],
            "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 4, "ignore_eos": True}],
            "return_logprob": [False, True],
            "rid": "m",
        },
    ).json()
    assert [o["meta_info"]["id"] for o in mixed] == ["m_0", "m_1"]
    assert "output_token_logprobs" not in mixed[0]["meta_info"]
    assert mixed[1]["meta_info"]["completion_tokens"] == 4
    assert len(mixed[1]["meta_info"]["output_token_logprobs"]) == 4


def test_text_input_stop_strings_and_trimming(srv, tok):
    base = {"text": "hello world", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    free = srv.post("/generate", base).json()
    assert free["meta_info"]["prompt_tokens"] == len(tok.encode("hello world"))
    ids = free["output_ids"]
    assert free["text"] == tok.decode(ids, skip_special_tokens=True)
    stop = tok.decode(ids[4:6])
    sp = {**base["sampling_params"], "stop": stop}
    trimmed = srv.post("/generate", {**base, "sampling_params": sp}).json()
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    full_text = tok.decode(trimmed["output_ids"])
    assert stop in full_text and trimmed["text"] == full_text[: full_text.find(stop)]
    kept = srv.post("/generate", {**base, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["text"] == full_text

    stop_id = ids[3]
    sp = {**base["sampling_params"], "stop_token_ids": [stop_id]}
    by_id = srv.post("/generate", {**base, "sampling_params": sp}).json()
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_id["output_ids"][-1] == stop_id  # ids keep the matched token ...
    assert by_id["text"] == tok.decode(by_id["output_ids"][:-1])  # ... text drops it
    kept = srv.post("/generate", {**base, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["text"] == tok.decode(by_id["output_ids"])

    # return_text_in_logprobs fills the third element of each logprob item.
    with_text = srv.post(
        "/generate",
        {**base, "return_logprob": True, "return_text_in_logprobs": True},
    ).json()
    texts = [item[2] for item in with_text["meta_info"]["output_token_logprobs"]]
    assert texts == [tok.decode([t]) for t in with_text["output_ids"]]


def test_prompt_logprobs_and_scoring(srv, refs):
    prompt = [10, 11, 12, 13, 14]
    gen = srv.post(
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 2,
        },
    ).json()
    items = gen["meta_info"]["input_token_logprobs"]
    assert [it[1] for it in items] == prompt[2:] and items[0][0] is None
    with torch.no_grad():
        logits = refs[0](input_ids=torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits, -1)[2:4].gather(-1, torch.tensor(prompt[3:])[:, None])
    torch.testing.assert_close(
        torch.tensor([it[0] for it in items[1:]]), expected.squeeze(-1), atol=1e-5, rtol=0
    )

    seq = prompt + gen["output_ids"]
    score = srv.post(
        "/generate",
        {
            "input_ids": seq,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
        },
    ).json()
    assert score["output_ids"] == [] and score["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    scored = [it[0] for it in score["meta_info"]["input_token_logprobs"][1:]]
    rolled = [it[0] for it in gen["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(scored), torch.tensor(rolled), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------- bad input


BAD_BODIES = [
    (b"{not json", "invalid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"input_ids": [5], "text": "hi"}, "Only one of text or input_ids"),
    ({"sampling_params": {}}, "Either text or input_ids"),
    ({"input_ids": []}, "input_ids cannot be empty"),
    ({"input_ids": [[5], []]}, "input_ids cannot be empty"),
    ({"input_ids": ["a"]}, "list of token ids"),
    ({"input_ids": [5, 99]}, "outside the vocabulary"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, "at least 0"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 10**9}}, "maximum context length"),
    ({"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 1}}, "longer than the model"),
    ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "top_k must be -1"),
    ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [5], "sampling_params": {"bogus": 1}}, "unknown sampling parameters"),
    ({"input_ids": [5], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
    ({"input_ids": [5], "stream": "yes"}, "stream must be a bool"),
    ({"input_ids": [[5], [6]], "rid": ["x"]}, "rids length mismatch"),
    ({"input_ids": [[5], [6]], "sampling_params": [{}]}, "sampling_params should be equal"),
    ({"input_ids": [5], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len=4"),
]


@pytest.mark.parametrize(("body", "message"), BAD_BODIES)
def test_bad_requests_get_400_and_the_server_keeps_serving(srv, body, message):
    if isinstance(body, bytes):
        r = srv.client.post("/generate", content=body, headers={"content-type": "application/json"})
    else:
        r = srv.post("/generate", body)
    assert r.status_code == 400, r.text
    err = r.json()
    text = err["error"]["message"] if "error" in err else err["message"]
    assert message in text
    assert srv.client.get("/health_generate").status_code == 200
    assert srv.engine.load()["num_waiting_reqs"] == 0


def test_a_bad_item_rejects_the_whole_batch(srv):
    tokens = srv.engine.stats["tokens"]
    r = srv.post("/generate", {"input_ids": [[5, 6], [5, 99]], "rid": ["ok", "bad"]})
    assert r.status_code == 400 and "token id 99" in r.json()["error"]["message"]
    time.sleep(0.05)
    assert srv.engine.stats["tokens"] == tokens  # the valid item was not submitted either
    assert srv.engine.load()["num_running_reqs"] == srv.engine.load()["num_waiting_reqs"] == 0


# ------------------------------------------------------------- abort, pause, memory


def test_abort_request_returns_partial_tokens(clean):
    clean.pause_after(4)
    body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 100, "ignore_eos": True, "sampling_seed": 1},
        "return_logprob": True,
        "rid": "victim",
    }
    pending = clean.in_background("/generate", body)
    clean.wait(lambda: clean.engine.paused, "the pause")
    assert clean.post("/abort_request", {"rid": "victim"}).status_code == 200
    out = pending().json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] == len(out["output_ids"]) < 100
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]

    # Waiting requests abort "before prefill"; abort_all reaches everything.
    waiting = [
        clean.in_background("/generate", {"input_ids": [7], "rid": f"w{i}"}) for i in range(2)
    ]
    clean.wait(lambda: clean.engine.load()["num_waiting_reqs"] == 2, "two waiting requests")
    assert clean.post("/abort_request", {"abort_all": True}).status_code == 200
    for w in waiting:
        fr = w().json()["meta_info"]["finish_reason"]
        assert fr["type"] == "abort" and fr["message"] == "Abort before prefill"


def test_pause_continue_and_flush_cache(clean):
    c = clean.client
    assert c.post("/pause_generation").json() == {  # old servers send no body
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    pending = clean.in_background(
        "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 3}}
    )
    clean.wait(lambda: clean.engine.load()["num_waiting_reqs"] == 1, "a queued request")
    assert c.get("/flush_cache").status_code == 400  # a request is waiting
    assert c.get("/health_generate").status_code == 200  # paused on purpose is healthy
    assert clean.post("/continue_generation", {}).json()["status"] == "ok"
    assert pending().status_code == 200
    assert c.get("/flush_cache").status_code == 200 and c.post("/flush_cache").text.startswith(
        "Cache flushed"
    )
    for mode in ("retract", "in_place", "abort"):
        assert clean.post("/pause_generation", {"mode": mode}).status_code == 200
        assert clean.engine.paused
        clean.post("/continue_generation")
    assert clean.post("/pause_generation", {"mode": "bogus"}).status_code == 400


def test_pause_retract_then_continue_gives_the_same_tokens(clean, refs):
    clean.pause_after(3)
    params = {"max_new_tokens": 12, "sampling_seed": 8, "ignore_eos": True}
    pending = clean.in_background("/generate", {"input_ids": [20, 21], "sampling_params": params})
    clean.wait(lambda: clean.engine.paused, "the pause")
    clean.engine.on_step = None
    assert clean.post("/pause_generation", {"mode": "retract"}).status_code == 200
    assert clean.engine.load()["num_waiting_reqs"] == 1
    clean.post("/continue_generation")
    out = pending().json()
    _ref(refs[0], [20, 21], out, SamplingParams(max_new_tokens=12, seed=8, ignore_eos=True))
    assert len(out["output_ids"]) == 12 and out["meta_info"]["num_retractions"] == 1


def test_release_and_resume_memory_occupation(clean):
    c = clean.client
    r = clean.post("/release_memory_occupation", {"tags": None})
    assert r.status_code == 200 and r.json() is None
    assert clean.engine.memory_released == {"weights": True, "kv_cache": True}
    pending = clean.in_background(
        "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}
    )
    clean.wait(lambda: clean.engine.load()["num_waiting_reqs"] == 1, "a queued request")
    assert c.get("/health_generate").status_code == 200
    assert c.get("/resume_memory_occupation").status_code == 200  # GET works too
    assert pending().status_code == 200
    assert clean.post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert clean.engine.memory_released == {"weights": False, "kv_cache": True}
    assert clean.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    assert clean.post("/release_memory_occupation", {"tags": ["bogus"]}).status_code == 400


def test_client_disconnect_aborts_its_requests(clean):
    clean.engine.pause("in_place")
    with pytest.raises(httpx.ReadTimeout):
        clean.client.post("/generate", json={"input_ids": [5], "rid": "gone"}, timeout=0.3)
    clean.wait(lambda: clean.engine.load()["num_waiting_reqs"] == 0, "the disconnect abort")


# ------------------------------------------------------------------ weight updates


@pytest.fixture(scope="module")
def upd(dirs) -> Iterator[Served]:
    s = Served(dirs[0])
    yield s
    s.close()


def test_update_weights_from_disk_endpoint(upd, dirs, refs):
    r = upd.post("/update_weights_from_disk", {"model_path": str(dirs[1]), "weight_version": "3"})
    assert r.status_code == 200
    assert r.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    assert upd.client.get("/get_weight_version").json() == {"weight_version": "3"}
    assert upd.client.get("/model_info").json()["weight_version"] == "3"
    assert upd.client.get("/weights_checksum").json() == {
        "checksum": weights_checksum(refs[1].state_dict()), "weight_version": "3"}  # fmt: skip
    out = upd.post(
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 2}},
    ).json()
    assert out["meta_info"]["weight_version"] == "3"
    _ref(refs[1], [5, 6], out, SamplingParams(max_new_tokens=6, seed=2))

    bad = upd.post("/update_weights_from_disk", {"model_path": "/nonexistent/model"})
    assert bad.status_code == 400 and bad.json()["success"] is False
    assert "/nonexistent/model" in bad.json()["message"]
    assert upd.post("/update_weights_from_disk", {}).status_code == 400
    assert upd.client.get("/get_weight_version").json() == {"weight_version": "3"}


def test_update_weight_version_endpoint(upd):
    assert upd.post("/update_weights_from_tensor", {}).status_code == 404  # never served
    r = upd.post("/update_weight_version", {"new_version": "5"})
    assert r.json() == {
        "success": True,
        "message": "Weight version updated to 5",
        "new_version": "5",
    }
    assert upd.post("/update_weight_version", {}).status_code == 400
    assert upd.client.get("/weights_checksum").json()["weight_version"] == "5"


def test_distributed_update_endpoints(upd, refs, tmp_path):
    # The engine serves refs[1] (the disk update above): broadcast the first weights back.
    new = {k: v.contiguous() for k, v in refs[0].state_dict().items()}
    weights_file = tmp_path / "w.safetensors"
    save_file(new, str(weights_file))
    port = free_port()
    trainer = start_trainer_broadcast(weights_file, port, "grp")
    try:
        wait_ready(trainer)
        r = upd.post(
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "grp",
            },
        )
        assert r.json() == {
            "success": True,
            "message": "Succeeded to initialize custom process group.",
        }
        names, dtypes, shapes = bucket_meta(new)
        r = upd.post(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": "grp",
                "weight_version": "9",
            },
        )
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        r = upd.post("/destroy_weights_update_group", {"group_name": "grp"})
        assert r.json()["success"] is True
        log, _ = trainer.communicate(timeout=WAIT)
        assert trainer.returncode == 0, log
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(timeout=WAIT)
    assert upd.client.get("/weights_checksum").json() == {
        "checksum": weights_checksum(refs[0].state_dict()), "weight_version": "9"}  # fmt: skip
    assert upd.client.get("/model_info").json()["weight_version"] == "9"
    r = upd.post(
        "/update_weights_from_distributed",
        {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "grp"},
    )
    assert r.status_code == 400 and "no weight update group" in r.json()["message"]
    r = upd.post("/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert upd.post("/destroy_weights_update_group", {"group_name": "grp"}).status_code == 400


# ------------------------------------------------------------------------- the CLI


def test_serve_loads_in_the_background_and_answers_503_until_ready(dirs):
    server = build_server(dirs[0], port=free_port(), log_level="warning", num_threads=1)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    app = server.config.app
    try:
        url = f"http://127.0.0.1:{server.config.port}"
        deadline = time.monotonic() + WAIT
        seen: set[int] = set()
        while 200 not in seen:  # connection refused, then 503 while loading, then 200
            assert time.monotonic() < deadline and app.state.load_error is None
            try:
                seen.add(httpx.get(f"{url}/health_generate", timeout=5).status_code)
            except httpx.TransportError:
                time.sleep(0.02)
        assert seen <= {200, 503}
        assert httpx.get(f"{url}/model_info", timeout=5).json()["model_path"] == str(dirs[0])
    finally:
        server.should_exit = True
        thread.join(WAIT)
        if app.state.engine is not None:
            app.state.engine.close()
    assert not thread.is_alive()


def test_cli_exits_1_when_the_model_cannot_load(tmp_path):
    assert main(["--model", str(tmp_path / "missing"), "--port", str(free_port())]) == 1


def test_a_slow_load_logs_every_threads_stack_once_and_a_fast_one_nothing(caplog) -> None:
    """The load watchdog reads stacks holding the GIL (faulthandler's reads them without it,
    while the loading thread imports; a restart under load crashed with SIGSEGV after one)."""
    import threading

    from rl_core.engine.server import _stacks_if_not_done

    slow = _stacks_if_not_done(threading.Event(), 0.01)
    slow.join(30)
    assert not slow.is_alive()
    assert "still loading after" in caplog.text and "thread MainThread" in caplog.text
    caplog.clear()
    done = threading.Event()
    done.set()
    fast = _stacks_if_not_done(done, 0.01)
    fast.join(30)
    assert not fast.is_alive() and "still loading" not in caplog.text
