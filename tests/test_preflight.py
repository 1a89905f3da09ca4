"""Pre-flight (``rl_core/preflight.py``) and the CLI's one-paragraph errors.

What this file is for: one test per pre-flight check, each feeding a config that cannot work
and reading the answer (the field, the value, the limit, the fix), and the command line as a
user runs it (``python -m grpoflow.cli`` in a subprocess): a bad config is refused before any
flow starts, in seconds, as ``grpoflow: <paragraph>`` with no traceback and no Prefect
lines; a failure inside a task ends the same way, and ``--debug`` shows the traceback.

What it must never do: download anything or build the demo model (model directories are the
64-token test model, written by ``engine_helpers.save_tiny_model``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import save_tiny_model

from rl_core.config import ConfigError, load_config
from rl_core.models.hub import MANIFEST, ModelError, local_model_dir, tiny_spec_for
from rl_core.preflight import context_length, preflight

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def _cfg(tmp: Path, *overrides: str, prompt_tokens: int = 128):
    """The demo config in ``tmp``; prompts fit the test model's 256-token context."""
    return load_config(TINY, [f"storage.root={tmp / 'runs'}", f"storage.cache_dir={tmp / 'cache'}",
                              f"data.max_prompt_tokens={prompt_tokens}", *overrides])  # fmt: skip


def _refused(tmp: Path, *overrides: str, model_path: Path | None = None, **checks: bool) -> str:
    with pytest.raises(ConfigError) as info:
        preflight(_cfg(tmp, *overrides), model_path=model_path, **checks)
    message = str(info.value)
    assert "\n" not in message, message  # one paragraph
    return message


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The 64-token test model: max_position_embeddings 256, no chat template."""
    return save_tiny_model(tmp_path_factory.mktemp("preflight") / "model")


def _copy(model_dir: Path, tmp: Path, name: str = "m") -> Path:
    return Path(shutil.copytree(model_dir, tmp / name))


def _cli(*argv: str, env: dict[str, str] | None = None,
         timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "grpoflow.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    return done, time.monotonic() - t0


def _no_prefect_noise(text: str) -> None:
    for noise in ("Traceback", "Flow run", "Task run", "| ERROR"):
        assert noise not in text, text


# ============================================================ the CLI: refused before a flow


def test_a_bad_value_is_one_paragraph_without_a_traceback(tmp_path: Path) -> None:
    done, _ = _cli("train", str(TINY), f"storage.root={tmp_path}", "algorithm.kl_coef=banana")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("grpoflow: invalid config ("), done.stderr
    assert "algorithm.kl_coef: Input should be a valid number" in done.stderr
    assert "(got 'banana')" in done.stderr
    _no_prefect_noise(done.stdout + done.stderr)
    assert not any(tmp_path.iterdir())  # no run directory: nothing started


def test_prompts_beyond_the_context_are_refused_before_any_task_in_seconds(
    tmp_path: Path,
) -> None:
    """The demo model is not built here: its spec's context (512) is checked."""
    done, seconds = _cli("train", str(TINY), f"storage.root={tmp_path / 'runs'}",
                         f"storage.cache_dir={tmp_path / 'cache'}", "data.max_prompt_tokens=100000")
    assert done.returncode == 2, done.stderr
    message = done.stderr
    for fragment in ("grpoflow: data.max_prompt_tokens=100000", "rollout.max_new_tokens=32",
                     "= 100032 tokens", "the embedded tiny model (512 tokens",
                     "at most 512", "lower data.max_prompt_tokens"):  # fmt: skip
        assert fragment in message, (fragment, message)
    _no_prefect_noise(done.stdout + message)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
    assert seconds < 30, seconds  # python, torch and transformers start; nothing else


def test_a_failure_inside_a_task_is_one_paragraph_and_debug_shows_the_traceback(
    prefect_harness, tmp_path: Path
) -> None:
    """Pre-flight passes (the file exists); the prepare-data task then refuses its rows."""
    import prefect.settings

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "question": "1 + 1?", "answer": "two"}) + "\n")
    env = dict(os.environ, PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value() or "")
    argv = ["prepare-data", str(TINY), f"data.source={bad}", f"storage.cache_dir={tmp_path}"]
    done, _ = _cli(*argv, env=env)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"grpoflow: prepare-data failed: {bad}: "), done.stderr
    assert "line 1: field 'answer' has no parsable final number" in done.stderr
    assert "(DataValidationError; run it again with --debug for the traceback)" in done.stderr
    _no_prefect_noise(done.stdout + done.stderr)

    debug, _ = _cli(*argv, "--debug", env=env)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "Task run" in debug.stderr  # Prefect's own lines
    assert debug.stderr.rstrip().splitlines()[-2].startswith("grpoflow: prepare-data failed:")


# ============================================================ the model's context


