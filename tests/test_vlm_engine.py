"""The embedded engine serving a vision-language model (issue 37, docs/vlm.md, "The engine"):
the tiny Qwen2.5-VL-architecture model, images through SGLang's ``image_data`` on
``/generate`` (every accepted form) and OpenAI ``image_url`` parts sent by the real ``openai``
client, batched with text requests and continuously admitted, each sample's tokens and
log-probs equal to one unbatched forward over prompt + output with the pixels."""

from __future__ import annotations

import base64
import http.server
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rl_core.data.shapes import generate_shapes
from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.sampling import SamplingParams
from rl_core.engine.server import ServerThread, create_app
from rl_core.models.tiny_vlm import IMAGE_PAD
from rl_core.models.vlm import BANNED_LOGIT, mrope_positions, placeholder_ids

pytestmark = pytest.mark.usefixtures("one_thread")

RECORDS = generate_shapes(4, seed=5)


@pytest.fixture(scope="module")
def engine(vlm_dir: Path) -> Iterator[EmbeddedEngine]:
    eng = EmbeddedEngine(vlm_dir, control_timeout_s=30)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine: EmbeddedEngine) -> Iterator[str]:
    srv = ServerThread(create_app(engine)).start()
    yield srv.url
    srv.stop()


def _chat_ids(engine: EmbeddedEngine, question: str, images: int = 1) -> list[int]:
    """A shapes question under ``images`` unexpanded image placeholders (the template's)."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                add_generation_prompt=True, tokenize=False)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _reference_logprobs(engine: EmbeddedEngine, prompt: list[int], output: list[int],
                        images: Any) -> list[float]:  # noqa: ANN401
    """One unbatched, uncached forward over prompt + output with the pixels: each output
    token's log-prob (temperature 1; the vision placeholders masked, as both planes do)."""
    model = engine.model
    ids = torch.tensor([prompt + output])
    mask = torch.ones_like(ids)
    positions, _ = mrope_positions(model, ids, mask, images)
    extra = {} if images is None else {"pixel_values": images.pixel_values,
                                       "image_grid_thw": images.grid_thw}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       **extra).logits[0].float()
    banned = torch.tensor(placeholder_ids(model.config))  # never sampled: both sides mask them
    logp = torch.log_softmax(logits.index_fill(-1, banned, BANNED_LOGIT), -1)
    return [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(output)]


def test_image_and_text_requests_batch_continuously_with_exact_logprobs(
        engine: EmbeddedEngine) -> None:
    """Two image prompts and a text prompt in one batch, a third image prompt admitted while
    they decode: every sample's tokens are what it draws alone, and its log-probs are the
    unbatched forward's (the engine's prefill and M-RoPE decode positions are right)."""
    def req(rid: str, k: int, seed: int, text: bool = False) -> GenerateRequest:
        params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed, ignore_eos=True)
        if text:
            return GenerateRequest(rid, engine.tokenizer("How many red squares")["input_ids"],
                                   params, return_logprob=True)
        ids, pixels = engine.images.prepare(_chat_ids(engine, RECORDS[k].question),
                                            [RECORDS[k].images[0]])
        return GenerateRequest(rid, ids, params, return_logprob=True, images=pixels)

    first = [req("a", 0, 1), req("b", 1, 2), req("t", 0, 3, text=True)]
    late = req("c", 2, 4)
    futures = []

    def on_step(n: int) -> None:  # the late request arrives after 3 decode steps
        if n == start + 3 and not futures:
            futures.append(engine.submit(late))

    start = engine.stats["decode_steps"]
    engine.on_step = on_step
    try:
        outs = engine.generate_sync(first)
        assert futures, "the late request was not submitted"
        outs.append(futures[0].result(60))
    finally:
        engine.on_step = None
    for r, out in zip([*first, late], outs, strict=True):
        alone = engine.generate_sync([GenerateRequest(r.rid + "-alone", r.input_ids, r.params,
                                                      return_logprob=True, images=r.images)])[0]
        assert out.output_ids == alone.output_ids, r.rid
        ref = _reference_logprobs(engine, r.input_ids, out.output_ids, r.images)
        assert max(abs(a - b) for a, b in zip(ref, out.output_logprobs, strict=True)) < 1e-4
    assert outs[0].prompt_tokens == len(first[0].input_ids) > len(_chat_ids(engine, "x"))


