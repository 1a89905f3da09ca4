"""Records: the one in-memory shape every data source is turned into.

A :class:`Record` is ``(id, question, answer, columns)``: the prompt as text or as chat
messages, the reference answer of any type (GSM8K's ends in ``#### <number>``), and every
other column of the row, which travels with its samples to the reward, evaluation and the
sample tables (docs/data-and-rewards.md), and its images as checked bytes (``images``:
:mod:`rl_core.data.images`, docs/vlm.md). :func:`validate_records` reports every bad row by
number, refusing an answer only for what the reward needs (``answer_check``);
:func:`records_digest` fingerprints a record list for lineage and resume checks.
Pure data handling (images are read through :mod:`rl_core.data.images`): never touches the
network or imports prefect or mlflow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_core.data.images import ImageError, ImageSpec, image_digest, load_image
from rl_core.data.numbers import parse_number

__all__ = ["AnswerCheck", "BadRow", "cell_text", "cell_texts", "content_id", "content_text",
           "DataValidationError", "field_images", "message_images",
           "Record", "extract_final_answer",
           "numeric_answer", "prompt_text", "records_digest", "validate_numbered_rows",
           "validate_records"]

ANSWER_MARKER = "####"
MAX_LISTED_PROBLEMS = 10
CHAT_ROLES = ("system", "user", "assistant", "tool")
IMAGE_PARTS = ("image", "image_url")  # content part types that carry an image
# A reward's requirement on a reference answer: None when the answer will do, else why not.
AnswerCheck = Callable[[Any], str | None]


def extract_final_answer(answer: str) -> str:
    """Text after the last ``####`` marker, stripped; the whole answer stripped if no marker."""
    head, marker, tail = answer.rpartition(ANSWER_MARKER)
    return (tail if marker else head + tail).strip()


def prompt_text(question: str | Sequence[Mapping[str, Any]]) -> str:
    """A prompt as one text: itself, or a chat prompt's last user message (what a judge or an
    environment is told the task is)."""
    if isinstance(question, str):
        return question
    users = [content_text(m.get("content", "")) for m in question if m.get("role") == "user"]
    return users[-1] if users else ""


def content_text(content: Any) -> str:  # noqa: ANN401 - text or a list of content parts
    """A message's content as text: itself, or its text parts joined (images left out)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


@dataclass(frozen=True)
class Record:
    """One task: ``question`` is the prompt (text, or chat messages ``[{role, content}]``),
    ``answer`` the reference answer (GSM8K's: reasoning ending in ``#### <number>``; any JSON
    type), ``columns`` every column of the source row but the prompt and the images (the answer
    and id included, under their column names), ``images`` the row's images as encoded bytes:
    those of ``data.image_field`` first, then those of the messages' image parts in order (each
    such part left in ``question`` as ``{"type": "image"}``)."""

    id: str
    question: Any  # str | list[dict[str, str | list[dict]]]
    answer: Any
    columns: Mapping[str, Any] = field(default_factory=dict, compare=True)
    images: tuple[bytes, ...] = ()

    @property
    def final_answer(self) -> str:
        """Text after the last ``####``, stripped (the whole answer if there is no marker)."""
        return extract_final_answer(cell_text(self.answer))

    @property
    def text(self) -> str:
        """The prompt as one text (:func:`prompt_text`)."""
        return prompt_text(self.question)

    __hash__ = None  # type: ignore[assignment]  # columns is a dict


