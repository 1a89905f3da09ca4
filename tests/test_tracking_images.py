"""The prompt's images in MLflow's samples tables (issue 37 item 6): a training step's table and
an evaluation's carry an ``image`` column MLflow's UI draws (thumbnails of at most 256 px,
files beside the table), ``images`` (the count) and ``image_files``; a text-only table is
unchanged. Against real tracking stores: SQLite with local artifacts, and a real ``mlflow
server`` (proxied artifacts) whose ``get-artifact`` endpoint, the one the UI's table view
loads pictures from, serves the files. No MLflow call is mocked.
"""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow_server import MlflowServer, start_mlflow_server  # noqa: E402
from PIL import Image  # noqa: E402

from rl_core.data.records import Record  # noqa: E402
from rl_core.evaluation import evaluate  # noqa: E402
from rl_core.host import free_port
from rl_core.rewards import RewardRunner  # noqa: E402
from rl_core.thumbnails import THUMBNAIL_SIDE, thumbnail, thumbnails_b64  # noqa: E402
from rl_core.types import Sample  # noqa: E402
from tasks import tracking  # noqa: E402
from tasks.tracking import artifacts, images, sender  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT_COLUMNS = ["uid", "prompt", "completion", "answer", "reward", "correct", "truncated",
                "tokens", "weight_version"]  # fmt: skip


# ---------------------------------------------------------------------------- helpers


def _encode(im: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt)
    return out.getvalue()


def _photo(size: tuple[int, int]) -> bytes:
    """A JPEG with detail (a Mandelbrot set), as a dataset's photo would be."""
    w, h = size
    return _encode(Image.effect_mandelbrot(size, (-2, -1.2, 1, 1.2), 64).convert("RGB")
                   .resize((w, h)), "JPEG")  # fmt: skip


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    return _encode(Image.new(mode, size, (40, 90, 200, 128)[: len(mode)]), "PNG")


BROKEN = b"\x89PNG\r\n\x1a\n not really a png"


def _sample(i: int, imgs: tuple[bytes, ...] = (), step: int = 2) -> Sample:
    return Sample([10 + i, 11], [13, 14], [-1.0, -1.0], {"type": "stop"}, text=f"answer {i}",
                  uid=f"{step}:r{i}:0", group=i, record_id=f"r{i}", answer="3",
                  weight_version=step - 1, reward=float(i % 2), correct=bool(i % 2),
                  images=imgs)  # fmt: skip


def _image_samples() -> list[Sample]:
    return [
        _sample(0, (_photo((1024, 768)),)),  # a photo: a 256 x 192 JPEG
        _sample(1, (_png((300, 600), "RGBA"), _png((100, 80)))),  # two: 128 x 256, as is
        _sample(2),  # text only, in a table with images: the placeholder
        _sample(3, (BROKEN, *[_png((32, 32))] * 9)),  # ten, the first broken: 8 files kept
    ]


