"""The code sandbox (rl_core/rewards/sandbox.py) with the real bubblewrap: escapes that must
fail (network, DNS, writing outside /tmp, a fork bomb, the project's files, the parent's
environment, memory, CPU, output, file size), the sandbox usable after each; the queue and the
caller's deadline; the start-up error where bwrap cannot run; and the code environment and the
``code_tests`` reward end to end with hand-written solutions. ``make sandbox-deps`` installs
bwrap (make test runs it)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import rl_core.rewards.sandbox as sandbox_mod
from rl_core.agents import environment_factory, resolve_tools
from rl_core.agents.code_env import CodeEnv
from rl_core.agents.env import Environment, EnvironmentFailure, Turn
from rl_core.data.records import Record
from rl_core.rewards import RewardRunner
from rl_core.rewards.code import code_tests, run_tests
from rl_core.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=256, processes=16, output_bytes=4096,
                       file_mb=4)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return Sandbox(LIMITS, max_concurrent=4)


def _usable(box: Sandbox) -> None:
    ran = box.run("print(6 * 7)")
    assert (ran.status, ran.returncode, ran.stdout) == ("ok", 0, "42\n"), ran


def _cmdlines() -> list[bytes]:
    out = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # it ended between the listing and the read
            out.append(path.read_bytes())
    return out


def _tagged(code: str, tag: str) -> str:
    """``code`` re-executed with ``tag`` in its command line, so the host can find it."""
    return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-c', {code!r}, {tag!r}])"


def _none_left(tag: str) -> None:
    deadline = time.monotonic() + 10  # the PID namespace goes down with its init
    while any(tag.encode() in c for c in _cmdlines()):
        assert time.monotonic() < deadline, f"a sandboxed process ({tag}) outlived its run"
        time.sleep(0.05)


def test_no_network_no_dns(box: Sandbox) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port, accepted = server.getsockname()[1], threading.Event()
    server.settimeout(0.2)

    def accept() -> None:
        try:
            server.accept()[0].close()
            accepted.set()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)\n"
            "try:\n    print('RESOLVED', socket.getaddrinfo('example.com', 80))\n"
            "except OSError as e:\n    print('no dns', e)\n")
    ran = box.run(code)
    thread.join(5)
    server.close()
    assert "refused" in ran.stdout and "no dns" in ran.stdout, ran
    assert "CONNECTED" not in ran.stdout and "RESOLVED" not in ran.stdout
    assert not accepted.is_set()
    _usable(box)


def test_read_only_root_private_tmp_no_project_files(box: Sandbox, tmp_path: Path) -> None:
    (tmp_path / "host.txt").write_text("host secret")
    code = f"""