def numeric_answer(answer: Any) -> str | None:  # noqa: ANN401
    """GSM8K's requirement (the ``gsm8k`` reward): a final number after ``####``, or a bare one."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        return f"must be text or a number for a numeric reward, got {type(answer).__name__}"
    final = extract_final_answer(str(answer))
    if parse_number(final) is None:
        shown = final if len(final) <= 40 else final[:37] + "..."
        return (f"has no parsable final number: expected a last line '{ANSWER_MARKER} <number>' "
                f"or a bare number, got {shown!r} (reward.fn=gsm8k needs one; another reward "
                "takes any answer)")
    return None


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


def content_id(question: Any, answer: Any, images: Sequence[bytes] = ()) -> str:  # noqa: ANN401
    """A row's id from its content (``data.id_field: null``): the same text over other pictures
    is another task."""
    if images:
        answer = [answer, [image_digest(p) for p in images]]
    if not (isinstance(question, str) and isinstance(answer, str)):
        question, answer = (json.dumps(v, sort_keys=True, default=str) for v in (question, answer))
    return hashlib.sha1(f"{question}\x1f{answer}".encode()).hexdigest()[:12]


def _prompt_problem(name: str, value: Any) -> str | None:  # noqa: ANN401
    """Why ``value`` is no prompt (text, or chat messages with a user turn), or None."""
    if value is None:
        return f"field {name!r} is null; every row needs a prompt"
    if isinstance(value, str):
        return None if value.strip() else f"field {name!r} is empty"
    if not isinstance(value, list | tuple) or not value:
        return (f"field {name!r} must be text or a list of chat messages "
                f"[{{role, content}}], got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str | list | tuple):
            return (f"field {name!r}: message {i} is not {{'role': ..., 'content': <text or "
                    "content parts>}")
        for j, part in enumerate(m["content"] if not isinstance(m["content"], str) else ()):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("text", *IMAGE_PARTS) or (
                    kind == "text" and not isinstance(part.get("text"), str)):
                return (f"field {name!r}: message {i}, part {j} is not {{'type': 'text', 'text': "
                        "...}, {'type': 'image', 'image': ...} or {'type': 'image_url', "
                        "'image_url': {'url': ...}}")
        if m.get("role") not in CHAT_ROLES:
            return (f"field {name!r}: message {i} has role {m.get('role')!r}; roles are "
                    f"{', '.join(CHAT_ROLES)}")
    if not any(m["role"] == "user" for m in value):
        return f"field {name!r}: the chat messages have no user message"
    return None


def _check_row(
    row: object, *, question_field: str, answer_field: str, id_field: str | None,
    answer_check: AnswerCheck | None = None, images: ImageSpec | None = None,
) -> tuple[Record | None, bool, list[str]]:
    """(record or None, whether its id was generated, reasons it is bad)."""
    if isinstance(row, BadRow):
        return None, False, [row.reason]
    if not isinstance(row, Mapping):
        return None, False, [f"expected an object with fields, got {type(row).__name__}"]

    reasons: list[str] = []
    for name, arg in ((question_field, "question_field"), (answer_field, "answer_field")):
        if name not in row:
            present = ", ".join(sorted(map(str, row.keys()))[:8]) or "none"
            reasons.append(f"missing field {name!r} (row has: {present}); "
                           f"if the column is named differently set data.{arg}=<name>")
    question, answer = row.get(question_field), row.get(answer_field)
    if question_field in row and (why := _prompt_problem(question_field, question)):
        reasons.append(why)
    if answer_field in row:
        if answer is None:  # a null cell (Parquet, datasets) or a JSON null
            reasons.append(f"field {answer_field!r} is null; every row needs an answer")
        elif isinstance(answer, str) and not answer.strip():
            reasons.append(f"field {answer_field!r} is empty")
        elif answer_check is not None and (why := answer_check(answer)):
            reasons.append(f"field {answer_field!r} {why}")
    raw_id = row.get(id_field) if id_field is not None else None
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))):
        reasons.append(
            f"field {id_field!r} must be a string or integer, got {type(raw_id).__name__}; "
            "set data.id_field: null to use content-hash ids")
    elif raw_id is not None and not str(raw_id).strip():
        reasons.append(f"field {id_field!r} is empty; set data.id_field: null to use "
                       "content-hash ids")
    spec = images or ImageSpec()
    pixels: list[bytes] = []
    if not reasons:
        pixels, reasons = field_images(row, spec)
    if reasons:
        return None, False, reasons
    if not isinstance(question, str):
        question, why = message_images(question, spec, question_field, pixels)
        if why:
            return None, False, why
    record_id = content_id(question, answer, pixels) if raw_id is None else str(raw_id)
    columns = {str(k): v for k, v in row.items() if k not in (question_field, spec.field)}
    return Record(record_id, question, answer, columns, tuple(pixels)), raw_id is None, []


def field_images(row: Mapping[str, Any], spec: ImageSpec) -> tuple[list[bytes], list[str]]:
    """The images of a row's ``data.image_field`` column (one reference or a list; none when
    the field is unset), each loaded and checked: (images, problems naming the field and the
    image). GRPO's records and SFT's examples read them alike."""
    if spec.field is None:
        return [], []
    refs = row.get(spec.field)
    if refs is None:
        return [], [f"field {spec.field!r} (data.image_field) is missing or null; every row "
                    "needs its image(s)"]
    pixels, problems = [], []
    for k, ref in enumerate(refs if isinstance(refs, list | tuple) else [refs]):
        try:
            pixels.append(load_image(ref, spec))
        except ImageError as exc:
            problems.append(f"field {spec.field!r}, image {k + 1}: {exc}")
    return pixels, problems


def message_images(messages: Sequence[Mapping[str, Any]], spec: ImageSpec, name: str,
                   pixels: list[bytes]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with each image part's image loaded into ``pixels`` and left as
    ``{"type": "image"}``; text-only part lists become plain text. (messages, problems)."""
    out, problems = [], []
    for i, m in enumerate(messages):
        content = m["content"]
        if not isinstance(content, str):
            parts = []
            for j, part in enumerate(content):
                if part["type"] == "text":
                    parts.append({"type": "text", "text": part["text"]})
                    continue
                ref = part.get("image") if part["type"] == "image" else part.get("image_url")
                try:
                    pixels.append(load_image(ref, spec))
                    parts.append({"type": "image"})
                except ImageError as exc:
                    problems.append(f"field {name!r}: message {i}, part {j}: {exc}")
            content = parts if any(p["type"] == "image" for p in parts) else content_text(parts)
        out.append({"role": m["role"], "content": content})
    return out, problems


