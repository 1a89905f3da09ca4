"""SFT on rows with images (``grpoflow sft`` with ``data.image_field``; docs/sft.md, "Images"):
the tiny Qwen2.5-VL (``vlm_dir``, untrained), real image files, Prefect's test API.

Pinned here:

- Image rows are read by GRPO's loader (relative paths, base64 data URLs, Parquet bytes cells,
  chat image parts); a bad image names the file, the line and the field; ids and the snapshot
  digest cover the pixels (the same text over another picture is another example).
- A prompt row's ids are exactly the GRPO rollout's prompt for the same record (images placed
  first or at ``<image>``, pads expanded by the processor), then the completion; no pad is
  trained; chat turns' image parts are expanded in place.
- The flow trains the VLM on image rows, evaluates greedily with the pictures, and exports the
  model with its image processor; a text model with image rows is refused before training,
  naming data.image_field and the model.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rl_core.config import ConfigError
from rl_core.data.records import DataValidationError, Record
from rl_core.sft import (
    Example,
    SFTDataConfig,
    examples_digest,
    read_examples,
    synthetic_examples,
    tokenize_example,
)

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "configs" / "sft-tiny-cpu.yaml")
DATA = SFTDataConfig(image_field="image", id_field=None)
COLOURS = {"red": "1", "blue": "2", "green": "3", "yellow": "4"}


def png(colour: str, size: tuple[int, int] = (56, 56)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _write_rows(folder: Path, n: int = 24) -> tuple[Path, Path]:
    """train.jsonl (image paths beside it, a data URL, a chat row with an image part) and
    eval.parquet (``datasets`` Image cells: bytes)."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for c in COLOURS:
        (folder / "img" / f"{c}.png").write_bytes(png(c))
    colours = list(COLOURS)
    rows = [{"prompt": "How many squares?", "completion": f"#### {COLOURS[c]}",
             "image": f"img/{c}.png"} for c in (colours[i % 4] for i in range(n))]
    rows = [dict(r, prompt=f"{r['prompt']} ({i})") for i, r in enumerate(rows)]
    rows.append({"prompt": "<image> and <image>: how many?", "completion": "#### 2",
                 "image": [data_url(png("red")), "img/blue.png"]})
    rows.append({"image": [], "messages": [
        {"role": "user", "content": [{"type": "image", "image": "img/green.png"},
                                     {"type": "text", "text": "How many squares?"}]},
        {"role": "assistant", "content": "#### 3"}]})
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({
        "prompt": [f"How many squares? (held {i})" for i in range(8)],
        "completion": [f"#### {COLOURS[colours[i % 4]]}" for i in range(8)],
        "image": [{"bytes": png(colours[i % 4]), "path": None} for i in range(8)]}),
        folder / "eval.parquet")
    return train, folder / "eval.parquet"


@pytest.fixture(scope="module")
def vision(vlm_dir: Path):
    from transformers import AutoTokenizer

    from rl_core.models.vlm import vision_processor

    return AutoTokenizer.from_pretrained(vlm_dir), vision_processor(vlm_dir)


