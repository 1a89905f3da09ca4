"""Tests for rl_core.data: records, sources, synthetic problems, prompts and the sampler.

Everything runs on small local fixtures; nothing here may touch the network (the hub path is
exercised with a monkeypatched ``datasets.load_dataset``).
"""

from __future__ import annotations

import ast
import json
import operator
import pickle
import random
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_core.config import ConfigError, load_config
from rl_core.data.prompts import encode_prompts, render_prompt
from rl_core.data.records import (
    MAX_LISTED_PROBLEMS,
    DataValidationError,
    Record,
    numeric_answer,
    records_digest,
    validate_records,
)
from rl_core.data.sampler import PromptSampler
from rl_core.data.sources import load_records, read_parquet, write_parquet
from rl_core.data.synthetic import generate_arithmetic, generate_splits
from rl_core.rewards import parse_number

ROWS = [
    {"id": "a", "question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
    {"id": "b", "question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
    {"id": "c", "question": "What is 10 - 4?", "answer": "#### 6"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _write_parquet_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# ============================================================================ records


def test_final_answer_and_number_parsing() -> None:
    assert Record("x", "q", "step 1\n#### 1,234").final_answer == "1,234"
    assert Record("x", "q", "a #### 1 #### 7 ").final_answer == "7"
    assert Record("x", "q", " 42 ").final_answer == "42"
    for text, value in [("1,234", 1234), ("-3.5", -3.5), ("3/4", 0.75), (".5", 0.5), ("+7", 7)]:
        assert parse_number(text) == pytest.approx(value), text
    for text in ["", "abc", "1,23", "3/0", "1.2.3"]:
        assert parse_number(text) is None, text


def _triples(records: list[Record]) -> list[tuple]:
    return [(r.id, r.question, r.answer) for r in records]


def test_validate_records_accepts_good_rows() -> None:
    good, problems = validate_records(ROWS, "mem")
    assert problems == []
    assert [r.id for r in good] == ["a", "b", "c"]
    assert good[0] == Record("a", "What is 1 + 1?", "1 + 1 = 2\n#### 2",
                             {"id": "a", "answer": "1 + 1 = 2\n#### 2"})  # every column
    # integer ids become strings; a bare-number answer is accepted
    good, _ = validate_records([{"id": 7, "question": "q?", "answer": "-3/4"}], "mem",
                               answer_check=numeric_answer)
    assert _triples(good) == [("7", "q?", "-3/4")]


def test_generated_ids_are_content_hashes_stable_under_reordering() -> None:
    rows = [{"question": r["question"], "answer": r["answer"]} for r in ROWS]
    forward, _ = validate_records(rows, "mem", id_field=None)
    backward, _ = validate_records(list(reversed(rows)), "mem")  # "id" absent -> generated
    assert {r.id: r for r in forward} == {r.id: r for r in backward}
    assert all(re.fullmatch(r"[0-9a-f]{12}", r.id) for r in forward)
    assert len({r.id for r in forward}) == 3


def test_validation_problems_name_rows_and_fields() -> None:
    rows = [
        ROWS[0],
        {"id": "m", "answer": "#### 1"},  # 2: missing question
        {"id": "e", "question": "   ", "answer": "#### 1"},  # 3: empty question
        {"id": "u", "question": "q?", "answer": "the answer is five"},  # 4: unparsable
        {"id": "a", "question": "again?", "answer": "#### 3"},  # 5: duplicate id
        {"id": "n", "question": "q?", "answer": [5]},  # 6: no number (for a numeric reward)
        {"id": "i", "question": "q?", "answer": 5},  # 7: a number is a numeric answer
        ROWS[1],
    ]
    good, problems = validate_records(rows, "mem", max_bad_fraction=1.0,
                                      answer_check=numeric_answer)
    assert [r.id for r in good] == ["a", "i", "b"]
    by_row = dict(problems)
    assert sorted(by_row) == [2, 3, 4, 5, 6]
    assert "missing field 'question'" in by_row[2] and "question_field=" in by_row[2]
    assert "'question' is empty" in by_row[3]
    assert "no parsable final number" in by_row[4] and "####" in by_row[4]
    assert "duplicate id 'a'" in by_row[5] and "row 1" in by_row[5]
    assert "must be text or a number for a numeric reward, got list" in by_row[6]
    # without a numeric reward, any non-null answer will do
    good, problems = validate_records(rows, "mem", max_bad_fraction=1.0)
    assert [r.id for r in good] == ["a", "u", "n", "i", "b"] and sorted(dict(problems)) == [2, 3, 5]


def test_duplicate_generated_ids_are_reported_as_duplicate_rows() -> None:
    row = {"question": "q?", "answer": "#### 1"}
    good, problems = validate_records([row, dict(row)], "mem", max_bad_fraction=0.5)
    assert len(good) == 1
    assert problems == [(2, "duplicate row: same question and answer as row 1")]


def test_max_bad_fraction_and_error_message() -> None:
    bad = {"id": "z", "question": "", "answer": "#### 1"}
    rows = [*ROWS, bad]  # 1 of 4 bad
    with pytest.raises(DataValidationError) as info:
        validate_records(rows, "train.jsonl")
    err = info.value
    assert err.problems == [(4, "field 'question' is empty")]
    assert "train.jsonl" in str(err) and "row 4" in str(err) and "max_bad_fraction" in str(err)
    assert isinstance(err, ValueError)
    good, problems = validate_records(rows, "train.jsonl", max_bad_fraction=0.25)
    assert len(good) == 3 and len(problems) == 1
    # the error survives pickling (it may cross process boundaries)
    clone = pickle.loads(pickle.dumps(err))
    assert clone.problems == err.problems and str(clone) == str(err)


def test_error_lists_only_first_problems() -> None:
    rows = [ROWS[0]] + [{"id": str(i), "question": "q", "answer": "x"} for i in range(15)]
    with pytest.raises(DataValidationError) as info:
        validate_records(rows, "big.jsonl", answer_check=numeric_answer)
    assert len(info.value.problems) == 15
    assert str(info.value).count("no parsable final number") == MAX_LISTED_PROBLEMS
    assert "... and 5 more" in str(info.value)


def test_empty_dataset_is_an_error() -> None:
    with pytest.raises(DataValidationError, match="empty dataset"):
        validate_records([], "none.jsonl")
    with pytest.raises(DataValidationError, match="empty dataset") as info:
        validate_records([{"question": "q"}], "bad.jsonl", max_bad_fraction=1.0)
    assert info.value.problems[0][0] == 1


def test_records_digest_is_stable_and_order_sensitive() -> None:
    good, _ = validate_records(ROWS, "mem")
    again, _ = validate_records([dict(r) for r in ROWS], "other-name")
    assert records_digest(good) == records_digest(again)
    assert re.fullmatch(r"[0-9a-f]{64}", records_digest(good))
    assert records_digest(good) != records_digest(list(reversed(good)))
    changed = [*good[:2], Record("c", good[2].question, "#### 7")]
    assert records_digest(changed) != records_digest(good)
    assert records_digest([]) != records_digest(good)


# ============================================================================ sources


def test_load_jsonl_reports_bad_lines_by_line_number(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    lines = [
        json.dumps(ROWS[0]).encode(),
        b"",  # blank line: skipped, but line numbers keep counting
        b'{"id": "x", "question": "caf\xe9?", "answer": "#### 1"}',  # latin-1 byte
        b'{"id": "y", "question": ',  # truncated JSON
        b"[1, 2]",  # not an object
        json.dumps(ROWS[1]).encode(),
        json.dumps({"id": "z", "question": "é?", "answer": "#### 3"}, ensure_ascii=False).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataValidationError) as info:
        load_records(path)
    problems = dict(info.value.problems)
    assert sorted(problems) == [3, 4, 5]
    assert problems[3].startswith("not valid UTF-8")
    assert problems[4].startswith("invalid JSON")
    assert "expected a JSON object" in problems[5]
    assert "line 3: not valid UTF-8" in str(info.value)
    assert str(path) in str(info.value)

    records = load_records(str(path), max_bad_fraction=0.5)
    assert [r.id for r in records] == ["a", "b", "z"]
    assert records[2].question == "é?"


def test_load_json_lines_and_json_array(tmp_path: Path) -> None:
    lines = _write_jsonl(tmp_path / "lines.json", ROWS)
    assert [r.id for r in load_records(lines)] == ["a", "b", "c"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(ROWS), encoding="utf-8")
    assert load_records(array) == load_records(lines)


def test_load_parquet_with_custom_fields_and_limit(tmp_path: Path) -> None:
    rows = [{"q": r["question"], "a": r["answer"], "extra": 1} for r in ROWS]
    path = _write_parquet_rows(tmp_path / "data.parquet", rows)
    records = load_records(path, question_field="q", answer_field="a", id_field=None)
    assert [r.question for r in records] == [r["question"] for r in ROWS]
    assert load_records(path, question_field="q", answer_field="a", limit=2) == records[:2]
    assert load_records(path, question_field="q", answer_field="a", limit=0) == []
    with pytest.raises(DataValidationError, match="question_field=") as info:
        load_records(path)  # default field names are not columns of this file
    assert "data.parquet" in str(info.value) and "'question'" in str(info.value)


def test_load_save_to_disk_dataset_dict_and_dataset(tmp_path: Path) -> None:
    train = datasets.Dataset.from_list(ROWS)
    test = datasets.Dataset.from_list(ROWS[:1])
    dd_path = tmp_path / "dd"
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(dd_path))
    assert [r.id for r in load_records(dd_path)] == ["a", "b", "c"]
    assert [r.id for r in load_records(dd_path, split="test")] == ["a"]
    with pytest.raises(ValueError, match="available splits: test, train"):
        load_records(dd_path, split="validation")

    ds_path = tmp_path / "ds"
    train.save_to_disk(str(ds_path))
    assert [r.id for r in load_records(ds_path)] == ["a", "b", "c"]


def test_load_directory_of_split_files(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _write_parquet_rows(tmp_path / "test.parquet", ROWS[:2])
    assert [r.id for r in load_records(tmp_path)] == ["a", "b", "c"]
    assert [r.id for r in load_records(tmp_path, split="test")] == ["a", "b"]
    with pytest.raises(FileNotFoundError, match="no data for split 'validation'"):
        load_records(tmp_path, split="validation")


def test_load_directory_of_parquet_shards_numbers_rows_across_files(tmp_path: Path) -> None:
    # HF hub layout: <repo>/<subset>/train-0000x-of-0000y.parquet
    shard_dir = tmp_path / "main"
    shard_dir.mkdir()
    _write_parquet_rows(shard_dir / "train-00000-of-00002.parquet", ROWS[:2])
    bad = {"id": "d", "question": "q?", "answer": "no number"}
    _write_parquet_rows(shard_dir / "train-00001-of-00002.parquet", [ROWS[2], bad])
    with pytest.raises(DataValidationError) as info:
        load_records(tmp_path, subset="main", answer_check=numeric_answer)
    assert info.value.problems[0][0] == 4
    assert "train-00001-of-00002.parquet: rows 3-4" in str(info.value)
    records = load_records(tmp_path, subset="main", max_bad_fraction=0.25,
                           answer_check=numeric_answer)
    assert [r.id for r in records] == ["a", "b", "c"]


def test_hub_dataset_goes_through_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[tuple, dict]] = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        rows = [{"question": r["question"], "answer": r["answer"]} for r in ROWS]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    records = load_records("openai/gsm8k", "test", subset="main")
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]
    assert [r.question for r in records] == [r["question"] for r in ROWS]
    assert all(re.fullmatch(r"[0-9a-f]{12}", r.id) for r in records)


def test_hub_failure_keeps_its_type_and_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError) as info:
        load_records("someone/missing")
    assert any("hub dataset" in note for note in info.value.__notes__)


def test_missing_paths_and_unsupported_schemes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args, **kwargs):
        raise AssertionError("a local path must never reach datasets.load_dataset")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_records(missing)
    with pytest.raises(FileNotFoundError):
        load_records("./data/train.jsonl")
    with pytest.raises(ValueError, match="unsupported URI scheme gs://"):
        load_records("gs://bucket/train.jsonl")
    path = _write_jsonl(tmp_path / "ok.jsonl", ROWS)
    assert len(load_records(f"file://{path}")) == 3


def test_write_and_read_parquet_round_trip(tmp_path: Path) -> None:
    records = generate_arithmetic(20, seed=3)
    path = tmp_path / "nested" / "snap.parquet"
    digest = write_parquet(records, path)
    assert digest == records_digest(records)
    assert read_parquet(path) == records
    assert _triples(load_records(path)) == _triples(records)
    meta = pq.read_schema(path).metadata
    assert meta[b"grpoflow.records_digest"].decode() == digest
    assert sorted(p.name for p in path.parent.iterdir()) == ["snap.parquet"]  # no temp files
    with pytest.raises(FileNotFoundError):
        read_parquet(tmp_path / "absent.parquet")


# ============================================================================ synthetic

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(expression: str) -> int:
    """Evaluate +, -, * over integers with ordinary precedence, independently of the generator."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"unexpected syntax in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def _question_expression(question: str) -> str:
    match = re.fullmatch(r"What is (.+)\?", question)
    assert match, question
    return match.group(1)


def test_synthetic_is_deterministic_and_ignores_global_rng() -> None:
    random.seed(1)
    first = generate_arithmetic(50, seed=7, operations=("+", "-", "*"), steps=(1, 3))
    random.seed(999)
    second = generate_arithmetic(50, seed=7, operations=("+", "-", "*"), steps=(1, 3))
    assert first == second
    assert [r.id for r in first] == [f"syn-7-{i}" for i in range(50)]
    assert generate_arithmetic(50, seed=8) != generate_arithmetic(50, seed=7)


def test_synthetic_answers_are_correct() -> None:
    records = generate_arithmetic(
        300, seed=11, operations=("+", "-", "*"), steps=(1, 4), allow_negative=True
    )
    assert any("(" in r.question for r in records)  # "*" after "+"/"-" gets parentheses
    for r in records:
        expected = _evaluate(_question_expression(r.question))
        *steps, last = r.answer.split("\n")
        assert last == f"#### {expected}", r
        assert parse_number(r.final_answer) == expected
        previous = None
        for line in steps:  # each worked step is right and chains from the previous result
            m = re.fullmatch(r"(-?\d+) ([-+*]) (\d+) = (-?\d+)", line)
            assert m, line
            a, op, b, result = int(m[1]), m[2], int(m[3]), int(m[4])
            assert {"+": a + b, "-": a - b, "*": a * b}[op] == result
            assert previous is None or a == previous
            previous = result
        assert previous == expected


def test_synthetic_knobs_are_honoured() -> None:
    records = generate_arithmetic(200, seed=5, digits=(2, 3), operations=("-",), steps=(2, 3))
    for r in records:
        step_lines = r.answer.split("\n")[:-1]
        assert 2 <= len(step_lines) <= 3
        assert all(" - " in line for line in step_lines)
        operands = [int(x) for x in re.findall(r"\d+", _question_expression(r.question))]
        assert all(10 <= x <= 999 for x in operands), r.question
        results = [int(line.split(" = ")[1]) for line in step_lines]
        assert all(x >= 0 for x in results), r  # no negative intermediates

    mult = generate_arithmetic(100, seed=2, digits=(1, 1), operations=("*",), steps=(1, 1))
    for r in mult:
        left, right = (int(x) for x in re.findall(r"\d+", r.question))
        assert 0 <= left <= 9 and 2 <= right <= 9

    counts = {len(r.answer.split("\n")) - 1 for r in generate_arithmetic(200, seed=1)}
    assert counts == {1, 2}  # default steps=(1, 2), both ends reached

    negatives = generate_arithmetic(200, seed=4, operations=("-",), allow_negative=True)
    assert any(parse_number(r.final_answer) < 0 for r in negatives)


def test_synthetic_rejects_bad_knobs() -> None:
    with pytest.raises(ValueError, match="unsupported operations"):
        generate_arithmetic(1, seed=0, operations=("/",))
    with pytest.raises(ValueError, match="digits"):
        generate_arithmetic(1, seed=0, digits=(0, 2))
    with pytest.raises(ValueError, match="steps"):
        generate_arithmetic(1, seed=0, steps=(3, 2))


def test_generate_splits_are_disjoint() -> None:
    train, test = generate_splits(300, 100, seed=0)
    assert len(train) == 300 and len(test) == 100
    assert not {r.question for r in train} & {r.question for r in test}
    assert len({r.question for r in test}) == 100
    assert not {r.id for r in train} & {r.id for r in test}
    assert (train, test) == generate_splits(300, 100, seed=0)
    # a space of only 100 questions cannot give 50 unseen ones after 1000 train draws
    with pytest.raises(ValueError, match="not in the training set"):
        generate_splits(1000, 50, seed=0, digits=(1, 1), operations=("+",), steps=(1, 1))


# ============================================================================ prompts

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tiny_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Question", ":", "Answer", "What", "is", "1", "+", "2", "?", "Be", "brief", "."]
    words += ["<|", "|>", "user", "system", "assistant"]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


def test_render_prompt_plain_template() -> None:
    tok = _tiny_tokenizer(None)
    assert render_prompt(tok, "What is 1 + 2?") == "Question: What is 1 + 2?\nAnswer:"
    assert render_prompt(tok, "x {y}", plain_template="Q {question} A") == "Q x {y} A"
    assert render_prompt(tok, "x", system_prompt="Be brief.") == "Be brief.\n\nQuestion: x\nAnswer:"
    with pytest.raises(ConfigError, match="data.use_chat_template is true but the tokenizer"):
        render_prompt(tok, "x", use_chat_template=True)
    with pytest.raises(ConfigError, match=r"data.plain_template must contain '\{question\}'"):
        render_prompt(tok, "x", plain_template="no placeholder")


def test_data_plain_template_renders_the_prompt_without_a_chat_template() -> None:
    """``data.plain_template`` from a config: only ``{question}`` is replaced (other braces
    stay), the system prompt goes first; with a chat template it is used only when
    ``data.use_chat_template`` is false."""
    cfg = load_config(None, ["data.plain_template=Solve: {question}\nShow {work}, then '####'.",
                             "data.system_prompt=Be brief."])  # fmt: skip
    d = cfg.data
    plain = render_prompt(_tiny_tokenizer(None), "1 + 2?", system_prompt=d.system_prompt,
                          use_chat_template=d.use_chat_template, plain_template=d.plain_template)
    assert plain == "Be brief.\n\nSolve: 1 + 2?\nShow {work}, then '####'."
    chat = _tiny_tokenizer(CHAT_TEMPLATE)
    assert render_prompt(chat, "1 + 2?", plain_template=d.plain_template).startswith("<|user|>")
    forced = render_prompt(chat, "1 + 2?", use_chat_template=False, plain_template=d.plain_template)
    assert forced == "Solve: 1 + 2?\nShow {work}, then '####'."


def test_render_prompt_chat_template() -> None:
    tok = _tiny_tokenizer(CHAT_TEMPLATE)
    assert render_prompt(tok, "What is 1 + 2?") == "<|user|> What is 1 + 2?\n<|assistant|>"
    with_system = render_prompt(tok, "What is 1 + 2?", system_prompt="Be brief.")
    assert with_system == "<|system|> Be brief.\n<|user|> What is 1 + 2?\n<|assistant|>"
    forced_plain = render_prompt(tok, "What is 1 + 2?", use_chat_template=False)
    assert forced_plain == "Question: What is 1 + 2?\nAnswer:"


def test_encode_prompts_adds_no_special_tokens() -> None:
    tok = _tiny_tokenizer(CHAT_TEMPLATE)
    ids = encode_prompts(tok, ["What is 1 + 2?", "What is 2 + 1?"], use_chat_template=False)
    expected = tok("Question: What is 1 + 2?\nAnswer:", add_special_tokens=False)["input_ids"]
    assert ids[0] == expected and len(ids) == 2
    assert 0 not in ids[0]  # every word is in the vocabulary
    chat_ids = encode_prompts(tok, ["What is 1 + 2?"])
    rendered = render_prompt(tok, "What is 1 + 2?")
    assert chat_ids[0] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert 0 not in chat_ids[0]
    assert encode_prompts(tok, []) == []


# ============================================================================ sampler


def _draw(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_is_deterministic_and_each_epoch_is_a_permutation() -> None:
    a, b = PromptSampler(10, 4, seed=3), PromptSampler(10, 4, seed=3)
    batches = _draw(a, 10)  # 40 indices = 4 whole epochs
    assert batches == _draw(b, 10)
    flat = [i for batch in batches for i in batch]
    epochs = [flat[k : k + 10] for k in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs == [a.permutation(e) for e in range(4)]
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled every epoch
    assert batches[2] == epochs[0][8:] + epochs[1][:2]  # a batch spans the boundary
    assert a.state_dict() == {"seed": 3, "epoch": 4, "position": 0}
    assert _draw(PromptSampler(10, 4, seed=4), 3) != batches[:3]


def test_sampler_batch_larger_than_dataset_spans_epochs() -> None:
    sampler = PromptSampler(3, 7, seed=0)
    batch = sampler.next_batch()
    assert batch == sampler.permutation(0) + sampler.permutation(1) + sampler.permutation(2)[:1]
    assert sampler.state_dict() == {"seed": 0, "epoch": 2, "position": 1}


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])  # mid-epoch, at and across boundaries
def test_sampler_resume_equals_uninterrupted_run(stop_after: int) -> None:
    reference = _draw(PromptSampler(7, 3, seed=42), 12)
    original = PromptSampler(7, 3, seed=42)
    head = _draw(original, stop_after)
    state = json.loads(json.dumps(original.state_dict()))  # as if checkpointed to disk
    resumed = PromptSampler(7, 3, seed=0)  # the saved seed wins
    resumed.load_state_dict(state)
    assert resumed.epoch_progress == pytest.approx(state["position"] / 7)
    assert head + _draw(resumed, 12 - stop_after) == reference


def test_sampler_resume_at_exact_epoch_end() -> None:
    reference = _draw(PromptSampler(6, 3, seed=1), 6)
    sampler = PromptSampler(6, 3, seed=1)
    head = _draw(sampler, 2)  # exactly one epoch
    assert sampler.state_dict() == {"seed": 1, "epoch": 1, "position": 0}
    # a state saved as "end of epoch 0" means the same thing as "start of epoch 1"
    resumed = PromptSampler(6, 3, seed=1)
    resumed.load_state_dict({"seed": 1, "epoch": 0, "position": 6})
    assert resumed.state_dict() == {"seed": 1, "epoch": 1, "position": 0}
    assert head + _draw(resumed, 4) == reference


def test_sampler_state_validation() -> None:
    sampler = PromptSampler(5, 2, seed=0)
    for bad in [
        {"seed": 0, "epoch": 0},
        {"seed": 0, "epoch": 0, "position": 0, "extra": 1},
        {"seed": 0, "epoch": -1, "position": 0},
        {"seed": 0, "epoch": 0, "position": 6},
        {"seed": 0, "epoch": 0, "position": 1.5},
        {"seed": True, "epoch": 0, "position": 0},
    ]:
        with pytest.raises(ValueError):
            sampler.load_state_dict(bad)
    assert sampler.state_dict() == {"seed": 0, "epoch": 0, "position": 0}
    with pytest.raises(ValueError, match="num_items"):
        PromptSampler(0, 2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(3, 0, seed=0)
