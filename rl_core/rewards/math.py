"""Answer extraction and numeric equivalence for math-word-problem rewards (GSM8K style).

`extract_answer` (completion -> answer string), `parse_number` (-> exact Fraction),
`answers_equal`, and the builtin rewards `gsm8k_reward` and `format_reward` built on them; the
rules (precedence, spellings, tolerance): docs/agents.md, 'Reward functions'. Imports nothing
heavy (reward workers import it); never uses floats for equality; every public function is
total on ``str`` and signals "no answer" with None / 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rl_core.data.numbers import MINUS_SIGNS, parse_number

__all__ = ["answers_equal", "extract_answer", "format_reward", "gsm8k_reward", "parse_number"]

_SIGN = rf"[-+{MINUS_SIGNS}]"

# Regexes use [0-9], not \d: \d also matches other scripts' digits, which int() accepts but
# no reference answer uses, so a match there is far more likely noise than an answer.
_INT_COMMAS = r"[0-9]+(?:,[0-9]+)*"
_UNSIGNED_DECIMAL = rf"(?:{_INT_COMMAS}(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_LATEX_FRAC = (r"\\[dt]?frac\s*\{\s*[-+\u2212]?\s*[0-9]+(?:\.[0-9]+)?\s*\}"
               r"\s*\{\s*[-+\u2212]?\s*[0-9]+(?:\.[0-9]+)?\s*\}")
# Possessive so "3/45.6" cannot backtrack to "3/4"; a sentence-final period is allowed.
_PLAIN_FRAC = r"[0-9]++/[0-9]++(?!\.[0-9])"

# A number as it appears in free text. The look-behind keeps digits glued to a word
# ("mp3", "x2") or to a previous number ("1.2.3") from being read as an answer; a sign
# directly after a digit ("10-3") is a binary minus, so only the "3" is taken there.
_NUMBER = rf"(?:{_LATEX_FRAC}|{_PLAIN_FRAC}|{_UNSIGNED_DECIMAL})"
_TOKEN_RE = re.compile(rf"(?<![\w.])(?:{_SIGN}(?:\\?\$)?)?{_NUMBER}")
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_CLEAN_TOKEN_RE = re.compile(r"\\?\$|\s+")

_GSM8K_MARKER = "####"
_FORMAT_LINE_RE = re.compile(
    rf"[ \t]*{_GSM8K_MARKER}[ \t]*(?:\\?\$)?(?P<num>{_SIGN}?{_NUMBER})\s*")

_TOLERANCE_TRIGGER_RE = re.compile(r"\.[0-9]{6,}")
_TOLERANCE = Fraction(1, 10**6)


def _clean_token(token: str) -> str:
    return _CLEAN_TOKEN_RE.sub("", token)


def _first_number(text: str) -> str | None:
    m = _TOKEN_RE.search(text)
    return _clean_token(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    found = _TOKEN_RE.findall(text)
    return _clean_token(found[-1]) if found else None


def _boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, nested braces balanced; escaped braces (``\\{``)
    do not count. An unclosed box (generation cut off) yields everything after its brace."""
    starts = list(_BOXED_RE.finditer(text))
    if not starts:
        return None
    begin = i = starts[-1].end()
    depth = 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return text[begin:]


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``, the number only in its own spelling, or None: the first
    number after the last ``####``, else in the last ``\\boxed{}``, else the last one."""
    # LaTeX's "{,}" thousands separator would otherwise split "1{,}000" into two numbers.
    text = text.replace("{,}", ",")
    marker = text.rfind(_GSM8K_MARKER)
    if marker != -1 and (found := _first_number(text[marker + len(_GSM8K_MARKER):])) is not None:
        return found
    boxed = _boxed_content(text)
    if boxed is not None and (found := _first_number(boxed)) is not None:
        return found
    return _last_number(text)


def answers_equal(pred: str | None, ref: str) -> bool:
    """Whether ``pred`` and ``ref`` denote the same number: exact Fractions, or within 1e-6 when
    either is a decimal with 6+ fractional digits; a side that does not parse is wrong."""
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(ref)
    if a is None or b is None:
        return False
    tolerant = _TOLERANCE_TRIGGER_RE.search(pred) or _TOLERANCE_TRIGGER_RE.search(ref)
    return a == b or bool(tolerant and abs(a - b) <= _TOLERANCE)


def gsm8k_reward(completion: str, answer: str | int | float) -> float:
    """1.0 if the answer extracted from ``completion`` equals the reference's, else 0.0
    (``answer``: a full GSM8K solution, a bare number, or a number; one with no number scores
    0.0)."""
    ref = extract_answer(answer if isinstance(answer, str) else str(answer))
    return 1.0 if ref is not None and answers_equal(extract_answer(completion), ref) else 0.0


def format_reward(completion: str) -> float:
    """1.0 if the completion ends with a well-formed ``#### <number>`` line (the last ``####``
    starts it; one number, an optional ``$``, then only whitespace), else 0.0."""
    marker = completion.rfind(_GSM8K_MARKER)
    if marker == -1:
        return 0.0
    m = _FORMAT_LINE_RE.fullmatch(completion, completion.rfind("\n", 0, marker) + 1)
    return 0.0 if m is None or parse_number(m.group("num")) is None else 1.0
