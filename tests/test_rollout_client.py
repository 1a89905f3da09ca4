"""The SGLang client: bounds, retries, failover, concurrency, sync wrapper.

Retry and timeout policy is pinned against small real HTTP servers on 127.0.0.1 (a FastAPI
app under uvicorn that fails on purpose, a socket that never answers, a closed port); the
protocol itself is pinned against the embedded engine's real server (``engines`` fixture).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from rollout_helpers import agenerate_groups, generate_groups

from rl_core.host import free_port
from rl_core.rollout.client import (
    RolloutRequestError,
    RolloutUnavailableError,
    SGLangClient,
    SyncSGLangClient,
)
from rl_core.rollout.pool import EnginePool
from rl_core.types import Sample

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05}

# ---------------------------------------------------------------- tiny real HTTP servers


class ThreadServer:
    """A FastAPI app served by uvicorn on 127.0.0.1 in a thread of the test process."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="error",  # the router probes for gRPC first: uvicorn would warn
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start within 10 s"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def fake_engine(
    *,
    fail_first: int = 0,
    fail_status: int = 500,
    delay_s: float = 0.0,
    weight_version: str = "default",
    old_info_only: bool = False,
    flush_busy: int = 0,
) -> tuple[FastAPI, dict[str, Any]]:
    """An app answering SGLang-shaped JSON, with knobs to fail; ``state`` records traffic.

    ``/generate`` echoes the request: output token ids are ``[input_ids[0], sampling_seed]``.
    """
    app = FastAPI()
    state: dict[str, Any] = {
        "calls": Counter(),
        "inflight": 0,
        "max_inflight": 0,
        "aborted": [],
        "bodies": [],
    }

    def one(ids: list[int], params: dict[str, Any], rid: str) -> dict[str, Any]:
        out = [ids[0], int(params.get("sampling_seed", 0))]
        return {
            "text": "x y",
            "output_ids": out,
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": 2},
                "prompt_tokens": len(ids),
                "completion_tokens": 2,
                "weight_version": weight_version,
                "output_token_logprobs": [[-0.5, t, None] for t in out],
            },
        }

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        state["calls"]["generate"] += 1
        state["bodies"].append(body)
        if state["calls"]["generate"] <= fail_first:
            return JSONResponse({"error": {"message": "engine overloaded"}}, fail_status)
        state["inflight"] += 1
        state["max_inflight"] = max(state["max_inflight"], state["inflight"])
        try:
            await asyncio.sleep(delay_s)
        finally:
            state["inflight"] -= 1
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            params = body["sampling_params"]
            ps = params if isinstance(params, list) else [params] * len(ids)
            return [one(i, p, r) for i, p, r in zip(ids, ps, body["rid"], strict=True)]
        return one(ids, body["sampling_params"], body["rid"])

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return PlainTextResponse("")

    @app.post("/abort_request")
    async def abort(request: Request):
        state["aborted"].append((await request.json()).get("rid"))
        return PlainTextResponse("")

    @app.post("/flush_cache")
    async def flush():
        state["calls"]["flush"] += 1
        if state["calls"]["flush"] <= flush_busy:
            return PlainTextResponse("Cache not flushed: requests running", 400)
        return PlainTextResponse("Cache flushed.")

    info = {"model_path": "tiny", "is_generation": True}
    if not old_info_only:
        info["weight_version"] = weight_version

        @app.get("/model_info")
        async def model_info():
            return info

        @app.get("/server_info")
        async def server_info():
            return {"tp_size": 1, "dp_size": 1}

    @app.get("/get_model_info")
    async def get_model_info():
        return info

    @app.get("/get_server_info")
    async def get_server_info():
        return {"tp_size": 1, "dp_size": 1, "old": True}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": weight_version}

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        body = await request.json()
        if body["model_path"] == "/missing":
            return {"success": False, "message": "no such checkpoint: /missing"}
        return {"success": True, "message": "ok"}

    return app, state


