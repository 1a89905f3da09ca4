"""The one rule for what is secret (rl_core/secrets.py), and the places that write things down
applying it: the run directory's ``config.yaml``, the MLflow params of a run (a real MLflow
store: SQLite, as the embedded default), and Prefect flow-run parameters.

The rule: names (secret-looking keys vs counts of LLM tokens), environment values masked
unless on the harmless allow-list, argument lists (``--api-key X``, ``--api-key=X``), and the
text rules (URL user-info, AWS key ids, HF tokens, presigned signatures, ``Bearer`` tokens,
``name=value`` with a secret name, values of secret-named environment variables).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import yaml

from flows._redacted import redact_parameters
from rl_core.config import load_config
from rl_core.rundir import RunDir
from rl_core.secrets import (
    MASK,
    RedactFilter,
    is_harmless_env,
    is_secret_name,
    redact,
    redact_config,
    redact_env,
    redact_url,
)

CREDS = "s3cr3t-value-123"  # under a name without secret/token/key in it


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_TOKEN", "token", "oauth_token",
    "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "WANDB_API_KEY", "apikey", "api-key",
    "--api-key", "private_key", "key", "MLFLOW_TRACKING_PASSWORD", "db_passwd",
    "GOOGLE_APPLICATION_CREDENTIALS", "client_secret", "auth", "Authorization", "sig",
    "X-Amz-Signature", "session_cookie", "github.pat",
])  # fmt: skip
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "max_new_tokens", "TOKENIZERS_PARALLELISM", "tokenizer", "stop_token_ids", "pad_token_id",
    "token_budget", "num_tokens", "response_tokens", "PWD", "author", "keyboard", "path",
    "monkey", "signal", "id_field", "MY_SERVICE_CREDS", "OMP_NUM_THREADS", "",
    "tiny_experts_per_token",
])  # fmt: skip
def test_names_that_are_not_secret(name: str) -> None:
    assert not is_secret_name(name)


def test_the_default_config_has_no_secret_named_field() -> None:
    """A field of the config whose name looks secret would be masked in every record."""
    data = load_config(None, []).model_dump(mode="json")
    assert redact_config(data) == data


# ---------------------------------------------------------------------------- environment


def test_env_values_are_masked_unless_on_the_harmless_list() -> None:
    for name in ("OMP_NUM_THREADS", "NCCL_DEBUG", "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES",
                 "HF_HUB_OFFLINE", "PYTHONUNBUFFERED", "RAY_DEDUP_LOGS"):  # fmt: skip
        assert is_harmless_env(name), name
    for name in ("MY_SERVICE_CREDS", "DATABASE_URL", "HF_TOKEN", "NCCL_SECRET", "RAY_AUTH_TOKEN",
                 "SOMETHING"):  # fmt: skip
        assert not is_harmless_env(name), name
    env = {"MY_SERVICE_CREDS": CREDS, "DATABASE_URL": "postgres://db/x", "OMP_NUM_THREADS": "2",
           "RAY_ADDRESS": "ray://u:pw-123456@head:10001", "UNSET": None}  # fmt: skip
    assert redact_env(env) == {"MY_SERVICE_CREDS": MASK, "DATABASE_URL": MASK,
                               "OMP_NUM_THREADS": "2", "RAY_ADDRESS": "ray://***@head:10001",
                               "UNSET": None}  # fmt: skip


# ---------------------------------------------------------------------------- configs


def test_redact_config_nested_and_flat() -> None:
    nested = {
        "cluster": {"env": {"AWS_SECRET_ACCESS_KEY": "x/y+z", "OMP_NUM_THREADS": "2",
                            "MY_SERVICE_CREDS": CREDS}},
        "rollout": {"max_new_tokens": 32, "stop_token_ids": [151645],
                    "sglang_extra_args": ["--api-key", "sk-1", "--api-key=sk-2", "--tp", "2"]},
        "tracking": {"uri": "http://bob:pw-654321@mlflow:5000", "token": "t0k3n-abc", "alias": ""},
        "data": {"id_field": "id", "credentials": {"user": "u", "pass": "p"}},
        "storage": {"root": "runs", "s3_endpoint_url": None},
    }  # fmt: skip
    assert redact_config(nested) == {
        "cluster": {"env": {"AWS_SECRET_ACCESS_KEY": MASK, "OMP_NUM_THREADS": "2",
                            "MY_SERVICE_CREDS": MASK}},
        "rollout": {"max_new_tokens": 32, "stop_token_ids": [151645],
                    "sglang_extra_args": ["--api-key", MASK, f"--api-key={MASK}", "--tp", "2"]},
        "tracking": {"uri": "http://***@mlflow:5000", "token": MASK, "alias": ""},
        "data": {"id_field": "id", "credentials": MASK},
        "storage": {"root": "runs", "s3_endpoint_url": None},
    }  # fmt: skip
    flat = {"cluster.env.MY_SERVICE_CREDS": CREDS, "cluster.env.OMP_NUM_THREADS": "1",
            "cluster.env": "{}", "rollout.max_new_tokens": 32,
            "rollout.sglang_extra_args": ["--api-key", "sk-1"]}  # fmt: skip
    assert redact_config(flat) == {**flat, "cluster.env.MY_SERVICE_CREDS": MASK,
                                   "rollout.sglang_extra_args": ["--api-key", MASK]}  # fmt: skip


# ---------------------------------------------------------------------------- text


def test_text_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-0123456789")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t/VALUE+from-env")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to mask everywhere it appears
    monkeypatch.setenv("PWD", "/home/someone/project")  # the shell's cwd is not a secret
    r = redact
    assert r("s3://user:pa55@bucket/x") == "s3://***@bucket/x"
    assert r("http://minio:hunter22@store:9000/b") == "http://***@store:9000/b"
    assert r("id AKIAIOSFODNN7EXAMPLE here") == "id AKIA**** here"
    assert r("token hf_abcdefghijklmnopqrstuvwx end") == "token *** end"
    assert r("https://b.s3/k?X-Amz-Credential=AK%2F1&X-Amz-Signature=deadbeef&x=1") == (
        "https://b.s3/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1")
    assert r("https://h/x.jsonl?token=abc&n=1") == "https://h/x.jsonl?token=***&n=1"
    assert r("aws_secret_access_key = literal123, password: 'hunter2'") == (
        "aws_secret_access_key = ***, password: ***")
    assert r("Authorization: Bearer eyJhbGciOi.x-y_z") == "Authorization: *** ***"
    assert r("uses tok-0123456789 and s3cr3t/VALUE+from-env") == "uses *** and ***"
    for plain in ("max_new_tokens=32, plain text", "stop_token_ids: [2]", "author: me",
                  "abc", "sqlite:////home/someone/project/mlflow.db", ""):  # fmt: skip
        assert r(plain) == plain
    assert r(123) == "123"
    assert redact_url("https://u:p@host/a?X-Amz-Signature=x#frag") == "https://***@host/a?..."


def test_redact_filter_covers_messages_args_and_tracebacks(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwx")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactFilter())
    log = logging.getLogger("test_secrets.filter")
    log.addHandler(handler)
    try:
        log.warning("fetching %s with %s", "s3://u:pw-123456@b/k", "hf_abcdefghijklmnopqrstuvwx")
        try:
            raise RuntimeError("failed for http://x:pw-123456@h/")
        except RuntimeError:
            log.exception("boom")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "pw-123456" not in text and "hf_abcdefghijklmnopqrstuvwx" not in text
    assert "s3://***@b/k with ***" in text and "RuntimeError: failed for http://***@h/" in text


# ---------------------------------------------------- where the rule applies (the regressions)


def _creds_config(tmp: Path, *extra: str):
    return load_config(None, [
        f"storage.root={tmp}", "run_name=creds",
        f"cluster.env={{MY_SERVICE_CREDS: {CREDS}, OMP_NUM_THREADS: '1'}}",
        "rollout.sglang_extra_args=[--api-key, sk-arg-778899]", *extra,
    ])  # fmt: skip


def test_the_run_directory_config_masks_env_values(tmp_path: Path) -> None:
    """The run directory's config.yaml used a rule of its own that wrote env values whose
    name says nothing about secrets in clear."""
    run = RunDir(_creds_config(tmp_path))
    text = (run.path / "config.yaml").read_text()
    assert CREDS not in text and "sk-arg-778899" not in text
    saved = yaml.safe_load(text)
    assert saved["cluster"]["env"] == {"MY_SERVICE_CREDS": MASK, "OMP_NUM_THREADS": "1"}
    assert saved["rollout"]["sglang_extra_args"] == ["--api-key", MASK]


def test_prefect_parameters_mask_env_values() -> None:
    stored = redact_parameters({"overrides": [
        f"cluster.env.MY_SERVICE_CREDS={CREDS}", "cluster.env.OMP_NUM_THREADS=2",
        f"cluster.env={{MY_SERVICE_CREDS: {CREDS}}}", "rollout.sglang_extra_args=[--api-key, k9]",
        "train.steps=2",
    ]})  # fmt: skip
    assert stored["overrides"] == [
        "cluster.env.MY_SERVICE_CREDS=***", "cluster.env.OMP_NUM_THREADS=2",
        'cluster.env={"MY_SERVICE_CREDS": "***"}', 'rollout.sglang_extra_args=["--api-key", "***"]',
        "train.steps=2",
    ]  # fmt: skip


def test_mlflow_params_mask_env_values(prefect_harness, tmp_path: Path, monkeypatch) -> None:
    """A real MLflow store (SQLite in storage.root): the flattened config's
    ``cluster.env.MY_SERVICE_CREDS`` used to be logged as a param in clear."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from tasks import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    cfg = _creds_config(tmp_path, "tracking.backend=mlflow", "tracking.system_metrics=false")
    run_dir = tmp_path / "creds"
    handle = tracking.start_tracking(cfg, str(run_dir))
    tracking.finish_tracking(handle)
    params = MlflowClient(handle.tracking_uri).get_run(handle.run_id).data.params
    assert params["cluster.env.MY_SERVICE_CREDS"] == MASK
    assert params["cluster.env.OMP_NUM_THREADS"] == "1"
    assert params["rollout.sglang_extra_args"] == '["--api-key", "***"]'
    files = [p for p in tmp_path.rglob("*") if p.is_file()]  # the project's store is there
    assert any(p.name == "mlflow.db" for p in files) and any(p.name == "config.yaml" for p in files)
    for p in files:  # the store, the config artifact, the run directory's config.yaml
        assert CREDS.encode() not in p.read_bytes(), p
        assert b"sk-arg-778899" not in p.read_bytes(), p

