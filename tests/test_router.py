"""The real ``sglang-router`` in front of engines: routing, worker API, failover, the pool.

Everything runs on 127.0.0.1 and every process a test starts is stopped by a fixture.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
from rollout_helpers import generate_groups, update_from_disk
from test_rollout_client import (
    FAST,
    SP,
    ThreadServer,
    engine_command,
    fake_engine,
    tiny_dirs,  # noqa: F401  (fixture)
)

from rl_core.rollout.client import SyncSGLangClient
from rl_core.rollout.pool import EnginePool
from rl_core.rollout.router import RouterError, RouterProcess
from rl_core.weight_sync import WeightSyncError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def fake_pair():
    """Two SGLang-shaped HTTP workers in this process, with their traffic records."""
    (app_a, state_a), (app_b, state_b) = fake_engine(), fake_engine()
    with ThreadServer(app_a) as a, ThreadServer(app_b) as b:
        yield (a, state_a), (b, state_b)


def test_router_spreads_work_and_manages_workers(tmp_path, fake_pair):
    (a, state_a), (b, state_b) = fake_pair
    with RouterProcess([a.url], log_dir=tmp_path, policy="round_robin") as router:
        assert router.proc is not None and router.log_path.exists()
        assert router.list_workers() == [a.url]
        router.add_worker(b.url)
        router.add_worker(b.url)  # already there: no-op
        assert sorted(router.list_workers()) == sorted([a.url, b.url])
        before = state_a["calls"]["generate"], state_b["calls"]["generate"]
        with SyncSGLangClient(router.url) as client:
            results = [client.generate([i + 3], SP) for i in range(8)]
            assert all(
                r.meta["base_url"] == router.url and r.completion_ids[0] == i + 3 for i, r in enumerate(results)
            )
            assert state_a["calls"]["generate"] - before[0] == 4
            assert state_b["calls"]["generate"] - before[1] == 4
            router.remove_worker(a.url)
            assert router.list_workers() == [b.url]
            n_a = state_a["calls"]["generate"]
            for _ in range(4):
                client.generate([3], SP)
            assert state_a["calls"]["generate"] == n_a
        proc = router.proc
    assert router.proc is None and proc.poll() is not None


def test_router_that_cannot_start_reports_its_log(tmp_path):
    router = RouterProcess(log_dir=tmp_path, extra_args=["--no-such-flag"], startup_timeout_s=30)
    with pytest.raises(RouterError, match="(?s)exited with code.*no-such-flag"):
        router.start()
    assert router.proc is None


def test_router_rejects_unknown_policy(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        RouterProcess(log_dir=tmp_path, policy="bucket")  # type: ignore[arg-type]


# ---------------------------------------------------------------- embedded engines + pool

GEN = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pool(tiny_dirs, tmp_path_factory):  # noqa: F811
    """Two embedded engines behind the real router, watched by the pool's monitor."""
    p = EnginePool(
        engine_command(tiny_dirs[0]),
        2,
        log_dir=tmp_path_factory.mktemp("pool"),
        env={"OMP_NUM_THREADS": "1"},
        router=True,
        router_policy="round_robin",
        health_interval_s=0.5,
        health_timeout_s=10,
        failure_threshold=2,
        startup_timeout_s=120,
        client_kwargs=FAST,
    )
    with p:
        yield p


def test_router_sends_work_to_both_engines(pool):
    client = pool.client
    assert sorted(pool.router.list_workers()) == sorted(pool.engine_urls)
    # label each engine's weights so every sample says which engine produced it
    for url, label in zip(pool.engine_urls, ("engine-a", "engine-b"), strict=True):
        client.update_weight_version(label, url=url)
    out = generate_groups(client, [[5, 6], [7, 8]], 4, GEN)
    assert {r.meta["base_url"] for r in out} == {pool.url}
    assert sorted(r.meta["weight_version"] for r in out) == ["engine-a"] * 4 + ["engine-b"] * 4


def test_weight_update_moves_every_engine_or_fails_loudly(pool, tiny_dirs):  # noqa: F811
    client = pool.client
    update_from_disk(pool, 1, tiny_dirs[1])
    assert [client.weight_version(url=u) for u in pool.engine_urls] == ["1", "1"]
    assert {r.meta["weight_version"] for r in generate_groups(client, [[5]], 4, GEN)} == {"1"}
    with pytest.raises(WeightSyncError, match="update_weights_from_disk failed"):
        update_from_disk(pool, 2, "/nonexistent/ckpt")
    # the failed update resumed every engine and left the served version alone
    assert pool.weight_version == "1"
    assert [client.weight_version(url=u) for u in pool.engine_urls] == ["1", "1"]
    assert len(generate_groups(client, [[5]], 2, GEN)) == 2


