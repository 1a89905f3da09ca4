"""Exact resume: a run killed with SIGKILL mid-step continues as if it had never stopped.

Run S steps uninterrupted; run the same config again, SIGKILL the flow process in the middle
of a step after a checkpoint, resume with ``--resume``. The prompts consumed after the
checkpoint (the sample ledger: uids, rewards, token counts) and the final weights must be
identical to the uninterrupted run's. Both runs use one torch thread, per-sample sampling
seeds and batch-invariant decoding, so identity is bit-exact on CPU.

``test_sigkills_at_random_points_then_resume_is_exact`` kills at random moments instead (start-up,
a step, a checkpoint write, the final evaluation), resumes each time, and checks the ledger,
the final weights and that no kill left a process running; once in CI for a streamed run,
``GRPOFLOW_SOAK_KILLS`` times per mode under ``-m soak`` (``GRPOFLOW_SOAK_SEED`` replays a
failure: the seed is in every assertion message).

The epoch-boundary variant keeps its checkpoints in S3 (the session's moto server) and
resumes on "another machine": a fresh ``storage.root`` with nothing of the killed run, so
the checkpoint is found and downloaded from the bucket.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import prefect.settings
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")
STEPS = 4

# The moto server fixtures (s3_server, s3_bucket) live in tests/s3_server.py.
pytest_plugins = ["s3_server"]


def _argv(tmp: Path, cache: Path, run_name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "grpoflow.cli", "train", DEMO, "--quiet",
        f"storage.root={tmp}", f"storage.cache_dir={cache}", f"run_name={run_name}",
        f"train.steps={STEPS}", "train.prompts_per_step=8", "rollout.n_samples=4",
        "checkpoint.every=2", "eval.every=0", "eval.num_examples=16", "eval.pass_k_examples=0",
        "train.num_threads=1", "data.synthetic_train_size=3000", "tracking.backend=none", *extra,
    ]


def _env() -> dict[str, str]:
    # The children talk to the session's Prefect API instead of starting their own.
    env = dict(os.environ, PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value() or "")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def _ledger(run_dir: Path) -> dict[int, list]:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return {r["step"]: r["samples"] for r in rows}


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run exited (rc={proc.returncode}) before step {step}")
        if metrics.is_file():
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x]
            if step in steps:
                return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not logged within {timeout_s}s")


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run exited (rc={proc.returncode}) before {path} existed")
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {timeout_s}s")


# The in-process plane on 16 prompts (8 a step: epochs of 2 steps), for the clean run and the
# runs compared with it.
_CLEAN = ["rollout.engine=local", "data.max_train_examples=16"]


def _in_process(tmp: Path, cache: Path, run_name: str, *extra: str) -> list[str]:
    """The overrides only, for a flow run in this process (on the in-process plane)."""
    return [*_argv(tmp, cache, run_name, *extra)[6:], *_CLEAN]


def _straight(tmp: Path, cache: Path, *extra: str) -> Path:
    """The uninterrupted run, in this process (the same flow as ``grpoflow train`` runs,
    without a process start-up); its run directory."""
    from flows.grpo_train import grpo_train

    out = grpo_train(config=DEMO, overrides=[*_argv(tmp, cache, "straight", *extra)[6:]],
                     show_progress=False)  # fmt: skip
    return Path(out["run_dir"])


@pytest.fixture(scope="module")
def clean_local(prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path_factory) -> Path:
    """The uninterrupted run on the in-process plane, shared by the tests that compare a
    killed, a resumed or a rebuilt run with it: 16 prompts, 8 per step (epochs of 2 steps;
    where a run checkpoints does not change what it trains)."""
    return _straight(tmp_path_factory.mktemp("clean"), tiny_cache, *_CLEAN)


@pytest.mark.parametrize(
    "variant",
    [
        # 16 prompts, 8 per step, a checkpoint every 3 steps: the step-3 checkpoint falls in
        # the middle of epoch 1 (steps 3-4), where a resume must go on with its second half.
        "mid-epoch",
        # A checkpoint every 2 steps: the step-2 checkpoint falls exactly on the end of
        # epoch 0, where a resume must start epoch 1, neither repeating epoch 0 nor skipping
        # 1. Checkpoints in S3, resumed on another machine.
        "epoch-boundary-s3",
    ],
)
def test_sigkill_mid_step_then_resume_is_exact(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, variant: str, request,
    clean_local: Path,
) -> None:
    # Both variants on the in-process plane (the exact resume over HTTP, with samples in
    # flight, is the streamed run's test below).
    elsewhere = tmp_path  # where the resume runs: the same machine, or another one
    bucket = None
    if variant == "epoch-boundary-s3":
        bucket = request.getfixturevalue("s3_bucket")  # also points boto3 at the server
        extra = [*_CLEAN, f"checkpoint.uri=s3://{bucket}/checkpoints"]
        elsewhere = tmp_path / "another-machine"
        ckpt = 2
    else:
        extra = [*_CLEAN, "checkpoint.every=3"]
        ckpt = 3
    env = _env()
    straight_dir = clean_local  # the uninterrupted run (made once per module)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _argv(tmp_path, tiny_cache, "killed", *extra), env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        # Step 3 is logged after the step-2 checkpoint committed (S3: step 4 is now in
        # flight); the step-3 checkpoint commits after step 3's lines, so the local variant
        # waits for its manifest too (then step 4 is in flight).
        _wait_for_step(killed / "metrics.jsonl", 3, proc, timeout_s=300)
        if bucket is None:
            _wait_for_file(killed / "checkpoints" / f"step-{ckpt:06d}" / "MANIFEST.json", proc,
                           timeout_s=120)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    if bucket is None:
        assert [p.name for p in sorted((killed / "checkpoints").glob("step-*"))
                if (p / "MANIFEST.json").is_file()] == [f"step-{ckpt:06d}"]
    else:
        from rl_core.checkpoint import latest_checkpoint

        assert latest_checkpoint(f"s3://{bucket}/checkpoints/killed") == (
            f"s3://{bucket}/checkpoints/killed/step-000002"
        )

    if bucket:  # another machine, by the command line's code (`--resume --json`), in this
        # process (one process start-up less)
        rc, out, err = _cli([*_argv(elsewhere, tiny_cache, "killed", *extra), "--resume",
                             "--json"], request.getfixturevalue("capsys"))
        assert rc == 0, err[-3000:]
        summary = json.loads(out[out.index("{"):])
    else:  # the same flow in this process (one process start-up less)
        from flows.grpo_train import grpo_train

        summary = grpo_train(config=DEMO, overrides=_argv(elsewhere, tiny_cache, "killed",
                                                          *extra)[6:],
                             show_progress=False, resume="always")
    assert summary["resumed_from_step"] == ckpt
    killed = elsewhere / "killed"

    # The same prompts, samples and rewards after the checkpoint, and no step twice.
    straight, again = _ledger(straight_dir), _ledger(killed)
    after = list(range(ckpt + 1, STEPS + 1))
    assert sorted(again) == (after if bucket else list(range(1, STEPS + 1)))
    for step in after:
        assert again[step] == straight[step], f"step {step} differs after resume"

    if bucket:  # another machine: the first evaluation is of the restored policy, at step 2
        evals = [json.loads(x) for x in (killed / "evals.jsonl").read_text().splitlines()]
        assert evals[0]["step"] == 2
        # epoch 1 (steps 3-4) visits all 16 prompts exactly once

        def prompts(steps: range) -> list[str]:
            return sorted({s["uid"].split(":")[1] for t in steps for s in again[t]})

        assert len(prompts(range(3, 5))) == 16
        assert sum(len(again[t]) for t in (3, 4)) == 16 * 4  # 4 samples each, none twice
        straight_prompts = sorted(
            {s["uid"].split(":")[1] for t in (1, 2) for s in straight[t]}
        )
        assert prompts(range(3, 5)) == straight_prompts

    # The same final weights, bit for bit.
    a = load_file(straight_dir / "model" / "model.safetensors")
    b = load_file(killed / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:  # noqa: ANN001
    """``grpoflow`` in this process (``main(argv)``: the command line's code without the
    process start-up and its reaper); rc, stdout, stderr. The environment is left as found."""
    from grpoflow.cli import main

    before = dict(os.environ)
    log = logging.getLogger("rl_core")
    level = log.level
    try:
        rc = main(argv[3:])  # after `python -m grpoflow.cli`
    finally:
        os.environ.clear()
        os.environ.update(before)
        for handler in [h for h in log.handlers if h.get_name() == "grpoflow-cli"]:
            log.removeHandler(handler)  # it writes to this test's captured stderr
        log.setLevel(level)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_resume_without_checkpoint_fails_clearly(
    prefect_harness, tiny_cache: Path, tmp_path: Path, capsys
) -> None:
    rc, _, err = _cli([*_argv(tmp_path, tiny_cache, "nothing-here"), "--resume"], capsys)
    assert rc != 0
    assert "no complete checkpoint under" in err


def test_a_lost_trainer_is_rebuilt_from_the_checkpoint(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, monkeypatch,
    clean_local: Path,
) -> None:
    """One run, two lost trainers (their tasks never retry). train-step-2 fails (no
    checkpoint yet): the run starts over from the base model at step 1, and its logs and
    sample ledger start over with it (no step counted twice). Later train-step-4 fails: the
    planes are rebuilt from the step-2 checkpoint. The run ends exactly where an
    uninterrupted run ends."""
    from flows.grpo_train import grpo_train
    from rl_core.training.torch_trainer import TorchTrainer

    a = load_file(clean_local / "model" / "model.safetensors")
    real_step = TorchTrainer.train_step
    # calls: 1 (step 1), 2 (step 2: lost; from the base model), 3-5 (steps 1-3),
    # 6 (step 4: lost; from the step-2 checkpoint), 7-8 (steps 3-4)
    fail_at, calls = (2, 6), {"n": 0}

    def flaky(self, batch):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] in fail_at:
            raise RuntimeError("trainer rank lost (injected)")
        return real_step(self, batch)

    monkeypatch.setattr(TorchTrainer, "train_step", flaky)
    name = "flaky"
    recovered = grpo_train(config=DEMO, overrides=[*_in_process(tmp_path, tiny_cache, name),
                                                   "train.max_plane_restarts=2"],
                           show_progress=False)
    assert calls["n"] == 8, calls  # each failure cost one rebuild and the steps it names
    assert recovered["plane_restarts"] == 2
    b = load_file(Path(recovered["model_dir"]) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _ledger(tmp_path / name) == _ledger(clean_local)
    steps = [json.loads(x)["step"] for x in (tmp_path / name / "metrics.jsonl").read_text()
             .splitlines()]  # fmt: skip
    assert steps == sorted(set(steps)), f"a step logged twice: {steps}"


class _Killed(BaseException):
    """A SIGKILL at a chosen line of the flow, in this process: nothing after it runs."""


@pytest.mark.parametrize("where", [
    # after the step-2 checkpoint committed, before anything else of step 2 (its MLflow
    # metrics, the console): the soak once killed a run there and its ledger lost step 4
    "after-the-commit",
    # after the step-2 lines reached the run directory, before its checkpoint committed
    "before-the-commit",
])
def test_a_kill_beside_a_checkpoint_loses_and_repeats_no_step(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, monkeypatch,
    clean_local: Path, where: str,
) -> None:
    """A run stopped next to its step-2 checkpoint, then resumed: the ledger and the metrics
    hold every step once and equal the uninterrupted run's (checkpoints every 2 steps)."""
    import flows.run
    from flows.grpo_train import GRPOPlanes, grpo_train

    real = GRPOPlanes.checkpoint if where == "before-the-commit" else flows.run.log_checkpoint
    armed = {"on": True}

    def kill_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if armed.pop("on", False):
            raise _Killed
        return real(*args, **kwargs)

    if where == "before-the-commit":
        monkeypatch.setattr(GRPOPlanes, "checkpoint", kill_once)
    else:
        monkeypatch.setattr(flows.run, "log_checkpoint", kill_once)
    overrides = _in_process(tmp_path, tiny_cache, "stopped")
    with pytest.raises(_Killed):
        grpo_train(config=DEMO, overrides=overrides, show_progress=False)
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    grpo_train(config=DEMO, overrides=overrides, show_progress=False)  # resumes
    assert _ledger(tmp_path / "stopped") == _ledger(clean_local)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "time/checkpoint" in rows[3]  # the checkpoint's time joins its step's line


