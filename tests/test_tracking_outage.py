"""The MLflow server goes away mid-run (issue 9, fault 6): training goes on, the metrics are
kept and sent when the server is back, and the run says so; a server still down at the end
leaves a replayable file in the run directory.

A real ``mlflow server`` process (SQLite store), SIGKILLed and restarted on the same port
and store; no MLflow call is mocked.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl_core.host import free_port

pytest.importorskip("mlflow")

from engine_helpers import save_tiny_model  # noqa: E402
from mlflow_server import MlflowServer, start_mlflow_server  # noqa: E402

from tasks import tracking  # noqa: E402
from tasks.tracking import outbox, sender  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")
STEPS = 6  # 2 before the outage, 3-5 during it (6 waits for the restart)


class Server:
    """One mlflow server for the module that tests take down and bring back."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc: MlflowServer = start_mlflow_server(root, wait=False)
        self.url = self.proc.url

    def down(self) -> None:
        self.proc.kill()

    def up(self, wait: bool = True) -> None:
        if self.proc.proc.poll() is None:
            self.proc.wait_ready(timeout=180)
            return
        self.proc = start_mlflow_server(self.root, port=self.proc.port, wait=wait)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """Not waited for here: it boots while the Prefect harness and the model are made."""
    saved = os.environ.get("MLFLOW_DISABLE_TELEMETRY")
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    srv = Server(tmp_path_factory.mktemp("mlflow-outage"))
    try:
        yield srv
    finally:
        srv.proc.stop()
        if saved is None:
            os.environ.pop("MLFLOW_DISABLE_TELEMETRY", None)
        else:
            os.environ["MLFLOW_DISABLE_TELEMETRY"] = saved


def _client(url: str):  # noqa: ANN202 - an MlflowClient
    from mlflow import MlflowClient

    return MlflowClient(url)


def _steps(client, run_id: str, key: str) -> list[int]:  # noqa: ANN001
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _watch(
    server: Server, metrics: Path, seen: dict[int, float], events: dict, stop: threading.Event,
    down: threading.Event, up: threading.Event,
) -> None:
    """Kill the server once step 2 has reached MLflow; start it again (same port and store)
    once two more steps have run without it and the sender has noticed the outage. Records
    when each step was written; ``down``/``up`` tell the gated steps (the test)."""
    from mlflow import MlflowClient

    client = MlflowClient(server.url)
    deadline = time.monotonic() + 300
    while not stop.is_set() and time.monotonic() < deadline:
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                seen.setdefault(json.loads(line)["step"], time.monotonic())
        if "down_at_step" not in events and seen.get(2):
            runs = list(sender._TRACKERS)
            if runs and 2 in _steps(client, runs[0], "reward_mean"):
                server.down()
                events["down_at_step"] = max(seen)
                events["down"] = time.monotonic()
                down.set()
        elif (
            "down_at_step" in events
            and "up" not in events
            and (max(seen) >= events["down_at_step"] + 2)
            # an event, not a duration: the sender has noticed the outage (a send failed
            # after MLflow's own retries); a server back within those retries is no outage
            and any(t.failing_since is not None for t in list(sender._TRACKERS.values()))
        ):
            events["up"] = time.monotonic()
            server.up(wait=False)  # boots (10-30 s) while training goes on
            up.set()
        time.sleep(0.05)