def test_killed_engine_loses_nothing_and_comes_back_resynced(pool, tiny_dirs):  # noqa: F811
    """Router on: a kill mid-batch loses no sample; the monitor restarts the engine,
    re-syncs it to the current weight_version and puts it back behind the router."""
    victim = pool.engines[0]
    client = pool.client
    update_from_disk(pool, 3, tiny_dirs[1])
    with SyncSGLangClient(victim.url) as probe:

        def kill_when_busy() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if probe.loads()["loads"][0]["num_running_reqs"] >= 2:
                    pool.kill(0)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        out = generate_groups(client, [[5 + i] for i in range(6)], 4, {**GEN, "max_new_tokens": 48})
        killer.join(30)
    assert victim.proc.poll() is not None or victim.restarts >= 1, "victim was not killed"
    assert len(out) == 24 and all(len(r.completion_ids) == 48 for r in out)

    deadline = time.monotonic() + 90
    while not (victim.restarts >= 1 and victim.in_service):
        assert time.monotonic() < deadline, "the monitor did not bring the engine back"
        time.sleep(0.2)
    assert victim.alive
    assert client.weight_version(url=victim.url) == "3"
    assert sorted(pool.router.list_workers()) == sorted(pool.engine_urls)
    before = client.server_info(url=victim.url)["internal_states"][0]["decode_steps"]
    out = generate_groups(client, [[5], [6]], 4, GEN)
    assert {r.meta["weight_version"] for r in out} == {"3"}
    assert client.server_info(url=victim.url)["internal_states"][0]["decode_steps"] > before


# ---------------------------------------------------------------- pool recovery policy

# A minimal engine process for the pool's restart / resync policy (fast to start: no torch).
FAKE_ENGINE = """
import sys, uvicorn
from fastapi import FastAPI, Request
app, state = FastAPI(), {"version": "default"}
@app.get("/health")
@app.get("/health_generate")
def health():
    return {}
@app.get("/model_info")
def info():
    return {"model_path": "fake", "weight_version": state["version"]}
@app.post("/update_weights_from_disk")
async def update(request: Request):
    state["version"] = (await request.json())["weight_version"]
    return {"success": True, "message": "ok"}
@app.post("/pause_generation")
@app.post("/continue_generation")
@app.post("/flush_cache")
def ok():
    return {}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_pool_restarts_a_hung_engine_and_resyncs_before_service(tmp_path):
    calls: list[str] = []
    fail_resync = threading.Event()

    def push(urls: list[str], version: str) -> None:  # the caller's own update path
        for url in urls:
            p.client.update_weights_from_disk("/ckpt", version, url=url)

    def resync(url: str) -> None:
        calls.append(url)
        if fail_resync.is_set():
            raise RuntimeError("checkpoint store unreachable")
        push([url], p.weight_version)

    p = EnginePool(
        lambda i, port: [sys.executable, "-c", FAKE_ENGINE, str(port)],
        1,
        log_dir=tmp_path,
        resync=resync,
        monitor=False,
        health_timeout_s=0.5,
        failure_threshold=2,
        max_failed_recoveries=1,
        stop_timeout_s=1,
        startup_timeout_s=60,
    )
    with p:
        e = p.engines[0]
        with p.paused() as urls:
            push(urls, "5")
            p.weight_version = "5"
        with p._sync_lock:  # a weight update in progress: the monitor leaves engines alone
            assert p.check_health() == []

        os.kill(e.proc.pid, signal.SIGSTOP)  # alive but silent
        assert p.check_health() == [] and e.failures == 1 and e.in_service
        assert p.check_health() == [0]
        assert calls == [e.url] and e.in_service and e.failures == 0
        assert p.client.weight_version(url=e.url) == "5"

        fail_resync.set()
        p.kill(0)
        assert p.check_health() == []
        assert not e.in_service and e.restarts == 2 and len(calls) == 2
        assert p.client.base_urls == [e.url]  # none in service: keep trying the last one
        assert not e.alive  # a half-synced engine is stopped, not left answering
        pid = e.proc.pid
        assert p.check_health() == [] and e.proc.pid == pid  # the monitor gave up on it
        fail_resync.clear()
        p.restart(0)  # an operator (or a Prefect retry) brings it back explicitly
        assert e.in_service and e.alive and e.restarts == 3 and len(calls) == 3
        assert p.client.weight_version(url=e.url) == "5"
    assert e.proc is None
