"""Tests for rl_core.rewards: answer extraction, numeric equivalence and the reward runner.

What this file is for: pinning the answer-parsing conventions other modules rely on with
hand-computed expectations, and proving that RewardRunner bounds bad user functions (raise,
hang, crash, NaN, memory) without raising or blocking the caller.

What it must never do: import prefect or mlflow, or take long — hangs are bounded by
timeouts of at most a second or two and the whole file runs in well under 20 s.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import time
from fractions import Fraction
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from rl_core.rewards import (
    BUILTIN_REWARDS,
    RewardResult,
    RewardRunner,
    answers_equal,
    extract_answer,
    format_reward,
    gsm8k_reward,
    load_reward_fn,
    parse_number,
)
from rl_core.rewards import runner as runner_mod

TESTS_DIR = Path(__file__).resolve().parent

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


@pytest.fixture(autouse=True)
def plugins_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker subprocesses receive sys.path at start-up, so this reaches them too.
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def _process_gone(pid: int, within_s: float = 3.0) -> bool:
    """True once `pid` no longer runs (absent, or a zombie nobody has reaped yet)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _write_module(directory: Path, name: str, body: str) -> str:
    (directory / f"{name}.py").write_text(body)
    return name


# ----------------------------------------------------------------------------- extract_answer

