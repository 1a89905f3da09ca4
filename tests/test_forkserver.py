"""Embedded CPU engines forked from the engine fork server (``rl_core.rollout.forkserver``):
the same process as ``python -m rl_core.engine.server`` from the outside (its command line as
its title, its own session, its log, the caller's environment, exit codes as Popen's), without
importing torch and transformers again; an engine whose parent is killed exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from rl_core.host import free_port
from rl_core.rollout import forkserver, launch

pytestmark = pytest.mark.timeout(300)


def test_a_forked_engine_is_the_command_it_stands_for(demo_model: Path, tmp_path: Path) -> None:
    cmd = launch.embedded_engine_command(demo_model, num_threads=1)
    assert forkserver.forkable(cmd(0, 1))
    assert not forkserver.forkable(launch.embedded_engine_command(demo_model, device="cuda",
                                                                  gpus=1)(0, 1))
    port, log = free_port(), tmp_path / "engine-0.log"
    proc = launch.start_process(cmd(0, port), log, fork=True)
    try:
        assert isinstance(proc, forkserver.ForkedProcess) and proc.poll() is None
        launch.wait_healthy(f"http://127.0.0.1:{port}", timeout_s=120, proc=proc, log_path=log)
        p = psutil.Process(proc.pid)
        argv = " ".join(p.cmdline()).split()  # a process title: one string
        assert argv[1:3] == ["-m", forkserver.ENGINE_MODULE] and argv[argv.index("--port") + 1] == str(port)
        assert os.getpgid(proc.pid) == proc.pid  # its own session: a killpg ends only it
        # it did not import torch again: far less CPU than a fresh interpreter's ~4 s
        assert sum(p.cpu_times()[:2]) < 2.0, p.cpu_times()
        assert log.read_text().startswith("$ ")  # the command line, then the engine's own output
        launch.kill_process(proc)
        assert proc.returncode == -signal.SIGKILL and proc.wait(1) == -signal.SIGKILL
        with pytest.raises(psutil.NoSuchProcess):
            psutil.Process(proc.pid).status()
    finally:
        launch.stop_process(proc, 5)


def test_an_engine_forked_for_a_killed_parent_exits(demo_model: Path, tmp_path: Path) -> None:
    """The parent (a training flow, here a script) dies by SIGKILL: its fork server ends with
    it, and the engine, now an orphan, sees its ``--parent-pid`` gone and exits."""
    port = free_port()
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from rl_core.rollout import launch
        cmd = launch.embedded_engine_command({str(demo_model)!r}, num_threads=1)
        proc = launch.start_process(cmd(0, {port}), {str(tmp_path / "e.log")!r}, fork=True)
        launch.wait_healthy("http://127.0.0.1:{port}", timeout_s=120, proc=proc)
        print(proc.pid, flush=True)
        sys.stdin.read()
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    engine = None
    try:
        assert parent.stdout is not None
        engine = psutil.Process(int(parent.stdout.readline()))
        parent.kill()
        parent.wait(10)
        engine.wait(30)  # its watch polls every second
    finally:
        if parent.poll() is None:
            parent.kill()
        if engine is not None and engine.is_running():
            engine.kill()
    assert not engine.is_running()


def test_a_command_it_cannot_fork_runs_as_before(tmp_path: Path) -> None:
    proc = launch.start_process([sys.executable, "-c", "print('plain')"], tmp_path / "p.log",
                                fork=True)
    assert isinstance(proc, subprocess.Popen) and proc.wait(30) == 0
    assert "plain" in (tmp_path / "p.log").read_text()