def _decode(path: Path | bytes) -> Image.Image:
    data = path if isinstance(path, bytes) else path.read_bytes()
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def _store(tmp: Path) -> tuple[str, str]:
    """A SQLite tracking store with its artifacts under ``tmp``: (uri, experiment id)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    exp = MlflowClient(uri).create_experiment(
        f"images-{time.time_ns()}", artifact_location=(tmp / "artifacts").as_uri())
    return uri, exp


def _handle(uri: str, exp: str, run_dir: Path, **kw: Any) -> tracking.TrackingHandle:
    from mlflow import MlflowClient

    run_id = MlflowClient(uri).create_run(exp).info.run_id
    return tracking.TrackingHandle(uri, exp, run_id, "images", "m", 4, samples_every=2,
                                   run_dir=str(run_dir), **kw)  # fmt: skip


def _table(client: Any, run_id: str, path: str, tmp: Path) -> dict[str, Any]:
    return json.loads(Path(client.download_artifacts(run_id, path, str(tmp))).read_text())


def _files(client: Any, run_id: str, folder: str) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, folder)}


@pytest.fixture
def thumbnail_threads(monkeypatch) -> list[str]:
    """The threads that made thumbnails (the wrapped function is ours, not MLflow's)."""
    names: list[str] = []

    def recording(data: bytes, *args: Any) -> bytes:
        names.append(threading.current_thread().name)
        return thumbnail(data, *args)

    monkeypatch.setattr(images, "thumbnail", recording)
    return names


def _check_step_table(uri: str, exp: str, run_id: str, tmp: Path,
                      monkeypatch: pytest.MonkeyPatch) -> dict[str, Image.Image]:
    """Step 2's table and its files as logged from :func:`_image_samples`; the images by path."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    folder = "samples/step-000002"
    assert f"{folder}.json" in _files(client, run_id, "samples")
    table = _table(client, run_id, f"{folder}.json", tmp / "tables")
    cols = table["columns"]
    assert cols[:3] == ["uid", "image", "prompt"], "the picture beside the prompt"
    assert cols[-2:] == ["images", "image_files"] and set(TEXT_COLUMNS) <= set(cols)
    rows = [dict(zip(cols, r, strict=True)) for r in table["data"]]
    assert [r["images"] for r in rows] == [1, 2, 0, 10]
    files = [r["image_files"] for r in rows]
    assert files[0] == [f"{folder}/2_r0_0-0.jpg"]
    assert files[1] == [f"{folder}/2_r1_0-0.png", f"{folder}/2_r1_0-1.png"]
    assert files[2] == [] and len(files[3]) == 8  # at most MAX_ROW_IMAGES files a row
    for row, first in zip(rows, [f[0] if f else f"{folder}/no-image.png" for f in files],
                          strict=True):  # fmt: skip
        assert row["image"] == {"type": "image", "filepath": first, "compressed_filepath": first}
    # MLflow lists it as a table (the UI's table view, with the image column drawn)
    tag = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": f"{folder}.json", "type": "table"} in tag
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # load_table searches the default store
    df = client.load_table(exp, f"{folder}.json", run_ids=[run_id])
    assert list(df["images"]) == [1, 2, 0, 10] and df["image"][0]["type"] == "image"

    listed = _files(client, run_id, folder)
    wanted = {p for f in files for p in f} | {f"{folder}/no-image.png"}
    assert listed == wanted, "every image is a file in the table's folder, nothing more"
    got = {p: _decode(Path(client.download_artifacts(run_id, p, str(tmp / "files"))))
           for p in sorted(listed)}  # fmt: skip
    return got


# ---------------------------------------------------------------------------- unit


def test_thumbnails_keep_the_format_fit_256_and_leave_small_images_alone() -> None:
    photo = _decode(thumbnail(_photo((2000, 1000))))
    assert (photo.format, photo.size) == ("JPEG", (THUMBNAIL_SIDE, 128))
    tall = _decode(thumbnail(_png((300, 600), "RGBA")))
    assert (tall.format, tall.size, tall.mode) == ("PNG", (128, 256), "RGBA")
    small = _png((100, 80))
    assert thumbnail(small) is small
    webp = _decode(thumbnail(_encode(Image.new("RGB", (512, 512)), "WEBP")))
    assert (webp.format, webp.size) == ("PNG", (256, 256))
    with pytest.raises(OSError):
        thumbnail(BROKEN)
    # an evaluation's rows carry JSON-safe thumbnails; a broken image is left out
    (b64,) = thumbnails_b64([BROKEN, _photo((800, 800))])
    assert _decode(base64.b64decode(b64)).size == (256, 256)


def test_text_only_rows_and_tables_are_unchanged() -> None:
    rows = artifacts.sample_rows([_sample(0), _sample(1)])
    assert [list(r) for r in rows] == [TEXT_COLUMNS] * 2
    assert images.with_images(rows, "samples/step-000002") == rows
    # a dataset's own text column called "images" is a column like any other
    rows[0]["images"] = '["a.png"]'
    assert images.with_images(rows, "x") == rows
    assert not any(isinstance(c, images.TableImage) for col in
                   artifacts.columns(images.with_images(rows, "x")).values() for c in col)


def test_evaluation_rows_carry_thumbnails_of_the_prompts_images() -> None:
    """rl_core.evaluation's rows: base64 thumbnails for a prompt with images, nothing for
    text (the rows are written to evals.jsonl as JSON)."""
    photo = _photo((640, 480))
    records = [Record("a", "What is drawn? #0", "#### 1", images=(photo,)),
               Record("b", "1 + 0 = ?", "#### 1")]  # fmt: skip

    class Plane:
        def generate(self, prompts: Any, params: Any, images: Any = None) -> list[Sample]:
            return [Sample(list(p), [7], [-0.5], {"type": "stop"}, text="#### 1")
                    for p in prompts]

    result = evaluate(Plane(), records, [[1], [2]], RewardRunner("gsm8k"), max_new_tokens=4, k=1)
    with_image, text = json.loads(json.dumps(result.to_dict()))["samples"]
    assert "images" not in text
    (b64,) = with_image["images"]
    im = _decode(base64.b64decode(b64))
    assert (im.format, im.size) == ("JPEG", (256, 192))


# ---------------------------------------------------------------------------- SQLite store


def test_step_table_with_images_in_a_sqlite_store(tmp_path: Path, thumbnail_threads,
                                                  monkeypatch) -> None:
    from mlflow import MlflowClient

    uri, exp = _store(tmp_path)
    h = _handle(uri, exp, tmp_path / "run")
    client = MlflowClient(uri)
    try:
        samples = _image_samples()
        rows = artifacts.sample_rows(samples)
        assert rows[0]["images"][0] is samples[0].images[0], "the sample's bytes, not a copy"
        started = time.monotonic()
        assert artifacts.log_step(h, 2, {"reward_mean": 0.5}, rows)
        assert time.monotonic() - started < 2, "log_step only queues"
        assert "MainThread" not in thumbnail_threads, "thumbnails are made off the loop"
        # a text-only step's table: exactly the columns it always had, no image folder
        artifacts.log_step(h, 4, {"reward_mean": 0.6},
                           artifacts.sample_rows([_sample(0, step=4), _sample(1, step=4)]))
        assert tracking.tracker_for(h).flush(60), "the sender sent both tables"
    finally:
        tracking.tracker_for(h).end("FINISHED")
        sender.drop_tracker(h.run_id)
    assert set(thumbnail_threads) <= {"grpoflow-mlflow-thumbnails", "grpoflow-mlflow-sender"}

    got = _check_step_table(uri, exp, h.run_id, tmp_path, monkeypatch)
    folder = "samples/step-000002"
    photo = got[f"{folder}/2_r0_0-0.jpg"]
    assert (photo.format, photo.size) == ("JPEG", (256, 192))
    tall, small = got[f"{folder}/2_r1_0-0.png"], got[f"{folder}/2_r1_0-1.png"]
    assert (tall.format, tall.size, tall.mode) == ("PNG", (128, 256), "RGBA")
    assert (small.format, small.size) == ("PNG", (100, 80))
    assert got[f"{folder}/no-image.png"].size == (64, 64)
    assert got[f"{folder}/2_r3_0-0.png"].size == (64, 64), "a broken image: the placeholder"
    assert got[f"{folder}/2_r3_0-1.png"].size == (32, 32)
    assert all(max(im.size) <= THUMBNAIL_SIDE for im in got.values())

    text = _table(client, h.run_id, "samples/step-000004.json", tmp_path / "text")
    assert text["columns"] == TEXT_COLUMNS
    assert _files(client, h.run_id, "samples") == {f"{folder}.json", folder,
                                                   "samples/step-000004.json"}  # fmt: skip


def test_evaluation_tables_with_and_without_images(tmp_path: Path) -> None:
    """log_evaluation's nested run: the rows' thumbnails (as rl_core.evaluation makes them,
    through JSON as evals.jsonl keeps them) as files beside ``samples.json``."""
    from mlflow import MlflowClient

    uri, exp = _store(tmp_path)
    h = _handle(uri, exp, tmp_path / "run")
    client = MlflowClient(uri)
    rows = [{"question": "What is drawn?", "completion": "a set", "answer": "set",
             "correct": "True", "images": thumbnails_b64([_photo((900, 600)), _png((50, 50))])},
            {"question": "1 + 2 = ?", "completion": "3", "answer": "3", "correct": "True"}]
    result = json.loads(json.dumps({"pass_at_1": 1.0, "num_examples": 2, "samples": rows}))
    text_only = {"pass_at_1": 1.0, "num_examples": 1, "samples": rows[1:]}
    try:
        child = artifacts.log_evaluation.fn(h, 2, result)
        plain = artifacts.log_evaluation.fn(h, 4, text_only)
    finally:
        tracking.tracker_for(h).end("FINISHED")
        sender.drop_tracker(h.run_id)
    assert child and plain

    table = _table(client, child, "samples.json", tmp_path / "t")
    assert table["columns"] == ["image", "question", "completion", "answer", "correct",
                                "images", "image_files"]  # fmt: skip
    first, second = (dict(zip(table["columns"], r, strict=True)) for r in table["data"])
    assert first["image_files"] == ["samples/row-000-0.jpg", "samples/row-000-1.png"]
    assert first["image"]["filepath"] == "samples/row-000-0.jpg" and first["images"] == 2
    assert second["image"]["filepath"] == "samples/no-image.png" and second["images"] == 0
    assert _files(client, child, "samples") == {"samples/row-000-0.jpg", "samples/row-000-1.png",
                                                "samples/no-image.png"}  # fmt: skip
    photo = _decode(Path(client.download_artifacts(child, "samples/row-000-0.jpg", str(tmp_path))))
    assert (photo.format, photo.size) == ("JPEG", (256, 171))

    plain_table = _table(client, plain, "samples.json", tmp_path / "p")
    assert plain_table["columns"] == ["question", "completion", "answer", "correct"]
    assert {a.path for a in client.list_artifacts(plain)} == {"samples.json"}


# ---------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[MlflowServer]:
    srv = start_mlflow_server(tmp_path_factory.mktemp("mlflow-images"), wait=False)
    try:
        yield srv
    finally:
        srv.stop()


def test_images_through_a_server_and_the_unsent_file(
    server: MlflowServer, tmp_path: Path, monkeypatch
) -> None:
    """The sender's table through a real server's artifact proxy; the files load from the
    ``get-artifact`` URL the UI's table view uses. A tracker whose server never answers
    writes the table, thumbnails included, to the unsent-metrics file; the replay sends it."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    server.wait_ready(timeout=180)
    client = MlflowClient(server.url)
    exp = client.create_experiment(f"images-server-{time.time_ns()}")
    h = _handle(server.url, exp, tmp_path / "run")
    try:
        artifacts.log_step(h, 2, {"reward_mean": 0.5}, artifacts.sample_rows(_image_samples()))
        assert tracking.tracker_for(h).flush(120)
    finally:
        tracking.tracker_for(h).end("FINISHED")
        sender.drop_tracker(h.run_id)
    got = _check_step_table(server.url, exp, h.run_id, tmp_path, monkeypatch)
    path = "samples/step-000002/2_r0_0-0.jpg"
    query = urllib.parse.urlencode({"path": path, "run_uuid": h.run_id})
    with urllib.request.urlopen(f"{server.url}/get-artifact?{query}", timeout=30) as r:
        served = r.read()
    assert _decode(served).size == got[path].size == (256, 192)

    # the server is away for good: the table goes to the file, then to the live server
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run_id = client.create_run(exp).info.run_id
    dead = tracking.TrackingHandle(f"http://127.0.0.1:{free_port()}", exp, run_id, "images",
                                   "m", 4, run_dir=str(tmp_path / "dead"), flush_timeout_s=2)
    tracker = tracking.Tracker(dead)
    folder = "samples/step-000004"
    tracker.log_table(f"{folder}.json", artifacts.columns(
        images.with_images(artifacts.sample_rows(_image_samples()[:2]), folder)))
    report = tracker.end("FINISHED")
    assert report["unsent_tables"] == 1
    (record,) = [json.loads(x) for x in Path(report["unsent_file"]).read_text().splitlines()
                 if json.loads(x)["kind"] == "table"]  # fmt: skip
    cell = record["table"]["image"][0]
    assert cell["type"] == "image-file" and cell["path"] == f"{folder}/2_r0_0-0.jpg"
    assert _decode(base64.b64decode(cell["base64"])).size == (256, 192), "thumbnails, not originals"
    assert tracking.replay_unsent(report["unsent_file"], server.url)["tables"] == 1
    table = _table(client, run_id, f"{folder}.json", tmp_path / "replayed")
    assert table["columns"][1] == "image" and table["data"][0][1]["type"] == "image"
    assert _files(client, run_id, folder) == {f"{folder}/2_r0_0-0.jpg", f"{folder}/2_r1_0-0.png",
                                              f"{folder}/2_r1_0-1.png"}  # fmt: skip
    replayed = _decode(Path(client.download_artifacts(run_id, f"{folder}/2_r1_0-0.png",
                                                      str(tmp_path / "r"))))  # fmt: skip
    assert replayed.size == (128, 256)


@pytest.mark.browser
@pytest.mark.skipif(os.environ.get("GRPOFLOW_BROWSER_TESTS") != "1",
                    reason="browser test: set GRPOFLOW_BROWSER_TESTS=1 (and have chromium)")
def test_the_ui_table_view_draws_the_images(server: MlflowServer, tmp_path: Path) -> None:
    """Headless Chromium (driven as scripts/screenshots.py does) on the run's *Artifacts*
    view of the table: the ``image`` column's pictures load, at the thumbnails' sizes."""
    import importlib.util
    import sys

    name = "grpoflow_screenshots"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "screenshots.py")
        assert spec and spec.loader
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    shots = sys.modules[name]
    if (chromium := shots.find_chromium()) is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    from mlflow import MlflowClient

    server.wait_ready(timeout=180)
    exp = MlflowClient(server.url).create_experiment(f"images-ui-{time.time_ns()}")
    h = _handle(server.url, exp, tmp_path / "run")
    try:
        artifacts.log_step(h, 2, {"reward_mean": 0.5}, artifacts.sample_rows(_image_samples()))
        assert tracking.tracker_for(h).flush(120)
    finally:
        tracking.tracker_for(h).end("FINISHED")
        sender.drop_tracker(h.run_id)
    loaded = ("[...document.querySelectorAll('img')].filter(i => i.src.includes('get-artifact')"
              " && i.complete && i.naturalWidth > 0)")
    with shots.Browser(chromium, tmp_path) as browser:
        browser.open(f"{server.url}/#/experiments/{exp}/runs/{h.run_id}/artifacts/"
                     "samples/step-000002.json")
        browser.wait_for("the table's pictures", f"{loaded}.length >= 4", timeout=120)
        sizes = browser.evaluate(f"{loaded}.map(i => [decodeURIComponent(i.src.split("
                                 f"'path=')[1].split('&')[0]), i.naturalWidth, i.naturalHeight])")
        text = browser.text()
    assert "image" in text and "completion" in text and "2:r0:0" in text
    assert {p: (w, h) for p, w, h in sizes} == {
        "samples/step-000002/2_r0_0-0.jpg": (256, 192),
        "samples/step-000002/2_r1_0-0.png": (128, 256),
        "samples/step-000002/no-image.png": (64, 64),
        "samples/step-000002/2_r3_0-0.png": (64, 64),
    }