def validate_numbered_rows(
    rows: Iterable[tuple[int, Mapping | BadRow]], source: str, *, question_field: str = "question",
    answer_field: str = "answer", id_field: str | None = "id", max_bad_fraction: float = 0.0,
    row_label: str = "row", note: str | None = None, answer_check: AnswerCheck | None = None,
    images: ImageSpec | None = None,
) -> tuple[list[Record], list[tuple[int, str]]]:
    """Like :func:`validate_records` for rows that carry their own numbers (JSONL lines); a
    :class:`BadRow` counts as bad with its reason. ``row_label`` names the unit in messages;
    ``note`` is appended to an error message (which file a row range came from); ``images``:
    how a row's images are read and checked (:class:`~rl_core.data.images.ImageSpec`)."""
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction must be within [0, 1], got {max_bad_fraction}")
    good: list[Record] = []
    problems: list[tuple[int, str]] = []
    seen: dict[str, int] = {}
    total = 0
    for number, row in rows:
        total += 1
        record, generated, reasons = _check_row(
            row, question_field=question_field, answer_field=answer_field, id_field=id_field,
            answer_check=answer_check, images=images)
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
    answer_check: AnswerCheck | None = None, images: ImageSpec | None = None,
) -> tuple[list[Record], list[tuple[int, str]]]:
    """Build records from raw rows; return (good records, [(1-based row number, reason)]). Ids
    missing (or ``id_field`` None): sha1 of question and answer, so identical rows are duplicates
    (the bad-row rules: docs/configuration.md, 'Data'). ``answer_check``: what the reward needs
    of an answer (:func:`numeric_answer` for ``gsm8k``; None: any non-null answer). Raises
    :class:`DataValidationError` above ``max_bad_fraction`` bad rows or when no row is good."""
    return validate_numbered_rows(
        enumerate(rows, start=1), source, question_field=question_field,
        answer_field=answer_field, id_field=id_field, max_bad_fraction=max_bad_fraction,
        answer_check=answer_check, images=images)


def records_digest(records: Sequence[Record]) -> str:
    """sha256 hex over a canonical serialisation of (id, question, answer, the columns where a
    record has any, the sha256 of each image where it has any); order-sensitive."""
    digest = hashlib.sha256(b"grpoflow.records.v1\n")
    for r in records:
        fields = [r.id, r.question, r.answer]
        if r.columns or r.images:
            fields.append(r.columns)
        if r.images:
            fields.append([image_digest(p) for p in r.images])
        line = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                          default=str)
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def cell_text(value: Any) -> str:  # noqa: ANN401
    """A value as text: text as is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def cell_texts(columns: Mapping[str, Any], skip: Sequence[str] = ()) -> dict[str, str]:
    """A row's columns as table cells (:func:`cell_text`; the sample tables)."""
    return {str(k): cell_text(v) for k, v in columns.items() if k not in skip}
