"""Issue 38, items 3-4, on the real compute (rl_core.tinker.backend.LoraBackend on a tiny random
Qwen2, tests/engine_helpers.py) driven by the REAL Tinker SDK (0.38): tenants with hashed keys
and what one tenant can never reach of another's (runs, checkpoints, sampler weights, request
ids), the request-size and queue bounds, the MLflow lineage (grpoflow.tinker.lineage) read back
with MlflowClient, a tracking server that is down, and `grpoflow serve-tinker` killed with
SIGKILL and restarted on the same root, resuming bitwise where an uninterrupted run goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker  # the dev extra installs it: a missing one fails, not skips

# grpoflow.tinker.lineage is imported here, not in a test: its first import sets up Prefect's
# logging, which replaces the root logger's handlers (caplog's among them)
from conftest import EOS_ID  # noqa: E402
from engine_helpers import save_tiny_model  # noqa: E402

from grpoflow.tinker.app import create_app  # noqa: E402
from grpoflow.tinker.auth import KeyTable, check_tenants, hash_key, owner_of  # noqa: E402
from grpoflow.tinker.futures import Result  # noqa: E402
from grpoflow.tinker.lineage import MlflowLineage, registered_name  # noqa: E402
from rl_core.engine.server import ServerThread  # noqa: E402

pytestmark = pytest.mark.timeout(240)

ALICE, BOB, BOB2, PLAIN = "tml-alice-secret-1", "tml-bob-secret-1", "tml-bob-secret-2", \
    "tml-plain-secret"
KEYS = (ALICE, BOB, BOB2, PLAIN)
TENANTS = {"alice": [hash_key(ALICE)], "bob": [hash_key(BOB), hash_key(BOB2).upper()]}
FULL = [5, 6, 7, 20, 21, 22, 23, EOS_ID]
ADAM = {"learning_rate": 1e-2, "eps": 1e-8}
EXPERIMENT = "tinker-lineage-test"


def datum(tokens=FULL):
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [0.0, 0.0] + [1.0] * (len(tokens) - 3)})


def train(tc, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([datum()], "cross_entropy")
        tc.optim_step(tinker.AdamParams(**ADAM)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def raw(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": key}, timeout=30)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("lineage") / "m0", seed=0)


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    """One service: tenants alice and bob (two keys), a plain key; MLflow lineage into a
    SQLite store; 1 MiB bodies; 4 queued requests."""
    from rl_core.tinker.backend import LoraBackend

    tmp = tmp_path_factory.mktemp("lineage-svc")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    backend = LoraBackend({"tiny": model_dir}, num_threads=1)
    tracker = MlflowLineage(uri, EXPERIMENT, root=tmp / "root", flush_timeout_s=60)
    app = create_app(backend, root=tmp / "root", api_keys=[PLAIN], tenants=TENANTS,
                     tracker=tracker, max_body_bytes=1 << 20, max_queued=4, poll_timeout_s=5)
    thread = ServerThread(app).start()
    try:
        yield {"url": thread.url, "app": app, "backend": backend, "root": tmp / "root",
               "uri": uri, "tracker": tracker}
    finally:
        app.state.tinker.close()
        thread.stop()
        backend.close()


@pytest.fixture(scope="module")
def alice_run(service):
    """Alice's training client: 2 steps, a save_state and a named sampler save, and a second
    client resumed from the state; then her session finishes (their runs end)."""
    with tinker.ServiceClient(base_url=service["url"], api_key=ALICE,
                              user_metadata={"project": "lineage"}) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3,
                                            user_metadata={"recipe": "sl",
                                                           "api_key": "sk-meta-value"}).result()
        losses = train(tc, 2)
        state = tc.save_state("a1").result().path
        sampler = tc.save_weights_for_sampler("a-s1").result().path
        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        train(resumed, 1)
    return {"tc": tc, "resumed": resumed, "state": state, "sampler": sampler,
            "losses": losses}


# ----------------------------------------------------------------------------- keys
def test_keys_are_hashed_and_tenants_checked():
    table = KeyTable([PLAIN], TENANTS)
    assert [table.owner(k) for k in KEYS] == ["alice", "bob", "bob", owner_of(PLAIN)]
    assert table.owner("tml-alice-secret-2") is None and table.owner("") is None
    assert not any(k in repr(vars(table)) for k in KEYS)  # digests only
    assert KeyTable(None, TENANTS).owner(PLAIN) is None  # tenants alone: no open door
    assert KeyTable().owner("tml-anything") == owner_of("tml-anything")
    assert KeyTable().owner("sk-nope") is None
    with pytest.raises(ValueError, match="not a SHA-256") as bad:
        check_tenants({"alice": [ALICE]})  # the key pasted instead of its digest
    assert ALICE not in str(bad.value)
    with pytest.raises(ValueError, match="same key digest"):
        check_tenants({"a": [hash_key(ALICE)], "b": [hash_key(ALICE)]})
    with pytest.raises(ValueError, match="tenant name"):
        check_tenants({"user-x": [hash_key(ALICE)]})
    out = subprocess.run([sys.executable, "-m", "grpoflow.tinker.serve", "hash-key"],
                         input=ALICE + "\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == hash_key(ALICE), out.stderr


# ----------------------------------------------------------------------------- isolation
def test_a_tenant_never_reaches_another_tenants_work(service, alice_run, caplog):
    caplog.set_level(logging.DEBUG)
    url = service["url"]
    live_alice = tinker.ServiceClient(base_url=url, api_key=ALICE)  # her live session
    live = live_alice.create_lora_training_client(base_model="tiny", rank=2).result()
    train(live, 1)
    live.save_weights_and_get_sampling_client().result()  # an ephemeral sampling session
    with raw(url, ALICE) as c:  # a request id of alice's (the SDK does not show its own)
        rid = c.post("/asample", json={"base_model": "tiny", "num_samples": 1, "seq_id": 0,
                                       "prompt": {"chunks": [{"tokens": [5, 6, 7],
                                                              "type": "encoded_text"}]},
                                       "sampling_params": {"max_tokens": 2, "seed": 1}}
                     ).json()["request_id"]
    try:
        _isolation(service, alice_run, live, rid, caplog)
    finally:
        live_alice.close("success").result(timeout=60)


def _isolation(service, alice_run, live, rid, caplog) -> None:
    url, tc, state, sampler = service["url"], alice_run["tc"], alice_run["state"], \
        alice_run["sampler"]
    before = {p: p.read_bytes() for p in (service["root"] / tc.model_id).rglob("*")
              if p.is_file()}
    with tinker.ServiceClient(base_url=url, api_key=BOB2) as sc:
        rest = sc.create_rest_client()
        # runs and checkpoints: not listed, not readable, not deletable
        listed = rest.list_training_runs().result().training_runs
        assert {r.model_owner for r in listed} <= {"bob"}
        for call in (lambda: rest.get_training_run(tc.model_id).result(),
                     lambda: rest.list_checkpoints(tc.model_id).result(),
                     lambda: rest.get_weights_info_by_tinker_path(state).result(),
                     lambda: rest.delete_checkpoint_from_tinker_path(state).result(),
                     lambda: rest.delete_checkpoint_from_tinker_path(sampler).result()):
            with pytest.raises(tinker.NotFoundError):
                call()
        # load_state of alice's path: neither into a new client nor into his own
        with pytest.raises(tinker.NotFoundError):
            sc.create_training_client_from_state_with_optimizer(state).result()
        mine = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        with pytest.raises((tinker.NotFoundError, RuntimeError)):
            mine.load_state(state).result()
        # sampling alice's weights (sampler or state checkpoint)
        for path in (sampler, state):
            with pytest.raises(tinker.NotFoundError):
                sc.create_sampling_client(model_path=path).result()
        # his own save under alice's checkpoint name lands in his own run
        bob = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        assert bob.save_state("a1").result().path == f"tinker://{bob.model_id}/weights/a1"
        runs = rest.list_training_runs().result().training_runs
        assert {r.model_owner for r in runs} == {"bob"}
    after = {p: p.read_bytes() for p in (service["root"] / tc.model_id).rglob("*")
             if p.is_file()}
    assert after == before  # nothing of alice's was touched

    with raw(url, BOB) as c, raw(url, ALICE) as a:
        # alice's request id: unknown to bob (404), alice's to read
        assert c.post("/retrieve_future", json={"request_id": rid}).status_code == 404
        assert a.post("/retrieve_future", json={"request_id": rid}).status_code == 200
        # the same sampling request (same seq_id) under bob's key: his own request id
        again = c.post("/asample", json={"base_model": "tiny", "num_samples": 1, "seq_id": 0,
                                         "prompt": {"chunks": [{"tokens": [5, 6, 7],
                                                                "type": "encoded_text"}]},
                                         "sampling_params": {"max_tokens": 2, "seed": 1}})
        assert again.json()["request_id"] != rid
        # replaying alice's requests under her live ids: 404, no request id handed out
        resumed, session = live.model_id, live.model_id.split(":")[0]
        samplers = a.get(f"/sessions/{session}").json()["sampler_ids"]
        assert samplers and c.get(f"/sessions/{session}").status_code == 404
        for path, body in (
                ("/optim_step", {"model_id": resumed, "seq_id": 1,
                                 "adam_params": {"learning_rate": 1.0}}),
                ("/optim_step", {"model_id": resumed, "seq_id": 99,
                                 "adam_params": {"learning_rate": 1.0}}),
                ("/save_weights", {"model_id": resumed, "seq_id": 99, "path": "stolen"}),
                ("/asample", {"sampling_session_id": samplers[0], "seq_id": 0,
                              "prompt": {"chunks": [{"tokens": [5]}]}}),
                ("/session_heartbeat", {"session_id": session}),
                ("/create_model", {"session_id": session, "model_seq_id": 50,
                                   "base_model": "tiny"}),
                ("/get_info", {"model_id": resumed}),
                ("/load_weights", {"path": state, "session_id": "s-none",
                                   "model_seq_id": 0})):
            r = c.post(path, json=body)
            assert r.status_code == 404 and "request_id" not in r.json(), (path, r.text)
        assert c.get(f"/training_runs/{tc.model_id}/checkpoints").status_code == 404
        assert c.get(f"/samplers/{samplers[0]}").status_code == 404
        assert c.post("/weights_info", json={"tinker_path": sampler}).status_code == 404
        assert session not in c.get("/sessions").json()["sessions"]
        assert c.post(f"/sessions/{session}/finish", json={}).status_code == 404
        # wrong or missing keys; a digest is not a key
        for headers in ({}, {"X-API-Key": hash_key(ALICE)}, {"X-API-Key": "tml-guess"}):
            r = httpx.get(url + "/api/v1/get_server_capabilities", headers=headers, timeout=10)
            assert r.status_code == 401, headers
    # the tenant's name, never a key, is what the runs and logs record
    run_meta = (service["root"] / tc.model_id / "training_run.json").read_text()
    assert '"model_owner": "alice"' in run_meta
    for f in service["root"].rglob("*"):
        if f.is_file() and f.stat().st_size < 1 << 20:
            data = f.read_bytes()
            assert not any(k.encode() in data or hash_key(k).encode() in data for k in KEYS), f
    assert not any(k in caplog.text for k in KEYS)


def test_body_and_queue_bounds(service, alice_run):
    url = service["url"]
    with tinker.ServiceClient(base_url=url, api_key=BOB) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        big = list(range(10, 40)) * 3000  # ~90k tokens: ~1.4 MB of protobuf
        started = time.monotonic()
        with pytest.raises(tinker.APIStatusError) as exc:
            tc.forward_backward([datum(big)], "cross_entropy").result()
        assert exc.value.status_code == 413 and "max_body_bytes" in str(exc.value)
        assert time.monotonic() - started < 20  # answered, not retried for minutes
        # that client is poisoned by the SDK (its seq_id never reached the server); a new
        # one on the same server trains
        fresh = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        assert train(fresh, 1)[0] > 0
    with raw(url, BOB) as c:
        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(40):
                yield b"x" * 65536
        r = c.post("/optim_step", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
        # training queue bound: the worker busy, 4 requests queued, the 5th is 429 until the
        # queue drains; a retry of the same seq_id then goes through
        session = c.post("/create_session", json={}).json()["session_id"]
        model = c.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                              "base_model": "tiny",
                                              "lora_config": {"rank": 2}}).json()
        assert c.post("/retrieve_future", json={"request_id": model["request_id"]}).json()[
            "model_id"] == model["model_id"]
        gate = threading.Event()
        sched = service["app"].state.tinker.scheduler

        def hold() -> Result:
            gate.wait(60)
            return Result(json={})

        sched.submit("tiny", hold)
        deadline = time.monotonic() + 10
        while sched.queue_depth("tiny") and time.monotonic() < deadline:
            time.sleep(0.01)  # the gate job is running, the queue is empty

        def step(seq: int) -> httpx.Response:
            return c.post("/optim_step", json={"model_id": model["model_id"], "seq_id": seq,
                                               "adam_params": {"learning_rate": 0.0}})

        try:
            rids = [step(s).json()["request_id"] for s in (1, 2, 3, 4)]
            full = step(5)
            assert full.status_code == 429 and "queue is full" in full.json()["detail"]
            assert step(2).json()["request_id"] == rids[1]  # a replay is not refused
        finally:
            gate.set()
        deadline = time.monotonic() + 30
        while (r := step(5)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        rids.append(r.json()["request_id"])
        for rid in rids:
            out = c.post("/retrieve_future", json={"request_id": rid}).json()
            assert "metrics" in out, out


def test_held_requests_bound_never_refuses_the_awaited_one():
    from grpoflow.tinker.futures import FutureStore, QueueFull, Scheduler

    sched = Scheduler(["b"], FutureStore())
    sched.open_order("m", "b", owner="alice")
    ran: list[int] = []

    def job(i: int):
        return lambda: (ran.append(i), Result(json={}))[1]

    try:
        held = [sched.submit_ordered("m", s, job(s), limit=3) for s in (2, 3, 4)]
        with pytest.raises(QueueFull, match="waiting for an earlier seq_id"):
            sched.submit_ordered("m", 5, job(5), limit=3)
        assert sched.submit_ordered("m", 3, job(3), limit=3) == held[1]  # a replay
        sched.submit_ordered("m", 1, job(1), limit=3)  # the awaited one: accepted
        deadline = time.monotonic() + 10
        while len(ran) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == [1, 2, 3, 4] and sched.held("m") == []
        sched.submit_ordered("m", 5, job(5), limit=3)
    finally:
        sched.close()


# ----------------------------------------------------------------------------- lineage
def test_lineage_in_mlflow(service, alice_run):
    from mlflow import MlflowClient

    tc, resumed = alice_run["tc"], alice_run["resumed"]
    tracker = service["tracker"]
    deadline = time.monotonic() + 60  # alice's session ended: its runs end FINISHED
    client = MlflowClient(service["uri"], registry_uri=service["uri"])
    while True:
        assert tracker.flush(60), "the lineage records did not reach the store"
        exp = client.get_experiment_by_name(EXPERIMENT)
        runs = {r.data.tags["tinker.training_run_id"]: r
                for r in client.search_runs([exp.experiment_id])} if exp else {}
        if {tc.model_id, resumed.model_id} <= set(runs) and all(
                runs[m].info.status == "FINISHED" for m in (tc.model_id, resumed.model_id)):
            break
        assert time.monotonic() < deadline, {k: r.info.status for k, r in runs.items()}
        time.sleep(0.2)
    run = runs[tc.model_id]
    assert run.data.params == {"base_model": "tiny", "lora_rank": "4", "seed": "3",
                               "train_mlp": "True", "train_attn": "True",
                               "train_unembed": "True", "tenant": "alice"}
    tags = run.data.tags
    assert tags["tinker.tenant"] == "alice" and tags["tinker.session_id"] == \
        tc.model_id.split(":")[0] and tags["tinker.session_metadata.project"] == "lineage"
    assert tags["tinker.user_metadata.recipe"] == "sl"
    assert tags["tinker.user_metadata.api_key"] == "***"  # named like a secret: masked
    assert tags["checkpoint/weights/a1"] == alice_run["state"]
    assert tags["checkpoint/sampler_weights/a-s1"] == alice_run["sampler"]
    rid = run.info.run_id
    history = {k: [(m.step, m.value) for m in client.get_metric_history(rid, k)]
               for k in ("loss_sum", "tokens_sum", "grad_norm_mean", "learning_rate_mean",
                         "forward_backward/seconds", "optim_step/queue_seconds",
                         "optim_step/learning_rate")}
    assert [v for _, v in history["loss_sum"]] == pytest.approx(alice_run["losses"])
    assert [s for s, _ in history["loss_sum"]] == [0, 1]
    assert [s for s, _ in history["grad_norm_mean"]] == [1, 2]
    assert [v for _, v in history["tokens_sum"]] == [5.0, 5.0]
    assert [v for _, v in history["optim_step/learning_rate"]] == pytest.approx([1e-2] * 2)
    assert len(history["forward_backward/seconds"]) == 2
    assert all(v >= 0 for _, v in history["optim_step/queue_seconds"])
    for kind, name in (("weights", "a1"), ("sampler_weights", "a-s1")):
        files = {Path(f.path).name for f in client.list_artifacts(rid, f"checkpoints/{kind}/{name}")}
        assert "adapter_model.safetensors" in files, files
    versions = client.search_model_versions(f"name = '{registered_name('alice', tc.model_id)}'")
    assert [(v.tags["tinker.path"], v.run_id, v.source) for v in versions] == [
        (alice_run["sampler"], rid, f"runs:/{rid}/checkpoints/sampler_weights/a-s1")]
    # the resumed client: its own run, linked to where it came from
    child = runs[resumed.model_id]
    assert child.data.params["resumed_from"] == alice_run["state"]
    assert child.data.tags["grpoflow.tinker.resumed_from_mlflow_run"] == rid
    everything = repr([(r.data.params, r.data.tags) for r in runs.values()])
    assert not any(k in everything or hash_key(k) in everything for k in KEYS)
    # a service killed with a run open: the next one on the same root ends it KILLED
    other_root = service["root"].parent / "other-root"
    killed = MlflowLineage(service["uri"], EXPERIMENT, root=other_root)
    killed.start_run("s-dead:train:0", {"tenant": "carol"}, {})
    assert killed.flush(60)
    killed.stop()
    restarted = MlflowLineage(service["uri"], EXPERIMENT, root=other_root)
    restarted.open()
    assert restarted.flush(60)
    restarted.close()
    [dead] = client.search_runs([exp.experiment_id],
                                filter_string="tags.`tinker.training_run_id` = 's-dead:train:0'")
    assert dead.info.status == "KILLED"
    assert runs[tc.model_id].info.run_id != dead.info.run_id and client.get_run(
        runs[tc.model_id].info.run_id).info.status == "FINISHED"  # another root's: untouched


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def test_lineage_outage_never_blocks(monkeypatch, tmp_path):
    """A tracking server that is down: every call returns at once, one warning, close is
    bounded."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    caplog, logger = _Lines(), logging.getLogger("grpoflow.tinker.lineage")
    level = logger.level
    logger.addHandler(caplog)
    logger.setLevel(logging.INFO)
    try:
        _outage(port, tmp_path, caplog)
    finally:
        logger.removeHandler(caplog)
        logger.setLevel(level)