def test_server_killed_mid_run_training_goes_on_and_nothing_is_lost(
    prefect_harness, server: Server, tmp_path: Path, caplog, monkeypatch
) -> None:
    import flows.grpo_train
    from flows.grpo_train import grpo_train

    # The outage's order, by events (the in-process engine's steps are faster than the
    # sender, so by time alone the run could end before the server went down): step 3 starts
    # once the server is down, step 6 once it is being started again; gated[s] is the time
    # step s waited for that (not a step that waited on the dead server).
    down, up = threading.Event(), threading.Event()
    gated: dict[int, float] = {}
    real_step = flows.grpo_train.grpo_step

    def gated_step(planes, rollouts, step):  # noqa: ANN001, ANN202 - the real step, gated
        gate = {3: (down, "the server to be killed"), 6: (up, "the server to start again")}
        if step in gate:
            started = time.monotonic()
            if not gate[step][0].wait(240):
                raise RuntimeError(f"step {step} waited 240 s for {gate[step][1]}")
            gated[step] = time.monotonic() - started
        return real_step(planes, rollouts, step)

    monkeypatch.setattr(flows.grpo_train, "grpo_step", gated_step)
    # The outage is an event here, not a duration: the sender's backoff (1 s doubling to
    # 30 s in a run) and MLflow's own retries shortened so the restarted server is heard
    # within seconds, not after a 30 s wait (the outcome does not depend on them).
    monkeypatch.setattr(outbox, "RETRY_DELAYS", (0.2, 2.0))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    queued: dict[int, float] = {}  # step -> seconds its metrics took to queue (log_step)
    real_log_metrics = sender.Tracker.log_metrics

    def timed(self, step, metrics):  # noqa: ANN001, ANN202 - the real method, timed
        started = time.perf_counter()
        try:
            return real_log_metrics(self, step, metrics)
        finally:
            queued[step] = max(queued.get(step, 0.0), time.perf_counter() - started)

    monkeypatch.setattr(sender.Tracker, "log_metrics", timed)

    model_dir = save_tiny_model(tmp_path / "model")
    server.up()
    run_dir = tmp_path / "outage"
    seen: dict[int, float] = {}
    events: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(server, run_dir / "metrics.jsonl", seen, events, stop, down, up),
        daemon=True,
    )
    overrides = [
        f"storage.root={tmp_path}", f"storage.cache_dir={tmp_path / 'cache'}",
        "run_name=outage", f"model.path={model_dir}", "rollout.engine=local",
        f"train.steps={STEPS}", "train.prompts_per_step=4", "rollout.n_samples=4",
        "train.num_threads=1", "eval.every=0", "eval.num_examples=8", "eval.pass_k_examples=0",
        "tracking.backend=mlflow", f"tracking.uri={server.url}", "tracking.samples_every=2",
        "tracking.register_model=false", "tracking.flush_timeout_s=180",
        "data.max_prompt_tokens=200",  # the random tiny model has a 256-token context
    ]  # fmt: skip
    caplog.set_level(logging.INFO)
    logging.getLogger("prefect").addHandler(caplog.handler)
    watcher.start()
    try:
        state = grpo_train(config=DEMO, overrides=overrides, show_progress=False, return_state=True)
    finally:
        stop.set()
        watcher.join(timeout=10)
        logging.getLogger("prefect").removeHandler(caplog.handler)
        server.up()  # whatever happened, the next test finds it up
    assert state.is_completed(), state
    summary = state.result()
    assert "down" in events and "up" in events, (events, seen)

    # training went on: no step waited on the dead server
    down_step = events["down_at_step"]
    during = [s for s in range(down_step + 1, STEPS + 1) if seen[s] < events["up"] + 1]
    assert len(during) >= 2, (events, seen)
    gaps = {s: seen[s] - seen[s - 1] - gated.get(s, 0.0) for s in range(2, STEPS + 1)}
    before = max(gaps[s] for s in range(2, down_step + 1))
    assert max(gaps[s] for s in during) < 3 * before + 10, (gaps, events, gated)
    for s in during:  # queueing never waits (the old synchronous log_batch took ~4 minutes)
        assert queued[s] < 1, queued

    # nothing lost: every step's every metric is in MLflow, in order, once
    tracked = summary["tracking"]
    assert "unsent_file" not in tracked and not (run_dir / sender.UNSENT_FILE).exists()
    client = _client(server.url)
    run_id = tracked["run_id"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = set.intersection(*({k for k, v in r.items() if isinstance(v, float)} for r in rows))
    keys.discard("time")  # the run directory's timestamp, not a metric
    assert {"reward_mean", "loss", "time/rollout"} <= keys
    for key in sorted(keys):
        name = tracking.metric_name(key)
        assert _steps(client, run_id, name) == list(range(1, STEPS + 1)), key
    samples = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert samples == {f"samples/step-{s:06d}.json" for s in range(2, STEPS + 1, 2)}

    # ... and the run says so: on the MLflow run, in the result, in the log
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert int(run.data.tags[sender.OUTAGES_TAG]) >= 1
    assert float(run.data.tags[sender.OUTAGE_SECONDS_TAG]) > 0
    assert client.get_metric_history(run_id, sender.OUTAGE_METRIC)
    assert tracked["tracking_outages"] >= 1 and tracked["tracking_outage_seconds"] > 0
    assert "is unreachable" in caplog.text and "again after" in caplog.text


def test_server_down_at_the_end_leaves_a_file_that_replays(
    server: Server, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A tracker whose server never answers (a port nothing listens on): queueing never
    waits, the end is bounded by flush_timeout_s and leaves the values (and the run's status)
    in the run directory; replaying the file into the live server gives the whole history."""
    from grpoflow.cli import main as cli_main

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a dead server fails at once
    server.up()
    client = _client(server.url)
    exp = client.create_experiment(f"outage-unit-{time.time_ns()}")
    run_id = client.create_run(exp).info.run_id
    dead = f"http://127.0.0.1:{free_port()}"
    handle = tracking.TrackingHandle(
        dead, exp, run_id, "outage-unit", "m", 6, run_dir=str(tmp_path), flush_timeout_s=2
    )
    tracker = tracking.Tracker(handle)
    started = time.monotonic()
    for step in range(1, 7):
        tracker.log_metrics(step, {"reward_mean": step / 10, "loss": -step})
    tracker.log_table("samples/step-000006.json", {"completion": ["a", "b"], "reward": [0, 1]})
    assert time.monotonic() - started < 1, "queueing never waits on the server"
    report = tracker.end("FINISHED")
    assert time.monotonic() - started < 20, "the end is bounded by flush_timeout_s"

    path = tmp_path / sender.UNSENT_FILE
    assert report["unsent_file"] == str(path)
    assert (report["unsent_values"], report["unsent_tables"]) == (12, 1)
    assert report["tracking_outages"] == 1
    records = [json.loads(line) for line in path.read_text().splitlines()]
    header = records[0]
    assert header["kind"] == "run" and header["run_id"] == run_id
    assert header["status"] == "FINISHED", "the server never heard the run end"
    assert sorted((r["key"], r["step"]) for r in records if r["kind"] == "metric") == sorted(
        (k, s) for k in ("reward_mean", "loss") for s in range(1, 7)
    )

    assert tracking.replay_unsent(path, server.url) == {
        "runs": 1, "metrics": 12, "skipped": 0, "tables": 1,
    }  # fmt: skip
    assert _steps(client, run_id, "reward_mean") == [1, 2, 3, 4, 5, 6]
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [-1, -2, -3, -4, -5, -6]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[sender.OUTAGES_TAG] == "1"
    assert "samples/step-000006.json" in {a.path for a in client.list_artifacts(run_id, "samples")}
    # a second replay sends nothing twice (here through the command line)
    assert cli_main(["tracking", "replay", str(path), "--uri", server.url]) == 0
    assert "replayed 0 metric values (12 already there)" in capsys.readouterr().out
    assert len(client.get_metric_history(run_id, "loss")) == 6