def test_a_step_that_keeps_failing_fails_the_run_naming_task_and_step(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, monkeypatch
) -> None:
    from flows.grpo_train import grpo_train
    from rl_core.training.torch_trainer import TorchTrainer

    def broken(self, batch):  # noqa: ANN001
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(TorchTrainer, "train_step", broken)
    with pytest.raises(RuntimeError, match=r"GRPO step 1 failed .* task train-step-1 failed: "
                       r"RuntimeError: out of memory \(injected\)"):
        grpo_train(config=DEMO, overrides=_in_process(tmp_path, tiny_cache, "broken"),
                   show_progress=False)


def _kill_at(tmp: Path, cache: Path, env: dict[str, str], extra: list[str],
             points: list[float | int]) -> list[str]:
    """SIGKILL ``grpoflow train`` (resuming whatever its run directory holds) once per point;
    every process it had started must be gone after each kill (the reaper). A point is an
    int (kill once step N is logged: step N + 1 is in flight; an event, never missed, the
    ``make test`` variant) or a float (kill that many seconds after the start, the soak's
    random moments; a run that finishes first is simply complete). Returns what was killed
    when, for messages."""
    import psutil

    log = []
    metrics = tmp / "killed" / "metrics.jsonl"
    for i, point in enumerate(points):
        proc = subprocess.Popen(_argv(tmp, cache, "killed", *extra), env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tree = []
        try:
            if isinstance(point, int):
                _wait_for_step(metrics, point, proc, timeout_s=300)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=point)
            if proc.poll() is None:
                tree = psutil.Process(proc.pid).children(recursive=True)
                proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        steps = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        what = f"after step {point} was logged" if isinstance(point, int) else f"at {point:.1f}s"
        log.append(f"kill {i + 1} {what} ({steps} logged steps, rc {rc})")
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"{log[-1]}: left running: {[p.pid for p in alive]}"
    return log


