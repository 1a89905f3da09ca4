"""Episode traces (tasks/tracking/traces.py): multi-turn episodes logged to MLflow as traces,
linked to the run (its Traces tab) and to the sample ledger (tags), a sample per step.

Episodes come from the real :class:`rl_core.agents.EpisodeRunner` over an
:class:`~rl_core.rollout.inprocess.InProcessPlane` serving a tiny random model, or are written
out by hand where a test needs exact numbers. Traces go to a real SQLite store (the embedded
default) and to a real ``mlflow server``, which a test takes down (SIGKILL) and brings back;
they are read back with ``MlflowClient.search_traces``. Nothing of MLflow is mocked.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from engine_helpers import save_tiny_model  # noqa: E402
from mlflow_server import MlflowServer, start_mlflow_server  # noqa: E402

from rl_core.types import Sample  # noqa: E402
from tasks import tracking  # noqa: E402
from tasks.tracking import traces  # noqa: E402
from tasks.tracking.handle import TrackingHandle  # noqa: E402

SECRET = "sk-trace-4f3e2d1c0b9a"  # an API key an environment echoes back
ENV_SECRET = "envpw-77aa66bb55cc"  # a secret-named variable of this process
# What a chat template needs to turn messages into the tiny model's characters.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


@pytest.fixture(scope="module", autouse=True)
def _mlflow_env() -> Iterator[None]:
    """No telemetry; a dead server fails a call at once (no retries) rather than after ~7 s."""
    values = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "GRPOFLOW_TRACE_TEST_PASSWORD": ENV_SECRET}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def server(_mlflow_env, tmp_path_factory) -> Iterator[MlflowServer]:
    """Not waited for here: it boots while the first tests run."""
    srv = start_mlflow_server(tmp_path_factory.mktemp("mlflow-traces"), wait=False)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module", autouse=True)
def _boot_server_early(server: MlflowServer) -> None:
    pass


@pytest.fixture
def logs(caplog) -> Any:  # noqa: ANN401
    caplog.set_level(logging.INFO)
    return caplog


# ---------------------------------------------------------------------------- helpers


def _store(root: Path, name: str = "traces") -> tuple[str, str, str]:
    """A SQLite tracking store with an experiment and a run: (uri, experiment id, run id)."""
    from mlflow import MlflowClient

    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment(name, artifact_location=(root / "mlartifacts").as_uri())
    return uri, exp, client.create_run(exp, run_name=f"{name}-1").info.run_id


def _handle(uri: str, exp: str, run: str, **kw: Any) -> TrackingHandle:
    return TrackingHandle(uri, exp, run, "trc-1", "trc-policy", 4, flush_timeout_s=60, **kw)


def _search(uri: str, exp: str, **kw: Any) -> list[Any]:
    from mlflow import MlflowClient

    return list(MlflowClient(uri).search_traces(locations=[exp], max_results=500, **kw))


def _by_uid(found: list[Any]) -> dict[str, Any]:
    return {t.info.tags["grpoflow.uid"]: t for t in found}


def _episode(uid: str, group: int, reward: float, *, status: str = "ok",
             trace: list[dict] | None = None, errors: list[str] | None = None,
             attempts: int = 1, **extra: Any) -> Sample:
    """An episode sample written out by hand (the shape EpisodeRunner gives)."""
    trace = trace if trace is not None else [
        {"attempt": 0, "role": "reset", "messages": [{"role": "user", "content": "1+2?"}],
         "tokens": 12},
        {"attempt": 0, "role": "assistant", "text": "3", "tokens": 2, "seconds": 0.5,
         "weight_version": 3, "finish_reason": "stop"},
        {"attempt": 0, "role": "environment", "reward": reward, "done": True, "seconds": 0.25,
         "messages": [], "tool_calls": 0}]
    episode = {"status": status, "finish": "failed" if status == "failed" else "done",
               "turns": sum(e["role"] == "assistant" for e in trace), "attempts": attempts,
               "errors": errors or [], "env_reward": reward, "tool_calls": 0, "info": {},
               "masked_tokens": 0, "trace": trace, "seconds": 1.0, **extra}
    record = uid.split(":")[1]
    return Sample([5, 6, 7], [8, 9], [-0.5, -0.5], {"type": "stop"}, 3, "3", uid=uid,
                  group=group, record_id=record, answer="3", reward=reward,
                  correct=reward > 0, meta={"episode": episode})


def _spans(trace: Any) -> dict[str, Any]:
    return {s.name: s for s in trace.data.spans}


def _seconds(span: Any) -> float:
    return (span.end_time_ns - span.start_time_ns) / 1e9


# ---------------------------------------------------------------------------- unit


def test_choose_episodes_failed_first_then_spread_over_groups() -> None:
    """Failed episodes first, then one per group spread over the step (best reward, then
    worst, ...); deterministic; samples without an episode never chosen."""
    samples = [_episode(f"1:r{g}:{j}", g, reward=float(j)) for g in range(6) for j in range(4)]
    samples[9] = _episode("1:r2:1", 2, 0.0, status="failed", errors=["attempt 1: reset: x: y"])
    samples[22] = _episode("1:r5:2", 5, 0.0, status="failed", errors=["boom"])
    plain = Sample([1], [2], [-1.0], uid="1:p:0")  # a single-turn sample
    uids = lambda chosen: [s.uid for s in chosen]  # noqa: E731

    assert traces.choose_episodes([plain, *samples], 0) == []
    assert traces.choose_episodes([plain] * 5, 4) == []
    assert uids(traces.choose_episodes(samples, 1)) == ["1:r2:1"]
    assert uids(traces.choose_episodes(samples, 2)) == ["1:r2:1", "1:r5:2"]
    # 4 more from 6 groups: spread (groups 0, 1, 3, 4), each group's best reward first
    four = uids(traces.choose_episodes([plain, *samples], 6))
    assert four == ["1:r0:3", "1:r1:3", "1:r2:1", "1:r3:3", "1:r4:3", "1:r5:2"]
    # a second round takes each group's worst
    many = uids(traces.choose_episodes(samples, 14))
    assert {"1:r0:3", "1:r0:0", "1:r3:0"} <= set(many) and len(many) == 14
    assert uids(traces.choose_episodes(samples, 14)) == many
    assert len(traces.choose_episodes(samples, 100)) == len(samples)


def test_episode_trace_spans_timings_and_errors(monkeypatch) -> None:
    """One episode's trace, built without I/O: a failed attempt then a successful one with a
    tool call; span types, parents, durations, token usage, ledger tags, redaction."""
    monkeypatch.setenv("GRPOFLOW_TRACE_TEST_PASSWORD", ENV_SECRET)
    trace = [
        {"attempt": 0, "role": "reset", "messages": [{"role": "user", "content": "6*7?"}],
         "tokens": 10},
        {"attempt": 0, "role": "assistant", "text": "<tool_call>", "tokens": 4, "seconds": 0.4,
         "weight_version": 6, "finish_reason": "stop"},
        {"attempt": 1, "role": "reset", "messages": [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "6*7?"}],
         "tokens": 14},
        {"attempt": 1, "role": "assistant", "text": "calc(6*7)", "tokens": 5, "seconds": 0.5,
         "weight_version": 6, "finish_reason": "stop"},
        {"attempt": 1, "role": "environment", "reward": 0.0, "done": False, "seconds": 0.125,
         "messages": [{"role": "tool", "content": f"42 (api_key={SECRET}) {ENV_SECRET}"}],
         "tool_calls": 1, "tokens": 7},
        {"attempt": 1, "role": "assistant", "text": "42", "tokens": 2, "seconds": 0.25,
         "weight_version": 7, "finish_reason": "stop"},
        {"attempt": 1, "role": "environment", "reward": 1.0, "done": True, "seconds": 0.0625,
         "messages": [], "tool_calls": 0},
    ]
    errors = [f"attempt 1: step: timeout: no answer within 30s (token={SECRET})"]
    sample = _episode("7:q1:2", 1, 1.0, trace=trace, errors=errors, attempts=2,
                      started_at=1_700_000_000.0, info={"api_key": SECRET, "tool_calls": 0})
    sample.meta["episode"]["seconds"] = 1.0  # the last attempt's wall time
    t = traces.episode_trace(sample, 7, experiment_id="5", run_id="run-1", run_name="trc-1",
                             trained=True)

    assert t.info.trace_id.startswith("tr-") and t.info.experiment_id == "5"
    assert t.info.trace_metadata["mlflow.sourceRun"] == "run-1"
    tags = t.info.tags
    assert tags["grpoflow.uid"] == "7:q1:2" and tags["grpoflow.step"] == "7"
    assert (tags["grpoflow.record_id"], tags["grpoflow.group"]) == ("q1", "1")
    assert tags["grpoflow.reward"] == "1" and tags["grpoflow.status"] == "ok"
    assert tags["grpoflow.trained"] == "true" and tags["grpoflow.kind"] == "episode"
    assert tags["mlflow.traceName"] == "episode 7:q1:2" and t.info.client_request_id == "7:q1:2"
    assert t.info.state.value == "OK" and t.info.request_preview == "6*7?"

    s = _spans(t)
    root = s["episode 7:q1:2"]
    assert set(s) == {"episode 7:q1:2", "attempt 1", "attempt 2", "reset", "model (turn 1)",
                      "environment (turn 1)", "tools (turn 1)", "model (turn 2)",
                      "environment (turn 2)"}
    assert root.span_type == "AGENT" and root.parent_id is None
    assert root.start_time_ns == 1_700_000_000 * 10**9  # the record's own wall clock
    a1, a2 = s["attempt 1"], s["attempt 2"]
    assert a1.status.status_code == "ERROR" and "timeout" in a1.status.description
    assert a2.status.status_code == "OK" and root.status.status_code == "OK"
    # attempt 1: its turn, then the environment call that timed out (an error span)
    failed_env = s["environment (turn 1)"]
    assert failed_env.parent_id == a1.span_id and failed_env.status.status_code == "ERROR"
    assert failed_env.events[0].attributes["exception.type"] == "timeout"
    # attempt 2: spans laid end to end with the record's durations, after attempt 1
    assert a2.start_time_ns >= a1.end_time_ns
    llm, tool = s["model (turn 2)"], s["tools (turn 1)"]
    assert (llm.span_type, tool.span_type) == ("LLM", "TOOL")
    assert _seconds(llm) == pytest.approx(0.25) and _seconds(tool) == pytest.approx(0.125)
    assert s["model (turn 1)"].parent_id in (a1.span_id, a2.span_id)
    assert llm.attributes["weight_version"] == 7 and llm.attributes["finish_reason"] == "stop"
    # the engine saw the prompt, turn 1 and the tool output before turn 2
    assert llm.attributes["mlflow.chat.tokenUsage"] == {
        "input_tokens": 14 + 5 + 7, "output_tokens": 2, "total_tokens": 28}
    assert llm.outputs == {"role": "assistant", "content": "42"}
    assert tool.outputs["reward"] == 0.0 and tool.attributes["tool_calls"] == 1
    assert root.outputs["answer"] == "3" and root.attributes["attempts"] == 2
    assert _seconds(root) >= 0.4 + 1.0
    assert t.info.execution_duration == (root.end_time_ns - root.start_time_ns) // 1_000_000
    # secrets: not in any span, tag or preview
    blob = str([sp.to_dict() for sp in t.data.spans]) + str(t.info.to_dict())
    assert SECRET not in blob and ENV_SECRET not in blob
    assert root.attributes["info"]["api_key"] == "***"

    failed = _episode("7:q2:0", 2, 0.0, status="failed", trace=[], attempts=2, errors=[
        "attempt 1: reset: error: RuntimeError: down", "attempt 2: reset: error: OSError: gone"])
    f = traces.episode_trace(failed, 7, experiment_id="5", run_id="run-1", logged_at=100.0)
    root = f.data.spans[0]
    assert f.info.state.value == "ERROR" and f.info.tags["grpoflow.status"] == "failed"
    assert root.status.status_code == "ERROR" and "OSError: gone" in root.status.description
    assert root.end_time_ns == 100 * 10**9  # no wall clock in the record: ends when logged
    assert sum(sp.name == "reset" for sp in f.data.spans) == 2


# ---------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def episodes(tmp_path_factory) -> dict[int, list[Sample]]:
    """Two steps of real episodes: EpisodeRunner over an in-process plane serving a tiny
    random model, in an environment that answers with a tool result, then ends. Task
    ``broken`` fails every reset (failed episodes); ``flaky``'s first step calls fail once
    (retried episodes)."""
    import torch
    from transformers import AutoTokenizer

    from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner, StepResult
    from rl_core.data.records import Record
    from rl_core.engine.sampling import SamplingParams
    from rl_core.rollout.inprocess import InProcessPlane

    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    lock, flaky = threading.Lock(), {"left": 0}

    class Env:
        def reset(self, task: Record) -> list[dict]:
            if task.id == "broken":
                raise RuntimeError(f"sandbox died (api_key={SECRET})")
            self.task = task
            return [{"role": "user", "content": task.question}]

        def step(self, turn: Any) -> StepResult:
            if self.task.id == "flaky":
                with lock:
                    if flaky["left"]:
                        flaky["left"] -= 1
                        raise ConnectionError("tool server reset")
            if turn.index == 0:
                return StepResult([{"role": "tool", "content": "42"}], reward=0.25,
                                  info={"tool_calls": 1})
            return StepResult(reward=1.0, done=True, info={"tool_calls": 0})

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    plane = InProcessPlane(path)
    try:
        runner = EpisodeRunner(plane, ChatTokens(tok), Env, EpisodeLimits(3, 64), retries=1)
        records = [Record("r0", "six times seven", "42"), Record("broken", "x", "1"),
                   Record("flaky", "add two", "4"), Record("r1", "two plus two", "4")]
        out = {}
        for step in (1, 2):
            flaky["left"] = 2  # both of flaky's episodes fail their first environment step
            out[step] = runner.run(records, n=2, step=step, seed=0,
                                   params=SamplingParams(temperature=1.0, max_new_tokens=6))
        return out
    finally:
        plane.close()
        torch.set_num_threads(threads)


def test_sqlite_store_traces_linked_to_run_and_ledger(episodes, tmp_path: Path, monkeypatch,
                                                      logs) -> None:
    """The embedded default: ``traces_per_step`` real episodes per step in the run's SQLite
    store, failed ones first, linked to the run and findable by ledger uid; a single-turn
    step logs nothing; a resumed run's redone step replaces its traces; MLflow's global
    tracking URI is never touched."""
    import mlflow

    monkeypatch.chdir(tmp_path)  # nothing may land in ./mlruns or ./mlflow.db
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    global_uri = mlflow.get_tracking_uri()
    uri, exp, run = _store(tmp_path / "run")
    h = _handle(uri, exp, run, run_dir=str(tmp_path / "run"))
    limit = 4

    started = time.perf_counter()
    trained, dropped = episodes[1][2:], episodes[1][:2]  # group 0 not trained on
    assert traces.log_traces(h, 1, trained, limit, dropped) == limit
    assert traces.log_traces(h, 2, episodes[2], limit) == limit
    assert time.perf_counter() - started < 2.0, "queueing is the step's only cost"
    assert traces.log_traces(h, 3, [Sample([1], [2], [-1.0], uid="3:p:0")], limit) == 0
    assert traces.log_traces(h, 3, episodes[2], 0) == 0
    assert traces.log_traces(None, 3, episodes[2], limit) == 0
    assert tracking.flush_traces(h, timeout=60)

    found = _search(uri, exp, run_id=run)
    assert len(found) == 2 * limit
    for step in (1, 2):
        ours = _search(uri, exp, filter_string=f"tags.`grpoflow.step` = '{step}'")
        assert len(ours) == limit
        # both failed episodes (task "broken"), then one of each of two other groups
        statuses = sorted(t.info.tags["grpoflow.status"] for t in ours)
        assert statuses == ["failed", "failed", "ok", "ok"]
        assert {t.info.tags["grpoflow.record_id"] for t in ours} == {"broken", "r0", "flaky"}
    failed = _search(uri, exp, filter_string="trace.status = 'ERROR'")
    assert {t.info.tags["grpoflow.record_id"] for t in failed} == {"broken"}
    assert all(t.data.spans[0].status.status_code == "ERROR" for t in failed)

    # the ledger's key finds the trace; the trace holds the episode as the runner recorded it
    by_uid = _by_uid(found)
    sample = next(s for s in episodes[2] if s.uid in by_uid and s.record_id != "broken")
    t = by_uid[sample.uid]
    assert t.info.trace_metadata["mlflow.sourceRun"] == run
    assert t.info.tags["grpoflow.trained"] == "true"
    assert _by_uid(_search(uri, exp, filter_string=f"tags.`grpoflow.uid` = '{sample.uid}'"))
    ep = sample.meta["episode"]
    turns = [e for e in ep["trace"] if e["role"] == "assistant"
             and e["attempt"] == ep["attempts"] - 1]
    llm = sorted((s for s in t.data.spans if s.span_type == "LLM"), key=lambda s: s.start_time_ns)
    assert len(llm) >= len(turns) == ep["turns"]
    for span, turn in zip(llm[-len(turns):], turns, strict=True):
        assert span.outputs["content"] == turn["text"]
        assert span.attributes["tokens"] == turn["tokens"]
        assert _seconds(span) == pytest.approx(turn["seconds"], abs=1e-6)
        assert span.attributes["weight_version"] == turn["weight_version"]
    tools = [s for s in t.data.spans if s.span_type == "TOOL"]
    assert tools and tools[0].outputs["messages"] == [{"role": "tool", "content": "42"}]
    assert float(t.info.tags["grpoflow.reward"]) == sample.reward
    # step 1's group 0 was generated, not trained on: the ledger says so, and so does its tag
    assert {x.info.tags["grpoflow.record_id"]: x.info.tags["grpoflow.trained"] for x in found
            if x.info.tags["grpoflow.step"] == "1"} == {"r0": "false", "broken": "true",
                                                         "flaky": "true"}
    # a retried episode: its failed first attempt is an ERROR span, the episode is not
    flaky = next(x for x in found if x.info.tags["grpoflow.record_id"] == "flaky")
    spans = _spans(flaky)
    assert spans["attempt 1"].status.status_code == "ERROR"
    assert "tool server reset" in spans["attempt 1"].status.description
    assert spans["attempt 2"].status.status_code == "OK" and flaky.info.state.value == "OK"
    # the failed episodes' secret-bearing errors are redacted in the store
    blob = (tmp_path / "run" / "mlflow.db").read_bytes()
    assert SECRET.encode() not in blob and b"sandbox died" in blob

    # a resumed run redoes step 2: its traces replace the first try's
    resumed = dataclasses.replace(h, resumed=True)
    assert traces.log_traces(resumed, 2, episodes[2], limit) == limit
    assert tracking.flush_traces(resumed, timeout=60)
    again = _search(uri, exp, filter_string="tags.`grpoflow.step` = '2'")
    assert len(again) == limit
    assert not {x.info.trace_id for x in again} & {x.info.trace_id for x in found}
    assert len(_search(uri, exp, run_id=run)) == 2 * limit

    # so does a step redone in the same process (the planes rebuilt from a checkpoint)
    assert traces.log_traces(h, 1, episodes[1], limit) == limit
    assert tracking.flush_traces(h, timeout=60)
    assert len(_search(uri, exp, run_id=run)) == 2 * limit
    assert "episode" not in logs.text  # nothing went wrong, nothing was said

    # an episode record the tracer cannot read costs its trace, once said, nothing else
    bad = _episode("5:bad:0", 0, 1.0, attempts="many")
    assert traces.log_traces(h, 5, [bad, *episodes[2][:2]], limit) == 3
    assert tracking.flush_traces(h, timeout=60)
    assert len(_search(uri, exp, filter_string="tags.`grpoflow.step` = '5'")) == 2
    assert logs.text.count("episode 5:bad:0 of step 5 not traced (ValueError") == 1

    assert tracking.close_traces(h, timeout=10) == 0
    assert mlflow.get_tracking_uri() == global_uri and "MLFLOW_TRACKING_URI" not in os.environ
    assert not list(tmp_path.glob("mlruns")) and not (tmp_path / "mlflow.db").exists()


# ---------------------------------------------------------------------------- a server


def test_server_traces_and_an_outage_never_fail_the_step(episodes, server: MlflowServer,
                                                         logs) -> None:
    """On a real ``mlflow server``: traces land in the run's Traces tab. Then the server dies:
    queueing a step's traces still returns at once, one warning says so, and when the server
    is back on the same port and store the kept traces are written."""
    from mlflow import MlflowClient

    server.wait_ready(timeout=180)
    client = MlflowClient(server.url)
    exp = client.create_experiment("traces-server")
    run = client.create_run(exp).info.run_id
    h = _handle(server.url, exp, run)

    assert traces.log_traces(h, 1, episodes[1], 2) == 2
    assert tracking.flush_traces(h, timeout=60)
    found = _search(server.url, exp, run_id=run)
    assert len(found) == 2 and all(t.data.spans for t in found)
    assert {t.info.tags["grpoflow.status"] for t in found} == {"failed"}
    assert all(t.info.trace_metadata["mlflow.sourceRun"] == run for t in found)

    server.kill()
    started = time.perf_counter()
    for step in (2, 3, 4):
        assert traces.log_traces(h, step, episodes[2], 2) == 2
    assert time.perf_counter() - started < 2.0, "an outage never blocks the step"
    assert not tracking.flush_traces(h, timeout=3)
    deadline = time.monotonic() + 20
    while "cannot reach MLflow" not in logs.text and time.monotonic() < deadline:
        time.sleep(0.2)
    assert logs.text.count("episode traces cannot reach MLflow") == 1, logs.text

    back = start_mlflow_server(server.db_path.parent, port=server.port, wait=True)
    try:
        assert tracking.flush_traces(h, timeout=90)
        steps = sorted(int(t.info.tags["grpoflow.step"])
                       for t in _search(server.url, exp, run_id=run))
        assert steps == [1, 1, 2, 2, 3, 3, 4, 4]
        assert "episode traces reach" in logs.text
        assert tracking.close_traces(h, timeout=10) == 0
    finally:
        back.stop()
