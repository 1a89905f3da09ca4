"""``grpoflow doctor``: the default config passes here, a GPU config names its fixes, probes
are bounded (unreachable and reachable MLflow), and secrets never reach the output."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpoflow import doctor
from rl_core.cluster.platform import detect_platform

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")

# Variables that would change what doctor sees on a developer's machine.
_ENV = (
    "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "HF_TOKEN", "HF_ENDPOINT",
    "HF_HUB_OFFLINE", "AWS_SHARED_CREDENTIALS_FILE",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path, request):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.chdir(ROOT)
    if not request.node.get_closest_marker("config_checks"):
        # `grpoflow validate`'s checks start a child process (~5 s of CPU): only the tests
        # marked config_checks run them; the others are about the machine's rows
        monkeypatch.setattr(doctor, "check_config", lambda config, overrides: [])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server(tmp_path) -> Iterator[str]:
    """A tiny HTTP server on 127.0.0.1 (stands in for an MLflow server)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):  # keep the test output clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _run_json(capsys, *argv: str) -> tuple[int, dict, str]:
    rc = doctor.main([*argv, "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


def _row(report: dict, name: str) -> dict:
    rows = [r for r in report["checks"] if r["name"] == name]
    assert rows, f"no {name!r} row in {[r['name'] for r in report['checks']]}"
    return rows[0]


# ----------------------------------------------------------------------------- tests


def test_default_config_is_ready_on_this_machine(capsys):
    assert doctor.main([TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"grpoflow doctor: {TINY}")
    assert "ready: nothing this config needs is missing" in out
    for name in ("python", "torch", "platform", "env presets", "ray", "sglang", "megatron-core"):
        assert f" {name} " in out, name
    # Ray is not needed for a local run: reported with the pip extra, never failing
    assert "pip install -e '.[ray]'" in out or "ray " in out


def test_json_report_and_built_in_defaults(capsys):
    rc, report, _ = _run_json(capsys)
    assert rc == 0 and report["ready"] is True and report["config"] == "built-in defaults"
    assert report["platform"]["kind"] == detect_platform().kind
    assert {r["status"] for r in report["checks"]} <= {"ok", "warn", "missing"}
    assert all(r["status"] != "missing" or not r["needed"] for r in report["checks"])
    assert _row(report, "python")["status"] in ("ok", "warn")
    sglang = _row(report, "sglang")
    if sglang["status"] == "missing":
        assert not sglang["needed"] and "embedded engine" in sglang["detail"]


def test_a_gpu_config_reports_what_is_missing_with_the_fix(capsys, monkeypatch):
    real = doctor.import_probe

    def absent(module: str, dist: str) -> tuple[bool, str]:
        if module in ("sglang", "megatron.core"):
            return False, "not installed"
        return real(module, dist)

    monkeypatch.setattr(doctor, "import_probe", absent)
    argv = [TINY, "rollout.engine=sglang", "train.backend=megatron"]
    rc, report, _ = _run_json(capsys, *argv)
    assert rc == 1 and report["ready"] is False
    sglang, megatron = _row(report, "sglang"), _row(report, "megatron-core")
    assert sglang["status"] == megatron["status"] == "missing"
    assert sglang["needed"] and megatron["needed"]
    assert "pip install -e '.[sglang]'" in sglang["fix"]
    assert "rollout.engine=embedded" in sglang["fix"]
    assert "pip install -e '.[megatron]'" in megatron["fix"]
    assert "train.backend=torch" in megatron["fix"]

    assert doctor.main(argv) == 1
    out = capsys.readouterr().out
    assert "not ready: this config needs" in out and "megatron-core" in out.splitlines()[-1]
    assert "fix: pip install -e '.[megatron]'" in out


def test_unreachable_mlflow_is_reported_within_the_bound(capsys):
    uri = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    rc, report, err = _run_json(capsys, TINY, "tracking.backend=mlflow", f"tracking.uri={uri}")
    assert time.monotonic() - t0 < 30  # the whole doctor, torch detection included
    assert rc == 1
    row = _row(report, "mlflow server")
    assert row["status"] == "missing" and row["needed"]
    assert uri in row["detail"] and "tracking.uri" in row["detail"]
    assert "mlflow server --host 127.0.0.1" in row["fix"]
    [probe] = [p for p in report["probes"] if p["url"] == uri]
    assert not probe["ok"] and probe["seconds"] <= doctor.PROBE_TIMEOUT_S + 0.5
    assert f"doctor: probe GET {uri}" in err  # every probe is logged


def test_a_server_that_never_answers_is_cut_off(monkeypatch):
    with socket.socket() as sink:  # accepts connections (backlog), never replies
        sink.bind(("127.0.0.1", 0))
        sink.listen(8)
        t0 = time.monotonic()
        probe = doctor.probe_http(f"http://127.0.0.1:{sink.getsockname()[1]}", timeout_s=0.5)
        elapsed = time.monotonic() - t0
    assert not probe.ok and elapsed < 1.5 and probe.seconds < 1.5
    assert "no answer within 0.5s" in probe.error or probe.error.endswith("Timeout")


def test_reachable_mlflow_is_ok_and_env_uri_wins(capsys, monkeypatch, http_server):
    rc, report, _ = _run_json(
        capsys, TINY, "tracking.backend=mlflow", f"tracking.uri={http_server}"
    )
    row = _row(report, "mlflow server")
    assert row["status"] == "ok" and "answered HTTP 200" in row["detail"]
    assert [p["ok"] for p in report["probes"]] == [True]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", http_server)
    _, report, _ = _run_json(capsys, TINY, "tracking.backend=none")  # optional, still probed
    row = _row(report, "mlflow server")
    assert row["status"] == "ok" and "MLFLOW_TRACKING_URI" in row["detail"]
    assert not _row(report, "mlflow")["needed"]


@pytest.mark.config_checks
def test_doctor_config_runs_the_validate_checks(capsys, monkeypatch):
    """``doctor CONFIG`` adds ``grpoflow validate``'s rows; a reward that raises on a gold
    answer makes the config not ready, named with its fix."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))  # the child imports reward_plugins
    rc, report, _ = _run_json(capsys, TINY, "reward.fn=reward_plugins:raising_reward")
    for name in ("pre-flight", "model", "data", "planes"):
        assert _row(report, f"config: {name}")["status"] in ("ok", "warn"), name
    reward = _row(report, "config: reward")
    assert rc == 1 and reward["status"] == "missing" and "gold answer" in reward["detail"]


def test_secrets_never_reach_the_output(capsys, monkeypatch):
    secrets = {
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-bPxRfiCYSECRET",
        "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLESESSIONTOKEN",
        "HF_TOKEN": "hf_NotARealTokenButSecretAnyway",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-pass-do-not-print",
        "MLFLOW_TRACKING_TOKEN": "mlflow-token-do-not-print",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    port = _closed_port()
    argv = [
        TINY,
        "storage.root=s3://grpoflow-bucket/runs",
        "model.path=Qwen/Qwen2.5-0.5B-Instruct",
        "tracking.backend=mlflow",
        f"tracking.uri=http://alice:pa55word-in-url@127.0.0.1:{port}/?token=qs-secret",
    ]
    rc_text = doctor.main(argv)
    text_out, text_err = capsys.readouterr()
    rc_json = doctor.main([*argv, "--json"])
    json_out, json_err = capsys.readouterr()
    assert rc_text == rc_json == 1  # nothing is reachable here
    for output in (text_out, text_err, json_out, json_err):
        for value in [*secrets.values(), "pa55word-in-url", "qs-secret", "AKIAIOSFODNN7"]:
            assert value not in output
    report = json.loads(json_out)
    creds = _row(report, "s3 credentials")
    assert creds["status"] == "ok" and "****MPLE" in creds["detail"]
    assert "AWS_SECRET_ACCESS_KEY set" in creds["detail"]
    assert "HF_TOKEN set" in _row(report, "model")["detail"]
    assert _row(report, "boto3")["needed"] and "storage.root" in _row(report, "boto3")["detail"]


def test_cluster_env_values_are_never_printed():
    info = detect_platform()
    cfg = SimpleNamespace(
        cluster=SimpleNamespace(env={"HF_TOKEN": "hf_value-in-cluster-env", "NCCL_DEBUG": None})
    )
    [row] = doctor.check_env_presets(cfg, info)
    assert row.status == "ok"
    assert "hf_value-in-cluster-env" not in row.detail
    assert "cluster.env sets HF_TOKEN" in row.detail
    assert "cluster.env removes NCCL_DEBUG" in row.detail


def test_half_set_credentials_and_bad_cluster_env_are_missing(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7EXAMPLE")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    cfg = doctor_cfg("storage.root=s3://bucket/runs")
    rows, _ = doctor.check_s3(cfg)
    creds = next(r for r in rows if r.name == "s3 credentials")
    assert creds.status == "missing" and creds.needed and "AWS_SECRET_ACCESS_KEY" in creds.fix

    bad = SimpleNamespace(cluster=SimpleNamespace(env={"NCCL_MIN_NCHANNELS": 64}))
    [row] = doctor.check_env_presets(bad, detect_platform())
    assert row.status == "missing" and "cluster.env.NCCL_MIN_NCHANNELS" in row.detail


def test_threads_disk_and_model_rows():
    info = detect_platform()
    [row] = doctor.check_threads(doctor_cfg(f"train.num_threads={info.cpu_count + 3}"), info)
    assert row.status == "warn" and row.fix == f"train.num_threads={info.cpu_count}"
    [row] = doctor.check_disk(doctor_cfg("storage.root=/nonexistent/deep/runs"))
    assert row.status in ("ok", "warn") and "GiB free" in row.detail
    rows, probes = doctor.check_model(doctor_cfg("model.path=/no/such/model"))
    assert rows[0].status == "missing" and "embedded:tiny" in rows[0].fix and probes == []


def test_a_config_that_does_not_load_exits_2(capsys):
    assert doctor.main(["configs/no-such-file.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_urls_are_redacted():
    assert (
        doctor.redact_url("https://u:p@host:5000/path?token=x#f")
        == "https://***@host:5000/path?..."
    )
    assert doctor.redact_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert doctor.mask("AKIAIOSFODNN7EXAMPLE") == "****MPLE"
    assert doctor.mask("short") == "****"


def doctor_cfg(*overrides: str):
    from rl_core.config import load_config

    return load_config(TINY, list(overrides))


def test_the_demo_and_the_tests_write_bytecode():
    """`make run` and `make test` let Python write bytecode (docs/testing.md): the installs do
    not compile it, and with PYTHONDONTWRITEBYTECODE (this machine's) a package without it is
    compiled from source by every process that imports it; torch alone once cost the suite
    minutes that way. What the suite imported has bytecode now."""
    import importlib.util
    import re

    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^WRITE_BYTECODE := PYTHONDONTWRITEBYTECODE=$", makefile, re.M)
    assert re.search(r"^PYTEST := .*\$\(WRITE_BYTECODE\)", makefile, re.M)
    assert "\t$(WRITE_BYTECODE) $(BIN)/grpoflow train $(CONFIG)" in makefile
    if sys.flags.dont_write_bytecode:
        pytest.skip("run outside make with PYTHONDONTWRITEBYTECODE set: nothing is written")
    for name in ("torch", "transformers", "prefect", "mlflow"):
        init = importlib.util.find_spec(name).origin
        cached = importlib.util.cache_from_source(init)
        assert Path(cached).is_file(), f"{name} has no bytecode ({cached})"
