"""MLflow tracking (the tasks/tracking package) against a real ``mlflow server`` and the embedded
SQLite default: params, batched per-step metrics, samples tables, nested evaluations,
checkpoints, the registered model (alias ``candidate``, loaded back and generating), resume,
and secrets kept out of the store, the artifacts and the logs (the rule itself:
tests/test_secrets.py).

The server keeps its artifacts in S3: a bucket on the session's moto server (a real HTTP S3
endpoint), behind the server's artifact proxy, as a team's tracking server would.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from engine_helpers import save_tiny_model  # noqa: E402
from mlflow_server import MlflowServer, start_mlflow_server  # noqa: E402
from prefect import flow  # noqa: E402
from s3_server import S3Server  # noqa: E402

from rl_core.config import load_config  # noqa: E402
from rl_core.types import Sample  # noqa: E402
from tasks import tracking  # noqa: E402
from tasks.setup import PreparedData  # noqa: E402
from tasks.tracking import sender  # noqa: E402

STEPS = 4

# The moto server fixtures (s3_server, s3_bucket) live in tests/s3_server.py.
pytest_plugins = ["s3_server"]


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _mlflow_env() -> Iterator[None]:
    """No telemetry, fast system-metrics sampling; restored afterwards."""
    saved = {
        k: os.environ.get(k)
        for k in ("MLFLOW_DISABLE_TELEMETRY", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL")
    }
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = "0.5"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


ARTIFACT_BUCKET = "grpoflow-mlflow-artifacts"


def _s3(server: S3Server):  # noqa: ANN202 - a boto3 client
    import boto3

    return boto3.client(
        "s3", endpoint_url=server.url, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _server_process(_mlflow_env, s3_server: S3Server, tmp_path_factory) -> Iterator[MlflowServer]:
    """Started with the module's first test and not waited for here: the server boots while
    the Prefect harness (session-scoped, first needed later) starts. Its artifacts go to a
    bucket on the S3 endpoint. Stopped at module end."""
    _s3(s3_server).create_bucket(Bucket=ARTIFACT_BUCKET)
    server = start_mlflow_server(
        tmp_path_factory.mktemp("mlflow-server"),
        wait=False,
        artifacts_destination=f"s3://{ARTIFACT_BUCKET}/mlflow",
        env={
            "MLFLOW_S3_ENDPOINT_URL": s3_server.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        },
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mlflow_server(_server_process: MlflowServer) -> MlflowServer:
    _server_process.wait_ready(timeout=180)
    return _server_process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def no_env_uri(monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _cfg(name: str, *extra: str):
    return load_config(
        None,
        [f"name={name}", f"model.name={name}-policy", f"train.steps={STEPS}",
         "tracking.backend=mlflow", *extra],
    )  # fmt: skip


def _data(tmp: Path, source: str = "synthetic") -> PreparedData:
    return PreparedData(
        train_path=str(tmp / "train.parquet"),
        eval_path=str(tmp / "eval.parquet"),
        train_digest="a1" * 32,
        eval_digest="b2" * 32,
        num_train=100,
        num_eval=20,
        source=source,
        cached=False,
    )


def _step_metrics(step: int) -> dict[str, float]:
    """The keys the flow's step produces (tasks/step.py, the trainer, save_checkpoint)."""
    return {
        "reward_mean": 0.1 * step, "reward_std": 0.3, "accuracy": 0.05 * step,
        "response_len_mean": 12.0, "response_len_max": 32.0, "truncation_rate": 0.1,
        "zero_std_group_frac": 0.25, "response_tokens": 400.0, "reward_errors": 0.0,
        "reward_timeouts": 0.0, "time/rollout": 1.5, "rollout_tokens_per_s": 260.0,
        "time/reward": 0.01, "time/logprobs": 0.2, "loss": -0.01, "pg_loss": -0.01,
        "kl": 0.002, "entropy": 2.1, "clip_frac": 0.05, "clip_frac_low": 0.02,
        "clip_frac_high": 0.03, "dual_clip_frac": 0.0, "ratio_mean": 1.0, "ratio_max": 1.3,
        "ppo_kl": 0.0, "tis_mean": 0.98, "tis_max": 2.0, "tis_clip_frac": 0.01,
        "rollout_trainer_logp_diff": 0.001, "grad_norm": 0.7, "lr": 1e-4,
        "train_tokens_per_s": 900.0, "time/train": 0.4, "time/sync": 0.05,
        "sync_bytes": 4e6, "time/checkpoint": 0.3,
    }  # fmt: skip