def test_a_groups_identical_image_prompts_are_prefilled_once(engine: EmbeddedEngine) -> None:
    """GRPO's samples of one image prompt share one prefill (the vision tower runs once for
    them); the same ids with another picture do not; every sample equals its request alone,
    its log-probs the unbatched forward's."""
    def req(rid: str, seed: int, picture: int) -> GenerateRequest:
        ids, pixels = engine.images.prepare(_chat_ids(engine, RECORDS[0].question),
                                            [RECORDS[picture].images[0]])
        params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed, ignore_eos=True)
        return GenerateRequest(rid, ids, params, return_logprob=True, images=pixels)

    reqs = [req("g0", 20, 0), req("g1", 21, 0), req("o", 30, 1), req("g2", 22, 0)]
    assert reqs[2].input_ids == reqs[0].input_ids  # the same ids: only the pixels differ
    before = engine.stats["prefill_shared_rows"]
    outs = engine.generate_sync(reqs)
    assert engine.stats["prefill_shared_rows"] - before == 2  # g1 and g2 were g0's copies
    for r, out in zip(reqs, outs, strict=True):
        alone = engine.generate_sync([GenerateRequest(r.rid + "-alone", r.input_ids, r.params,
                                                      return_logprob=True, images=r.images)])[0]
        assert out.output_ids == alone.output_ids, r.rid
        ref = _reference_logprobs(engine, r.input_ids, out.output_ids, r.images)
        assert max(abs(a - b) for a, b in zip(ref, out.output_logprobs, strict=True)) < 1e-4


def test_the_pixels_change_the_answer_and_placeholders_expand(engine: EmbeddedEngine) -> None:
    ids = _chat_ids(engine, RECORDS[0].question)
    pad = engine.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert ids.count(pad) == 1
    expanded, pixels = engine.images.prepare(ids, [RECORDS[0].images[0]])
    assert expanded.count(pad) == pixels.tokens[0] == 4  # 64x64 -> 56x56: 2x2 merged patches
    again, _ = engine.images.prepare(expanded, [RECORDS[0].images[0]])
    assert again == expanded  # already expanded: unchanged (as SGLang re-expands)
    scoring = SamplingParams(temperature=1.0, max_new_tokens=0)
    other, other_px = engine.images.prepare(ids, [RECORDS[1].images[0]])
    a, b = engine.generate_sync([
        GenerateRequest("p0", expanded, scoring, return_logprob=True, logprob_start_len=0,
                        images=pixels),
        GenerateRequest("p1", other, scoring, return_logprob=True, logprob_start_len=0,
                        images=other_px)])
    assert a.input_logprobs[-1] != b.input_logprobs[-1]


def _png(k: int) -> bytes:
    return RECORDS[k].images[0]


@pytest.fixture(scope="module")
def image_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 serving one PNG at /shape.png (SGLang fetches URLs)."""
    root = tmp_path_factory.mktemp("images")
    (root / "shape.png").write_bytes(_png(2))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/shape.png"
    httpd.shutdown()


def test_generate_takes_sglang_image_data_in_every_form(
        engine: EmbeddedEngine, server: str, image_host: str, tmp_path: Path) -> None:
    """base64, data URL, path, file:// and http URLs give the same sample as the bytes; a
    batch takes one image list per prompt; the answer counts the expanded prompt."""
    path = tmp_path / "s.png"
    path.write_bytes(_png(2))
    b64 = base64.b64encode(_png(2)).decode()
    ids = _chat_ids(engine, RECORDS[2].question)
    sp = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 7, "ignore_eos": True}
    with httpx.Client(base_url=server, timeout=60) as client:
        info = client.get("/model_info").json()
        assert info["has_image_understanding"] is True and info["model_type"] == "qwen2_5_vl"
        outs = []
        for form in (b64, f"data:image/png;base64,{b64}", str(path), f"file://{path}",
                     image_host, [b64]):
            r = client.post("/generate", json={"input_ids": ids, "image_data": form,
                                               "sampling_params": sp, "return_logprob": True})
            assert r.status_code == 200, r.text
            outs.append(r.json())
        assert len({tuple(o["output_ids"]) for o in outs}) == 1
        assert outs[0]["meta_info"]["prompt_tokens"] == len(ids) + 3  # 1 pad -> 4
        batch = client.post("/generate", json={
            "input_ids": [ids, _chat_ids(engine, "two pictures", images=2)],
            "image_data": [[b64], [base64.b64encode(_png(0)).decode(), b64]],
            "sampling_params": sp, "return_logprob": True})
        assert batch.status_code == 200, batch.text
        first, second = batch.json()
        assert first["output_ids"] == outs[0]["output_ids"]
        assert second["meta_info"]["prompt_tokens"] == len(_chat_ids(engine, "two pictures", 2)) + 6


@pytest.mark.parametrize(("image_data", "input_images", "message"), [
    ("bm90IGFuIGltYWdl", 1, r"image_data\[0\]: the image does not decode"),
    ("data:text/plain;base64,aGk=", 1, r"image_data\[0\]: a data URL must be"),
    ("/nonexistent/x.png", 1, r"image_data\[0\]: .* is not a data URL, an existing file"),
    ({"format": "processor_output"}, 1, "processor_output' is not supported"),
    (None, 1, r"1 image placeholder\(s\) but 0 image\(s\)"),
    ("IMG", 2, r"2 image placeholder\(s\) but 1 image\(s\)"),
])
def test_bad_images_are_refused_with_the_image_named(engine: EmbeddedEngine, server: str,
                                                     image_data: Any, input_images: int,
                                                     message: str) -> None:
    if image_data == "IMG":
        image_data = base64.b64encode(_png(0)).decode()
    body = {"input_ids": _chat_ids(engine, "x", images=input_images),
            "sampling_params": {"max_new_tokens": 2}}
    if image_data is not None:
        body["image_data"] = image_data
    r = httpx.post(f"{server}/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert re.search(message, r.text), r.text


def test_the_real_openai_client_sends_image_url_parts(engine: EmbeddedEngine,
                                                      server: str) -> None:
    """``image_url`` parts (a data URL) through the ``openai`` SDK: the completion's token ids
    are /generate's for the same rendered prompt, image and seed."""
    import openai
    url = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=60)
    resp = client.chat.completions.create(
        model=engine.model_path, max_tokens=6, temperature=1.0, seed=11,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": RECORDS[1].question}]}],
        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    sp = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 11, "ignore_eos": True}
    gen = httpx.post(f"{server}/generate", timeout=60, json={
        "input_ids": _chat_ids(engine, RECORDS[1].question), "image_data": url,
        "sampling_params": sp}).json()
    token_ids = choice.model_extra.get("token_ids") or getattr(choice, "token_ids", None)
    assert token_ids == gen["output_ids"]
    assert resp.usage.prompt_tokens == gen["meta_info"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError, match="image"):
        client.chat.completions.create(model=engine.model_path, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}])