@pytest.fixture
def silent_socket():
    """A port that accepts TCP connections (kernel backlog) and never answers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


SP = {"max_new_tokens": 2, "temperature": 1.0}


# ---------------------------------------------------------------- retry / timeout policy


def test_5xx_is_retried_with_backoff_until_success(caplog):
    app, state = fake_engine(fail_first=2)
    with (
        ThreadServer(app) as srv,
        SyncSGLangClient(srv.url, **FAST) as client,
        caplog.at_level(logging.WARNING, "rl_core.rollout.client"),
    ):
        r = client.generate([5, 6], SP)
    assert state["calls"]["generate"] == 3
    assert r.completion_ids == [5, 0] and r.logprobs == [-0.5, -0.5]
    retries = [m for m in caplog.messages if "retry" in m]
    assert len(retries) == 2 and "HTTP 500: engine overloaded" in retries[0]


def test_4xx_is_not_retried_and_carries_the_server_message():
    app, state = fake_engine(fail_first=5, fail_status=400)
    with (
        ThreadServer(app) as srv,
        SyncSGLangClient(srv.url, **FAST) as client,
        pytest.raises(RolloutRequestError, match="engine overloaded") as err,
    ):
        client.generate([5], SP)
    assert err.value.status == 400
    assert state["calls"]["generate"] == 1


def test_read_timeout_is_bounded(silent_socket):
    with SyncSGLangClient(silent_socket, read_timeout_s=0.3, max_retries=1, **FAST) as client:
        t0 = time.monotonic()
        with pytest.raises(RolloutUnavailableError, match="2 attempt.*ReadTimeout"):
            client.generate([1], SP)
    assert time.monotonic() - t0 < 3.0


def test_total_timeout_is_bounded_and_aborts_the_request():
    app, state = fake_engine(delay_s=30)
    with (
        ThreadServer(app) as srv,
        SyncSGLangClient(
            srv.url, read_timeout_s=60, total_timeout_s=0.4, max_retries=0, **FAST
        ) as client,
    ):
        t0 = time.monotonic()
        with pytest.raises(RolloutUnavailableError, match="total bound"):
            client.generate([1], SP, rid="slow-1")
        assert time.monotonic() - t0 < 3.0
    assert state["aborted"] == ["slow-1"]


def test_connection_refused_fails_over_to_another_engine():
    app, state = fake_engine()
    dead = closed_port_url()
    with ThreadServer(app) as srv, SyncSGLangClient([dead, srv.url], **FAST) as client:
        results = [client.generate([i + 3], SP) for i in range(6)]
    assert all(r.meta["base_url"] == srv.url for r in results)
    assert state["calls"]["generate"] == 6


def test_round_robin_and_failover_on_5xx():
    good_a, state_a = fake_engine()
    good_b, state_b = fake_engine()
    bad, state_bad = fake_engine(fail_first=10**6, fail_status=503)
    with ThreadServer(good_a) as a, ThreadServer(good_b) as b, ThreadServer(bad) as c:
        with SyncSGLangClient([a.url, b.url], **FAST) as client:
            urls = Counter(client.generate([3], SP).meta["base_url"] for _ in range(8))
        assert urls == {a.url: 4, b.url: 4}
        with SyncSGLangClient([c.url, a.url], engine_cooldown_s=60, **FAST) as client:
            assert {client.generate([3], SP).meta["base_url"] for _ in range(5)} == {a.url}
        # the failed engine cools down instead of being tried first by every request
        assert state_bad["calls"]["generate"] == 1


def test_concurrency_limit_is_respected():
    app, state = fake_engine(delay_s=0.1)
    with ThreadServer(app) as srv, SyncSGLangClient(srv.url, max_concurrency=3) as client:
        out = generate_groups(client, [[3], [4]], 6, SP)
    assert len(out) == 12
    assert state["max_inflight"] == 3


def test_generate_groups_is_prompt_major_with_one_seed_per_sample():
    app, state = fake_engine()
    seeds = [[11, 12, 13], [21, 22, 23]]
    with ThreadServer(app) as srv, SyncSGLangClient(srv.url) as client:
        out = generate_groups(client, [[7, 1], [8, 1]], 3, SP, seeds)
    assert [r.completion_ids for r in out] == [[7, 11], [7, 12], [7, 13], [8, 21], [8, 22], [8, 23]]
    assert all(b["return_logprob"] is True and isinstance(b["rid"], str) for b in state["bodies"])
    assert len({r.meta["id"] for r in out}) == 6
    with SyncSGLangClient(srv.url) as client, pytest.raises(ValueError, match="seeds"):
        generate_groups(client, [[1]], 2, SP, [[1]])


def test_generate_batch_is_one_request():
    app, state = fake_engine()
    with ThreadServer(app) as srv, SyncSGLangClient(srv.url) as client:
        out = client.generate_batch(
            [[4], [5]], [{**SP, "sampling_seed": 1}, {**SP, "sampling_seed": 2}]
        )
    assert [r.completion_ids for r in out] == [[4, 1], [5, 2]]
    assert state["calls"]["generate"] == 1


def test_info_falls_back_to_old_endpoint_names():
    app, _ = fake_engine(old_info_only=True, weight_version="7")
    with ThreadServer(app) as srv, SyncSGLangClient(srv.url) as client:
        assert client.model_info()["model_path"] == "tiny"
        assert client.server_info()["old"] is True
        assert client.weight_version() == "7"


def test_flush_cache_waits_while_busy_then_gives_up():
    app, state = fake_engine(flush_busy=2)
    with ThreadServer(app) as srv, SyncSGLangClient(srv.url) as client:
        client.flush_cache(wait_s=10)
        assert state["calls"]["flush"] == 3
    app, _ = fake_engine(flush_busy=10**6)
    with (
        ThreadServer(app) as srv,
        SyncSGLangClient(srv.url) as client,
        pytest.raises(RolloutRequestError, match="gave up"),
    ):
        client.flush_cache(wait_s=0.3)


def test_control_calls_report_success_false_and_need_a_target():
    app, _ = fake_engine()
    with ThreadServer(app) as srv:
        with SyncSGLangClient(srv.url) as client:
            client.update_weights_from_disk("/ckpt", 3)
            with pytest.raises(RolloutRequestError, match="no such checkpoint"):
                client.update_weights_from_disk("/missing", 3)
        with SyncSGLangClient([srv.url, srv.url + "/"]) as client:
            with pytest.raises(ValueError, match="pass url="):
                client.flush_cache()
            client.flush_cache(url=srv.url)


def test_a_sglang_response_becomes_a_sample():
    body = {
        "text": " 4",
        "output_ids": [9, 1],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "stop", "matched": 1},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "5",
            "output_token_logprobs": [[-0.25, 9, None], [-1.5, 1, None]],
        },
    }
    r = Sample.from_sglang([3, 4, 5], body)
    assert (r.prompt_ids, r.completion_ids, r.logprobs, r.text) == ([3, 4, 5], [9, 1], [-0.25, -1.5], " 4")
    assert (r.meta["weight_version"], r.meta["id"], r.loss_mask, r.reward) == ("5", "r1", None, 0.0)
    assert not r.truncated and not r.aborted
    plain = Sample.from_sglang([3], {"output_ids": [7], "meta_info": {}})  # no log-probs asked
    assert (plain.completion_ids, plain.logprobs, plain.finish_reason) == ([7], [], {})


def test_async_client_in_its_own_loop():
    app, _ = fake_engine()

    async def main(url: str) -> list[Sample]:
        async with SGLangClient(url) as client:
            return await agenerate_groups(client, [[3]], 2, SP, [[1, 2]])

    with ThreadServer(app) as srv:
        assert [r.completion_ids for r in asyncio.run(main(srv.url))] == [[3, 1], [3, 2]]


def test_sync_client_repeated_calls_and_clean_shutdown():
    app, _ = fake_engine()
    before = threading.active_count()
    with ThreadServer(app) as srv:
        client = SyncSGLangClient(srv.url)
        for i in range(20):
            assert client.generate([i + 3], SP).completion_ids[0] == i + 3
        thread = client._thread
        client.close()
        client.close()  # idempotent
        assert not thread.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            client.generate([3], SP)
    assert threading.active_count() <= before


# ---------------------------------------------------------------- the embedded engine

SERVE = "import sys; from rl_core.engine.server import main; sys.exit(main(sys.argv[1:]))"


def engine_command(model_dir: Path) -> Callable[[int, int], list[str]]:
    """argv for one embedded engine (one torch thread) on 127.0.0.1:port."""

    def command(index: int, port: int) -> list[str]:
        return [
            sys.executable,
            "-c",
            SERVE,
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--log-level",
            "warning",
        ]

    return command


def save_tiny(path: Path, seed: int) -> Path:
    from conftest import tiny_qwen2, tiny_tokenizer

    tiny_qwen2(seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model (seed 0) and a second checkpoint of it (seed 1) for weight updates."""
    root = tmp_path_factory.mktemp("tiny")
    return save_tiny(root / "base", 0), save_tiny(root / "step1", 1)


