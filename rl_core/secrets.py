"""One rule for what is secret, used wherever grpoflow writes something down.

The run directory's ``config.yaml``, MLflow params and tags, Prefect flow-run parameters, log
records, error messages and ``grpoflow doctor`` all mask the same things through these
functions: values *by name* (:func:`is_secret_name`; not LLM token counts such as
``max_new_tokens``), every ``cluster.env`` value but known-harmless settings
(:func:`is_harmless_env`), the value of a secret-named flag in an argument list, and *in every
string* URL user-info, key ids, tokens, signatures and secret-named environment values (the
full rule: docs/reliability.md, 'Security'). Never imports Prefect, MLflow or torch; never logs.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "RedactFilter", "is_harmless_env", "is_secret_name", "redact", "redact_config",
           "redact_env", "redact_url"]

MASK = "***"
_MIN_SECRET_LEN = 6  # a shorter environment value would mask ordinary words
_SECRET_PARTS = ("secret", "passw", "credential")
_SECRET_ENDS = ("token", "apikey", "accesskey", "privatekey")  # not "tokens": a count
_SECRET_WORDS = {"key", "auth", "authorization", "sig", "signature", "pat", "cookie"}  # not PWD
# ``stop_token_ids``, ``pad_token_id``, ``token_budget``: LLM tokens, not credentials
_TOKEN_IDS = ("id", "ids", "count", "budget", "limit", "len", "length", "per")
# Environment settings that never hold a credential (a secret-looking name still wins).
_HARMLESS_ENV = re.compile(
    r"(?x)^(?:OMP_|MKL_|OPENBLAS_|NUMEXPR_|NCCL_|RCCL_|GLOO_|RAY_|HIP_|HSA_|ROCM_|ROCR_|CUDA_|"
    r"NVIDIA_|TORCH_|PYTORCH_|TORCHINDUCTOR_|TRITON_|SGLANG_|VLLM_|MIOPEN_|AMD_|GPU_|"
    r"TOKENIZERS_PARALLELISM$|TRANSFORMERS_(?:VERBOSITY|OFFLINE)$|HF_HUB_(?:OFFLINE|"
    r"DISABLE_\w+|ENABLE_HF_TRANSFER)$|HF_HOME$|PYTHON(?:UNBUFFERED|HASHSEED|PATH)$|"
    r"MASTER_PORT$|WORLD_SIZE$|LOCAL_RANK$|RANK$|LOG_?LEVEL$|LANG$|LC_\w+$|TZ$)"
)
_ACCESS_KEY = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AIDA|AROA|ABIA|ACCA)[A-Z0-9]{16}(?![A-Z0-9])")
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s]+@")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_SIGNED = re.compile(
    r"(?i)(?P<name>X-Amz-(?:Signature|Security-Token|Credential)|Signature|AWSAccessKeyId)"
    r"=[^&\s\"']+"
)
_BEARER = re.compile(r"(?i)\b(?P<name>Bearer)\s+[\w\-.~+/]+=*")
# ``name=value`` / ``name: value``: a cheap pre-filter on the name, then :func:`is_secret_name`
_ASSIGNED = re.compile(
    r"(?i)(?P<name>\b[\w\-]*(?:token|secret|passw|credential|key|auth|sig|cookie|pat)[\w\-]*)"
    r"(?P<sep>\s*[=:]\s*)['\"]?[^\s&#,;'\"]+['\"]?"
)


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def is_secret_name(name: str) -> bool:
    """Whether a config key, flag or variable name says its value is a credential."""
    words = _words(name)
    for before, w, after in zip(["", *words], words, [*words[1:], ""], strict=False):
        if w in _SECRET_WORDS or any(p in w for p in _SECRET_PARTS):
            return True
        if w.endswith(_SECRET_ENDS) and not (w.endswith("token") and (
                after in _TOKEN_IDS or before == "per")):  # experts_per_token: a count
            return True
    return False


def is_harmless_env(name: str) -> bool:
    """Whether an environment variable is a known-harmless setting (shown in clear)."""
    return bool(_HARMLESS_ENV.match(name)) and not is_secret_name(name)


def _env_secrets() -> list[str]:
    """Values of this process's secret-named variables, longest first."""
    values = {v for k, v in os.environ.items() if len(v) >= _MIN_SECRET_LEN and is_secret_name(k)}
    return sorted(values, key=len, reverse=True)


def redact(text: object) -> str:
    """``text`` with credentials masked (the text rules of the module docstring)."""
    out = str(text)
    if not out:
        return out
    for value in _env_secrets():
        out = out.replace(value, MASK)
    out = _ACCESS_KEY.sub(lambda m: m.group(0)[:4] + "****", out)
    out = _USERINFO.sub(rf"\g<scheme>{MASK}@", out)
    out = _HF_TOKEN.sub(MASK, out)
    out = _SIGNED.sub(rf"\g<name>={MASK}", out)
    out = _BEARER.sub(rf"\g<name> {MASK}", out)
    return _ASSIGNED.sub(
        lambda m: m["name"] + m["sep"] + MASK if is_secret_name(m["name"]) else m[0], out
    )


def redact_url(url: str) -> str:
    """``url`` for a report: no user-info, no query (signatures live there), no fragment."""
    url = redact(url)
    head, sep, _ = url.partition("?")
    return head.split("#", 1)[0] + ("?..." if sep else "")


def redact_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """Environment settings with every value masked but the harmless ones' (which still go
    through the text rules: ``RAY_ADDRESS=ray://user:pw@host``)."""
    return {k: MASK if v is not None and not is_harmless_env(str(k)) else
            redact(v) if isinstance(v, str) else v for k, v in env.items()}


def _redact_args(args: list[Any]) -> list[Any]:
    out: list[Any] = []
    for i, a in enumerate(args):
        prev = str(args[i - 1]) if i else ""
        flag, eq, _ = a.partition("=") if isinstance(a, str) else ("", "", "")
        if flag.startswith("-") and eq and is_secret_name(flag):  # --api-key=X
            out.append(f"{flag}={MASK}")
        elif prev.startswith("-") and "=" not in prev and is_secret_name(prev):  # --api-key X
            out.append(MASK)
        else:
            out.append(_redact(a, ""))
    return out


def _redact(value: Any, key: str) -> Any:
    if value is None or (isinstance(value, str | Mapping | list | tuple) and not value):
        return value
    if is_secret_name(key):  # the whole value, whatever its shape
        return MASK
    if isinstance(value, Mapping) and key == "env":  # cluster.env, any environment mapping
        return redact_env(value)
    if isinstance(value, Mapping):
        return {k: _redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return _redact_args(list(value))
    return redact(value) if isinstance(value, str) else value


def redact_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config (or a flat one with dotted keys) with every secret masked."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        parts = str(key).split(".")
        if len(parts) > 1 and parts[-2] == "env":  # a flattened cluster.env.NAME
            out[key] = redact_env({parts[-1]: value})[parts[-1]]
        else:
            out[key] = _redact(value, parts[-1])
    return out


class RedactFilter(logging.Filter):
    """Passes every record's message (and traceback) through :func:`redact`; attach it to a
    handler to cover every logger that reaches the handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the caller's bug; keep it
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True