def test_a_text_model_refuses_image_data(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_model

    eng = EmbeddedEngine(save_tiny_model(tmp_path / "m"), control_timeout_s=30)
    srv = ServerThread(create_app(eng)).start()
    try:
        b64 = base64.b64encode(_png(0)).decode()
        r = httpx.post(f"{srv.url}/generate", timeout=60, json={
            "input_ids": [3, 4, 5], "image_data": b64, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and "is a text model" in r.text, r.text
        assert httpx.get(f"{srv.url}/model_info").json()["has_image_understanding"] is False
    finally:
        srv.stop()
        eng.close()


def test_the_engine_never_samples_a_vision_placeholder(vlm_dir: Path) -> None:
    """A model that would rather write an image pad still never does (the trainer could not
    tell it from the picture's pads); both planes mask the placeholders alike."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    pad = model.config.image_token_id
    with torch.no_grad():  # the LM head (tied: the embedding) now favours the pad
        model.lm_head.weight[pad] *= 50
    eng = EmbeddedEngine(vlm_dir, model=model)
    try:
        ids = eng.tokenizer("How many", add_special_tokens=False)["input_ids"]
        out = eng.generate_sync([GenerateRequest("p", ids, SamplingParams(
            temperature=1.0, max_new_tokens=16, seed=1, ignore_eos=True), return_logprob=True)])[0]
    finally:
        eng.close()
    assert not set(out.output_ids) & set(placeholder_ids(model.config))
    assert all(lp > -50 for lp in out.output_logprobs)


def test_the_router_passes_images_through_unchanged(engine: EmbeddedEngine, server: str,
                                                    vlm_dir: Path, tmp_path: Path) -> None:
    """The real ``sglang-router`` between the rollout client and the engine: the client's
    base64 ``image_data`` reaches the engine unchanged: each sample equals the one the engine
    gives the client directly, token for token and log-prob for log-prob (and the client's
    check of ``prompt_tokens`` passes). One request per prompt, as the rollout plane sends
    them through a router (the router refuses a batch's list of ``rid``s)."""
    from rl_core.data.prompts import encode_record_prompts
    from rl_core.models.vlm import vision_processor
    from rl_core.rollout.client import SyncSGLangClient
    from rl_core.rollout.router import RouterProcess

    recs = RECORDS[1:3]
    prompts = encode_record_prompts(engine.tokenizer, recs, vision_processor(vlm_dir))
    sp = {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 11, "ignore_eos": True}

    def samples(url: str) -> list[tuple[list[int], list[float]]]:
        with SyncSGLangClient(url) as client:
            got = [client.generate(p, sp, image_data=r.images) for p, r in zip(prompts, recs,
                                                                             strict=True)]
        return [(s.completion_ids, s.logprobs) for s in got]

    direct = samples(server)
    assert direct[0] != direct[1]  # two pictures, two samples
    with RouterProcess([server], log_dir=tmp_path, policy="round_robin") as router:
        assert samples(router.url) == direct