def test_image_rows_are_read_checked_and_content_addressed(tmp_path: Path) -> None:
    train, held = _write_rows(tmp_path, n=4)
    examples = read_examples(str(train), "train", DATA)
    assert [len(e.images) for e in examples] == [1, 1, 1, 1, 2, 1]
    assert examples[0].images == (png("red"),) and examples[4].images == (png("red"), png("blue"))
    chat = examples[5]
    assert chat.images == (png("green"),) and chat.messages[0][1][0] == {"type": "image"}
    [ex] = read_examples(str(held), "test", DATA)[:1]
    assert ex.images == (png("red"),)
    # the snapshot line keeps the pixels; the id and the digest cover them
    assert Example.from_json(examples[4].to_json()) == examples[4]
    same_text = [{"prompt": "p", "completion": "#### 1", "image": data_url(png(c))}
                 for c in ("red", "blue")]
    (tmp_path / "same.jsonl").write_text("".join(json.dumps(r) + "\n" for r in same_text))
    a, b = read_examples(str(tmp_path / "same.jsonl"), "train", DATA)  # not duplicates
    assert a.id != b.id and examples_digest([a]) != examples_digest([b])
    text = Example("t", "x", prompt="p", completion="c")
    assert examples_digest([text]) == examples_digest([Example("t", "y", prompt="p",
                                                               completion="c")])
    # a bad image names the file, the line and the field
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"prompt": "p", "completion": "c", "image": "img/red.png"}) + "\n"
        + json.dumps({"prompt": "q", "completion": "c", "image": "img/missing.png"}) + "\n"
        + json.dumps({"prompt": "r", "completion": "c", "image": "data:image/png;base64,@@"}))
    with pytest.raises(DataValidationError) as err:
        read_examples(str(tmp_path / "bad.jsonl"), "train", DATA)
    msg = str(err.value)
    assert str(tmp_path / "bad.jsonl") in msg and "2 of 3 rows" in msg
    assert "line 2: field 'image', image 1: " in msg and "missing.png" in msg
    assert "line 3: field 'image', image 1: the data URL's base64 does not decode" in msg
    with pytest.raises(DataValidationError, match=r"line 1: turn 2 of 'messages': an assistant "
                                                  "turn's content must be text"):
        (tmp_path / "chat.jsonl").write_text(json.dumps({"image": [], "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "image", "image": "img/red.png"}]}]}))
        read_examples(str(tmp_path / "chat.jsonl"), "train", DATA)


def test_a_changed_image_beside_the_data_file_prepares_the_sft_data_again(
        tmp_path: Path) -> None:
    from rl_core.sft import load_sft_config
    from tasks.sft import _data_key

    train, _ = _write_rows(tmp_path, n=2)
    cfg = load_sft_config(SFT, [f"data.source={train}", "data.image_field=image"])
    before = _data_key(cfg.data)
    assert _data_key(cfg.data) == before
    (tmp_path / "img" / "red.png").write_bytes(png("red", (60, 60)))
    assert _data_key(cfg.data) != before
    with pytest.raises(ConfigError, match="data.teacher.path with data.image_field"):
        load_sft_config(SFT, ["data.image_field=image", "data.teacher.path=embedded:tiny"])


def test_prompt_ids_are_the_grpo_rollouts_and_no_pad_trains(vision) -> None:
    from rl_core.data.prompts import encode_record_prompts

    tok, vp = vision
    red, wide = png("red"), png("blue", (112, 56))
    for prompt, images in (("How many squares?", (red,)),
                           ("Left <image> right <image>: how many?", (red, wide))):
        ex = Example("a", "rows.jsonl line 3", prompt=prompt, completion="#### 2", images=images)
        t = tokenize_example(tok, ex, DATA, vp)
        [rollout] = encode_record_prompts(tok, [Record("a", prompt, "#### 2", images=images)], vp)
        assert t.ids[: t.prompt_len] == rollout and t.images == images
        assert tok.decode(t.ids[t.prompt_len:]) == "#### 2<|im_end|>"
        pads = [i for i, x in enumerate(t.ids) if x == vp.pad]
        assert len(pads) == sum(vp.process(images).tokens) and all(
            t.labels[i] == -100 for i in pads)
    assert tok.decode(t.ids).startswith("<|im_start|>user\nLeft <|vision_start|>")
    # a chat turn's image part is expanded where it stands; only the assistant trains
    chat = Example("c", "chat.jsonl line 1", messages=(
        ("user", [{"type": "text", "text": "Count: "}, {"type": "image"}]),
        ("assistant", "#### 1")), images=(wide,))
    t = tokenize_example(tok, chat, DATA, vp)
    assert t.ids.count(vp.pad) == vp.process([wide]).tokens[0] and t.images == (wide,)
    assert tok.decode([i for i, y in zip(t.ids, t.labels, strict=True) if y != -100]) == \
        "#### 1<|im_end|>"
    # an image the data.max_seq_len cut would split is dropped with what follows it
    with pytest.raises(ValueError, match="rows.jsonl line 3: nothing to train on"):
        tokenize_example(tok, ex, DATA.model_copy(update={"max_seq_len": 12}), vp)
    with pytest.raises(ValueError, match="rows.jsonl line 3: the row has 2 image.* text model"):
        tokenize_example(tok, ex, DATA, None)
    # the synthetic shapes task: the VLM demo's pictures as prompt rows
    shapes = SFTDataConfig(synthetic_task="shapes", synthetic_train_size=4, synthetic_test_size=2)
    [first, *_], _ = synthetic_examples(shapes)
    assert len(first.images) == 1
    assert vp.pad in tokenize_example(tok, first, shapes, vp).ids


def _sft(tmp: Path, cache: Path, model: str, *extra: str) -> dict:
    from flows.sft import sft_train

    train, held = _write_rows(tmp / "data")
    return sft_train(config=SFT, show_progress=False, resume="never", overrides=[
        f"storage.root={tmp}", f"storage.cache_dir={cache}", f"model.path={model}",
        "tracking.backend=none", f"data.source={train}", f"data.eval_source={held}",
        "data.image_field=image", "data.id_field=null", "data.max_seq_len=64",
        "train.steps=6", "train.steps_per_task=6", "train.batch_size=8",
        "train.micro_batch_size=8", "train.lr=5e-3", "train.warmup_steps=0",
        "train.num_threads=1", "eval.every=0", "eval.num_examples=8", "eval.greedy_examples=4",
        "eval.max_new_tokens=4", "checkpoint.every=0", *extra])


def test_sft_trains_a_vlm_on_image_rows_and_exports_its_processor(
        prefect_harness, vlm_dir: Path, tiny_cache: Path, tmp_path: Path) -> None:
    summary = _sft(tmp_path, tiny_cache, str(vlm_dir), "run_name=vlm")
    first, last = summary["first_eval"], summary["last_eval"]
    assert last["loss"] < first["loss"] - 1.0, (first["loss"], last["loss"])
    assert last["accuracy_examples"] == 4  # answered greedily with their pictures
    out = Path(summary["model_dir"])
    assert (out / "preprocessor_config.json").is_file() and (out / "model.safetensors").is_file()
    prepared = sorted((tiny_cache / "sft-data").glob("*/train.jsonl"))
    assert any('"images": [' in p.read_text() for p in prepared)  # the snapshot keeps pixels


def test_a_text_model_with_image_rows_is_refused_before_training(
        prefect_harness, tiny_cache: Path, tmp_path: Path) -> None:
    from rl_core.base_model import build_bare_tiny
    from rl_core.sft import SFTConfig
    from rl_core.sft_images import check_vision_model

    with pytest.raises(ConfigError, match=r"data.image_field='image'.*model.path \(.*\) is a "
                                          "text model"):
        _sft(tmp_path, tiny_cache, "embedded:tiny-init", "run_name=text")
    assert not list(tmp_path.glob("text*/metrics.jsonl"))
    # image parts in chat turns (no data.image_field) are refused the same way
    text = build_bare_tiny(SFTConfig().model, SFTDataConfig(), tiny_cache)
    with pytest.raises(ConfigError, match=r"3 SFT examples carry images .* is a text model"):
        check_vision_model(text, None, 3)
