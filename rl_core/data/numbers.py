"""Exact numbers from answer strings: `parse_number` turns "1,234.5", "3/4", "\\frac{1}{2}",
"$12", "50%" or "7 kg" into a `fractions.Fraction`, or None when the string is not one number.

Used where numeric answers are read: data validation (a row's final answer must parse) and the
math rewards (`rl_core.rewards.math`). Pure Python, total on `str` input, no float equality:
the rules are in `parse_number`'s docstring and docs/agents.md ("Reading a math answer").
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["MINUS_SIGNS", "parse_number"]

MINUS_SIGNS = "\u2212"  # unicode minus; models copy it from rendered LaTeX

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

    Accepted: thousands separators (``1,234.50``, ``1{,}000``, ``1\\,000``), decimals (``.5``,
    ``3.``), fractions (``-3/4``, ``\\frac``/``\\dfrac``/``\\tfrac``), signs (unicode ``−`` too),
    currency (``-$5``, ``€3``), percent (``50%`` is **50**, as GSM8K references write it),
    scientific notation (exponents within ±1000), trailing units (``7kg``, ``3\\text{ m}``,
    ``90^\\circ``), surrounding punctuation/markdown (``**42**``, ``= 42``, ``#### 42``). None:
    irregular comma groups (``1,23``, ``0,5``: no value is guessed), a zero denominator, further
    digits (``5-3``, ``1 1/2``, ``2^3``), empty or number-free strings.
    """
    if not isinstance(s, str):
        return None
    text = s.strip()
    for minus in MINUS_SIGNS:
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