_SOAK_KILLS = int(os.environ.get("GRPOFLOW_SOAK_KILLS", "8"))


_MODES = {"sync": [], "overlap-2": ["rollout.max_staleness=2"],
          "stream-2": ["rollout.max_staleness=2", "rollout.streaming=true",
                       "rollout.partial_tokens=8"]}


# In CI: one kill of a streamed run mid-step (the most state in flight: partial samples; the
# synchronous mode's single kill is the test above, the overlapped mode's exact resume is
# tests/test_overlap.py), at an event; `pytest -m soak`: many kills at random moments in
# every mode.
@pytest.mark.parametrize(("mode", "kills"), [
    pytest.param("stream-2", 0, id="stream-2-kill-mid-step"),
    *(pytest.param(m, _SOAK_KILLS, id=f"{m}-soak", marks=pytest.mark.soak) for m in _MODES),
])
def test_sigkills_at_random_points_then_resume_is_exact(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, mode: str,
    kills: int,
) -> None:
    """Kill the run (mid-step; in the soak at random moments: start-up, a step, a checkpoint
    write, the final evaluation), resume each time, and let the last resume finish: the
    ledger (every step once, the same samples) and the final weights equal the uninterrupted
    run's, in the synchronous, the overlapped and the streamed mode, and no kill leaves a
    process running."""
    import random

    extra = ["rollout.engine=embedded", *_MODES[mode], "checkpoint.keep_last=1"]
    env = _env()
    t0 = time.monotonic()
    straight_dir = _straight(tmp_path, tiny_cache, *extra)
    span = time.monotonic() - t0 + 5  # + the process start-up the killed runs pay
    seed = int(os.environ.get("GRPOFLOW_SOAK_SEED", str(time.time_ns() % 10**6)))
    rng = random.Random(seed)
    points: list[float | int] = [rng.uniform(1.0, span) for _ in range(kills)] or [3]
    log = _kill_at(tmp_path, tiny_cache, env, extra, points)
    where = f"GRPOFLOW_SOAK_SEED={seed}: {'; '.join(log)}"
    # the last resume runs the same flow in this process (one process start-up less)
    from flows.grpo_train import grpo_train

    grpo_train(config=DEMO, overrides=_argv(tmp_path, tiny_cache, "killed", *extra)[6:],
               show_progress=False)
    straight, killed = _ledger(straight_dir), _ledger(tmp_path / "killed")
    assert sorted(killed) == list(range(1, STEPS + 1)), where
    for step in killed:
        assert killed[step] == straight[step], f"{where}: step {step} differs"
    a = load_file(straight_dir / "model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), f"{where}: other final weights"