EXTRACT_CASES = [
    # GSM8K marker
    (GSM8K_ANSWER, "72"),
    ("#### 5\nWait, let me recheck.\n#### 7", "7"),
    ("#### 1,000", "1,000"),
    ("####-3", "-3"),
    ("#### 3/4", "3/4"),
    ("#### $1,234.50.", "1,234.50"),
    ("#### 12 cm", "12"),
    ("#### \u22123", "\u22123"),
    ("#### 50%", "50"),
    ("#### -0.75", "-0.75"),
    ("#### 72 apples and 3 pears", "72"),
    ("#### 1e3", "1e3"),
    ("#### -$5", "-5"),
    ("Total is 9.\n#### \n", "9"),
    ("Answer:\r\n#### 42\r\n", "42"),
    ("####\n42", "42"),
    ("##### 9", "9"),
    ("\\boxed{5}\n#### 6", "6"),
    # \boxed
    ("\\boxed{42}", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("so \\boxed{-\\dfrac{3}{4}} here", "-\\dfrac{3}{4}"),
    ("\\boxed{1,000}", "1,000"),
    ("\\boxed{\\$18}", "18"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{\\text{72 apples}}", "72"),
    ("First \\boxed{3}, then \\boxed{4}.", "4"),
    ("The answer is \\boxed{5}, not 7.", "5"),
    ("Answer: \\boxed{12", "12"),
    ("\\boxed{} so 8", "8"),
    ("\\boxed{\\{1\\}} 2", "1"),
    # last number
    ("The answer is 42.", "42"),
    ("no number here", None),
    ("", None),
    ("mp3 and x2 and H2O", None),
    ("item42 costs 7 dollars", "7"),
    ("He came 3rd", "3"),
    ("It weighs 7kg.", "7"),
    ("Speed is 1.5e-3 m/s", "1.5e-3"),
    ("It is \u22124 degrees", "\u22124"),
    ("The rate is 50%.", "50"),
    ("We get 10-3", "3"),
    ("x is .5", ".5"),
    ("value is +5", "+5"),
    ("She paid $1,234.56 in total", "1,234.56"),
    ("1{,}000 apples", "1,000"),
    ("half is 3/4.", "3/4"),
    ("ambiguous 1,23", "1,23"),
    ("Steps: 1. add 2. subtract\nResult: 15", "15"),
    ("between 3 and 4\n\n", "4"),
    ("The ratio is 2:3", "3"),
    ("version 1.2.3", "1.2"),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACT_CASES)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


# ----------------------------------------------------------------------------- parse_number

PARSE_CASES = [
    ("1,000", Fraction(1000)),
    ("1,234,567.50", Fraction(246913500, 200)),
    (".5", Fraction(1, 2)),
    ("3.", Fraction(3)),
    ("3/4", Fraction(3, 4)),
    ("-3/4", Fraction(-3, 4)),
    ("3 / 4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)),
    ("\\dfrac{3}{4}", Fraction(3, 4)),
    ("-\\frac{3}{4}", Fraction(-3, 4)),
    ("\\frac{-3}{4}", Fraction(-3, 4)),
    ("\\tfrac{1.5}{3}", Fraction(1, 2)),
    ("+5", Fraction(5)),
    ("-5", Fraction(-5)),
    ("\u22125", Fraction(-5)),
    ("$12", Fraction(12)),
    ("-$5", Fraction(-5)),
    ("$-5", Fraction(-5)),
    ("\u20ac3", Fraction(3)),
    ("50%", Fraction(50)),
    ("50\\%", Fraction(50)),
    ("12 cm", Fraction(12)),
    ("5 dollars", Fraction(5)),
    ("7kg", Fraction(7)),
    ("3\\text{ m}", Fraction(3)),
    ("90^\\circ", Fraction(90)),
    ("1e3", Fraction(1000)),
    ("2.5E-2", Fraction(1, 40)),
    ("(42)", Fraction(42)),
    ("**42**", Fraction(42)),
    ("42.", Fraction(42)),
    ("= 42", Fraction(42)),
    ("#### 72", Fraction(72)),
    ("1{,}000", Fraction(1000)),
    ("1\\,000", Fraction(1000)),
    ("{5}", Fraction(5)),
    ("1,23", None),
    ("1,23/4", None),
    ("1234,567", None),
    ("0,5", None),
    ("1,2,3", None),
    ("5-3", None),
    ("1 1/2", None),
    ("1/2/3", None),
    ("2^3", None),
    ("5 x 10^3", None),
    ("1/0", None),
    ("\\frac{1}{0}", None),
    ("abc", None),
    ("", None),
    ("-", None),
    ("--5", None),
    ("1e2000", None),
    ("1" * 5000, None),
]


@pytest.mark.parametrize(("text", "expected"), PARSE_CASES)
def test_parse_number(text: str, expected: Fraction | None) -> None:
    assert parse_number(text) == expected


def test_parse_number_rejects_non_strings() -> None:
    assert parse_number(5) is None  # type: ignore[arg-type]


EQUAL_CASES = [
    ("1,000", "1000", True),
    ("0.5", "1/2", True),
    ("-3", "\u22123", True),
    ("5.00", "5", True),
    ("$12", "12", True),
    ("7 cm", "7", True),
    ("1e3", "1000", True),
    ("\\frac{3}{4}", "0.75", True),
    ("\\dfrac{1}{4}", ".25", True),
    ("50%", "50", True),
    ("+5", "5", True),
    ("3.", "3", True),
    ("1,234,567.50", "1234567.5", True),
    ("-3/4", "-0.75", True),
    ("**42**", "42", True),
    ("5 dollars", "5", True),
    ("-$5", "-5", True),
    ("2.5E-2", "0.025", True),
    # >= 6 fractional digits: rounded value, 1e-6 absolute tolerance
    ("0.333333", "1/3", True),
    ("2.666667", "8/3", True),
    ("0.30000000000000004", "0.3", True),
    ("1/3", "0.3333333", True),
    # not equal
    ("0.333330", "1/3", False),
    ("0.33333", "1/3", False),
    ("1000001", "1000000", False),
    ("1000000.000000", "1000001", False),
    ("1,23", "123", False),
    ("1,23", "1.23", False),
    ("50%", "0.5", False),
    ("0.5", "5", False),
    ("-3", "3", False),
    ("abc", "abc", False),
    ("5-3", "2", False),
    ("1 1/2", "1.5", False),
    (None, "5", False),
    ("5", "", False),
]


@pytest.mark.parametrize(("pred", "ref", "expected"), EQUAL_CASES)
def test_answers_equal(pred: str | None, ref: str, expected: bool) -> None:
    assert answers_equal(pred, ref) is expected


# ----------------------------------------------------------------------------- builtin rewards


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", GSM8K_ANSWER, 1.0),
        ("The answer is \\boxed{72}.", GSM8K_ANSWER, 1.0),
        ("48 + 24 = 72", GSM8K_ANSWER, 1.0),
        ("#### 71", GSM8K_ANSWER, 0.0),
        ("I am not sure.", GSM8K_ANSWER, 0.0),
        ("#### 72.00", "72", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("#### $1,000", "Reasoning.\n#### 1000", 1.0),
        ("#### -4", "\u22124", 1.0),
        ("#### 72", "no reference number", 0.0),
        ("#### 1,23", "123", 0.0),
    ],
)
def test_gsm8k_reward(completion: str, answer: str, expected: float) -> None:
    assert gsm8k_reward(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Reasoning\n#### 72", 1.0),
        ("#### 72\n", 1.0),
        ("  #### -3/4  \n\n", 1.0),
        ("#### $18", 1.0),
        ("#### 1,000", 1.0),
        ("#### 0.5", 1.0),
        ("first try #### 5\n#### 6", 1.0),
        ("#### 72 apples", 0.0),
        ("#### 50%", 0.0),
        ("so #### 72", 0.0),
        ("#### 1,23", 0.0),
        ("#### 5\nmore text", 0.0),
        ("####\n72", 0.0),
        ("#### ", 0.0),
        ("The answer is 72.", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward(completion) == expected


# ----------------------------------------------------------------------------- load_reward_fn


def test_load_builtin_rewards() -> None:
    assert load_reward_fn("gsm8k") is gsm8k_reward
    assert load_reward_fn(" gsm8k ") is gsm8k_reward
    fmt = load_reward_fn("format")
    assert fmt is BUILTIN_REWARDS["format"]
    assert fmt("x\n#### 5", "ignored") == 1.0
    assert fmt("x", "5") == 0.0


def test_load_dotted_path() -> None:
    import reward_plugins

    fn = load_reward_fn("reward_plugins:length_reward")
    assert fn is reward_plugins.length_reward
    assert fn("x" * 30, "") == pytest.approx(0.3)
    assert load_reward_fn("reward_plugins:Scorer.score")("a", "b") == 0.5


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty"),
        ("bogus", "unknown reward spec"),
        ("a:b:c", "unknown reward spec"),
        (":fn", "unknown reward spec"),
        ("no_such_module_xyz:fn", "not found"),
        ("reward_plugins:missing", "has no attribute"),
        ("reward_plugins:Scorer.nope", "has no attribute"),
        ("reward_plugins:NOT_CALLABLE", "not callable"),
        ("reward_plugins:one_arg", "matches neither reward form"),
    ],
)
def test_load_reward_fn_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        load_reward_fn(spec)
    message = str(info.value)
    assert fragment in message
    assert repr(spec) in message
    assert "Fix:" in message


def test_load_reward_fn_missing_attribute_lists_callables() -> None:
    with pytest.raises(ValueError, match="bool_reward, die_on_marker"):
        load_reward_fn("reward_plugins:missing")


def test_load_reward_fn_non_string() -> None:
    with pytest.raises(ValueError, match="not a string"):
        load_reward_fn(None)  # type: ignore[arg-type]


def test_load_reward_fn_import_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = _write_module(tmp_path, "rw_broken_mod", "raise RuntimeError('bad import')\n")
    with pytest.raises(ValueError, match="raised RuntimeError: bad import"):
        load_reward_fn(f"{broken}:fn")
    needy = _write_module(tmp_path, "rw_needy_mod", "import no_such_dependency_xyz\n")
    with pytest.raises(ValueError, match="module it needs is missing"):
        load_reward_fn(f"{needy}:fn")


def test_load_reward_fn_uninspectable_callable() -> None:
    # Some C builtins (max) have no introspectable signature; loading must still work.
    assert load_reward_fn("builtins:max")("a", "b") == "b"


# ----------------------------------------------------------------------------- RewardRunner


def test_runner_builtin_inline_with_format_weight() -> None:
    with RewardRunner("gsm8k", format_weight=0.5) as runner:
        assert not runner.isolated
        assert runner.worker_pids == []
        result = runner.score(
            ["x\n#### 72", "the answer is 72", "#### 5", "#### 1,23"], ["72", "72", "72", "123"]
        )
    assert result.scores == [1.5, 1.0, 0.5, 0.0]
    assert result.correct == [True, True, False, False]
    assert (result.num_errors, result.num_timeouts, result.errors) == (0, 0, [])


def test_runner_builtin_guards_bad_inputs() -> None:
    runner = RewardRunner("gsm8k")
    result = runner.score([None, "#### 6"], ["5", "6"])  # type: ignore[list-item]
    assert result.scores == [0.0, 1.0]
    assert result.correct == [False, True]
    assert result.num_errors == 1
    assert "AttributeError" in result.errors[0]
    assert result.errors[0].startswith("sample 0: ")


def test_runner_format_spec() -> None:
    result = RewardRunner("format").score(["#### 5", "5"], ["1", "5"])
    assert result.scores == [1.0, 0.0]
    assert result.correct == [True, False]  # correct: the function scored >= pass_threshold


def test_runner_validates_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(timeout_s=0)
    with pytest.raises(ValueError, match="format_weight"):
        RewardRunner(format_weight=float("nan"))
    with pytest.raises(ValueError, match="max_workers"):
        RewardRunner(max_workers=0)
    with pytest.raises(ValueError, match="start_timeout_s"):
        RewardRunner(start_timeout_s=0)
    with pytest.raises(ValueError, match="memory_limit_mb must"):
        RewardRunner("reward_plugins:length_reward", memory_limit_mb=0)
    with pytest.raises(ValueError, match="isolate=True"):
        RewardRunner("gsm8k", memory_limit_mb=100)
    with pytest.raises(ValueError, match="unknown reward spec 'bogus'"):
        RewardRunner("bogus")
    with pytest.raises(ValueError, match="unknown reward spec 'bogus'"):
        RewardRunner("bogus", isolate=False)


def test_runner_length_mismatch_and_empty() -> None:
    runner = RewardRunner()
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        runner.score(["a", "b"], ["a"])
    empty = runner.score([], [])
    assert empty == RewardResult(scores=[], correct=[])


@pytest.mark.timeout(30)
def test_runner_custom_fn_in_subprocess() -> None:
    with RewardRunner("reward_plugins:pid_reward") as runner:
        assert runner.isolated
        pids = runner.worker_pids
        assert len(pids) == 1 and pids[0] != os.getpid()
        first = runner.score(["a", "b"], ["1", "2"])
        second = runner.score(["c"], ["3"])
        # Same worker across calls: batches are sent to a long-lived process.
        assert first.scores == [float(pids[0])] * 2
        assert second.scores == [float(pids[0])]
        assert runner.stats() == {
            "calls": 2,
            "samples": 3,
            "errors": 0,
            "timeouts": 0,
            "worker_restarts": 0,
            "leaked_threads": 0,
            "all_failed_calls": 0,
        }


@pytest.mark.timeout(30)
def test_runner_raising_fn_scores_zero_and_caps_messages() -> None:
    with RewardRunner("reward_plugins:raising_reward") as runner:
        result = runner.score([f"#### {i}" for i in range(7)], [str(i) for i in range(7)])
    assert result.scores == [0.0] * 7
    assert result.correct == [False] * 7  # a sample the function failed on is never correct
    assert result.num_errors == 7
    assert len(result.errors) == 5
    assert result.errors[0] == "sample 0: RuntimeError: boom on '#### 0'"


def test_runner_error_messages_are_short() -> None:
    runner = RewardRunner("reward_plugins:raising_reward", isolate=False)
    result = runner.score(["x" * 1000], ["1"])
    assert result.num_errors == 1
    assert len(result.errors[0]) <= 200
    assert result.errors[0].endswith("...")


@pytest.mark.timeout(30)
def test_runner_system_exit_does_not_kill_worker() -> None:
    with RewardRunner("reward_plugins:exit_reward") as runner:
        pids = runner.worker_pids
        result = runner.score(["a", "b"], ["1", "2"])
        assert result.num_errors == 2
        assert "SystemExit: 3" in result.errors[0]
        assert runner.worker_pids == pids


@pytest.mark.timeout(30)
@pytest.mark.parametrize("isolate", [None, False])
@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        ("nan_reward", "non-finite"),
        ("str_reward", "returned str '1.0'"),
        ("none_reward", "returned NoneType"),
        ("list_reward", "returned list"),
    ],
)
def test_runner_bad_return_values_are_errors(fn: str, fragment: str, isolate: bool | None) -> None:
    with RewardRunner(f"reward_plugins:{fn}", isolate=isolate) as runner:
        result = runner.score(["#### 1"], ["1"])
    assert result.scores == [0.0]
    assert result.num_errors == 1
    assert fragment in result.errors[0]


