"""Your own dataset and reward (docs/data-and-rewards.md): every file format, chat prompts,
answers of any type, every column travelling to the reward; rewards in both forms (one
sample, or TRL's batched ``fn(prompts, completions, **columns)``), sync or async, several
weighted and each reported, the builtins beside math, and ``grpoflow validate`` catching a
reward of neither form. Real files, real worker processes, the real sandbox."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_core.config import RewardConfig
from rl_core.data.prompts import render_prompt
from rl_core.data.records import DataValidationError, numeric_answer, records_digest
from rl_core.data.sources import load_records, read_parquet, write_parquet
from rl_core.rewards import RewardRunner, RewardSet, answer_kind, load_reward_fn, reward_form
from rl_core.rewards.builtins import (
    code_tests,
    exact_match,
    final_text,
    multiple_choice,
    normalized_match,
    regex_match,
)

CHAT = [{"role": "system", "content": "Answer even or odd."},
        {"role": "user", "content": "Is 3 + 4 even or odd?"}]
ROWS = [
    {"id": "a", "prompt": CHAT, "label": "odd", "difficulty": 1, "tags": ["sum"]},
    {"id": "b", "prompt": "Is 2 + 2 even or odd?", "label": "even", "difficulty": 2, "tags": []},
    {"id": "c", "prompt": "Pick one: (A) 3 (B) 4. Which is 2 + 2?", "label": 1, "difficulty": 3,
     "tags": ["mc"]},
]
FIELDS = dict(question_field="prompt", answer_field="label")


def _write(path: Path, rows: list[dict]) -> Path:
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".csv":
        path.write_text("id,prompt,label,note\n" + "".join(
            f'{r["id"]},"{r["prompt"]}",{r["label"]},n{r["id"]}\n' for r in rows))
    else:
        table = pa.Table.from_pylist([{**r, "prompt": json.dumps(r["prompt"]),
                                       "label": str(r["label"])} for r in rows])
        if suffix == ".parquet":
            pq.write_table(table, path)
        else:  # .arrow: the IPC stream format datasets caches splits in
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
    return path


# ------------------------------------------------------------------------------ data


def test_chat_prompts_any_answer_and_every_column_travel(tmp_path: Path) -> None:
    records = load_records(_write(tmp_path / "t.jsonl", ROWS), **FIELDS)
    a, b, c = records
    assert a.question == CHAT and a.text == "Is 3 + 4 even or odd?"
    assert b.question == "Is 2 + 2 even or odd?" and c.answer == 1  # an int answer is kept
    assert a.columns == {"id": "a", "label": "odd", "difficulty": 1, "tags": ["sum"]}
    # the snapshot a run trains from keeps all of it, and the digest
    digest = write_parquet(records, tmp_path / "snap.parquet")
    back = read_parquet(tmp_path / "snap.parquet")
    assert back == records and records_digest(back) == digest
    # the answer is refused only for what the reward needs: gsm8k needs a number
    with pytest.raises(DataValidationError) as info:
        load_records(tmp_path / "t.jsonl", **FIELDS, answer_check=numeric_answer)
    assert "line 1: field 'label' has no parsable final number" in str(info.value)
    assert "reward.fn=gsm8k needs one" in str(info.value)
    assert answer_kind(RewardConfig()) == "number"
    assert answer_kind(RewardConfig(fn="exact_match")) == "any"


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".arrow"])
def test_csv_parquet_and_arrow_files_read_every_column(tmp_path: Path, suffix: str) -> None:
    rows = [{k: v for k, v in r.items() if k != "tags"} for r in ROWS[1:]]
    records = load_records(_write(tmp_path / f"t{suffix}", rows), **FIELDS)
    assert [r.id for r in records] == ["b", "c"]
    assert set(records[0].columns) >= {"id", "label"} and records[0].answer == "even"
    # a missing column names the config field to set
    with pytest.raises(DataValidationError, match="data.answer_field=<column>"):
        load_records(tmp_path / f"t{suffix}", question_field="prompt", answer_field="gold")


def test_bad_chat_messages_are_refused_by_row(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "robot", "content": "hi"}], "label": "x"},
            {"prompt": [{"role": "system", "content": "only a system"}], "label": "x"},
            {"prompt": [{"role": "user"}], "label": "x"},
            {"prompt": "fine", "label": None},
            {"prompt": "fine", "label": "ok"}]
    with pytest.raises(DataValidationError) as info:
        load_records(_write(tmp_path / "bad.jsonl", rows), id_field=None, **FIELDS)
    problems = dict(info.value.problems)
    assert "role 'robot'" in problems[1] and "no user message" in problems[2]
    assert "message 0 is not" in problems[3] and "null" in problems[4]


def test_chat_prompts_render_through_the_template_or_the_plain_one() -> None:
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):  # noqa: ANN001, ANN202
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    assert render_prompt(Tok(), CHAT, system_prompt="ignored: it has its own") == (
        "system:Answer even or odd.|user:Is 3 + 4 even or odd?|assistant:")
    assert render_prompt(Tok(), "Q?", system_prompt="S") == "system:S|user:Q?|assistant:"
    plain = type("Plain", (), {"chat_template": None})()
    assert render_prompt(plain, CHAT, plain_template="Question: {question}\nAnswer:") == (
        "Answer even or odd.\n\nQuestion: Is 3 + 4 even or odd?\nAnswer:")


# --------------------------------------------------------------------------- builtins


def test_the_builtin_rewards() -> None:
    assert final_text("so 3 + 4 = 7\n#### odd") == "odd" and final_text("Answer: B") == "B"
    assert final_text("it is \\boxed{42}") == "42" and final_text("a\n\nlast line\n") == "last line"
    assert exact_match("#### odd", "odd") == 1.0 and exact_match("#### Odd", "odd") == 0.0
    assert exact_match("#### 5", 5) == 1.0  # a non-text answer compares as its JSON
    assert normalized_match("#### The  Odd.", "odd") == 1.0
    assert normalized_match("#### uneven", ["odd", "uneven"]) == 1.0
    assert normalized_match("#### odd", "even", aliases=("odd",)) == 1.0
    assert multiple_choice("I think the answer is (B).", "B") == 1.0
    assert multiple_choice("Answer: C", 2, letters="ABCD") == 1.0  # a 0-based index
    assert multiple_choice("(A)\nno wait\nB", "B") == 1.0  # the last pick
    assert multiple_choice("Answer: D", "B") == 0.0 and multiple_choice("B", "Z") == 0.0
    assert regex_match("x\n#### odd", pattern=r"^#### (even|odd)$") == 1.0
    assert regex_match("#### 7", pattern=r"^#### (even|odd)$") == 0.0
    assert regex_match(" odd ", pattern="odd|even", fullmatch=True) == 1.0


def test_code_runs_against_unit_tests_in_the_sandbox() -> None:
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return a * b\n```"
    tests = ["assert add(2, 2) == 4", "assert add(1, 2) == 3"]
    # snippets that finish get a bound no busy machine reaches; the hang its own short one
    scores = code_tests([None] * 4, [good, half, "def add(:", good],
                        tests=[tests, tests, tests, ""], tests_column="tests", timeout_s=60.0)
    assert scores == [1.0, 0.5, 0.0, None]  # a syntax error, no tests
    assert code_tests([None], ["while True: pass"], tests=[tests], tests_column="tests",
                      timeout_s=1.0) == [0.0]  # a hang
    # a script's top-level statements are its tests
    assert code_tests([None], [good], answer=["assert add(1, 1) == 2\nassert add(0, 0) == 1"]) \
        == [0.5]
    with pytest.raises(ValueError, match="set args.tests_column"):
        code_tests([None], [good], tests_column="missing")


# ------------------------------------------------------------------------------ forms


def test_forms_are_told_apart_and_a_function_of_neither_is_refused() -> None:
    assert reward_form(load_reward_fn("gsm8k")) == ("single", False)
    assert reward_form(load_reward_fn("reward_plugins:batched_label")) == ("batched", False)
    assert reward_form(load_reward_fn("reward_plugins:async_single")) == ("single", True)
    assert reward_form(load_reward_fn("reward_plugins:async_batched")) == ("batched", True)
    assert reward_form(load_reward_fn("regex", {"pattern": "x"})) == ("single", False)
    for spec in ("reward_plugins:one_arg", "reward_plugins:three_args"):
        with pytest.raises(ValueError, match="matches neither reward form") as info:
            load_reward_fn(spec)
        assert "fn(completion, answer)" in str(info.value)
    with pytest.raises(ValueError, match="neither reward form"):  # args it does not take
        load_reward_fn("exact_match", {"pattern": "x"})


@pytest.mark.parametrize("isolate", [True, False], ids=["worker", "inline"])
def test_batched_and_async_rewards_get_prompts_and_columns(isolate: bool) -> None:
    completions = ["... odd", "... even", "... odd"]
    answers = ["odd", "odd", "x"]
    prompts = [CHAT, "Q2", "Q3"]
    columns = [{"label": "odd", "extra": 1}, {"label": "odd", "extra": 2},
               {"label": None, "extra": 3}]
    kw = dict(isolate=isolate, memory_limit_mb=None, timeout_s=5.0)
    with RewardRunner("reward_plugins:batched_label", **kw) as runner:
        result = runner.score(completions, answers, prompts=prompts, columns=columns)
    assert result.raw == [1.0, 0.0, None]  # None: no score for that row, not an error
    assert result.scores == [1.0, 0.0, 0.0] and result.num_errors == 0
    with RewardRunner("reward_plugins:batched_sees_everything", **kw) as runner:
        assert runner.score(completions, answers, prompts=prompts, columns=columns).scores == [
            1.0] * 3
    with RewardRunner("reward_plugins:async_single", **kw) as runner:
        assert runner.score(["odd", "even"], ["odd", "odd"]).scores == [1.0, 0.0]
    with RewardRunner("reward_plugins:async_batched", **kw) as runner:
        assert runner.score(["ab", "abc"], ["", ""]).scores == [2.0, 3.0]
    with RewardRunner("reward_plugins:batched_wrong_length", **kw) as runner:
        result = runner.score(completions, answers)
    assert result.num_errors == 3 and "expected a list of 3 scores" in result.errors[0]


def test_a_hanging_batched_reward_costs_its_batch_bounded() -> None:
    with RewardRunner("reward_plugins:batched_hang", timeout_s=0.5, memory_limit_mb=None) as r:
        started = time.monotonic()
        result = r.score(["a", "b"], ["", ""], prompts=["p", "q"], columns=[{}, {}])
        took = time.monotonic() - started
        assert result.num_timeouts == 2 and result.scores == [0.0, 0.0]
        assert took < 10, took  # bounded by timeout_s x the batch, not the 60 s hang
        assert r.stats()["worker_restarts"] == 1


# ---------------------------------------------------------------------- several rewards


def test_several_rewards_are_weighted_and_each_reported() -> None:
    cfg = RewardConfig(fn="exact_match", extra=[
        {"fn": "regex", "weight": 0.5, "args": {"pattern": r"^#### \w+$"}, "name": "format"},
        {"fn": "reward_plugins:batched_label", "weight": 0.25}])
    with RewardSet.from_config(cfg) as rewards:
        assert [t.name for t in rewards.terms] == ["exact_match", "format", "batched_label"]
        result = rewards.score(["x\n#### odd", "odd", "#### even"], ["odd", "odd", "odd"],
                               prompts=["p"] * 3, columns=[{"label": "odd"}] * 3)
    # exact + 0.5 * format + 0.25 * label
    assert result.scores == [1.0 + 0.5 + 0.25, 1.0 + 0.25, 0.5]
    assert result.correct == [True, True, False]  # the task reward alone decides
    assert result.components == {"exact_match": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0],
                                 "batched_label": [1.0, 1.0, 0.0]}
    assert result.component_means() == {"reward/exact_match": 2 / 3, "reward/format": 2 / 3,
                                        "reward/batched_label": 2 / 3}
    # the format bonus is a term of its own; a failed task reward scores the sample 0
    legacy = RewardConfig(fn="reward_plugins:raising_reward", format_weight=0.5,
                          memory_limit_mb=None)
    with RewardSet.from_config(legacy) as rewards:
        result = rewards.score(["#### 5"], ["5"])
    assert result.scores == [0.0] and result.num_errors == 1
    assert set(result.components) == {"raising_reward", "format"}
    with pytest.raises(ValueError, match="distinct names"):
        RewardSet.from_config(RewardConfig(fn="regex", args={"pattern": "x"}, extra=[
            {"fn": "regex", "args": {"pattern": "y"}}]))


def test_the_config_knows_every_builtin() -> None:
    from rl_core.config.signals import BUILTIN_REWARD_NAMES
    from rl_core.rewards import BUILTIN_REWARDS

    assert tuple(BUILTIN_REWARDS) == BUILTIN_REWARD_NAMES


# ------------------------------------------------------------------- in a training run

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_on_your_own_data_reports_each_reward_and_keeps_the_columns(
        prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """configs/words-cpu.yaml's data (Parquet, chat prompts, words for answers) and rewards
    (exact match + a weighted regex format check) on the demo model: each reward is a metric
    of every step and evaluation, and the rows' columns reach the evaluation's samples."""
    from flows.grpo_train import grpo_train

    out = grpo_train(config=str(ROOT / "configs" / "words-cpu.yaml"), overrides=[
        f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}", "run_name=words",
        "model.path=embedded:tiny", "model.tiny_target_accuracy=0.3",
        f"data.source={ROOT / 'examples' / 'words' / 'data'}", "train.steps=1",
        "train.prompts_per_step=4", "rollout.n_samples=2", "eval.every=1",
        "eval.num_examples=4", "eval.pass_k_examples=0", "tracking.backend=none",
        "train.num_threads=1"], show_progress=False)
    run_dir = Path(out["run_dir"])
    (step,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/exact_match", "reward/format"} <= set(step), sorted(step)
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert set(evals[0]["rewards"]) == {"exact_match", "format"}
    row = evals[0]["samples"][0]
    assert {"label", "expression", "id"} <= set(row) and row["question"].startswith("What is")


def test_the_sample_tables_carry_the_rows_columns() -> None:
    from rl_core.types import Sample
    from tasks.tracking.artifacts import sample_rows

    s = Sample([1], [2], [0.0], {"type": "stop"}, text="#### seven", uid="1:a:0",
               answer=7, columns={"label": "seven", "tags": ["x"], "reward": "kept apart"})
    (row,) = sample_rows([s])
    assert (row["answer"], row["label"], row["tags"]) == ("7", "seven", '["x"]')
    assert row["reward"] == 0.0  # a column never overwrites the sample's own fields
