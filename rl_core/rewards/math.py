"""Answer extraction and numeric equivalence for math-word-problem rewards (GSM8K style).

What this module is for: turning a model completion into a final numeric answer string
(`extract_answer`), turning such strings into exact rationals (`parse_number`), and deciding
whether two answers mean the same number (`answers_equal`). The builtin reward functions
`gsm8k_reward` and `format_reward` are built from these.

What it must never do: import prefect, mlflow, torch or anything heavy (it is imported by
reward worker subprocesses, whose start-up time is paid again after every timeout); use
floating point for equality (values are `fractions.Fraction`, so "0.1 + 0.2" style rounding
never decides a reward); or raise on arbitrary model output (every public function is total
on `str` input and signals "no answer" with None / 0.0).

Decisions other modules rely on (see each docstring for detail):

* `50%` parses as 50, not 0.5 (GSM8K references are written without the percent sign).
* `1,23` and other irregular comma groupings are rejected (None), never read as 123 or 1.23.
* Mixed numbers (`1 1/2`) and `a \\times 10^b` notation are not supported.
* Decimals written with 6 or more fractional digits compare with an absolute tolerance of
  1e-6 (so `0.333333` equals `1/3`); everything else compares exactly.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "answers_equal",
    "extract_answer",
    "format_reward",
    "gsm8k_reward",
    "parse_number",
]

_MINUS_SIGNS = "\u2212"  # unicode minus; models copy it from rendered LaTeX
_SIGN = rf"[-+{_MINUS_SIGNS}]"

# Regexes use [0-9], not \d: \d also matches other scripts' digits, which int() accepts but
# no reference answer uses, so a match there is far more likely noise than an answer.
_INT_COMMAS = r"[0-9]+(?:,[0-9]+)*"
_UNSIGNED_DECIMAL = rf"(?:{_INT_COMMAS}(?:\.[0-9]+)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_LATEX_FRAC = (
    r"\\[dt]?frac\s*\{\s*[-+\u2212]?\s*[0-9]+(?:\.[0-9]+)?\s*\}"
    r"\s*\{\s*[-+\u2212]?\s*[0-9]+(?:\.[0-9]+)?\s*\}"
)
# Possessive so "3/45.6" cannot backtrack to "3/4"; a sentence-final period is allowed.
_PLAIN_FRAC = r"[0-9]++/[0-9]++(?!\.[0-9])"

# A number as it appears in free text. The look-behind keeps digits glued to a word
# ("mp3", "x2") or to a previous number ("1.2.3") from being read as an answer; a sign
# directly after a digit ("10-3") is a binary minus, so only the "3" is taken there.
_TOKEN_RE = re.compile(
    rf"(?<![\w.])(?:{_SIGN}(?:\\?\$)?)?(?:{_LATEX_FRAC}|{_PLAIN_FRAC}|{_UNSIGNED_DECIMAL})"
)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_CLEAN_TOKEN_RE = re.compile(r"\\?\$|\s+")

_GSM8K_MARKER = "####"
_FORMAT_LINE_RE = re.compile(
    rf"[ \t]*{_GSM8K_MARKER}[ \t]*(?:\\?\$)?(?P<num>{_SIGN}?(?:{_LATEX_FRAC}|{_PLAIN_FRAC}|"
    rf"{_UNSIGNED_DECIMAL}))\s*"
)

# parse_number: the whole string is one number, optionally wrapped in punctuation/units.
_NUM_PART = r"[0-9]+(?:,[0-9]+)*(?:\.[0-9]+)?"
_PARSE_RE = re.compile(
    rf"""
    (?P<sign>[-+])?\s*
    (?:
        \\[dt]?frac\s*\{{\s*(?P<lnum>[-+]?\s*{_NUM_PART})\s*\}}
                   \s*\{{\s*(?P<lden>[-+]?\s*{_NUM_PART})\s*\}}
      | (?P<fnum>{_NUM_PART})\s*/\s*(?P<fden>{_NUM_PART})
      | (?P<dec>(?:[0-9]+(?:,[0-9]+)*(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)
    )
    """,
    re.VERBOSE,
)
_PERCENT_RE = re.compile(r"\s*\\?%")
_THOUSANDS_RE = re.compile(r"[1-9][0-9]{0,2}(?:,[0-9]{3})+")
_DECIMAL_SPLIT_RE = re.compile(
    r"(?P<int>[0-9,]*)(?:\.(?P<frac>[0-9]*))?(?:[eE](?P<exp>[-+]?[0-9]+))?"
)
_LATEX_NOISE_RE = re.compile(r"\\[,!;: ]|\\[()\[\]]|\\\$|[$€£¥₹]")
_UNIT_COMMAND_RE = re.compile(r"\\(?:text|mathrm|textrm|textbf|mbox|operatorname|circ|degree)\b")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ")
_TIMES_POWER_RE = re.compile(r"(?:x|×|\\times|\\cdot)\s*[0-9]")
_LEADING_JUNK = " \t\r\n([{<\"'*_:=#~`"
# Beyond this an exponent is a denial-of-service (10**10**9), not an answer.
_MAX_EXPONENT = 1000
_TOLERANCE_TRIGGER_RE = re.compile(r"\.[0-9]{6,}")
_TOLERANCE = Fraction(1, 10**6)


def _clean_token(token: str) -> str:
    return _CLEAN_TOKEN_RE.sub("", token)


def _first_number(text: str) -> str | None:
    m = _TOKEN_RE.search(text)
    return _clean_token(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    last = None
    for m in _TOKEN_RE.finditer(text):
        last = m
    return _clean_token(last.group(0)) if last else None


def _boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced.

    An unclosed box (generation cut off) yields everything after the opening brace, since
    the answer usually comes first inside it. Escaped braces (``\\{``) do not count.
    """
    starts = list(_BOXED_RE.finditer(text))
    if not starts:
        return None
    begin = starts[-1].end()
    depth = 1
    i = begin
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
    """Return the final answer in ``text`` as it was written, or None if there is no number.

    Order of precedence:

    1. GSM8K marker: the first number after the *last* ``####``.
    2. ``\\boxed{...}``: the first number inside the last box (nested braces handled, so
       ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``).
    3. The last number anywhere in the text.

    A rule that finds no number falls through to the next one. The returned string is the
    number only: surrounding whitespace, ``$``, a trailing period, ``%`` and units are
    dropped, but the number keeps its spelling (``"1,000"``, ``"-3/4"``, ``"1e3"``,
    ``"\\frac{1}{2}"``, unicode minus) so that logs show what the model wrote. Digits glued
    to the end of a word (``"mp3"``) are not numbers; a minus right after a digit
    (``"10-3"``) is read as subtraction, so only ``"3"`` is taken.
    """
    # LaTeX's "{,}" thousands separator would otherwise split "1{,}000" into two numbers.
    text = text.replace("{,}", ",")
    marker = text.rfind(_GSM8K_MARKER)
    if marker != -1:
        found = _first_number(text[marker + len(_GSM8K_MARKER) :])
        if found is not None:
            return found
    boxed = _boxed_content(text)
    if boxed is not None:
        found = _first_number(boxed)
        if found is not None:
            return found
    return _last_number(text)


def _decimal_to_fraction(text: str) -> Fraction | None:
    m = _DECIMAL_SPLIT_RE.fullmatch(text)
    assert m is not None  # callers only pass text their own regex matched as a decimal
    int_part, frac_part, exp = m.group("int"), m.group("frac") or "", m.group("exp")
    if "," in int_part:
        # Only regular thousands groups: "1,23" could be 123 or 1.23 (European decimal
        # comma); guessing would hand out rewards for answers the model never gave.
        if not _THOUSANDS_RE.fullmatch(int_part):
            return None
        int_part = int_part.replace(",", "")
    exponent = int(exp) if exp else 0
    if abs(exponent) > _MAX_EXPONENT:
        return None
    value = Fraction(int(int_part + frac_part), 10 ** len(frac_part))
    return value * Fraction(10) ** exponent


def _signed_part(text: str) -> Fraction | None:
    text = text.replace(" ", "")
    negative = text.startswith("-")
    value = _decimal_to_fraction(text.lstrip("+-"))
    if value is None:
        return None
    return -value if negative else value


def _divide(num: Fraction | None, den: Fraction | None) -> Fraction | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def _rest_is_unit(rest: str) -> bool:
    """Whether text after a number is a unit/punctuation rather than more of the number."""
    rest = rest.strip()
    if not rest:
        return True
    if rest[0].isalpha() or rest[0] == "°":
        # "5 x 10^3" would otherwise read as 5 followed by the unit "x".
        return _TIMES_POWER_RE.match(rest) is None
    if _UNIT_COMMAND_RE.match(rest) or _DEGREE_RE.match(rest):
        return True
    # Pure trailing punctuation ("42.", "42)!") is fine; anything with digits ("5-3",
    # "1/2/3", "1 1/2", "2^3") is an expression we do not evaluate.
    return not any(ch.isdigit() for ch in rest)


def parse_number(s: str) -> Fraction | None:
    """Parse a number string into an exact Fraction, or None if it is not one number.

    Accepted: thousands separators (``1,234,567.50``; also LaTeX ``1{,}000`` / ``1\\,000``),
    decimals (``.5``, ``3.``), fractions (``3/4``, ``-3/4``, ``\\frac{3}{4}``, ``\\dfrac``,
    ``\\tfrac``), signs (``+5``, ``-5``, unicode minus ``−5``), currency (``$12``, ``-$5``,
    ``€3``), percent (``50%`` and ``50\\%`` are **50**: GSM8K convention, references are
    written without the sign), scientific notation (``1e3``, ``2.5E-2``; exponents beyond
    ±1000 are rejected), trailing units (``12 cm``, ``5 dollars``, ``7kg``,
    ``3\\text{ m}``, ``90^\\circ``) and surrounding punctuation/markdown (``(42)``,
    ``**42**``, ``42.``, ``= 42``, ``#### 42``).

    Rejected (None): irregular comma groups such as ``1,23``, ``1234,567`` or ``0,5`` —
    these are ambiguous between a thousands separator and a decimal comma, so no value is
    guessed; a zero denominator; anything where digits follow the number other than as part
    of it (``5-3``, ``1 1/2``, ``2^3``, ``5 x 10^3``); empty or number-free strings.
    """
    if not isinstance(s, str):
        return None
    text = s.strip()
    for minus in _MINUS_SIGNS:
        text = text.replace(minus, "-")
    text = text.replace("{,}", ",")
    text = _LATEX_NOISE_RE.sub("", text).lstrip(_LEADING_JUNK)
    m = _PARSE_RE.match(text)
    if m is None:
        return None
    try:
        if m.group("dec") is not None:
            value = _decimal_to_fraction(m.group("dec"))
        elif m.group("fnum") is not None:
            value = _divide(_signed_part(m.group("fnum")), _signed_part(m.group("fden")))
        else:
            value = _divide(_signed_part(m.group("lnum")), _signed_part(m.group("lden")))
    except ValueError:
        # int() refuses strings past sys.get_int_max_str_digits(); such a "number" is junk.
        return None
    if value is None:
        return None
    rest = text[m.end() :]
    percent = _PERCENT_RE.match(rest)
    if percent:
        rest = rest[percent.end() :]
    if not _rest_is_unit(rest):
        return None
    return -value if m.group("sign") == "-" else value


def answers_equal(pred: str | None, ref: str) -> bool:
    """Whether ``pred`` and ``ref`` denote the same number.

    Both sides go through `parse_number`; a side that does not parse makes the answer wrong.
    Values compare exactly as Fractions (``"5.00" == "5"``, ``"0.5" == "1/2"``), except when
    either side is written as a decimal with 6 or more fractional digits: such a value is
    almost certainly a rounded non-terminating decimal (``0.333333`` for 1/3, or a float
    artefact like ``0.30000000000000004``), so an absolute difference of at most 1e-6 is
    accepted. Integers and short decimals never get a tolerance, so ``1000000`` and
    ``1000001`` stay different.
    """
    if pred is None:
        return False
    a = parse_number(pred)
    b = parse_number(ref)
    if a is None or b is None:
        return False
    if a == b:
        return True
    if _TOLERANCE_TRIGGER_RE.search(pred) or _TOLERANCE_TRIGGER_RE.search(ref):
        return abs(a - b) <= _TOLERANCE
    return False


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 if the answer extracted from ``completion`` equals the reference, else 0.0.

    ``answer`` may be a full GSM8K solution (``"...\\n#### 72"``) or a bare number
    (``"72"``); it goes through the same `extract_answer` as the completion. A reference
    with no number in it scores every completion 0.0.
    """
    ref = extract_answer(answer)
    if ref is None:
        return 0.0
    return 1.0 if answers_equal(extract_answer(completion), ref) else 0.0


def format_reward(completion: str) -> float:
    """1.0 if the completion ends with a well-formed ``#### <number>`` line, else 0.0.

    Well-formed means: the last ``####`` in the text starts a line (only spaces/tabs before
    it on that line), is followed on the same line by one number that `parse_number`
    accepts (an optional ``$`` before it is allowed), and nothing but whitespace comes after
    the number — no units, no percent sign, no further text or lines.
    """
    marker = completion.rfind(_GSM8K_MARKER)
    if marker == -1:
        return 0.0
    line_start = completion.rfind("\n", 0, marker) + 1
    m = _FORMAT_LINE_RE.fullmatch(completion, line_start)
    if m is None or parse_number(m.group("num")) is None:
        return 0.0
    return 1.0
