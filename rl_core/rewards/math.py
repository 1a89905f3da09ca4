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

__all__ = ["answers_equal", "extract_answer", "format_reward", "gsm8k_reward", "parse_number"]

_MINUS_SIGNS = "\u2212"  # unicode minus; models copy it from rendered LaTeX
_SIGN = rf"[-+{_MINUS_SIGNS}]"

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
    r"(?P<int>[0-9,]*)(?:\.(?P<frac>[0-9]*))?(?:[eE](?P<exp>[-+]?[0-9]+))?")
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
    """Return the final answer in ``text`` as it was written, or None if there is no number.

    Precedence (a rule that finds no number falls through to the next): 1. the first number
    after the *last* ``####``; 2. the first number inside the last ``\\boxed{...}`` (nested
    braces handled: ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); 3. the last number
    anywhere.

    The result is the number only (whitespace, ``$``, a trailing period, ``%`` and units
    dropped) in its own spelling (``"1,000"``, ``"-3/4"``, ``"1e3"``, unicode minus), so logs
    show what the model wrote. Digits glued to a word (``"mp3"``) are not numbers; a minus
    right after a digit (``"10-3"``) is subtraction, so only ``"3"`` is taken.
    """
    # LaTeX's "{,}" thousands separator would otherwise split "1{,}000" into two numbers.
    text = text.replace("{,}", ",")
    marker = text.rfind(_GSM8K_MARKER)
    if marker != -1 and (found := _first_number(text[marker + len(_GSM8K_MARKER):])) is not None:
        return found
    boxed = _boxed_content(text)
    if boxed is not None and (found := _first_number(boxed)) is not None:
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
    return Fraction(int(int_part + frac_part), 10 ** len(frac_part)) * Fraction(10) ** exponent


def _signed_part(text: str) -> Fraction | None:
    text = text.replace(" ", "")
    value = _decimal_to_fraction(text.lstrip("+-"))
    return None if value is None else -value if text.startswith("-") else value


def _divide(num: Fraction | None, den: Fraction | None) -> Fraction | None:
    return None if num is None or den is None or den == 0 else num / den


def _rest_is_unit(rest: str) -> bool:
    """Whether text after a number is a unit/punctuation rather than more of the number."""
    rest = rest.strip()
    if not rest:
        return True
    if rest[0].isalpha() or rest[0] == "°":  # "5 x 10^3" is not 5 followed by the unit "x"
        return _TIMES_POWER_RE.match(rest) is None
    if _UNIT_COMMAND_RE.match(rest) or _DEGREE_RE.match(rest):
        return True
    # Pure trailing punctuation ("42.", "42)!") is fine; anything with digits ("5-3",
    # "1/2/3", "1 1/2", "2^3") is an expression we do not evaluate.
    return not any(ch.isdigit() for ch in rest)


def parse_number(s: str) -> Fraction | None:
    """Parse a number string into an exact Fraction, or None if it is not one number.

    Accepted: thousands separators (``1,234,567.50``; LaTeX ``1{,}000`` / ``1\\,000``),
    decimals (``.5``, ``3.``), fractions (``3/4``, ``-3/4``, ``\\frac{3}{4}``, ``\\dfrac``,
    ``\\tfrac``), signs (``+5``, ``-5``, unicode ``−5``), currency (``$12``, ``-$5``, ``€3``),
    percent (``50%`` and ``50\\%`` are **50**: GSM8K references are written without it),
    scientific notation (``1e3``, ``2.5E-2``; exponents beyond ±1000 rejected), trailing units
    (``12 cm``, ``7kg``, ``3\\text{ m}``, ``90^\\circ``) and surrounding punctuation/markdown
    (``(42)``, ``**42**``, ``42.``, ``= 42``, ``#### 42``).

    Rejected (None): irregular comma groups (``1,23``, ``1234,567``, ``0,5``: thousands
    separator or decimal comma? no value is guessed); a zero denominator; digits after the
    number other than as part of it (``5-3``, ``1 1/2``, ``2^3``, ``5 x 10^3``); empty or
    number-free strings.
    """
    if not isinstance(s, str):
        return None
    text = s.strip()
    for minus in _MINUS_SIGNS:
        text = text.replace(minus, "-")
    text = _LATEX_NOISE_RE.sub("", text.replace("{,}", ",")).lstrip(_LEADING_JUNK)
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
    except ValueError:  # int() refuses strings past sys.get_int_max_str_digits(): junk
        return None
    if value is None:
        return None
    rest = text[m.end():]
    if percent := _PERCENT_RE.match(rest):
        rest = rest[percent.end():]
    if not _rest_is_unit(rest):
        return None
    return -value if m.group("sign") == "-" else value


def answers_equal(pred: str | None, ref: str) -> bool:
    """Whether ``pred`` and ``ref`` denote the same number.

    Both sides go through `parse_number`; a side that does not parse makes the answer wrong.
    Values compare exactly as Fractions (``"5.00" == "5"``, ``"0.5" == "1/2"``), except when
    either side is a decimal with 6 or more fractional digits: almost certainly a rounded
    non-terminating decimal (``0.333333`` for 1/3, a float artefact like
    ``0.30000000000000004``), so |a - b| <= 1e-6 is accepted. Integers and short decimals get
    no tolerance: ``1000000`` and ``1000001`` stay different.
    """
    if pred is None:
        return False
    a, b = parse_number(pred), parse_number(ref)
    if a is None or b is None:
        return False
    tolerant = _TOLERANCE_TRIGGER_RE.search(pred) or _TOLERANCE_TRIGGER_RE.search(ref)
    return a == b or bool(tolerant and abs(a - b) <= _TOLERANCE)


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 if the answer extracted from ``completion`` equals the reference, else 0.0.

    ``answer`` may be a full GSM8K solution (``"...\\n#### 72"``) or a bare number (``"72"``);
    it goes through the same `extract_answer`. A reference with no number scores 0.0.
    """
    ref = extract_answer(answer)
    return 1.0 if ref is not None and answers_equal(extract_answer(completion), ref) else 0.0


def format_reward(completion: str) -> float:
    """1.0 if the completion ends with a well-formed ``#### <number>`` line, else 0.0: the last
    ``####`` starts a line (only spaces/tabs before it), is followed on that line by one number
    `parse_number` accepts (an optional ``$`` before it), and then only whitespace (no units,
    no percent sign, no further text or lines)."""
    marker = completion.rfind(_GSM8K_MARKER)
    if marker == -1:
        return 0.0
    m = _FORMAT_LINE_RE.fullmatch(completion, completion.rfind("\n", 0, marker) + 1)
    return 0.0 if m is None or parse_number(m.group("num")) is None else 1.0