@dataclass
class Engines:
    """Two embedded engines: ``urls[0]`` in its own process (the one a test kills; restarted,
    it listens on a new port), ``urls[1]`` served from a thread of this process (cheaper)."""

    pool: EnginePool
    local_url: str

    @property
    def urls(self) -> list[str]:
        return [self.pool.engine_urls[0], self.local_url]


@pytest.fixture(scope="module")
def engines(tiny_dirs, tmp_path_factory):
    import torch

    from rl_core.engine.core import EmbeddedEngine
    from rl_core.engine.server import serve_in_thread

    threads = torch.get_num_threads()
    pool = EnginePool(
        engine_command(tiny_dirs[0]), 1, log_dir=tmp_path_factory.mktemp("logs"),
        env={"OMP_NUM_THREADS": "1"}, monitor=False, startup_timeout_s=120,
    )  # fmt: skip
    local = EmbeddedEngine(tiny_dirs[0], num_threads=1)
    server = serve_in_thread(local)
    try:
        with pool:
            yield Engines(pool, server.url)
    finally:
        server.stop()
        local.close()
        torch.set_num_threads(threads)


@pytest.fixture
def client(engines):
    with SyncSGLangClient(engines.urls, **FAST) as c:
        yield c


GEN = {"max_new_tokens": 8, "temperature": 1.0}