def _outage(port: int, tmp_path: Path, caplog: _Lines) -> None:
    tracker = MlflowLineage(f"http://127.0.0.1:{port}", "x", flush_timeout_s=1)
    started = time.monotonic()
    tracker.start_run("s-1:train:0", {"tenant": "alice"}, {})
    for step in range(200):
        tracker.log_metrics("s-1:train:0", step, {"loss:sum": 1.0})
        tracker.log_call("s-1:train:0", "optim_step", step, {"seconds": 0.1})
    tracker.log_checkpoint("s-1:train:0", "weights", "a", tmp_path, "tinker://s-1:train:0/weights/a")
    tracker.end_run("s-1:train:0", "FINISHED")
    assert time.monotonic() - started < 1.0
    deadline = time.monotonic() + 60  # the sender's first attempt imports MLflow
    while "unreachable" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert caplog.text.count("unreachable") == 1
    started = time.monotonic()
    tracker.close()
    assert time.monotonic() - started < 5 and "did not reach MLflow" in caplog.text


# ----------------------------------------------------------------------------- restart
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cfg: Path, log: Path, port: int, timeout: float = 150.0) -> subprocess.Popen:
    """`grpoflow serve-tinker cfg` in its own process, up when /healthz answers (bounded)."""
    exe = Path(sys.executable).with_name("grpoflow")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c",
                                           "from grpoflow.cli import main; raise SystemExit(main())"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    with log.open("ab") as out:
        proc = subprocess.Popen([*cmd, "serve-tinker", str(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve-tinker exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1).status_code == 200:
                return proc
        time.sleep(0.2)
    _reap(proc)
    raise AssertionError(f"serve-tinker not up in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _reap(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait(timeout=30)


def _adapter(root: Path, path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    run, kind, name = path.removeprefix("tinker://").split("/")
    return load_file(root / run / kind / name / "adapter_model.safetensors")


def test_serve_tinker_killed_and_restarted_resumes_exactly(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    port, root = _free_port(), tmp_path / "root"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"base_models: {{tiny: {model_dir}}}\nport: {port}\nroot: {root}\n"
                   f"cache_dir: {tmp_path / 'cache'}\nlog_level: warning\napi_keys_env: null\n"
                   f"tenants: {{alice: [{hash_key(ALICE)}], bob: [{hash_key(BOB)}]}}\n"
                   "tracking: {backend: none}\n")
    url, log, proc = f"http://127.0.0.1:{port}", tmp_path / "serve.log", None
    try:
        proc = _start(cfg, log, port)
        sc = tinker.ServiceClient(base_url=url, api_key=ALICE)  # left open: the server dies
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        train(tc, 2)
        state = tc.save_state("mid").result().path
        train(tc, 2)  # the uninterrupted run goes on
        want_lp = tc.forward([datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        want = _adapter(root, tc.save_weights_for_sampler("ref").result().path)
        os.kill(proc.pid, signal.SIGKILL)  # the session, its models, its queue: gone
        proc.wait(timeout=30)

        proc = _start(cfg, log, port)  # same root, same port
        with contextlib.suppress(Exception):  # the old session is unknown now: 404
            sc.close("interrupted").result(timeout=30)
        with tinker.ServiceClient(base_url=url, api_key=BOB) as other, \
                pytest.raises(tinker.NotFoundError):  # still alice's after the restart
            other.create_training_client_from_state_with_optimizer(state).result()
        with tinker.ServiceClient(base_url=url, api_key=ALICE) as sc2:
            again = sc2.create_training_client_from_state_with_optimizer(state).result()
            train(again, 2)
            got_lp = again.forward([datum()], "cross_entropy").result().loss_fn_outputs[0][
                "logprobs"]
            got = _adapter(root, again.save_weights_for_sampler("resumed").result().path)
        assert sorted(got) == sorted(want) and want
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(np.asarray(got_lp.tolist()), np.asarray(want_lp.tolist()),
                                   rtol=0, atol=1e-6)
    finally:
        _reap(proc)
    assert ALICE not in log.read_text() and BOB not in log.read_text()
