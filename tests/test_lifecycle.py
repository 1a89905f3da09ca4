"""A stopped run leaves nothing running: SIGKILL, SIGTERM, and the reaper behind both.

The reaper (grpoflow/reaper.py) is tested on a plain process tree first: a parent that
started it and a child and grandchild (one in a session of its own, as engines are), then
SIGKILLed. End to end, ``grpoflow train`` runs on its own ephemeral Prefect API server (the
process a SIGKILLed run used to leave behind) with two engines behind the real
``sglang-router``; after the first step it is SIGKILLed or SIGTERMed, and every process it
had started must be gone within a bound. SIGTERM must also end the command itself within a
bound, with exit code 143 and the flow's teardown. Exact resume after a kill is
tests/test_resume.py's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from test_resume import _wait_for_step

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")


def _alive(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """The processes of ``procs`` still running after ``timeout_s`` (as cmdlines)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    out = []
    for p in alive:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            continue
    return out


def _tree(parent: subprocess.Popen, at_least: int) -> list[psutil.Process]:
    """``parent``'s descendants once there are ``at_least`` of them (20 s at most), after a
    scan or two of its reaper."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        tree = psutil.Process(parent.pid).children(recursive=True)
        if len(tree) >= at_least:
            break
        time.sleep(0.1)
    assert len(tree) >= at_least, [p.cmdline() for p in tree]
    time.sleep(0.6)
    return tree


def _kill_all(parent: subprocess.Popen, procs: list[psutil.Process]) -> None:
    """Never leave a failed test's processes to the rest of the suite."""
    if parent.poll() is None:
        parent.kill()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _start_logged(script: Path) -> tuple[subprocess.Popen, Path]:
    """Run ``script`` (a parent that starts its reaper) with the reaper's log beside it."""
    log = script.parent / "reaper.log"
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "GRPOFLOW_REAPER_LOG": str(log)})
    return parent, log


def _kill_and_check_reaped(parent: subprocess.Popen, procs: list[psutil.Process],
                           log: Path) -> None:
    """SIGKILL ``parent``: its reaper must end ``procs`` and say so in its log."""
    parent.kill()
    parent.wait(10)
    assert _alive(procs, timeout_s=15) == [], log.read_text() if log.exists() else ""
    for p in procs:
        assert f"{p.pid}:sleep 600" in log.read_text()


def test_the_reaper_ends_the_tree_of_a_sigkilled_process(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from grpoflow import reaper
        reaper.start(grace_s=1.0, poll_s=0.2)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        # a grandchild in its own session (as the engines and the Prefect server run)
        grand = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys, time; subprocess.Popen(['sleep', '600'], "
            "start_new_session=True); time.sleep(600)"], start_new_session=True)
        print("ready", flush=True)
        time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        tree = _tree(parent, 4)  # the child, the grandchild's tree, the reaper
        parent.kill()
        parent.wait(10)
        assert _alive(tree, timeout_s=15) == []
    finally:
        _kill_all(parent, tree)


def test_the_reaper_ends_what_escaped_its_scans(tmp_path: Path) -> None:
    """A process started after the reaper's last scan and reparented away at once (a
    daemonizing double fork) is not a descendant it saw: the environment marker finds it."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from grpoflow import reaper
        reaper.start(grace_s=1.0, poll_s=60.0)  # one scan, at its start
        time.sleep(1.0)
        subprocess.run([sys.executable, "-c", "import subprocess; subprocess.Popen("
                        "['sleep', '600'], start_new_session=True)"], check=True)
        print("ready", flush=True)
        time.sleep(600)
    """))
    parent, log = _start_logged(script)
    orphans: list[psutil.Process] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.cmdline() == ["sleep", "600"] and p.ppid() != parent.pid and \
                        p.environ().get("GRPOFLOW_REAPED_BY", "").startswith(f"{parent.pid}-"):
                    orphans.append(p)
        assert len(orphans) == 1, "the double-forked sleep, reparented away from its run"
        _kill_and_check_reaped(parent, orphans, log)
    finally:
        _kill_all(parent, orphans)


def test_the_reaper_ends_what_the_launcher_started_after_its_last_scan(tmp_path: Path) -> None:
    """sglang-router writes its title over its command line and environment, so neither the
    marker nor a command line can name it once its parent is gone; a process started after
    the reaper's last scan with no environment at all stands for it. rl_core's launcher lists
    what it starts (pid and start time) in the file the reaper reads at the end."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from grpoflow import reaper
        from rl_core.rollout.launch import start_process
        reaper.start(grace_s=1.0, poll_s=60.0)  # one scan, at its start
        time.sleep(1.0)
        proc = start_process(["sleep", "600"], {str(tmp_path / "sleep.log")!r}, env={{}})
        print(proc.pid, flush=True)
        time.sleep(600)
    """))
    parent, log = _start_logged(script)
    started: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        started.append(psutil.Process(int(parent.stdout.readline())))
        assert "GRPOFLOW_REAPED_BY" not in started[0].environ()  # no marker to find it by
        _kill_and_check_reaped(parent, started, log)
    finally:
        _kill_all(parent, started)