def test_sequences_longer_than_the_context_name_both_fields_the_model_and_the_fix(
    tmp_path: Path, model_dir: Path
) -> None:
    message = _refused(tmp_path, "data.max_prompt_tokens=240", "rollout.max_new_tokens=32",
                       model_path=model_dir)  # fmt: skip
    for fragment in ("data.max_prompt_tokens=240", "rollout.max_new_tokens=32", "= 272 tokens",
                     f"the model at {model_dir} (256 tokens, max_position_embeddings in its "
                     "config.json)", "at most 256", "lower data.max_prompt_tokens"):  # fmt: skip
        assert fragment in message, (fragment, message)
    # exactly the window fits; eval.max_new_tokens is checked when set
    preflight(_cfg(tmp_path, "data.max_prompt_tokens=224"), model_path=model_dir)
    message = _refused(tmp_path, "data.max_prompt_tokens=224", "eval.max_new_tokens=64",
                       model_path=model_dir)  # fmt: skip
    assert "eval.max_new_tokens=64 = 288 tokens" in message


def _config_only(directory: Path, **config: object) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    return directory


def test_context_length_follows_rope_scaling_and_may_be_unknown(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    limit, source = context_length(_config_only(tmp_path / "yarn", max_position_embeddings=256,
                                                rope_scaling=yarn))  # fmt: skip
    assert limit == 1024 and "256 x yarn rope_scaling factor 4" in source
    linear = {"type": "linear", "factor": 2}
    assert context_length(_config_only(tmp_path / "linear", max_position_embeddings=128,
                                       rope_scaling=linear))[0] == 256  # fmt: skip
    nested = _config_only(tmp_path / "vl", text_config={"max_position_embeddings": 128})
    assert context_length(nested)[0] == 128
    assert context_length(_config_only(tmp_path / "none")) is None  # no limit named


def test_the_demo_config_fits_the_demo_model(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, prompt_tokens=load_config(TINY).data.max_prompt_tokens)
    assert tiny_spec_for(cfg.model, cfg.data).max_position_embeddings == 512
    preflight(cfg)  # not built: checked against its spec, nothing is built
    assert not (tmp_path / "cache").exists()


# ============================================================ the model directory


def test_a_chat_template_required_but_missing_is_refused(tmp_path: Path, model_dir: Path) -> None:
    message = _refused(tmp_path, "data.use_chat_template=true", model_path=model_dir)
    assert "data.use_chat_template is true but the tokenizer" in message
    assert str(model_dir) in message and "data.plain_template" in message
    preflight(_cfg(tmp_path), model_path=model_dir)  # null (auto): the plain template


def test_a_chat_template_that_does_not_render_is_refused(tmp_path: Path, model_dir: Path) -> None:
    broken = _copy(model_dir, tmp_path)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    message = _refused(tmp_path, f"model.path={broken}")
    assert f"the chat template of the tokenizer at {broken} does not render" in message
    assert "data.use_chat_template=false" in message
    preflight(_cfg(tmp_path, f"model.path={broken}", "data.use_chat_template=false"))


def test_a_template_that_leaves_no_room_for_the_question_is_refused(
    tmp_path: Path, model_dir: Path
) -> None:
    """``data.plain_template`` is what the run renders without a chat template."""
    template = "data.plain_template=Solve the following problem carefully: {question}\\nAnswer:"
    message = _refused(tmp_path, template, "data.max_prompt_tokens=20", model_path=model_dir)
    assert "data.plain_template='Solve the following problem carefully: {question}" in message
    assert "before any question, and data.max_prompt_tokens=20" in message
    assert "raise data.max_prompt_tokens" in message
    preflight(_cfg(tmp_path, template, "data.max_prompt_tokens=128"), model_path=model_dir)


def test_tokenizer_ids_the_model_cannot_embed_are_refused(tmp_path: Path, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    grown = _copy(model_dir, tmp_path)
    tok = AutoTokenizer.from_pretrained(grown)
    tok.add_tokens(["<tool>", "<think>"])  # without resizing the model's 64 embeddings
    tok.save_pretrained(grown)
    with pytest.raises(ModelError) as info:
        preflight(_cfg(tmp_path, f"model.path={grown}"))
    message = str(info.value)
    for fragment in ("2 token(s) whose ids the model cannot embed", "'<tool>' (id 64)",
                     "'<think>' (id 65)", "vocabulary has 64 ids (vocab_size in config.json)",
                     "resize_token_embeddings"):  # fmt: skip
        assert fragment in message, (fragment, message)


def test_model_code_is_refused_without_trust_remote_code(tmp_path: Path, model_dir: Path) -> None:
    coded = _copy(model_dir, tmp_path)
    config = json.loads((coded / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (coded / "config.json").write_text(json.dumps(config))
    message = _refused(tmp_path, f"model.path={coded}")
    assert "auto_map" in message and "model.trust_remote_code=true" in message


def test_a_missing_local_model_path_is_refused_and_a_hub_id_waits_for_fetch(
    tmp_path: Path,
) -> None:
    message = _refused(tmp_path, f"model.path={tmp_path / 'no-such-model'}")
    assert "neither an existing directory nor a hub id" in message
    preflight(_cfg(tmp_path, "model.path=org/not-fetched-yet", "data.max_prompt_tokens=100000"))


def test_cached_snapshots_are_checked_without_the_network(tmp_path: Path, model_dir: Path) -> None:
    """A hub id with a cached snapshot of its revision, and a built tiny model, are read in
    place: their config.json decides the context, before any fetch."""
    sha = "a" * 40
    repo = tmp_path / "cache" / "models" / "hf" / "org--name"
    snapshot = _copy(model_dir, repo / "snapshots", sha)
    (snapshot / MANIFEST).write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(json.dumps({"sha": sha}))
    hub = _cfg(tmp_path, "model.path=org/name", "model.revision=v1")
    assert local_model_dir(hub.model, hub.data, hub.storage.cache_dir) == snapshot
    message = _refused(tmp_path, "model.path=org/name", "model.revision=v1",
                       "data.max_prompt_tokens=250")  # fmt: skip
    assert f"the model at {snapshot} (256 tokens" in message
    other = _cfg(tmp_path, "model.path=org/name", "model.revision=v2")  # not cached: None
    assert local_model_dir(other.model, other.data, other.storage.cache_dir) is None

    cfg = _cfg(tmp_path)
    built = tmp_path / "cache" / "models" / f"tiny-{tiny_spec_for(cfg.model, cfg.data).digest()}"
    _copy(model_dir, built.parent, built.name)
    (built / "grpoflow_tiny.json").write_text("{}")
    assert local_model_dir(cfg.model, cfg.data, cfg.storage.cache_dir) == built
    assert "the model at" in _refused(tmp_path, "data.max_prompt_tokens=250")


# ============================================================ data, storage, engines


def test_missing_or_unreadable_local_data_is_refused(tmp_path: Path) -> None:
    message = _refused(tmp_path, "data.source=./no/such/train.jsonl", model=False)
    assert "data.source='./no/such/train.jsonl': no such file or directory" in message
    assert "a .jsonl or .parquet file" in message
    good = tmp_path / "train.jsonl"
    good.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    message = _refused(tmp_path, f"data.source={good}", f"data.eval_source={tmp_path / 'x.jsonl'}",
                       model=False)  # fmt: skip
    assert message.startswith(f"data.eval_source='{tmp_path / 'x.jsonl'}'")
    (tmp_path / "empty").mkdir()
    assert "is empty" in _refused(tmp_path, f"data.source={tmp_path / 'empty'}", model=False)
    os.mkfifo(tmp_path / "pipe.jsonl")  # opening it would block: refused, never opened
    message = _refused(tmp_path, f"data.source={tmp_path / 'pipe.jsonl'}", model=False)
    assert "is not a regular file or a directory" in message
    assert "no such file" in _refused(tmp_path, f"data.source=file://{tmp_path}/gone.jsonl",
                                      model=False)  # fmt: skip
    if os.geteuid() != 0:  # root reads everything
        good.chmod(0)
        assert "cannot be read" in _refused(tmp_path, f"data.source={good}", model=False)
        good.chmod(0o644)
    # hub dataset names and s3:// are prepare-data's to reach (bounded); a file is fine
    for source in (str(good), "openai/gsm8k", "s3://bucket/train.jsonl", "synthetic"):
        preflight(_cfg(tmp_path, f"data.source={source}"), model=False)


def test_an_unwritable_storage_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    message = _refused(tmp_path, f"storage.root={tmp_path / 'a-file' / 'runs'}", model=False)
    assert f"storage.root='{tmp_path / 'a-file' / 'runs'}': {tmp_path / 'a-file'} is not a " \
        "directory" in message  # fmt: skip
    message = _refused(tmp_path, f"checkpoint.uri={tmp_path / 'a-file'}", model=False)
    assert message.startswith("checkpoint.uri=")


def test_engine_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    message = _refused(tmp_path, "model.trust_remote_code=true", "rollout.engine=embedded",
                       model=False)
    assert "rollout.engine=embedded" in message and "rollout.engine=local" in message
    message = _refused(tmp_path, "rollout.engine=sglang",
                       "rollout.sglang_extra_args=['--port', '31000']", model=False)  # fmt: skip
    assert "rollout.sglang_extra_args has --port" in message
    assert "grpoflow gives each engine its own" in message
    message = _refused(tmp_path, "rollout.engine=sglang",
                       "rollout.sglang_extra_args=['--tp-size=2']", model=False)  # fmt: skip
    assert "set it with rollout.sglang_tp" in message
    preflight(_cfg(tmp_path, "rollout.engine=sglang",
                   "rollout.sglang_extra_args=['--chunked-prefill-size', '4096']"), model=False)