def _samples(step: int, n: int = 4) -> list[Sample]:
    return [
        Sample(uid=f"{step}:r{i // 2}:{i % 2}", group=i // 2, record_id=f"r{i // 2}",
               prompt_ids=[10 + i, 11, 12], completion_ids=[13, 14], logprobs=[-1.0, -1.0],
               finish_reason={"type": "stop"}, text=f"answer {i}", answer="3",
               weight_version=step - 1, reward=float(i % 2), correct=bool(i % 2))
        for i in range(n)
    ]  # fmt: skip


def _eval(step: int, acc: float) -> dict:
    return {
        "step": step, "weight_version": step, "pass_at_1": acc, "pass_at_k": acc + 0.2, "k": 4,
        "num_examples": 20, "response_len_mean": 10.0, "truncation_rate": 0.0, "seconds": 1.2,
        "samples": [{"question": "1+2=", "completion": "3", "answer": "3", "correct": "True"}],
    }  # fmt: skip


def _checkpoint(root: Path, step: int, run_id: str | None = None) -> Path:
    d = root / f"step-{step:06d}"
    (d / "model").mkdir(parents=True)
    (d / "model" / "config.json").write_text("{}")
    (d / "state.json").write_text(json.dumps({"step": step, "tracking_run_id": run_id}))
    (d / "MANIFEST.json").write_text("{}")
    return d


class _CountBatches:
    """Counts MlflowClient.log_batch calls made by this thread (``calls``) and by the
    tracker's sender thread (``sender_calls``); not the system-metrics monitor's."""

    def __init__(self, monkeypatch) -> None:
        from mlflow import MlflowClient

        self.calls = self.sender_calls = 0
        original = MlflowClient.log_batch
        me = threading.get_ident()

        def counting(client, *args, **kwargs):
            if threading.get_ident() == me:
                self.calls += 1
            elif threading.current_thread().name == "grpoflow-mlflow-sender":
                self.sender_calls += 1
            return original(client, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, "log_batch", counting)


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


# ---------------------------------------------------------------------------- unit


def test_metric_names_and_eval_metrics() -> None:
    assert tracking.metric_name("time/rollout") == "time/rollout"
    assert tracking.metric_name("eval/pass@4") == "eval/pass_at_4"
    assert tracking.metric_name("a:b(c)//d/../e") == "a_b_c_/d/e"
    m = tracking.eval_metrics(_eval(3, 0.5))
    assert m["eval/pass_at_1"] == 0.5 and m["eval/pass_at_4"] == pytest.approx(0.7)
    assert set(m) == {"eval/pass_at_1", "eval/pass_at_4", "eval/response_len_mean",
                      "eval/truncation_rate", "eval/seconds", "eval/num_examples"}  # fmt: skip


# ---------------------------------------------------------------------------- server


