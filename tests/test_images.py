"""Images in the data (issue 37, the data layer): every accepted form of an image reads to the
same checked bytes, a bad image names its row, and snapshots carry (and digest) the pixels."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from s3_server import s3_bucket, s3_server  # noqa: F401 - fixtures

from rl_core.data.images import ImageError, ImageSpec, load_image, smart_resize
from rl_core.data.records import DataValidationError, records_digest, validate_records
from rl_core.data.sources import load_records, read_parquet, write_parquet


def png(colour: str = "red", size: tuple[int, int] = (64, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


SPEC = ImageSpec(field="image")


def test_every_accepted_form_reads_to_the_same_bytes(tmp_path: Path) -> None:
    red = png()
    (tmp_path / "red.png").write_bytes(red)
    spec = ImageSpec(field="image", base_dir=tmp_path)
    forms = [red, bytearray(red), str(tmp_path / "red.png"), "red.png", data_url(red),
             {"bytes": red, "path": "ignored.png"}, {"bytes": None, "path": "red.png"},
             {"url": data_url(red)}]
    assert all(load_image(f, spec) == red for f in forms)
    pil = load_image(Image.open(io.BytesIO(red)), spec)  # a PIL image is encoded as PNG
    assert Image.open(io.BytesIO(pil)).tobytes() == Image.open(io.BytesIO(red)).tobytes()


def test_an_image_column_and_image_parts_become_the_records_images() -> None:
    red, blue, green = png("red"), png("blue"), png("green")
    rows = [
        {"id": 1, "question": "How many squares?", "answer": "2", "image": [red, blue]},
        {"id": 2, "answer": "green", "image": [], "question": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(green)}},
                {"type": "text", "text": "Which colour?"}]}]},
        {"id": 3, "answer": "x", "image": None, "question": "text only"},
    ]
    (a, b), problems = validate_records(rows[:2], "mem", images=SPEC)
    assert problems == [] and a.images == (red, blue) and a.question == "How many squares?"
    assert "image" not in a.columns and a.columns["answer"] == "2"  # no bytes in the columns
    assert b.images == (green,)
    assert b.question == [{"role": "user", "content": [{"type": "image"},
                                                        {"type": "text", "text": "Which colour?"}]}]
    assert b.text == "Which colour?"
    with pytest.raises(DataValidationError, match=r"row 1: field 'image' \(data.image_field\) "
                       r"is missing or null"):
        validate_records(rows[2:], "mem", images=SPEC)
    # text-only content parts stay text: the text paths (templates, judges) see a string
    (c,), _ = validate_records([{"id": 4, "answer": "y", "question": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}],
        "mem")
    assert c.question == [{"role": "user", "content": "ab"}] and c.images == ()


@pytest.mark.parametrize(("image", "why"), [
    (png()[:60], "does not decode"),
    (b"not an image at all", "does not decode"),
    (png(size=(400, 1)), "aspect ratio 400:1 is over 200:1"),
    (png(size=(300, 200)), "over data.image_max_input_pixels=50,000"),
    ("missing.png", "missing.png: No such file"),
    ("https://example.com/cat.png", "not over the web"),
    ("data:text/plain;base64,aGk=", "must be 'data:image/<type>;base64"),
    (b"", "empty"),
    ([b""], "empty"),
    (7, "got int"),
])
def test_a_bad_image_fails_its_row_by_number_and_field(tmp_path: Path, image: object,
                                                       why: str) -> None:
    spec = ImageSpec(field="pics", base_dir=tmp_path, max_input_pixels=50_000)
    rows = [{"id": 1, "question": "q", "answer": "a", "pics": png()},
            {"id": 2, "question": "q", "answer": "a", "pics": [png(), image]}]
    which = "image 2"
    if isinstance(image, list):  # the column's value bare, not in a list
        rows[1]["pics"], which = image[0], "image 1"
    with pytest.raises(DataValidationError) as err:
        validate_records(rows, "data.jsonl", images=spec)
    assert err.value.problems[0][0] == 2
    assert f"field 'pics', {which}: " in str(err.value) and why in str(err.value)
    # skipped within max_bad_fraction: never silently, the row is counted as bad
    good, problems = validate_records(rows, "data.jsonl", images=spec, max_bad_fraction=0.5)
    assert [r.id for r in good] == ["1"] and [n for n, _ in problems] == [2]


def test_a_bad_image_part_names_its_message_and_part() -> None:
    rows = [{"id": 1, "answer": "a", "question": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image", "image": b"junk"}]}]}]
    with pytest.raises(DataValidationError, match=r"row 1: field 'question': message 0, part 1: "
                       r"the image does not decode"):
        validate_records(rows, "mem")
    rows[0]["question"][0]["content"][1] = {"type": "video", "video": "x.mp4"}
    with pytest.raises(DataValidationError, match="message 0, part 1 is not"):
        validate_records(rows, "mem")


def test_parquet_image_cells_load_and_the_snapshot_keeps_and_digests_the_pixels(
        tmp_path: Path) -> None:
    red, blue = png("red"), png("blue")
    cell = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # `datasets` Image
    table = pa.table({"id": ["a", "b"], "question": ["colour?", "colour?"],
                      "answer": ["red", "blue"],
                      "image": pa.array([{"bytes": red, "path": None},
                                         {"bytes": blue, "path": "b.png"}], type=cell)})
    pq.write_table(table, tmp_path / "train.parquet")
    records = load_records(tmp_path / "train.parquet", images=ImageSpec(field="image"))
    assert [r.images for r in records] == [(red,), (blue,)]

    digest = write_parquet(records, tmp_path / "snap.parquet")
    again = read_parquet(tmp_path / "snap.parquet")
    assert again == records and records_digest(again) == digest
    assert pq.read_schema(tmp_path / "snap.parquet").field("images").type == pa.list_(pa.binary())
    # content-addressed: the same rows over other pixels digest differently
    other = png("red", size=(64, 49))
    changed = [records[0].__class__(r.id, r.question, r.answer, r.columns,
                                    (other,) if r.id == "a" else r.images) for r in records]
    assert records_digest(changed) != digest
    # content-hash ids (no id column) tell the same text over other pictures apart
    rows = [{"question": "colour?", "answer": "red", "image": red},
            {"question": "colour?", "answer": "red", "image": other}]
    first, second = validate_records(rows, "mem", id_field=None, images=SPEC)[0]
    assert first.id != second.id


def test_text_snapshots_are_unchanged(tmp_path: Path) -> None:
    records, _ = validate_records([{"id": 1, "question": "q", "answer": "a"}], "mem")
    write_parquet(records, tmp_path / "t.parquet")
    assert "images" not in pq.read_schema(tmp_path / "t.parquet").names
    assert read_parquet(tmp_path / "t.parquet")[0].images == ()


def test_images_are_read_from_s3(tmp_path: Path, s3_bucket: str) -> None:  # noqa: F811
    from rl_core import storage

    red = png()
    storage.write_bytes(f"s3://{s3_bucket}/img/red.png", red)
    rows = [{"id": 1, "question": "colour?", "answer": "red",
             "image": f"s3://{s3_bucket}/img/red.png"},
            {"id": 2, "question": "colour?", "answer": "red",
             "image": f"s3://{s3_bucket}/img/gone.png"}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataValidationError, match="line 2: field 'image', image 1: .*gone.png"):
        load_records(tmp_path / "train.jsonl", images=ImageSpec(field="image"))
    good = load_records(tmp_path / "train.jsonl", images=ImageSpec(field="image"),
                        max_bad_fraction=0.5)
    assert good[0].images == (red,)


@pytest.mark.parametrize("size", [(64, 48), (112, 112), (30, 700), (2000, 3000), (10, 10)])
def test_smart_resize_is_qwen2_vls(size: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    h, w = size
    assert smart_resize(h, w) == hf(h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(1, 300)


def test_images_with_a_text_model_are_refused_at_bring_up(tmp_path: Path,
                                                         demo_model: Path) -> None:
    """A run whose records carry images on a text model stops before any plane starts,
    rather than training on the text without the pictures."""
    from rl_core.config import ConfigError, load_config
    from tasks.setup import PreparedData, bring_up

    records, _ = validate_records([{"id": 1, "question": "q", "answer": "1", "image": png()}],
                                  "mem", images=SPEC)
    write_parquet(records, tmp_path / "train.parquet")
    write_parquet(records, tmp_path / "eval.parquet")
    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml",
                      ["data.image_field=image"])
    data = PreparedData(str(tmp_path / "train.parquet"), str(tmp_path / "eval.parquet"), "", "",
                        1, 1, "mem", cached=False)
    with pytest.raises(ConfigError, match=r"2 records carry images .* is a text model"):
        bring_up.fn(cfg, str(demo_model), data, str(tmp_path))


def test_a_changed_image_beside_the_data_file_prepares_the_data_again(tmp_path: Path) -> None:
    from rl_core.config import load_config
    from tasks.setup import data_key

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png("red"))
    (tmp_path / "train.jsonl").write_text(json.dumps(
        {"id": 1, "question": "colour?", "answer": "red", "image": "img/a.png"}) + "\n")
    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml", [
        f"data.source={tmp_path / 'train.jsonl'}", "data.image_field=image"])
    before = data_key(cfg.data, "any")
    assert data_key(cfg.data, "any") == before
    (tmp_path / "img" / "a.png").write_bytes(png("blue"))
    assert data_key(cfg.data, "any") != before