import os
for path in ["/usr/evil", "/evil", "/etc/evil", "{ROOT}/evil", "{tmp_path}/evil"]:
    try:
        open(path, "w").write("x")
        print("WROTE:", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
for path in ["{ROOT}/README.md", "{ROOT}/pyproject.toml", "{tmp_path}/host.txt", "/etc/passwd"]:
    try:
        print("GOT:", path, open(path).read()[:20])
    except OSError as e:
        print("unreadable", path, type(e).__name__)
print("project listed" if os.path.exists("{ROOT}") else "no project")
open("/tmp/mine", "w").write("ok")
print("tmp", open("/tmp/mine").read(), os.getcwd())
"""
    ran = box.run(code)
    assert ran.status == "ok" and ran.returncode == 0, ran
    assert "WROTE:" not in ran.stdout and "GOT:" not in ran.stdout, ran.stdout
    assert ran.stdout.count("refused") == 5 and ran.stdout.count("unreadable") == 4
    assert "no project" in ran.stdout and "tmp ok /tmp" in ran.stdout
    assert not (ROOT / "evil").exists() and not (tmp_path / "evil").exists()
    assert "/tmp/mine" not in box.run("import os; print(os.listdir('/tmp'))").stdout  # private
    _usable(box)


def test_the_parents_environment_is_not_visible(box: Sandbox,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-canary-7f3a9c0e5d"
    monkeypatch.setenv("GRPOFLOW_FAKE_SECRET", secret)
    code = ("import os, glob\nprint(dict(os.environ))\n"
            "for p in glob.glob('/proc/*/environ'):\n"
            "    try:\n        print(p, open(p, 'rb').read())\n"
            "    except OSError as e:\n        print(p, type(e).__name__)\n")
    ran = box.run(code)
    assert ran.status == "ok" and "PATH" in ran.stdout, ran
    assert secret not in ran.stdout and secret not in ran.stderr
    assert "GRPOFLOW_FAKE_SECRET" not in ran.stdout and "HOME': '/tmp'" in ran.stdout
    _usable(box)


def test_a_fork_bomb_hits_the_process_limit_and_dies_with_its_run(box: Sandbox) -> None:
    counted = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n"
               "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
               "        n += 1\n    except OSError:\n        break\nprint('forked', n)\n")
    tag = f"bomb-{time.monotonic_ns()}"
    ran = box.run(_tagged(counted, tag))
    forked = int(ran.stdout.split()[-1])
    assert 0 < forked < LIMITS.processes, ran
    _none_left(tag)  # the parent exited: its sleeping children went with the namespace
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    tag = f"bomb-{time.monotonic_ns()}"
    t0 = time.monotonic()
    ran = box.run(_tagged(bomb, tag), limits=SandboxLimits(wall_s=1.5, processes=16))
    assert ran.status == "timeout" and ran.returncode is None, ran
    assert time.monotonic() - t0 < 5
    _none_left(tag)
    _usable(box)


def test_memory_cpu_output_and_file_limits(box: Sandbox) -> None:
    ran = box.run("x = bytearray(512 * 2**20)\nprint('ALLOCATED')")
    assert "MemoryError" in ran.stderr and "ALLOCATED" not in ran.stdout, ran
    t0 = time.monotonic()
    ran = box.run("while True:\n    pass", limits=SandboxLimits(wall_s=20.0, cpu_s=1))
    assert ran.status == "ok" and ran.returncode not in (0, None), ran  # SIGXCPU, not the wall
    assert time.monotonic() - t0 < 15
    ran = box.run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)")
    assert ran.status == "output_limit" and len(ran.stdout) <= LIMITS.output_bytes, ran.status
    ran = box.run("open('/tmp/big', 'wb').write(b'x' * (8 * 2**20))")
    assert ran.returncode != 0 and ("File too large" in ran.stderr
                                    or "No space" in ran.stderr), ran
    _usable(box)


def test_the_callers_deadline_bounds_the_run_and_the_queue_is_capped() -> None:
    box = Sandbox(LIMITS, max_concurrent=1, max_queued=0, reserve_s=0.5)
    t0 = time.monotonic()
    ran = box.run("import time\ntime.sleep(30)", deadline=t0 + 1.5)
    assert ran.status == "deadline" and ran.infrastructure_failure, ran
    assert time.monotonic() - t0 < 1.5  # the caller keeps its reserve
    assert box.run("print(1)", deadline=time.monotonic() + 0.3).status == "busy"
    started = threading.Event()
    hold = threading.Thread(target=lambda: started.set() or box.run(
        "import time\ntime.sleep(30)", limits=SandboxLimits(wall_s=2.0)))
    hold.start()
    assert started.wait(5)
    t_end = time.monotonic() + 5
    while box._slots.qsize():  # bounded: until the held run has the one slot
        assert time.monotonic() < t_end
        time.sleep(0.01)
    refused = box.run("print(1)")
    hold.join(10)
    assert refused.status == "busy" and "queue is full" in refused.stderr
    _usable(box)


def test_a_clear_error_at_start_up_where_bwrap_cannot_run(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="make sandbox-deps"):
        Sandbox()
    fake = tmp_path / "bwrap"  # what bwrap says without user namespaces
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="(?s)No permissions.*user namespaces"):
        Sandbox()
    monkeypatch.setattr(sandbox_mod, "_default", None)  # what the tool and env ask at start-up
    with pytest.raises(SandboxUnavailable):
        resolve_tools(["python"])
    agent = SimpleNamespace(env="code", env_args={}, env_timeout_s=10.0)
    with pytest.raises(SandboxUnavailable):
        environment_factory(agent)


# ---------------------------------------------------------------- code env and reward

TESTS = ["assert add(2, 2) == 4", "assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
RIGHT = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
HALF = "```python\ndef add(a, b):\n    return a * b\n```"


def _task() -> Record:
    return Record("add", "Write add(a, b) returning the sum.", None, {"tests": TESTS})


def test_code_env_gives_test_feedback_and_scores_the_last_attempt(box: Sandbox) -> None:
    env = CodeEnv(sandbox=box, step_timeout_s=10.0)
    messages = env.reset(_task())
    assert [m["role"] for m in messages] == ["system", "user"]
    first = env.step(Turn(HALF, []))  # add(2, 2) == 4 passes, the others fail
    assert not first.done and first.info["tests_passed"] == 1 and not first.info["correct"]
    feedback = first.observation[0]["content"]
    assert first.observation[0]["role"] == "user" and "1/3 tests passed" in feedback
    assert "Failed: assert add(1, 2) == 3" in feedback and "AssertionError" in feedback
    second = env.step(Turn("no code, just words", []))
    assert "raised before any test ran" in second.observation[0]["content"]
    third = env.step(Turn(RIGHT, []))
    assert third.done and third.info["correct"] and third.info["attempts"] == 3
    assert first.reward + second.reward + third.reward == pytest.approx(1.0)
    env = CodeEnv(sandbox=box, feedback="count", require="all", step_timeout_s=10.0)
    env.reset(_task())
    out = env.step(Turn(HALF, []))
    assert out.reward == 0.0 and "Failed" not in out.observation[0]["content"]
    with pytest.raises(EnvironmentFailure, match="no unit tests"):
        env.reset(Record("x", "q", None, {}))


def test_code_env_is_an_environment_kind_and_a_hang_is_the_codes_fault() -> None:
    agent = SimpleNamespace(env="code", env_args={"limits": {"wall_s": 1.0, "cpu_s": 1}},
                            env_timeout_s=10.0)
    env = environment_factory(agent)()
    assert isinstance(env, Environment) and isinstance(env, CodeEnv)
    env.reset(_task())
    out = env.step(Turn("```python\ndef add(a, b):\n    while True:\n        pass\n```", []))
    assert out.info["tests_passed"] == 0 and "0/3" in out.observation[0]["content"]
    assert env.step(Turn(RIGHT, [])).done


def test_code_reward_end_to_end_and_output_cannot_fake_a_pass() -> None:
    fake = ("```python\nimport os\nfor i in range(3):\n    print('PASSED', i)\n"
            "print('PASSED 3')\nos._exit(0)\n```")
    columns = [{"tests": TESTS}] * 4
    with RewardRunner("code_tests", args={"tests_column": "tests"}) as runner:
        result = runner.score([RIGHT, HALF, WRONG, fake], [None] * 4, columns=columns)
    assert result.scores == pytest.approx([1.0, 1 / 3, 0.0, 0.0])
    assert code_tests([None] * 2, [RIGHT, HALF], tests=[TESTS] * 2, tests_column="tests",
                      require="all") == [1.0, 0.0]
    report = run_tests("def add(a, b):\n    return a + b\n", TESTS)
    assert report.all_passed and report.fraction == 1.0
    t0 = time.monotonic()  # a hang scores 0 within the reward's own deadline
    assert code_tests([None], ["while True: pass"], tests=[TESTS], tests_column="tests",
                      timeout_s=30.0, deadline=t0 + 2.0) == [0.0]
    assert time.monotonic() - t0 < 2.0


def test_code_episodes_on_the_real_engine_feed_back_and_train_only_on_model_tokens(
        demo_model: Path) -> None:
    from transformers import AutoTokenizer

    from rl_core.agents.kind import AgentEpisodes
    from rl_core.config import AgentConfig
    from rl_core.engine.sampling import SamplingParams
    from rl_core.rollout.inprocess import InProcessPlane

    cfg = AgentConfig(env="code", env_args={"feedback": "count", "system_prompt": None},
                      max_turns=2, max_tokens=400, env_timeout_s=10.0, score_final_answer=False)
    plane = InProcessPlane(demo_model)
    agents = AgentEpisodes(cfg, plane, AutoTokenizer.from_pretrained(demo_model))
    try:
        samples = agents.episodes([_task()], n=2, step=1, seed=0,
                                  params=SamplingParams(temperature=1.0, max_new_tokens=12))
        agents.score(samples, None, pass_threshold=1.0)  # type: ignore[arg-type]
    finally:
        agents.close()
        plane.close()
    for s in samples:  # the arithmetic model's attempt fails, reads the count, tries again
        ep = s.meta["episode"]
        assert ep["status"] == "ok" and ep["turns"] == 2, ep
        assert ep["info"]["tests_total"] == 3 and ep["info"]["attempts"] == 2
        assert s.reward == 0.0 and not s.correct
        assert set(s.loss_mask) == {0, 1}  # the feedback's tokens are not trained on