def test_training_run_on_server(
    prefect_harness,
    mlflow_server: MlflowServer,
    s3_server: S3Server,
    model_dir: Path,
    tmp_path: Path,
    monkeypatch,
) -> None:
    """A short run through a real server: everything the issue lists ends up tracked."""
    from transformers import AutoTokenizer

    cfg = _cfg("trk-server", f"tracking.uri={mlflow_server.url}")
    run_dir = tmp_path / "trk-server-20260101-000000"
    tok = AutoTokenizer.from_pretrained(model_dir)
    ckpt_root = tmp_path / "checkpoints"
    counter = _CountBatches(monkeypatch)
    per_step_calls: list[int] = []

    @flow(name="tracking-test")
    def short_run() -> tuple[tracking.TrackingHandle, dict]:
        h = tracking.start_tracking(cfg, str(run_dir), _data(tmp_path))
        h = dataclasses.replace(h, samples_every=2)  # tracking.samples_every=2
        tracking.log_evaluation(h, 0, _eval(0, 0.1))
        for step in range(1, STEPS + 1):
            before = counter.calls
            tracking.log_step(
                h, step, _step_metrics(step), tracking.sample_rows(_samples(step), tok)
            )
            per_step_calls.append(counter.calls - before)
            if step % 2 == 0:
                _checkpoint(ckpt_root, step)
                tracking.log_checkpoint(h, step, str(ckpt_root))
        tracking.log_checkpoint(h, STEPS, "s3://bucket/ckpts")
        final = _eval(STEPS, 0.4)
        tracking.log_evaluation(h, STEPS, final)
        out = tracking.finish_tracking(h, model_dir=str(model_dir), eval_result=final)
        return h, out

    h, out = short_run()
    assert per_step_calls == [0] * STEPS, "log_step only queues; the sender thread sends"
    assert 1 <= counter.sender_calls <= STEPS + 2, "at most one log_batch per step (+ evals)"
    client = _client(mlflow_server.url)
    run = client.get_run(h.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert client.get_experiment(h.experiment_id).name == "trk-server"

    # params: the flattened config
    params = run.data.params
    assert params["train.steps"] == str(STEPS) and params["algorithm.kl_coef"] == "0.0"
    assert params["model.name"] == "trk-server-policy" and len(params) > 90

    # tags: Prefect flow run, git, platform
    tags = run.data.tags
    assert tags["prefect.flow_run_id"] and tags["grpoflow.platform"] == "cpu"
    assert len(tags.get("mlflow.source.git.commit", "x" * 40)) == 40
    assert tags["grpoflow.run_name"] == run_dir.name

    # metrics every step, names as logged, eval metrics at their steps
    hist = client.get_metric_history(h.run_id, "reward_mean")
    assert [m.step for m in hist] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(h.run_id, "time/rollout")] == [1, 2, 3, 4]
    assert {m.step for m in client.get_metric_history(h.run_id, "eval/pass_at_1")} == {0, STEPS}
    assert any(k.startswith("system/") for k in run.data.metrics), "system metrics on"

    # datasets
    inputs = run.inputs.dataset_inputs
    contexts = {t.value for d in inputs for t in d.tags if t.key == "mlflow.data.context"}
    assert contexts == {"training", "evaluation"}
    assert {d.dataset.digest for d in inputs} == {("a1" * 32)[:32], ("b2" * 32)[:32]}

    # nested evaluation runs
    children = client.search_runs(
        [h.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{h.run_id}'"
    )
    assert sorted(int(c.data.tags["grpoflow.step"]) for c in children) == [0, STEPS]
    assert all(c.data.metrics["pass_at_1"] >= 0.1 for c in children)

    # artifacts: samples every 2 steps, checkpoints, config, curve
    def paths(where: str | None = None) -> set[str]:
        return {a.path for a in client.list_artifacts(h.run_id, where)}

    assert paths("samples") == {"samples/step-000002.json", "samples/step-000004.json"}
    table = json.loads(Path(client.download_artifacts(
        h.run_id, "samples/step-000004.json", str(tmp_path / "dl"))).read_text())  # fmt: skip
    assert {"prompt", "completion", "reward"} <= set(table["columns"]) and len(table["data"]) == 4
    assert paths("checkpoints") == {"checkpoints/step-000002", "checkpoints/step-000004"}
    assert "checkpoints/step-000004/state.json" in paths("checkpoints/step-000004")
    assert tags["checkpoint/step-000002"].endswith("/artifacts/checkpoints/step-000002")
    # a checkpoint in object storage is referenced, not uploaded again
    assert (
        tags["checkpoint/step-000004"]
        == tags["checkpoint/latest"]
        == "s3://bucket/ckpts/step-000004"
    )
    png = Path(client.download_artifacts(h.run_id, out["curve"], str(tmp_path / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "config.yaml" in paths()

    # ... and every artifact is an object in the S3 bucket (through the server's proxy)
    listing = _s3(s3_server).get_paginator("list_objects_v2").paginate(
        Bucket=ARTIFACT_BUCKET, Prefix="mlflow/"
    )
    keys = {o["Key"] for page in listing for o in page.get("Contents", [])}
    run_prefix = f"mlflow/{h.experiment_id}/{h.run_id}/artifacts/"
    for path in ("samples/step-000004.json", "checkpoints/step-000002/state.json",
                 "config.yaml", out["curve"]):  # fmt: skip
        assert run_prefix + path in keys, (path, sorted(keys)[:20])
    assert any(k.endswith(".safetensors") for k in keys), "the registered model's weights"

    # the registered model: alias candidate, eval metrics, linked to the run; it generates
    mv = client.get_model_version_by_alias("trk-server-policy", "candidate")
    assert mv.run_id == h.run_id and mv.version == out["version"]
    assert float(mv.tags["eval/pass_at_1"]) == pytest.approx(0.4)
    assert mv.tags["grpoflow.base_model"] == params["model.path"]  # what it was trained from
    logged = client.get_logged_model(mv.source.removeprefix("models:/"))
    assert {m.key for m in logged.metrics} >= {"eval/pass_at_1", "reward_mean"}

    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")  # set_tracking_uri also writes it
    mlflow.set_tracking_uri(mlflow_server.url)
    try:
        model = mlflow.pyfunc.load_model("models:/trk-server-policy@candidate")
        [text] = model.predict(["abc"], params={"max_new_tokens": 6})
        assert text.startswith("abc") and len(text) > 3
        parts = mlflow.transformers.load_model(
            "models:/trk-server-policy@candidate", return_type="components"
        )
        ids = parts["tokenizer"]("abc", return_tensors="pt").input_ids
        new = parts["model"].generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
        assert len(new) > 0
    finally:
        mlflow.set_tracking_uri(previous)


def test_resume_reattaches(prefect_harness, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    """A resumed run continues the same MLflow run at the checkpoint's step: found by its
    run-directory tag, or by the id the checkpoint carries."""
    cfg = _cfg("trk-resume", f"tracking.uri={mlflow_server.url}",
               "tracking.experiment=trk-resume-exp")  # fmt: skip
    run_dir = tmp_path / "trk-resume-1"
    h = tracking.start_tracking(cfg, str(run_dir), _data(tmp_path))
    for step in (1, 2, 3):
        tracking.log_step(h, step, _step_metrics(step))
    tracking.log_evaluation(h, 2, _eval(2, 0.2))
    tracking.log_evaluation(h, 3, _eval(3, 0.3))  # past the checkpoint: redone after resume
    sender.drop_tracker(h.run_id).stop_system_metrics()  # the process dies mid-run
    client = _client(mlflow_server.url)
    assert client.get_run(h.run_id).info.status == "RUNNING"

    # by tag: the checkpoint of step 2 does not know the run id
    ckpt = _checkpoint(tmp_path / "ckpts", 2, run_id=None)
    h2 = tracking.start_tracking(cfg, str(run_dir), _data(tmp_path), resume_from=str(ckpt))
    assert h2.run_id == h.run_id and h2.resumed
    assert client.get_run(h.run_id).info.status == "RUNNING"
    assert client.get_run(h.run_id).data.tags["grpoflow.resumed_from_step"] == "2"
    for step in (3, 4):
        tracking.log_step(h2, step, _step_metrics(step))
    tracking.log_evaluation(h2, 3, _eval(3, 0.35))
    tracking.finish_tracking(h2)

    steps = [m.step for m in client.get_metric_history(h.run_id, "reward_mean")]
    assert sorted(steps) == [1, 2, 3, 3, 4]
    children = client.search_runs(
        [h.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{h.run_id}'"
    )
    by_step = {c.data.tags["grpoflow.step"]: c.data.metrics["pass_at_1"] for c in children}
    assert by_step == {"2": 0.2, "3": 0.35}, "a redone evaluation replaces the earlier one"
    assert client.get_run(h.run_id).info.status == "FINISHED"

    # by id: a checkpoint that carries the tracking run id, in another directory
    ckpt = _checkpoint(tmp_path / "ckpts-b", 4, run_id=h.run_id)
    h3 = tracking.start_tracking(cfg, str(tmp_path / "elsewhere"), None, resume_from=str(ckpt))
    assert h3.run_id == h.run_id
    tracking.finish_tracking(h3, status="KILLED")
    assert client.get_run(h.run_id).info.status == "KILLED"


# ---------------------------------------------------------------------------- embedded


def test_embedded_default_and_buffering(
    prefect_harness, no_env_uri, tmp_path: Path, monkeypatch
) -> None:
    """No URI anywhere: one SQLite store in storage.root for every run of the project (or
    one in the run directory: tracking.store=run). A failed log_batch keeps the metrics and
    the sender sends them again; tracking.backend=none is a no-op everywhere."""
    cfg = _cfg("trk-embedded", f"storage.root={tmp_path}")
    run_dir = tmp_path / "trk-embedded-1"
    h = tracking.start_tracking(cfg, str(run_dir), _data(tmp_path))
    assert h.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert (tmp_path / "mlflow.db").is_file() and not (run_dir / "mlflow.db").exists()
    # a second run of the project lands in the same store: `mlflow ui` shows both
    other = tracking.start_tracking(cfg, str(tmp_path / "trk-embedded-2"), _data(tmp_path))
    assert other.tracking_uri == h.tracking_uri and other.run_id != h.run_id
    tracking.finish_tracking(other)
    both = _client(h.tracking_uri).search_runs([h.experiment_id])
    assert {r.info.run_id for r in both} >= {h.run_id, other.run_id}
    per_run = _cfg("trk-embedded", f"storage.root={tmp_path}", "tracking.store=run")
    assert tracking.resolve_tracking_uri(per_run, run_dir)[0] == (
        f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")

    tracker = tracking.tracker_for(h)
    real = tracker.client.log_batch
    fail = {"n": 1}

    def flaky(*args, **kwargs):
        if fail["n"]:
            fail["n"] -= 1
            raise ConnectionError("tracking server restarting")
        return real(*args, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", flaky)
    tracking.log_step(h, 1, {"reward_mean": 0.1})
    tracking.log_step(h, 2, {"reward_mean": 0.2})
    assert tracker.flush(timeout=30), "the failed send is retried"
    assert fail["n"] == 0 and tracker.outages == 1
    client = _client(h.tracking_uri)
    assert [m.step for m in client.get_metric_history(h.run_id, "reward_mean")] == [1, 2]

    _checkpoint(tmp_path / "ck", 2)
    tracking.log_checkpoint(h, 2, str(tmp_path / "ck"))
    tracking.finish_tracking(h)
    run = client.get_run(h.run_id)
    assert run.info.status == "FINISHED"
    artifacts = tmp_path / "mlartifacts"
    assert (
        artifacts / h.run_id / "artifacts" / "checkpoints" / "step-000002" / "state.json"
    ).is_file()
    assert (artifacts / h.run_id / "artifacts" / "plots" / "reward_accuracy.png").is_file()

    # a failing flow ends its MLflow run as FAILED through the flow hook
    @flow(name="tracking-crash", on_failure=[tracking.tracking_failed])
    def crashing() -> None:
        crash_cfg = _cfg("trk-crash", f"tracking.uri={h.tracking_uri}")
        ids.append(tracking.start_tracking(crash_cfg, str(tmp_path / "crash"), None).run_id)
        raise RuntimeError("boom")

    ids: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        crashing()
    assert client.get_run(ids[0]).info.status == "FAILED"

    off = load_config(None, ["tracking.backend=none"])
    assert tracking.start_tracking(off, str(tmp_path / "off"), None) is None
    assert tracking.log_step(None, 1, {"x": 1.0}) is True
    assert tracking.finish_tracking(None, model_dir="unused") == {}


def test_secrets_never_reach_mlflow(
    prefect_harness, no_env_uri, model_dir: Path, tmp_path: Path, monkeypatch, caplog, capfd
) -> None:
    """AWS keys and tokens in the environment and the config appear nowhere in the tracking
    store, its artifacts (model included) or the logs."""
    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIAZZTESTKEY0000001",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIK7MDENGbPxRfiCYzzSECRET01",
        "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyzSECRET42",
        "GRPOFLOW_DB_PASSWORD": "pw-env-771b2c",
    }
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    in_config = ["pw-in-url-9f8e7d", "tok-query-5a4b3c2d1e", "wandb-key-0f1e2d3c4b5a",
                 "ckpt-pass-4242", "s3cr3t-value-123"]  # fmt: skip
    source = f"https://data.example.com/gsm8k.jsonl?token={in_config[1]}&split=x"
    cfg = _cfg(
        "trk-secrets",
        f"storage.root=s3://alice:{in_config[0]}@bucket/runs",
        f"data.source={source}",
        f"checkpoint.uri=s3://{secrets['AWS_ACCESS_KEY_ID']}:x@bucket/ckpt",
        f"cluster.env={{WANDB_API_KEY: {in_config[2]}, MY_SERVICE_CREDS: {in_config[4]}, "
        f"AWS_SECRET_ACCESS_KEY: {secrets['AWS_SECRET_ACCESS_KEY']}, OMP_NUM_THREADS: '1'}}",
    )
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may land in ./mlruns or ./mlflow.db of the caller
    caplog.set_level(logging.INFO)
    for name in ("prefect", "mlflow", "tasks"):
        logging.getLogger(name).addHandler(caplog.handler)
    try:
        run_dir = tmp_path / "trk-secrets-1"
        h = tracking.start_tracking(cfg, str(run_dir), _data(tmp_path, source=source))
        tracking.log_step(h, 1, _step_metrics(1))
        tracking.log_checkpoint(h, 1, f"s3://bob:{in_config[3]}@bucket/ckpts")
        tracking.log_evaluation(h, 1, _eval(1, 0.3))
        tracking.finish_tracking(h, model_dir=str(model_dir), eval_result=_eval(1, 0.3))
    finally:
        for name in ("prefect", "mlflow", "tasks"):
            logging.getLogger(name).removeHandler(caplog.handler)

    client = _client(h.tracking_uri)
    run = client.get_run(h.run_id)
    assert run.data.params["data.source"].endswith("?token=***&split=x")
    assert run.data.params["cluster.env.WANDB_API_KEY"] == "***"
    assert run.data.params["cluster.env.MY_SERVICE_CREDS"] == "***"  # env values by default
    assert run.data.params["cluster.env.OMP_NUM_THREADS"] == "1"  # a known-harmless setting
    assert run.data.params["storage.root"] == "s3://***@bucket/runs"
    assert run.data.tags["checkpoint/latest"] == "s3://***@bucket/ckpts/step-000001"

    assert not list(cwd.iterdir())
    assert "MLFLOW_TRACKING_URI" not in os.environ, "the global tracking URI is restored"
    needles = [*secrets.values(), *in_config]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files) and any(
        p.suffix == ".safetensors" for p in files
    )
    for p in files:
        blob = p.read_bytes()
        for s in needles:
            assert s.encode() not in blob, f"{s!r} found in {p}"
    out, err = capfd.readouterr()
    logs = caplog.text + out + err
    assert "tracking: started MLflow run" in logs
    for s in needles:
        assert s not in logs, f"{s!r} found in the logs"
