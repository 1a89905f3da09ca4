"""Bad input, refused clearly: configs, model directories and data files a user gets wrong.

What this file is for: the "bad input" part of the reliability suite (docs/reliability.md).
Each case feeds grpoflow one realistic mistake — through the same entry points a run uses
(`load_config`, `download_model` / `verify_model_dir`, `load_records`, the prompt-length
filter) — and checks the answer: an error of our own type whose message names the field,
file or row and says how to fix it, or a counted skip where skipping is right. Never a
traceback from inside pydantic, pyarrow, json or transformers.

What it must never do: download anything, start an engine or a flow, or take long (well
under 10 s; the model directories are the 64-token test model).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from engine_helpers import char_tokenizer, save_tiny_model

from rl_core.config import ConfigError, load_config
from rl_core.data.records import DataValidationError, Record, numeric_answer
from rl_core.data.sources import load_records, read_parquet
from rl_core.models.hub import ModelError, download_model, verify_model_dir

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"
PYDANTIC_NOISE = ("errors.pydantic.dev", "Traceback", "Value error,", "validation error for")


def _config_error(overrides: list[str], path: Path = TINY) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert not any(noise in message for noise in PYDANTIC_NOISE), message
    return message


# ============================================================================= configs

CONFIG_CASES = [
    # unknown keys: the path and the keys that exist
    (["rollout.n_sample=4"], "rollout.n_sample: unknown key; allowed keys:"),
    (["reward.timeout=3"], "reward.timeout: unknown key; allowed keys: args, extra, fn"),
    # wrong types
    (["train.steps=[1]"], "train.steps: Input should be a valid integer (got [1])"),
    (["rollout.stop=5"], "rollout.stop: Input should be a valid list (got 5)"),
    (["rollout=5"], "rollout: Input should be a valid dictionary"),
    (["train.steps=1.5"], "train.steps: Input should be a valid integer"),
    # out of range
    (["train.lr=-0.1"], "train.lr: Input should be greater than 0 (got -0.1)"),
    (["train.lr=.inf"], "train.lr: Input should be a finite number"),
    (["reward.timeout_s=.inf"], "reward.timeout_s: Input should be a finite number"),
    (["rollout.timeout_s=.nan"], "rollout.timeout_s: Input should be a finite number"),
    (
        ["reward.memory_limit_mb=1"],
        "reward.memory_limit_mb: Input should be greater than or equal to 64",
    ),
    (
        ["reward.max_failed_steps=-1"],
        "reward.max_failed_steps: Input should be greater than or equal to 0",
    ),
    (["algorithm.clip_low=0.3", "algorithm.clip_high=0.2"], "must not exceed algorithm.clip_high"),
    (["rollout.n_samples=1"], "rollout.n_samples must be >= 2 for GRPO"),
    (
        ["data.max_bad_fraction=1.5"],
        "data.max_bad_fraction: Input should be less than or equal to 1",
    ),
    # contradictory settings
    (["rollout.weight_sync=object_store"], "cluster.mode='local' runs no Ray"),
    (["data.answer_field=question"], "question_field and answer_field are both 'question'"),
    (["data.id_field=answer"], "id_field 'answer' is also the question or answer column"),
    (
        [
            "cluster.mode=ray",
            "rollout.weight_sync=distributed",
            "cluster.gpus_per_trainer=1",
            "cluster.gpus_per_engine=1",
        ],
        "Duplicate GPU detected",
    ),  # fmt: skip
    # missing or malformed names
    (["model.path="], "model.path: Input should be a valid string (got None)"),
    (["model.path=''"], "model.path: String should have at least 1 character"),
    (["data.source=' '"], "source is blank"),
    (["data.question_field=''"], "data.question_field: String should have at least 1"),
    (["reward.fn=my_rewards.score"], "reward.fn: 'my_rewards.score' is neither a builtin"),
    (["reward.fn=a:b:c"], "'package.module:function'"),
]


@pytest.mark.parametrize(
    ("overrides", "fragment"), CONFIG_CASES, ids=[" ".join(c[0]) for c in CONFIG_CASES]
)
def test_bad_configs_name_the_field_and_the_fix(overrides: list[str], fragment: str) -> None:
    assert fragment in _config_error(overrides)


def test_bad_yaml_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("reward:\n  fn: gsm8k\n  max_failed_step: 2\ntrain:\n  lr: -1\n")
    message = _config_error([], bad)
    assert str(bad) in message  # which file
    assert "reward.max_failed_step: unknown key" in message  # every problem at once
    assert "train.lr:" in message
    (tmp_path / "tabs.yaml").write_text("train:\n\tlr: 1\n")
    assert "not valid YAML" in _config_error([], tmp_path / "tabs.yaml")
    assert "does not exist" in _config_error([], tmp_path / "missing.yaml")


def test_the_reward_section_round_trips_its_new_fields() -> None:
    cfg = load_config(TINY, ["reward.fn=pkg.mod:Scorer.score", "reward.memory_limit_mb=null",
                             "reward.max_failed_steps=0"])  # fmt: skip
    assert (cfg.reward.fn, cfg.reward.memory_limit_mb, cfg.reward.max_failed_steps) == (
        "pkg.mod:Scorer.score",
        None,
        0,
    )


# ====================================================================== model directories


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "ok")


def _variant(model_dir: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(model_dir, out)
    return out


def test_a_good_model_directory_passes(model_dir: Path) -> None:
    assert verify_model_dir(model_dir) == model_dir


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelError, match="neither an existing directory nor a hub id"):
        download_model(str(missing), tmp_path / "cache")
    with pytest.raises(ModelError, match=f"model directory {missing} does not exist"):
        verify_model_dir(missing)


def test_model_directory_without_a_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    bare = _variant(model_dir, tmp_path, "no-tokenizer")
    (bare / "tokenizer.json").unlink()
    (bare / "tokenizer_config.json").unlink()
    with pytest.raises(ModelError, match="has no tokenizer .*copy the tokenizer files"):
        verify_model_dir(bare)


def test_model_directory_without_config_or_weights(model_dir: Path, tmp_path: Path) -> None:
    no_config = _variant(model_dir, tmp_path, "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelError, match="has no config.json"):
        verify_model_dir(no_config)
    truncated = _variant(model_dir, tmp_path, "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelError, match="does not load as safetensors"):
        verify_model_dir(truncated)


def _save_tokenizer(directory: Path, **special: str) -> None:
    from transformers import PreTrainedTokenizerFast

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink()
    backend = char_tokenizer().backend_tokenizer
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special).save_pretrained(
        directory
    )


@pytest.mark.parametrize("missing", ["eos_token", "pad_token"])
def test_tokenizer_without_eos_or_pad_is_refused(
    model_dir: Path, tmp_path: Path, missing: str
) -> None:
    special = {"eos_token": "<eos>", "pad_token": "<pad>"}
    del special[missing]
    broken = _variant(model_dir, tmp_path, f"no-{missing}")
    _save_tokenizer(broken, **special)
    with pytest.raises(ModelError, match=missing):
        verify_model_dir(broken)


# ================================================================================= data

GOOD = [
    {"id": "g1", "question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
    {"id": "g2", "question": "What is 2 + 3?", "answer": "#### 5"},
    {"id": "g3", "question": "What is 7 - 4?", "answer": "3"},
]
BAD = [  # (row, the reason a user is shown)
    ({"id": "b1", "answer": "#### 1"}, "missing field 'question' (row has: answer, id)"),
    ({"id": "b2", "question": "   ", "answer": "#### 1"}, "field 'question' is empty"),
    (
        {"id": "b3", "question": "q?", "answer": "about seven"},
        "field 'answer' has no parsable final number",
    ),  # fmt: skip
    ({"id": "g1", "question": "again?", "answer": "#### 9"}, "duplicate id 'g1' (first seen"),
    ({"id": "b5", "question": 12, "answer": "#### 1"}, "field 'question' must be text or a list of chat messages"),
]


def _jsonl(path: Path, rows: list[dict], extra_lines: list[bytes] = ()) -> Path:
    with open(path, "wb") as f:
        for row in rows:
            f.write(json.dumps(row).encode() + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")
    return path


def test_bad_jsonl_rows_are_named_by_line_with_their_reason(tmp_path: Path) -> None:
    extra = [
        b'{"id": "b6", "question": "caf\xe9?", "answer": "#### 1"}',  # latin-1, not UTF-8
        b'{"id": "b7", "question": "unterminated',
        b"[" * 50_000 + b"]" * 50_000,  # deeper than json can recurse
    ]
    path = _jsonl(tmp_path / "train.jsonl", GOOD + [row for row, _ in BAD], extra)
    with pytest.raises(DataValidationError) as info:
        load_records(path, answer_check=numeric_answer)  # (b3) gsm8k's reward needs a number
    message = str(info.value)
    assert str(path) in message and "8 of 11 rows are invalid" in message
    for line, (_, reason) in enumerate(BAD, start=len(GOOD) + 1):
        assert f"line {line}: {reason}" in message
    assert "line 9: not valid UTF-8 (byte 0xe9 at column 30); re-save the file as UTF-8" in message
    assert "line 10: invalid JSON (" in message
    assert "line 11: invalid JSON (nested too deeply to parse)" in message
    assert "raise max_bad_fraction" in message  # the fix
    assert [p[0] for p in info.value.problems] == list(range(4, 12))


def test_bad_rows_within_the_budget_are_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _jsonl(tmp_path / "train.jsonl", GOOD + [BAD[1][0]])
    with caplog.at_level(logging.WARNING, logger="rl_core.data.sources"):
        records = load_records(path, max_bad_fraction=0.25)
    assert [r.id for r in records] == ["g1", "g2", "g3"]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "skipped 1 of 4 rows (within max_bad_fraction=0.25)" in warning
    assert "line 4: field 'question' is empty" in warning


def test_bad_parquet_rows_are_named_by_row(tmp_path: Path) -> None:
    rows = GOOD + [row for row, _ in BAD[:4]]  # parquet columns need one type: no int question
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataValidationError) as info:
        load_records(path, answer_check=numeric_answer)
    reasons = [reason for _, reason in BAD[:4]]
    reasons[0] = "field 'question' is null; every row needs a prompt"  # a column has nulls
    for row, reason in enumerate(reasons, start=len(GOOD) + 1):
        assert f"row {row}: {reason}" in str(info.value)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "not a readable Parquet file (Parquet file size is 0 bytes)"),
        (b"PAR1 this is not parquet at all", "not a readable Parquet file"),
    ],
    ids=["empty", "garbage"],
)
def test_unreadable_parquet_names_the_file(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_records(path)
    assert type(info.value) is ValueError  # ours, not pyarrow's ArrowInvalid
    assert str(path) in str(info.value) and fragment in str(info.value)
    assert "write it again" in str(info.value)
    with pytest.raises(ValueError, match="records snapshot does not read"):
        read_parquet(path)


def test_truncated_parquet_names_the_file(tmp_path: Path) -> None:
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD * 50), whole, row_group_size=10)
    cut = tmp_path / "cut.parquet"
    data = whole.read_bytes()
    cut.write_bytes(data[:200] + data[-(len(data) // 2) :])  # footer intact, pages garbled
    with pytest.raises(ValueError) as info:
        load_records(cut, id_field=None, max_bad_fraction=1.0)
    assert str(cut) in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("train.jsonl", b"", "empty dataset: no rows found"),
        ("train.jsonl", b"\n\n  \n", "empty dataset: no rows found"),
        ("train.json", b"[]", "empty dataset: no rows found"),
        ("train.json", b'[{"question": "caf\xe9", "answer": "1"}]', "not a valid UTF-8 JSON array"),
        ("train.json", b"[" * 50_000 + b"]" * 50_000, "not a valid UTF-8 JSON array"),
        ("train.json", b'{"not": "an array"} trailing', "invalid JSON"),
        ("train.txt", b"question,answer\nq,1\n", "unsupported file type '.txt'"),
        ("train.csv", b"question,answer\nq,1,extra\n", "1 more cells than the header's 2"),
    ],
)
def test_empty_and_malformed_files(
    tmp_path: Path, name: str, content: bytes, fragment: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_records(path)
    assert str(path) in str(info.value) and fragment in str(info.value)


def test_empty_parquet_and_all_bad_rows_are_an_empty_dataset(tmp_path: Path) -> None:
    empty = tmp_path / "empty.parquet"
    schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist([], schema=schema), empty)
    with pytest.raises(DataValidationError, match="empty dataset: no rows found"):
        load_records(empty, id_field=None)
    all_bad = _jsonl(tmp_path / "bad.jsonl", [row for row, _ in BAD[:3]])
    with pytest.raises(DataValidationError, match="empty dataset: all 3 rows are invalid"):
        # even a full budget keeps no rows
        load_records(all_bad, max_bad_fraction=1.0, answer_check=numeric_answer)


def test_missing_columns_name_the_mapping_to_set(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "q", "solution": "#### 1"}]), path)
    with pytest.raises(DataValidationError) as info:
        load_records(path)
    message = str(info.value)
    assert "missing column(s) 'question', 'answer'" in message
    assert "the columns are: problem, solution" in message
    assert "data.question_field=<column>, data.answer_field=<column>" in message
    assert load_records(path, question_field="problem", answer_field="solution", id_field=None)


def test_missing_sources_and_splits(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found: no such file or directory"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError, match="no data for split 'train'.*\\(empty\\)"):
        load_records(tmp_path / "data")


# ============================================================= prompts over the context


def test_prompts_longer_than_the_limit_are_skipped_and_counted() -> None:
    from conftest import tiny_tokenizer

    from rl_core.planes import _encode_within_limit

    cfg = load_config(TINY, ["data.max_prompt_tokens=12", "data.use_chat_template=false"])
    records = [
        Record("short", "a05 a06", "#### 1"),
        Record("long", " ".join(["a07"] * 40), "#### 2"),
        Record("short2", "a08", "#### 3"),
    ]
    kept, prompts, skipped = _encode_within_limit(tiny_tokenizer(), records, cfg)
    assert [r.id for r in kept] == ["short", "short2"]
    assert skipped == 1
    assert all(len(p) <= 12 for p in prompts)
