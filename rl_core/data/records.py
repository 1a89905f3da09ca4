"""GSM8K-format records: the one in-memory shape every data source is turned into.

A :class:`Record` is ``(id, question, answer)``, the answer ending in ``#### <number>`` (or a
bare number). :func:`validate_records` reports every bad row by number; :func:`records_digest`
fingerprints a record list for lineage and resume checks (docs/configuration.md, 'Data').
Pure data handling: never does I/O, touches the network, or imports prefect or mlflow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rl_core.data.numbers import parse_number

__all__ = ["BadRow", "DataValidationError", "Record", "extract_final_answer", "records_digest",
           "validate_numbered_rows", "validate_records"]

ANSWER_MARKER = "####"
MAX_LISTED_PROBLEMS = 10


def extract_final_answer(answer: str) -> str:
    """Text after the last ``####`` marker, stripped; the whole answer stripped if no marker."""
    head, marker, tail = answer.rpartition(ANSWER_MARKER)
    return (tail if marker else head + tail).strip()


@dataclass(frozen=True)
class Record:
    """One problem: ``answer`` is reasoning text ending in ``#### <number>`` (or a bare number)."""

    id: str
    question: str
    answer: str

    @property
    def final_answer(self) -> str:
        """Text after the last ``####``, stripped (the whole answer if there is no marker)."""
        return extract_final_answer(self.answer)


@dataclass(frozen=True)
class BadRow:
    """Placeholder for a row a reader could not even parse (bad UTF-8, bad JSON): its reason."""

    reason: str


class DataValidationError(ValueError):
    """A data source has too many bad rows, or none good; ``problems`` is [(row number, reason)],
    numbers 1-based (for JSONL files: the line number)."""

    def __init__(self, source: str, problems: list[tuple[int, str]], message: str) -> None:
        super().__init__(message)
        self.source, self.problems = source, problems

    def __reduce__(self):  # keep the exception picklable across process boundaries
        return (type(self), (self.source, self.problems, str(self)))


def _format_problems(problems: list[tuple[int, str]], row_label: str) -> str:
    lines = [f"  {row_label} {row}: {reason}" for row, reason in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    return "\n".join(lines)


def _content_id(question: str, answer: str) -> str:
    return hashlib.sha1(f"{question}\x1f{answer}".encode()).hexdigest()[:12]


def _check_row(
    row: object, *, question_field: str, answer_field: str, id_field: str | None
) -> tuple[Record | None, bool, list[str]]:
    """(record or None, whether its id was generated, reasons it is bad)."""
    if isinstance(row, BadRow):
        return None, False, [row.reason]
    if not isinstance(row, Mapping):
        return None, False, [f"expected an object with fields, got {type(row).__name__}"]

    reasons: list[str] = []
    texts: dict[str, str] = {}
    for name, arg in ((question_field, "question_field"), (answer_field, "answer_field")):
        if name not in row:
            present = ", ".join(sorted(map(str, row.keys()))[:8]) or "none"
            reasons.append(f"missing field {name!r} (row has: {present}); "
                           f"if the column is named differently pass {arg}=<name>")
            continue
        value = row[name]
        if value is None:  # a null cell (Parquet, datasets) or a JSON null
            reasons.append(f"field {name!r} is null; every row needs a {arg.split('_')[0]}")
        elif not isinstance(value, str):
            reasons.append(f"field {name!r} must be a string, got {type(value).__name__}")
        elif not value.strip():
            reasons.append(f"field {name!r} is empty")
        else:
            texts[name] = value

    if answer_field in texts:
        final = extract_final_answer(texts[answer_field])
        if parse_number(final) is None:
            shown = final if len(final) <= 40 else final[:37] + "..."
            reasons.append(f"field {answer_field!r} has no parsable final number: expected a "
                           f"last line '{ANSWER_MARKER} <number>' or a bare number, got {shown!r}")
    raw_id = row.get(id_field) if id_field is not None else None
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))):
        reasons.append(
            f"field {id_field!r} must be a string or integer, got {type(raw_id).__name__}; "
            "pass id_field=None to use content-hash ids")
    elif raw_id is not None and not str(raw_id).strip():
        reasons.append(f"field {id_field!r} is empty; pass id_field=None to use content-hash ids")
    if reasons:
        return None, False, reasons
    question, answer = texts[question_field], texts[answer_field]
    record_id = _content_id(question, answer) if raw_id is None else str(raw_id)
    return Record(id=record_id, question=question, answer=answer), raw_id is None, []


def validate_numbered_rows(
    rows: Iterable[tuple[int, Mapping | BadRow]], source: str, *, question_field: str = "question",
    answer_field: str = "answer", id_field: str | None = "id", max_bad_fraction: float = 0.0,
    row_label: str = "row", note: str | None = None,
) -> tuple[list[Record], list[tuple[int, str]]]:
    """Like :func:`validate_records` for rows that carry their own numbers (JSONL lines); a
    :class:`BadRow` counts as bad with its reason. ``row_label`` names the unit in messages;
    ``note`` is appended to an error message (which file a row range came from)."""
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction must be within [0, 1], got {max_bad_fraction}")
    good: list[Record] = []
    problems: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    total = 0
    for number, row in rows:
        total += 1
        record, generated, reasons = _check_row(
            row, question_field=question_field, answer_field=answer_field, id_field=id_field)
        if record is not None and record.id in seen:
            first = seen[record.id]
            reasons = [f"duplicate row: same question and answer as {row_label} {first}"
                       if generated else
                       f"duplicate id {record.id!r} (first seen at {row_label} {first})"]
            record = None
        if record is None:
            problems.append((number, "; ".join(reasons)))
            continue
        seen[record.id] = number
        good.append(record)

    suffix = f"\n{note}" if note else ""
    if not good:
        if total == 0:
            detail = "no rows found; check the path, split and file contents"
        else:
            detail = f"all {total} rows are invalid:\n{_format_problems(problems, row_label)}"
        raise DataValidationError(source, problems, f"{source}: empty dataset: {detail}{suffix}")
    if problems and len(problems) / total > max_bad_fraction:
        raise DataValidationError(source, problems, (
            f"{source}: {len(problems)} of {total} rows are invalid "
            f"({len(problems) / total:.1%}, above max_bad_fraction={max_bad_fraction}):\n"
            f"{_format_problems(problems, row_label)}\n"
            "Fix these rows, or raise max_bad_fraction to skip up to that fraction of bad rows."
            f"{suffix}"))
    return good, problems


def validate_records(
    rows: Iterable[Mapping], source: str, question_field: str = "question",
    answer_field: str = "answer", id_field: str | None = "id", max_bad_fraction: float = 0.0,
) -> tuple[list[Record], list[tuple[int, str]]]:
    """Build records from raw rows; return (good records, [(1-based row number, reason)]). Ids
    missing (or ``id_field`` None): sha1 of question and answer, so identical rows are duplicates
    (the bad-row rules: docs/configuration.md, 'Data'). Raises :class:`DataValidationError` above
    ``max_bad_fraction`` bad rows or when no row is good."""
    return validate_numbered_rows(
        enumerate(rows, start=1), source, question_field=question_field,
        answer_field=answer_field, id_field=id_field, max_bad_fraction=max_bad_fraction)


def records_digest(records: Sequence[Record]) -> str:
    """sha256 hex over a canonical serialisation of (id, question, answer); order-sensitive."""
    digest = hashlib.sha256(b"grpoflow.records.v1\n")
    for r in records:
        line = json.dumps([r.id, r.question, r.answer], ensure_ascii=False, separators=(",", ":"))
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()