def test_runner_bool_return_and_non_finite_total() -> None:
    with RewardRunner("reward_plugins:bool_reward", isolate=False, format_weight=0.5) as runner:
        assert runner.score(["5", "6"], ["5", "5"]).scores == [1.0, 0.0]
        # Non-str completion: the format bonus is guarded like the function itself.
        assert runner.score([5], [5]).scores == [1.0]  # type: ignore[list-item]
    huge = RewardRunner("reward_plugins:huge_reward", isolate=False, format_weight=1e308)
    result = huge.score(["#### 1", "no format"], ["1", "1"])
    assert result.scores == [0.0, 1e308]
    assert result.num_errors == 1
    assert "not finite" in result.errors[0]


@pytest.mark.timeout(30)
def test_runner_hanging_fn_times_out_and_worker_restarts() -> None:
    with RewardRunner("reward_plugins:sleep_on_marker", timeout_s=1.0) as runner:
        old_pids = runner.worker_pids
        start = time.monotonic()
        result = runner.score(["#### 1", "HANG", "#### 3", "#### 5"], ["1", "2", "3", "4"])
        elapsed = time.monotonic() - start
        assert elapsed < 30.0  # the batch did not wait for the 60 s hang (not a timing check)
        assert result.scores == [1.0, 0.0, 1.0, 0.0]
        assert result.correct == [True, False, True, False]
        assert (result.num_timeouts, result.num_errors) == (1, 0)
        assert result.errors == ["sample 1: timed out after 1 s"]
        assert _process_gone(old_pids[0])
        assert runner.worker_pids != old_pids
        start = time.monotonic()
        again = runner.score(["#### 7"], ["7"])
        assert again.scores == [1.0]
        assert time.monotonic() - start < 30.0  # the restarted worker, not a hung one
        assert runner.stats()["timeouts"] == 1
        assert runner.stats()["worker_restarts"] == 1