def test_the_reaper_survives_the_signal_of_each_dying_thread(tmp_path: Path) -> None:
    """The parent-death signal follows threads: a SIGKILLed parent with many threads moves
    the reaper from thread to thread as they die, signalling it each time. One signal
    raises; the rest must not end the reaper before it reaps (CI saw it die silently)."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from grpoflow import reaper
        reaper.start(grace_s=1.0, poll_s=0.2)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        for _ in range(64):
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        print("ready", flush=True)
        time.sleep(600)
    """))
    log = tmp_path / "reaper.log"
    tree: list[psutil.Process] = []
    for _ in range(3):  # the race is in the kernel's timing: give it a few chances
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "GRPOFLOW_REAPER_LOG": str(log)})
        try:
            assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
            tree = _tree(parent, 2)  # the child and the reaper
            parent.kill()
            parent.wait(10)
            assert _alive(tree, timeout_s=15) == [], log.read_text() if log.exists() else ""
        finally:
            _kill_all(parent, tree)
    # Each parent's end was seen: by a scan, or (killed before the reaper's first scan) at start.
    text = log.read_text()
    assert text.count("its command ended") + text.count("it ended before the first scan") == 3, text


def test_exit_within_ends_a_process_whose_threads_do_not(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        from grpoflow import reaper
        threading.Thread(target=threading.Event().wait).start()  # non-daemon, never ends
        reaper.exit_within(1.0, 143)
    """))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], timeout=60, capture_output=True,
                          text=True)
    assert done.returncode == 143, done.stderr
    assert time.monotonic() - t0 < 30
    assert "still running 1s after the stop signal" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_stopped_train_leaves_nothing_running(demo_model: Path, tiny_cache: Path,
                                                tmp_path: Path, sig: signal.Signals) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"),  # its own ephemeral API server
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               GRPOFLOW_REAPER_LOG=str(tmp_path / "reaper.log"))
    argv = [sys.executable, "-m", "grpoflow.cli", "train", DEMO, "--quiet",
            f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}", "run_name=stopped",
            "train.steps=50", "train.prompts_per_step=4", "rollout.n_samples=4",
            "rollout.engine=embedded", "rollout.num_engines=2", "eval.every=0", "eval.num_examples=8",
            "eval.pass_k_examples=0", "train.num_threads=1", "tracking.backend=none"]
    # stderr to a file, not a pipe nobody reads until the end (a full pipe would block the run)
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as err:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    tree: list[psutil.Process] = []
    try:
        try:
            _wait_for_step(tmp_path / "stopped" / "metrics.jsonl", 1, proc, timeout_s=400)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{errors.read_text()[-3000:]}") from None
        tree = psutil.Process(proc.pid).children(recursive=True)
        lines = [" ".join(p.cmdline()) for p in tree]
        # What the run had started: the Prefect API server, the router, the engines, the reaper.
        for part in ("prefect.server.api", "sglang", "rl_core.engine.server", "grpoflow.reaper"):
            assert any(part in line for line in lines), (part, lines)
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=90)
        if sig == signal.SIGTERM:
            assert rc == 143, errors.read_text()[-3000:]
            assert time.monotonic() - t0 < 60
            assert "stopped by SIGTERM" in errors.read_text()
        else:
            assert rc == -signal.SIGKILL
        log = tmp_path / "reaper.log"
        assert _alive(tree, timeout_s=30) == [], log.read_text() if log.exists() else "no log"
    finally:
        _kill_all(proc, tree)


def test_a_command_killed_before_its_reapers_first_scan_is_still_reaped() -> None:
    """SIGKILLed within its first moments, the command is gone before its reaper has looked
    at it: the reaper still ends what carries the command's mark."""
    from grpoflow.reaper import MARK

    since = time.time()
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True,
                               env={**os.environ, MARK: "early-mark"})
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(60)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "grpoflow.reaper", "--pid", str(gone.pid), "--grace", "1",
             "--poll", "0.2", "--mark", "early-mark", "--since", repr(since)],
            cwd=ROOT, timeout=60)  # fmt: skip
        assert done.returncode == 0
        assert sleeper.wait(timeout=30) is not None  # ended by the reaper
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
