"""The builtin rewards beside math: exact and normalised match, a multiple-choice letter, a
regex (format) check, and (from :mod:`rl_core.rewards.code`) code run against unit tests in
the sandbox.

Each takes the completion and the reference answer as a user's single-sample reward does
(``code_tests`` is batched: it reads a test column); ``reward.args`` (or an ``extra`` entry's
``args``) become keyword arguments. The rules, with examples: docs/data-and-rewards.md.
Imports nothing heavy (reward workers import it); total on text: no answer scores 0.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Sequence
from typing import Any

from rl_core.rewards.code import code_tests  # the code reward lives with its harness

__all__ = ["code_tests", "exact_match", "final_text", "multiple_choice", "normalize",
           "normalized_match", "regex_match"]

_FINAL_MARKERS = ("####", "Answer:", "answer:", "ANSWER:")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CHOICE_PATTERNS = (
    r"answer\s*(?:is|:)?\s*\(?([A-Z])\)?(?![A-Za-z])",  # "the answer is (B)", "Answer: B"
    r"^\s*\(?([A-Z])\)?[.):]?\s*$",  # a line that is just "B", "(B)", "B."
)


def final_text(completion: str) -> str:
    r"""The answer part of a completion: after the last ``####`` or ``Answer:``, else the last
    ``\boxed{...}``, else the last non-empty line; stripped."""
    for marker in _FINAL_MARKERS:
        head, found, tail = completion.rpartition(marker)
        if found:
            return tail.strip().splitlines()[0].strip() if tail.strip() else ""
    if boxed := _BOXED.findall(completion):
        return boxed[-1].strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _answer_text(answer: Any) -> str:  # noqa: ANN401
    return answer if isinstance(answer, str) else json.dumps(answer)


def exact_match(completion: str, answer: Any) -> float:  # noqa: ANN401
    """1.0 when the completion's final answer (:func:`final_text`) is the reference answer
    exactly (a non-text answer compared as its JSON text), else 0.0."""
    return float(final_text(completion) == _answer_text(answer).strip())


def normalize(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the removed, whitespace collapsed (the
    SQuAD normalisation)."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalized_match(completion: str, answer: Any, *, aliases: Sequence[str] = ()) -> float:  # noqa: ANN401
    """1.0 when the normalised final answer equals the normalised reference (or one of a list
    of acceptable answers, when the answer is a list, or ``aliases``), else 0.0."""
    refs = answer if isinstance(answer, list) else [answer]
    wanted = {normalize(_answer_text(r)) for r in [*refs, *aliases]}
    return float(normalize(final_text(completion)) in wanted)


def _letter(answer: Any, letters: str) -> str | None:  # noqa: ANN401
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(letters):
        return letters[answer]  # a 0-based index, as many datasets store the label
    text = _answer_text(answer).strip().strip("().").upper()
    return text if len(text) == 1 and text in letters else None


def multiple_choice(completion: str, answer: Any, *, letters: str = "ABCDE") -> float:  # noqa: ANN401
    """1.0 when the letter the completion picks (``Answer: B``, ``(B)``, a line that is just
    ``B``; the last such) is the reference: a letter, or a 0-based index into ``letters``."""
    want = _letter(answer, letters)
    if want is None:
        return 0.0
    picked = None
    for pattern in _CHOICE_PATTERNS:
        found = [m for m in re.findall(pattern, completion, re.MULTILINE | re.IGNORECASE)
                 if m.upper() in letters]
        if found:
            picked = found[-1].upper()
            break
    return float(picked == want)


def regex_match(completion: str, answer: Any = None, *, pattern: str,  # noqa: ANN401
                fullmatch: bool = False) -> float:
    """1.0 when ``pattern`` is found in the completion (``fullmatch``: matches all of it,
    surrounding whitespace aside): a format reward. Multi-line mode: ``^``/``$`` match at
    line ends."""
    regex = re.compile(pattern, re.MULTILINE | re.DOTALL)
    hit = regex.fullmatch(completion.strip()) if fullmatch else regex.search(completion)
    return float(hit is not None)