@pytest.mark.timeout(30)
def test_runner_timeout_kills_grandchildren(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with RewardRunner("reward_plugins:spawn_and_hang", timeout_s=1.0) as runner:
        result = runner.score(["x"], [str(pid_file)])
    assert result.num_timeouts == 1
    assert _process_gone(int(pid_file.read_text()))


@pytest.mark.timeout(30)
def test_runner_worker_crash_is_an_error_and_work_continues() -> None:
    with RewardRunner("reward_plugins:die_on_marker", max_workers=2) as runner:
        assert len(runner.worker_pids) == 2
        result = runner.score(
            ["#### 1", "DIE", "#### 3", "DIE", "#### 5"], ["1", "2", "3", "4", "5"]
        )
        assert result.scores == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert result.num_errors == 2
        assert "worker process died (exit code 7)" in result.errors[0]
        assert runner.stats()["worker_restarts"] == 2


@pytest.mark.timeout(30)
def test_runner_worker_killed_while_idle_is_replaced() -> None:
    with RewardRunner("reward_plugins:sleep_on_marker") as runner:
        (pid,) = runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        # Wait for the socket EOF only (not reaping), as a worker dying between calls looks.
        conn = runner._slots[0].conn
        assert conn is not None and conn.poll(5)
        result = runner.score(["#### 1"], ["1"])
        assert result.errors == []
        assert result.scores == [1.0]
        assert runner.worker_pids != [pid]


@pytest.mark.timeout(30)
def test_runner_isolated_builtin_and_more_workers_than_samples() -> None:
    with RewardRunner("gsm8k", isolate=True, max_workers=3) as runner:
        assert runner.isolated and len(runner.worker_pids) == 3
        result = runner.score(["#### 1", "#### 3"], ["1", "2"])
    assert result.scores == [1.0, 0.0]


@pytest.mark.timeout(30)
def test_runner_memory_limit() -> None:
    with RewardRunner("reward_plugins:memory_hog", memory_limit_mb=512) as runner:
        result = runner.score(["1", "4096", "1"], ["", "", ""])
    assert result.scores == [1.0, 0.0, 1.0]
    assert result.num_errors == 1
    assert "MemoryError" in result.errors[0]


@pytest.mark.timeout(30)
def test_runner_inline_custom_fn_thread_timeout() -> None:
    import reward_plugins

    runner = RewardRunner("reward_plugins:wait_on_marker", timeout_s=0.3, isolate=False)
    try:
        assert not runner.isolated and runner.worker_pids == []
        start = time.monotonic()
        result = runner.score(["#### 1", "HANG", "#### 3"], ["1", "2", "3"])
        assert time.monotonic() - start < 2.0
        assert result.scores == [1.0, 0.0, 1.0]
        assert result.num_timeouts == 1
        assert runner.stats()["leaked_threads"] == 1
    finally:
        reward_plugins.RELEASE.set()  # let the abandoned thread finish


@pytest.mark.timeout(30)
def test_runner_bad_custom_spec_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        RewardRunner("reward_plugins:missing")
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        RewardRunner("no_such_module_xyz:fn")


@pytest.mark.timeout(30)
def test_runner_start_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    slow = _write_module(tmp_path, "rw_slow_import", "import time\ntime.sleep(60)\n")
    with pytest.raises(RuntimeError, match="did not finish starting within 0.5 s"):
        RewardRunner(f"{slow}:fn", start_timeout_s=0.5)
    dying = _write_module(tmp_path, "rw_dying_import", "import os\nos._exit(5)\n")
    with pytest.raises(RuntimeError, match=r"exited during start-up \(exit code 5\)"):
        RewardRunner(f"{dying}:fn")
    with pytest.raises(RuntimeError, match="may be too small"):
        RewardRunner(f"{dying}:fn", memory_limit_mb=4096)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no_such_python"))
    with pytest.raises(RuntimeError, match="could not start a worker process"):
        RewardRunner("reward_plugins:length_reward")


FLAKY_MODULE = """
import time
from pathlib import Path

from rl_core.rewards import gsm8k_reward

_mode = (Path(__file__).parent / "mode.txt").read_text().strip()
if _mode == "raise":
    raise RuntimeError("cannot load now")
if _mode == "exit":
    import os
    os._exit(4)
if _mode == "sleep":
    time.sleep(60)


def fn(completion, answer):
    if "HANG" in completion:
        time.sleep(60)
    return gsm8k_reward(completion, answer)
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("mode", "fragment"),
    [
        ("raise", "worker could not load reward: reward spec"),
        ("exit", "worker exited during start-up (exit code 4)"),
        ("sleep", "worker did not start within 1.5 s"),
    ],
)
def test_runner_restart_failures_fail_remaining_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, fragment: str
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"rw_flaky_{mode}"
    _write_module(tmp_path, name, FLAKY_MODULE)
    (tmp_path / "mode.txt").write_text("ok")
    # The first worker starts within the default bound however loaded the machine is; only
    # the restart, whose import sleeps in the "sleep" mode, gets 1.5 s.
    with RewardRunner(f"{name}:fn", timeout_s=2.0) as runner:
        runner.start_timeout_s = 1.5 if mode == "sleep" else 60.0
        # The restart after the timeout imports the module again, and now that fails.
        (tmp_path / "mode.txt").write_text(mode)
        result = runner.score(["#### 1", "HANG", "#### 3", "#### 4"], ["1", "2", "3", "4"])
        # one restart failed the samples left together (none waits for a restart of its own)
        assert runner.stats()["worker_restarts"] == 1
    assert result.scores == [1.0, 0.0, 0.0, 0.0]
    assert result.num_timeouts == 1
    assert result.num_errors == 2
    assert fragment in result.errors[1]


@pytest.mark.timeout(30)
def test_runner_restart_that_cannot_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    executable = sys.executable
    with RewardRunner("reward_plugins:sleep_on_marker", timeout_s=0.5) as runner:
        monkeypatch.setattr(sys, "executable", "")
        result = runner.score(["HANG", "#### 2"], ["1", "2"])
        assert result.num_timeouts == 1
        assert result.num_errors == 1
        assert "could not start worker process" in result.errors[1]
        monkeypatch.setattr(sys, "executable", executable)
        assert runner.score(["#### 2"], ["2"]).scores == [1.0]


@pytest.mark.timeout(30)
def test_runner_close_kills_workers() -> None:
    runner = RewardRunner("reward_plugins:length_reward", max_workers=2)
    pids = runner.worker_pids
    assert len(pids) == 2
    runner.close()
    assert all(_process_gone(pid) for pid in pids)
    assert runner.worker_pids == []
    runner.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        runner.score(["a"], ["1"])


@pytest.mark.timeout(30)
def test_runner_context_manager_and_gc_kill_workers() -> None:
    with RewardRunner("reward_plugins:length_reward") as runner:
        (pid,) = runner.worker_pids
    assert _process_gone(pid)
    runner = RewardRunner("reward_plugins:length_reward")
    (pid,) = runner.worker_pids
    del runner
    gc.collect()
    assert _process_gone(pid)


# ----------------------------------------------------------------------------- worker loop


def test_worker_serve_loop_in_process() -> None:
    # The same loop the subprocess runs, driven in a thread so its protocol is checked here.
    parent_sock, child_sock = socket.socketpair()
    parent = Connection(parent_sock.detach())
    child = Connection(child_sock.detach())
    thread = threading.Thread(target=runner_mod._serve, args=(child, gsm8k_reward))
    thread.start()
    parent.send([(0, "#### 1", "1"), (5, "#### 2", "3"), (9, "#### 7", 7), (11, None, "1")])
    assert parent.recv() == (0, "ok", 1.0)
    assert parent.recv() == (5, "ok", 0.0)
    assert parent.recv() == (9, "ok", 1.0)  # a numeric answer
    index, kind, message = parent.recv()
    assert (index, kind) == (11, "error") and "AttributeError" in message
    parent.send(None)
    thread.join(5)
    assert not thread.is_alive()
    # EOF (parent gone) also ends the loop.
    thread = threading.Thread(target=runner_mod._serve, args=(child, gsm8k_reward))
    thread.start()
    parent.close()
    thread.join(5)
    assert not thread.is_alive()
    child.close()


def test_worker_serve_stops_when_parent_disappears_mid_batch() -> None:
    release, taken = threading.Event(), threading.Event()

    def slow(completion: str, answer: str) -> float:
        taken.set()  # the worker took the batch and is scoring it
        release.wait(5)
        return 1.0

    parent_sock, child_sock = socket.socketpair()
    parent = Connection(parent_sock.detach())
    child = Connection(child_sock.detach())
    thread = threading.Thread(target=runner_mod._serve, args=(child, slow))
    thread.start()
    parent.send([(0, "a", "b"), (1, "c", "d")])
    assert taken.wait(5), "the worker never took the batch"
    parent.close()  # the parent goes away mid-batch
    release.set()
    thread.join(5)
    assert not thread.is_alive()
    child.close()


def test_worker_main_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # The subprocess entry point, minus the orphan watchdog, run on a thread for coverage.
    limits: list[int] = []
    monkeypatch.setattr(runner_mod, "_watch_parent", lambda parent_pid: None)
    monkeypatch.setattr(runner_mod, "apply_memory_limit", limits.append)
    for spec, expected in [("gsm8k", ("ready", ("single", False))), ("reward_plugins:missing", None)]:
        parent_sock, child_sock = socket.socketpair()
        parent = Connection(parent_sock.detach())
        cfg = {
            "fd": child_sock.detach(),
            "spec": spec,
            "parent_pid": os.getpid(),
            "memory_limit_mb": 256,
        }
        thread = threading.Thread(target=runner_mod._worker_main, args=(cfg,))
        thread.start()
        kind, payload = parent.recv()
        if expected is None:
            assert kind == "load_error" and "has no attribute 'missing'" in payload
        else:
            assert (kind, payload) == expected
            parent.send([(3, "#### 4", "4")])
            assert parent.recv() == (3, "ok", 1.0)
            parent.send(None)
        thread.join(5)
        assert not thread.is_alive()
        parent.close()
    assert limits == [256, 256]


def test_watch_parent_exits_when_orphaned(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(runner_mod, "_ORPHAN_POLL_S", 0.0)
    monkeypatch.setattr(runner_mod.os, "_exit", fake_exit)
    with pytest.raises(Exited):
        runner_mod._watch_parent(parent_pid=-1)


def test_apply_memory_limit_respects_hard_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    calls: list[tuple[int, tuple[int, int]]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY, 2**20))
    monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: calls.append((kind, limits)))
    runner_mod.apply_memory_limit(512)
    assert calls == [(resource.RLIMIT_AS, (2**20, 2**20))]


def test_has_data_on_closed_connection() -> None:
    a, b = socket.socketpair()
    conn = Connection(a.detach())
    conn.close()
    b.close()
    assert runner_mod._has_data(conn) is True


@pytest.mark.timeout(30)
def test_dispatch_to_dead_worker_charges_first_sample() -> None:
    # Race fallback: the worker dies after the idle check but before the batch is sent.
    with RewardRunner("reward_plugins:length_reward") as runner:
        slot = runner._slots[0]
        assert slot.proc is not None
        slot.proc.kill()
        slot.proc.wait(5)
        slot.queue.extend([0, 1])
        outcomes: list = [None, None]
        runner._dispatch(slot, [(0, "a", "", None, {}), (1, "b", "", None, {})], outcomes)
        assert outcomes[0][0] == "error" and "worker process died" in outcomes[0][1]
        assert list(slot.queue) == [1] and slot.state == "starting"
        slot.queue.clear()
        assert runner.score(["abc"], [""]).scores == [0.03]


def test_spawn_refused_after_close() -> None:
    runner = RewardRunner("reward_plugins:length_reward")
    runner.close()
    with pytest.raises(OSError, match="closed"):
        runner._spawn(runner_mod._Slot())


# ----------------------------------------------------------------------------- fault budget
# Fault 7 of the reliability suite: a reward function that raises, hangs or exhausts memory
# costs its samples (scored 0, counted); one that fails every sample of max_failed_steps
# consecutive steps stops the run with a message naming it (docs/reliability.md).


def test_defaults_match_the_reward_config() -> None:
    from rl_core.config import RewardConfig

    cfg = RewardConfig()
    assert cfg.memory_limit_mb == runner_mod.DEFAULT_MEMORY_LIMIT_MB
    assert cfg.max_failed_steps == runner_mod.DEFAULT_MAX_FAILED_STEPS
    with RewardRunner() as inline:
        assert inline.memory_limit_mb is None  # builtins run in-process: nothing to limit
        assert inline.max_failed_steps == cfg.max_failed_steps


@pytest.mark.timeout(30)
def test_from_config_applies_every_knob_and_the_worker_gets_the_memory_limit() -> None:
    from rl_core.config import RewardConfig

    cfg = RewardConfig(
        fn="reward_plugins:address_space_limit",
        timeout_s=2.5,
        format_weight=0.0,
        memory_limit_mb=1536,
        max_failed_steps=7,
    )
    with RewardRunner.from_config(cfg) as runner:
        assert (runner.timeout_s, runner.memory_limit_mb, runner.max_failed_steps) == (2.5, 1536, 7)
        assert runner.score(["x"], ["1"]).scores == [1536.0]  # RLIMIT_AS, read in the worker
    # The default: custom code never runs without a memory limit.
    with RewardRunner("reward_plugins:address_space_limit") as runner:
        assert runner.score(["x"], ["1"]).scores == [float(runner_mod.DEFAULT_MEMORY_LIMIT_MB)]
    with RewardRunner.from_config(cfg.model_copy(update={"memory_limit_mb": None})) as runner:
        assert runner.score(["x"], ["1"]).scores == [-1.0]  # null: no limit, as configured
    with RewardRunner.from_config(RewardConfig()) as builtin:  # the defaults: gsm8k, in-process
        assert not builtin.isolated and builtin.memory_limit_mb is None
        assert builtin.score(["#### 3"], ["3"]).scores == [1.0]


@pytest.mark.timeout(30)
def test_unbounded_allocation_is_stopped_and_the_worker_keeps_scoring() -> None:
    with RewardRunner("reward_plugins:grow_on_marker", memory_limit_mb=320) as runner:
        (pid,) = runner.worker_pids
        start = time.monotonic()
        result = runner.score(["#### 1", "GROW", "#### 3"], ["1", "2", "3"])
        assert time.monotonic() - start < 10.0
        assert result.scores == [1.0, 0.0, 1.0]
        assert (result.num_errors, result.num_timeouts) == (1, 0)
        assert "MemoryError" in result.errors[0]
        # The blocks were freed with the frame: the same worker scores the next step.
        assert runner.worker_pids == [pid]
        assert runner.score(["GROW", "#### 4"], ["1", "4"]).scores == [0.0, 1.0]


@pytest.mark.timeout(30)
def test_every_sample_failing_k_steps_in_a_row_fails_with_the_function_named() -> None:
    spec = "reward_plugins:raise_on_marker"
    with RewardRunner(spec, max_failed_steps=3) as runner:
        for step in (1, 2):
            result = runner.score(["FAIL a", "FAIL b"], ["1", "2"])
            assert result.scores == [0.0, 0.0] and result.all_failed
            assert result.failed_streak == step == runner.failed_streak
        with pytest.raises(runner_mod.RewardFunctionError) as info:
            runner.score(["FAIL c", "FAIL d"], ["1", "2"])
        err = info.value
        assert (err.spec, err.steps) == (spec, 3)
        assert err.last_error == "sample 1: ValueError: cannot score 'FAIL d'"
        message = str(err)
        assert repr(spec) in message and "3 consecutive steps" in message
        assert "reward.max_failed_steps" in message and "cannot score 'FAIL d'" in message
        # The run is over: a retried step fails at once, without scoring again.
        calls = runner.stats()["calls"]
        with pytest.raises(runner_mod.RewardFunctionError):
            runner.score(["#### 1"], ["1"])
        assert runner.stats()["calls"] == calls
        assert runner.stats()["all_failed_calls"] == 3


@pytest.mark.timeout(30)
def test_one_scored_sample_resets_the_streak_and_empty_calls_do_not_count() -> None:
    with RewardRunner("reward_plugins:raise_on_marker", max_failed_steps=2) as runner:
        assert runner.score(["FAIL"], ["1"]).failed_streak == 1
        assert runner.score([], []).failed_streak == 1  # no samples: proves nothing
        ok = runner.score(["FAIL", "#### 2"], ["1", "2"])  # one sample scored
        assert ok.scores == [0.0, 1.0] and ok.failed_streak == 0 and not ok.all_failed
        assert runner.score(["FAIL"], ["1"]).failed_streak == 1
        with pytest.raises(runner_mod.RewardFunctionError, match="2 consecutive steps"):
            runner.score(["FAIL"], ["1"])


@pytest.mark.timeout(30)
def test_calls_of_one_step_count_once() -> None:
    """Dynamic sampling scores a step in several calls, and a retried task scores it again:
    the budget counts steps, and one scored sample anywhere in a step clears it."""
    with RewardRunner("reward_plugins:raise_on_marker", max_failed_steps=2) as runner:
        for _ in range(3):  # three all-failed rounds of step 1 are one failed step
            assert runner.score(["FAIL"], ["1"], step=1).failed_streak == 1
        with pytest.raises(runner_mod.RewardFunctionError, match="2 consecutive steps"):
            runner.score(["FAIL"], ["1"], step=2)  # the second failed step, not the fourth call
    with RewardRunner("reward_plugins:raise_on_marker", max_failed_steps=2) as runner:
        assert runner.score(["FAIL"], ["1"], step=1).failed_streak == 1
        assert runner.score(["#### 2"], ["2"], step=1).failed_streak == 0  # a later round scored
        assert runner.score(["FAIL"], ["1"], step=2).failed_streak == 1
        assert runner.score(["FAIL"], ["1"], step=2).failed_streak == 1
        with pytest.raises(runner_mod.RewardFunctionError, match="2 consecutive steps"):
            runner.score(["FAIL"], ["1"], step=3)


@pytest.mark.timeout(30)
def test_hangs_count_as_failed_samples_and_zero_turns_the_budget_off() -> None:
    with RewardRunner("reward_plugins:sleep_on_marker", timeout_s=0.3, max_failed_steps=2) as r:
        assert r.score(["HANG"], ["1"]).num_timeouts == 1
        with pytest.raises(runner_mod.RewardFunctionError, match=r"timed out after 0\.3 s"):
            r.score(["HANG"], ["1"])
    with RewardRunner("reward_plugins:raising_reward", max_failed_steps=0) as runner:
        for _ in range(5):
            assert runner.score(["a"], ["1"]).scores == [0.0]
        assert runner.failed_streak == 5


@pytest.mark.timeout(30)
def test_correct_means_the_function_scored_at_least_pass_threshold() -> None:
    """Partial credit: correct iff the function's score >= pass_threshold, the format bonus
    excluded (it would lift 0.5 to 1.5 and 0.9 to 1.9, above any threshold here)."""
    from rl_core.config import RewardConfig

    completions = ["0.25", "0.5\n#### 3", "0.9\n#### 3", "1.0"]
    answers = ["3"] * 4
    with RewardRunner("reward_plugins:partial_credit", pass_threshold=0.5, format_weight=1.0) as r:
        result = r.score(completions, answers)
        assert result.scores == [0.25, 1.5, 1.9, 1.0]
        assert result.correct == [False, True, True, True]
    cfg = RewardConfig(fn="reward_plugins:partial_credit", format_weight=1.0)  # default 1.0
    with RewardRunner.from_config(cfg) as r:
        assert r.pass_threshold == 1.0
        assert r.score(completions, answers).correct == [False, False, False, True]
    with RewardRunner.from_config(cfg.model_copy(update={"pass_threshold": 0.9})) as r:
        assert r.score(completions, answers).correct == [False, False, True, True]
    with RewardRunner("reward_plugins:raise_on_marker", pass_threshold=0.0) as r:
        assert r.score(["FAIL"], ["1"]).correct == [False]  # a failed call is never correct


@pytest.mark.timeout(30)
def test_budget_false_calls_stay_out_of_the_fault_budget() -> None:
    """Evaluation scores with budget=False: a call where every sample fails neither advances
    nor resets the streak, and never raises RewardFunctionError."""
    with RewardRunner("reward_plugins:raise_on_marker", max_failed_steps=2) as runner:
        assert runner.score(["FAIL"], ["1"], step=1).failed_streak == 1
        for _ in range(3):
            ev = runner.score(["FAIL a", "FAIL b"], ["1", "2"], budget=False)
            assert ev.all_failed and ev.num_errors == 2 and ev.failed_streak == 0
            assert runner.failed_streak == 1
        ok = runner.score(["#### 2"], ["2"], budget=False)  # a scored eval does not reset it
        assert ok.scores == [1.0] and runner.failed_streak == 1
        assert runner.stats()["all_failed_calls"] == 1
        with pytest.raises(runner_mod.RewardFunctionError, match="2 consecutive steps"):
            runner.score(["FAIL"], ["1"], step=2)


def test_reward_function_error_survives_pickling_and_bad_budgets_are_refused() -> None:
    import pickle

    err = runner_mod.RewardFunctionError("m:f", 3, "sample 0: boom")
    back = pickle.loads(pickle.dumps(err))
    assert (back.spec, back.steps, back.last_error, str(back)) == (
        "m:f",
        3,
        "sample 0: boom",
        str(err),
    )
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_failed_steps must be an integer >= 0"):
            RewardRunner(max_failed_steps=bad)  # type: ignore[arg-type]