def test_engine_sample_has_the_training_fields(client, engines):
    r = client.generate([5, 6, 7], GEN)
    assert r.meta["base_url"] in engines.urls
    assert 1 <= len(r.completion_ids) == len(r.logprobs) == r.meta["completion_tokens"] <= 8
    assert all(lp <= 0 for lp in r.logprobs)
    assert r.finish_reason["type"] in ("length", "stop")
    assert (r.meta["prompt_tokens"], r.meta["weight_version"]) == (3, "default")
    assert isinstance(r.text, str) and r.meta["id"]


def test_engine_seeded_groups_are_reproducible_across_engines(client, engines):
    prompts, seeds = [[5, 6], [7, 8, 9]], [[1, 2, 3], [4, 5, 6]]
    first = generate_groups(client, prompts, 3, {**GEN, "ignore_eos": True}, seeds)
    with SyncSGLangClient(engines.urls[::-1]) as other_order:
        again = generate_groups(other_order, prompts, 3, {**GEN, "ignore_eos": True}, seeds)
    assert [r.completion_ids for r in first] == [r.completion_ids for r in again]
    for a, b in zip(first, again, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # round robin put each sample on the other engine the second time
    assert all(a.meta["base_url"] != b.meta["base_url"] for a, b in zip(first, again, strict=True))
    assert len({tuple(r.completion_ids) for r in first[:3]}) > 1  # seeds differ within a group
    batch = client.generate_batch(
        prompts,
        [{**GEN, "ignore_eos": True, "sampling_seed": s[0]} for s in seeds],
        rid=None,
    )
    assert [r.completion_ids for r in batch] == [first[0].completion_ids, first[3].completion_ids]


def test_engine_rejects_bad_requests_with_its_message(client):
    with pytest.raises(RolloutRequestError, match="context length") as err:
        client.generate([5] * 300, GEN)
    assert err.value.status == 400
    url = client.base_urls[0]
    with pytest.raises(RolloutRequestError, match="model_path|No such|not"):
        client.update_weights_from_disk("/nonexistent/ckpt", 9, url=url)


def test_engine_info_and_control_calls(client, engines):
    url = engines.urls[0]
    assert client.model_info(url=url)["weight_version"] == "default"
    assert client.server_info(url=url)["tp_size"] == 1
    assert client.health_generate(url=url)
    # The health check's one-token request may still be leaving the engine's running set
    # when its answer arrives (make test saw 1 once): wait, bounded, for the set to empty.
    deadline = time.monotonic() + 30
    while (running := client.loads(url=url)["loads"][0]["num_running_reqs"]) and (
            time.monotonic() < deadline):
        time.sleep(0.05)
    assert running == 0
    client.pause("retract", url=url)
    client.flush_cache(url=url, wait_s=10)
    client.resume(url=url)
    client.abort(abort_all=True)
    assert client.generate([5], GEN).completion_ids


def test_engine_weight_update_from_disk_sets_the_version(client, engines, tiny_dirs):
    _, step1 = tiny_dirs
    seeded = {**GEN, "ignore_eos": True, "sampling_seed": 7}
    before = client.generate([5, 6], seeded)
    for url in engines.urls:
        client.update_weights_from_disk(str(step1), 1, url=url)
        assert client.weight_version(url=url) == "1"
    after = [client.generate([5, 6], seeded) for _ in range(2)]
    assert {r.meta["weight_version"] for r in after} == {"1"}
    assert after[0].completion_ids == after[1].completion_ids != before.completion_ids
    for url in engines.urls:  # the module's engines as the other tests expect them, any order
        client.update_weights_from_disk(str(tiny_dirs[0]), "default", url=url)


def test_killing_an_engine_mid_batch_loses_no_request(engines, caplog):
    """Router off: the client retries the killed engine's requests on the other one."""
    victim, survivor = engines.urls
    n_prompts, n = 6, 4
    with SyncSGLangClient(engines.urls, **FAST) as client:

        def kill_when_busy() -> None:
            # Kill as soon as the victim holds a request (running or queued): its batch is
            # then in flight. A poll that fails (the engine busy, the machine loaded) is
            # retried, not the end of the thread: one such failure once left it alive.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    loads = client.loads(url=victim)["loads"][0]
                except Exception:  # noqa: BLE001 - keep polling until the bound
                    loads = {}
                if loads.get("num_running_reqs", 0) + loads.get("num_waiting_reqs", 0) >= 1:
                    engines.pool.kill(0)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        with caplog.at_level(logging.WARNING, "rl_core.rollout.client"):
            out = generate_groups(client,
                [[5 + i] for i in range(n_prompts)],
                n,
                {**GEN, "max_new_tokens": 48, "ignore_eos": True},
            )
        killer.join(70)
    assert engines.pool.engines[0].proc.poll() is not None, "the victim engine was not killed"
    assert len(out) == n_prompts * n
    assert all(len(r.completion_ids) == 48 and r.finish_reason["type"] == "length" for r in out)
    # the victim's requests were running when it died: the survivor served them too
    assert sum(r.meta["base_url"] == survivor for r in out) > len(out) // 2
    assert any(victim in m and "retry" in m for m in caplog.messages)
    engines.pool.restart(0)  # back for the tests that run after this one (any order)
