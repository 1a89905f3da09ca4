"""The two rollout planes behind one interface, and the one weight-update sequence.

:class:`~rl_core.rollout.http.HttpPlane` drives real engine processes (``python -m
rl_core.engine.server``) and, with two of them, the real ``sglang-router``;
:class:`~rl_core.rollout.inprocess.InProcessPlane` drives the same engine core in this
process. Pinned here: both sample exactly the same thing for the same seeds; every weight
update goes through :func:`rl_core.weight_sync.sync_weights` (pause -> abort/flush -> load ->
verify -> version -> resume) whatever the transport (disk, broadcast, in-process tensors,
shared parameters); the colocated fast path (an engine reading the trainer's parameters in
place) samples and trains exactly as the HTTP plane does; a sync that delivers other weights, and an engine that serves a stale version, fail loudly;
an engine that dies is restarted, re-synced and serves the current weights again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import save_tiny_model

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.grpo import advantages_for, rollout_groups
from rl_core.host import free_port
from rl_core.rollout.http import HttpPlane, sampling_payload
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch
from rl_core.weight_sync import WeightSyncError, sync_weights, weights_checksum
from rl_core.weight_sync.broadcast import BroadcastSync
from rl_core.weight_sync.transports import DiskSync, SharedSync, TensorSync

pytestmark = pytest.mark.timeout(600)  # an engine restart is bounded by RESTART_BOUND_S

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, seed=None)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
RECORDS = [Record(id=f"r{i}", question=f"q{i}", answer="1") for i in range(3)]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


# An engine's (re)start under the suite's load: on the 2-core AMD EPYC a restart that
# coincided with the multi-process Ray and megatron modules took over 120 s (the process
# got a fraction of a core: 4 s of CPU in its first 20 s; docs/testing.md).
RESTART_BOUND_S = 300


def _http(model: Path, tmp: Path, n: int = 1, transport: str = "disk",
          router: bool | None = None, ports: list[int] | None = None,
          ) -> tuple[HttpPlane, object]:  # fmt: skip
    pool = EnginePool(
        embedded_engine_command(model, num_threads=1), n, log_dir=tmp / "engines", ports=ports,
        router=n > 1 if router is None else router,
        router_policy="round_robin", health_interval_s=0.5, health_timeout_s=10,
        failure_threshold=2, startup_timeout_s=RESTART_BOUND_S,
        client_kwargs={"backoff_base_s": 0.05, "backoff_max_s": 0.5},
    )  # fmt: skip
    plane = HttpPlane(pool, request_batch_size=4, weight_sync_timeout_s=60)
    sync = (DiskSync(plane, tmp / "staging", 60) if transport == "disk"
            else BroadcastSync(plane, "gloo", 60, 10_000))  # fmt: skip
    pool.resync = sync.resync
    if transport != "disk":
        plane.before_generate = sync.rejoin
    return plane.start(), sync


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def one_started(model_dir: Path, tmp_path_factory):
    """One engine process for the module, asked to start on a port another socket holds (what
    a restart reusing its predecessor's port meets): ``(plane, sync, taken, port)``, ``port``
    the one it serves on after ``start``. No test kills it; the tests that change its weights
    or memory put them back."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        plane, sync = _http(model_dir, tmp_path_factory.mktemp("one"), ports=[taken])
    try:
        yield plane, sync, taken, plane.pool.engines[0].port
    finally:
        plane.close()


@pytest.fixture(scope="module")
def one(one_started):
    return one_started[:2]


@pytest.fixture(scope="module")
def local(model_dir: Path):
    plane = InProcessPlane(model_dir)
    try:
        yield plane
    finally:
        plane.close()


def _trainer(model_dir: Path, nudge: bool = True) -> TorchTrainer:
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=8)
    if nudge:  # the same nudge every time: no test depends on which random draw it got
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return trainer


def _ids(samples: list) -> list[list[int]]:
    return [s.completion_ids for s in samples]


def test_sampling_params_travel_as_sglang_spells_them() -> None:
    p = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=3, stop=["x"], seed=11)
    assert sampling_payload(p) == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 5, "min_p": 0.0, "max_new_tokens": 3,
        "ignore_eos": False, "stop": ["x"], "sampling_seed": 11,
    }  # fmt: skip


def test_http_samples_equal_the_in_process_plane(one, local, model_dir: Path) -> None:
    """Same seeds, same samples: the HTTP path changes transport, not results."""
    torch.set_num_threads(1)
    http, sync = one
    base = _trainer(model_dir, nudge=False)  # both planes back to the checkpoint, version 0
    sync_weights(base, http, sync, 0)
    sync_weights(base, local, TensorSync(local), 0)
    for params in (PARAMS, GREEDY):
        kw = dict(n=4, params=params, step=3, seed=7)
        a = rollout_groups(http, RECORDS, PROMPTS, **kw)
        b = rollout_groups(local, RECORDS, PROMPTS, **kw)
        assert _ids(a) == _ids(b)
        assert [s.uid for s in a] == [s.uid for s in b] and a[5].uid == "3:r1:1"
        for x, y in zip(a, b, strict=True):
            assert x.finish_reason == y.finish_reason and x.text == y.text
            assert x.prompt_ids == y.prompt_ids and x.weight_version == y.weight_version == 0
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    # different sampling seeds give different groups (the test above can fail)
    c = rollout_groups(http, RECORDS, PROMPTS, n=4, params=PARAMS, step=4, seed=7)
    assert _ids(c) != _ids(a)
    # Each engine's queue and KV usage (SGLang's /v1/loads), as adaptive agent concurrency
    # reads them; the same shape from the in-process engine.
    for plane in (http, local):
        (row,) = plane.loads()
        assert set(row) == {"waiting", "running", "token_usage"}
        assert row["waiting"] == 0 and 0.0 <= row["token_usage"] <= 1.0


def test_the_update_sequence_pauses_loads_verifies_bumps_and_resumes(model_dir: Path) -> None:
    """What every transport goes through, seen from inside the load: engines paused, the
    plane's version not yet bumped; after it: verified, bumped, resumed."""
    plane = InProcessPlane(model_dir)
    seen: dict = {}

    class Watching(TensorSync):
        def load(self, staged, engines, version):  # noqa: ANN001, ANN202
            seen.update(paused=plane.engine.paused, version=plane.weight_version,
                        engines=len(engines))  # fmt: skip
            super().load(staged, engines, version)

    try:
        trainer = _trainer(model_dir)
        metrics = sync_weights(trainer, plane, Watching(plane), 4)
        assert seen == {"paused": True, "version": 0, "engines": 1}
        assert plane.weight_version == 4 and not plane.engine.paused
        assert plane.engine.checksum() == weights_checksum(trainer.export_weights())
        assert metrics["sync_bytes"] > 0 and metrics["sync_seconds"] >= metrics["sync_stage_seconds"]
        assert {s.weight_version for s in plane.generate(PROMPTS, GREEDY)} == {4}

        class Corrupting(TensorSync):  # delivers other weights than it staged
            def load(self, staged, engines, version):  # noqa: ANN001, ANN202
                bad = {k: v + (1.0 if i == 0 else 0.0)
                       for i, (k, v) in enumerate(staged.payload.items())}  # fmt: skip
                engines[0].update_weights_from_tensors(bad, version)

        with pytest.raises(WeightSyncError, match="checksum"):
            sync_weights(trainer, plane, Corrupting(plane), 5)
        assert plane.weight_version == 4 and not plane.engine.paused  # resumed, not bumped
    finally:
        plane.close()


def test_shared_weights_follow_the_trainer_in_place_and_are_verified(model_dir: Path) -> None:
    """weight_sync=shared: no byte moves, the engine serves exactly the trainer's weights after
    each optimizer step, the trainer still trains, and a trainer that replaced its parameters
    is refused instead of leaving the engine on stale weights."""
    trainer = _trainer(model_dir, nudge=False)
    plane = InProcessPlane(model_dir, share=trainer.model)
    copied = InProcessPlane(model_dir)
    try:
        assert all(p.requires_grad for p in trainer.model.parameters())
        before = _ids(plane.generate(PROMPTS, GREEDY))
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))  # what an optimizer step does: in place
        metrics = sync_weights(trainer, plane, SharedSync(trainer), 1)
        assert metrics["sync_bytes"] == 0 and plane.weight_version == 1
        assert plane.engine.checksum() == weights_checksum(trainer.export_weights())
        sync_weights(trainer, copied, TensorSync(copied), 1)
        after = _ids(plane.generate(PROMPTS, GREEDY))
        assert after == _ids(copied.generate(PROMPTS, GREEDY)) and after != before
        assert {s.weight_version for s in plane.generate(PROMPTS, GREEDY)} == {1}
        name, p = next(iter(trainer.model.named_parameters()))
        parent = trainer.model.get_submodule(name.rpartition(".")[0])
        setattr(parent, name.rpartition(".")[2], torch.nn.Parameter(p.detach().clone()))
        with pytest.raises(WeightSyncError, match="no longer serves the trainer's parameters"):
            sync_weights(trainer, plane, SharedSync(trainer), 2)
        assert plane.weight_version == 1 and not plane.engine.paused
    finally:
        plane.close()
        copied.close()


def test_the_colocated_fast_path_samples_and_trains_like_the_http_plane(
        one, model_dir: Path) -> None:
    """Three GRPO steps from the same checkpoint and seeds: an HTTP engine process fed by
    disk sync, and an in-process engine reading the trainer's parameters, produce the same
    samples and the same losses step after step."""
    torch.set_num_threads(1)
    http, sync = one
    sync_weights(_trainer(model_dir, nudge=False), http, sync, 0)  # back to the checkpoint
    runs = {}
    for name in ("http", "shared"):
        trainer = _trainer(model_dir, nudge=False)
        plane, transport = ((http, sync) if name == "http"
                            else (InProcessPlane(model_dir, share=trainer.model),
                                  SharedSync(trainer)))  # fmt: skip
        steps = []
        for step in range(1, 4):
            samples = rollout_groups(plane, RECORDS, PROMPTS, n=4, params=PARAMS, step=step,
                                     seed=11)  # fmt: skip
            for s in samples:  # a reward with a gradient: prefer short, then token 9s
                s.reward = float(s.completion_ids.count(9)) - 0.1 * len(s.completion_ids)
            adv = advantages_for(samples, 4, "grpo")
            metrics = trainer.train_step(Batch.from_samples(samples, adv, 0))
            sync_weights(trainer, plane, transport, step)
            steps.append((_ids(samples), metrics["loss"], metrics["grad_norm"]))
        if name == "shared":
            plane.close()
        runs[name] = steps
    for (ids_a, loss_a, norm_a), (ids_b, loss_b, norm_b) in zip(*runs.values(), strict=True):
        assert ids_a == ids_b
        assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
        assert norm_a == pytest.approx(norm_b, rel=1e-5)
    assert runs["http"][0][0] != runs["http"][2][0]  # the steps sampled different things


def test_disk_sync_from_a_trainer_is_versioned_and_verified(one, local, model_dir: Path) -> None:
    http, sync = one
    sync_weights(_trainer(model_dir, nudge=False), http, sync, 0)  # from the checkpoint
    trainer = _trainer(model_dir)
    before = _ids(http.generate(PROMPTS, GREEDY))
    metrics = sync_weights(trainer, http, sync, 5)
    assert metrics["sync_bytes"] > 0 and metrics["sync_seconds"] > 0
    assert http.weight_version == 5
    url = http.pool.engine_urls[0]
    assert http.client.weight_version(url=url) == "5"
    assert http.client.weights_checksum(url=url) == weights_checksum(trainer.export_weights())
    after = _ids(http.generate(PROMPTS, GREEDY))
    sync_weights(trainer, local, TensorSync(local), 5)
    assert after == _ids(local.generate(PROMPTS, GREEDY)) and after != before
    # only the newest version stays staged (restarted engines re-sync from it)
    assert [p.name for p in sync.staging_dir.iterdir()] == ["v000005"]


def test_a_sync_that_delivers_other_weights_fails_loudly(one, model_dir: Path) -> None:
    """The trainer's checksum is of what it meant to write; the engine checksums what it
    loaded: a corrupted file (one weight off, what a broken bucket delivers) is caught."""
    http, sync = one

    class Corrupt(TorchTrainer):
        def _write_hf(self, path, weights):  # noqa: ANN001, ANN202
            name = next(iter(weights))
            bad = {**weights, name: weights[name].clone()}
            bad[name].view(-1)[0] += 1.0
            super()._write_hf(path, bad)

    trainer = Corrupt(model_dir, TrainConfig(), AlgorithmConfig())
    with pytest.raises(WeightSyncError, match="checksum .* but the trainer wrote"):
        sync_weights(trainer, http, sync, 6)
    assert http.weight_version != 6
    # the engines resumed, but serve unverified weights: nothing is sampled from them...
    with pytest.raises(WeightSyncError, match="last weight update was not verified"):
        http.generate(PROMPTS, GREEDY)
    # ...until a sync that delivers the trainer's weights (the sync task's retry)
    sync_weights(_trainer(model_dir), http, sync, 6)
    assert [s.weight_version for s in http.generate(PROMPTS, GREEDY)] == [6, 6, 6]


def test_a_stale_engine_cannot_slip_samples_into_a_step(one) -> None:
    http, _ = one
    version, url = http.weight_version, http.pool.engine_urls[0]
    http.weight_version = 9
    try:
        http.client.update_weight_version("8", url=url)
        with pytest.raises(WeightSyncError, match="weight_version 8, expected 9"):
            http.generate(PROMPTS, PARAMS)
        http.client.update_weight_version("9", url=url)
        assert [s.weight_version for s in http.generate(PROMPTS, PARAMS)] == [9, 9, 9]
    finally:
        http.weight_version = version
        http.client.update_weight_version(str(version), url=url)


def test_two_engines_behind_the_router_share_work_and_survive_a_kill(
    model_dir: Path, tmp_path: Path
) -> None:
    http, sync = _http(model_dir, tmp_path, n=2)
    try:
        assert http.urls == [http.pool.url]
        trainer = _trainer(model_dir)
        sync_weights(trainer, http, sync, 1)
        assert len(http.generate(PROMPTS * 8, PARAMS)) == 24
        steps = [http.client.server_info(url=u)["internal_states"][0]["decode_steps"]
                 for u in http.pool.engine_urls]  # fmt: skip
        assert all(s > 0 for s in steps), steps

        victim = http.pool.engines[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        # the client fails over to the other engine: nothing is lost
        assert len(http.generate(PROMPTS * 4, PARAMS)) == 12
        deadline = time.monotonic() + RESTART_BOUND_S + 30
        while time.monotonic() < deadline and not (victim.restarts and victim.in_service):
            time.sleep(0.2)
        assert victim.in_service, f"engine not back; see {victim.log_path}"
        # At least one restart: on a loaded machine a restart's own start can fail and be
        # retried (the pool's max_failed_recoveries), which is the pool doing its job.
        assert http.health()["restarts"] >= 1
        # back at the current version with the trainer's weights (re-synced from disk)
        assert http.client.weight_version(url=victim.url) == "1"
        http.verify(1, weights_checksum(trainer.export_weights()))
    finally:
        http.close()
    assert all(not e.alive for e in http.pool.engines)


def test_distributed_sync_broadcasts_to_every_engine_and_brings_back_a_killed_one(
    model_dir: Path, tmp_path: Path, local
) -> None:
    """``weight_sync=distributed``: a gloo group trainer (rank 0) + two engines; each sync
    is one broadcast per tensor, posted to the engines in buckets (10 kB here, so several),
    verified against the checksum of what was sent. A killed engine restarts on the base
    model and waits out of service; the next generate (the trainer still holds the synced
    weights) re-opens the group and re-broadcasts."""
    http, sync = _http(model_dir, tmp_path, n=2, transport="distributed", router=False)
    pool = http.pool
    trainer = _trainer(model_dir, nudge=False)
    try:
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            metrics = sync_weights(trainer, http, sync, version)
            expected = weights_checksum(trainer.export_weights())
            for url in pool.engine_urls:
                assert pool.client.weight_version(url=url) == str(version)
                assert pool.client.weights_checksum(url=url) == expected
        layout = sum(t.numel() * t.element_size() for t in trainer.export_weights().values())
        assert metrics["sync_bytes"] == 2 * layout and sync.num_buckets > 2
        first_group = sync._group[0]
        sync_weights(trainer, local, TensorSync(local), 2)
        want = _ids(local.generate(PROMPTS, GREEDY))
        assert _ids(http.generate(PROMPTS, GREEDY)) == want

        victim = pool.engines[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + RESTART_BOUND_S + 30
        while time.monotonic() < deadline and not victim.awaiting_weights:
            time.sleep(0.2)
        assert victim.awaiting_weights and not victim.in_service, victim
        assert pool.in_service_urls() == [pool.engines[0].url]
        # the next rollout brings it back first: same version, the trainer's weights
        assert _ids(http.generate(PROMPTS * 4, GREEDY)) == want * 4
        assert victim.in_service and sync._group[0] != first_group
        assert pool.client.weight_version(url=victim.url) == "2"
        http.verify(2, weights_checksum(trainer.export_weights()))
        assert pool.client.server_info(url=victim.url)["internal_states"][0]["decode_steps"] > 0
    finally:
        sync.close()
        http.close()
        trainer.close_weight_broadcast()
    assert all(not e.alive for e in pool.engines)


def test_colocated_engines_release_memory_for_training_and_take_it_back_to_sync(
    one, model_dir: Path, local
) -> None:
    """Time-shared devices: after the rollout the engine frees weights and KV cache; the
    monitor does not mistake it for a dead engine; the sync takes the weights back first and
    the engine serves the trainer's new weights. Sampling never runs on released engines."""
    http, sync = one
    restarts = http.pool.engines[0].restarts
    try:
        url = http.pool.engine_urls[0]
        trainer = _trainer(model_dir)

        def released() -> dict:
            return http.client.server_info(url=url)["internal_states"][0]["memory_released"]

        http.release_memory()
        assert http.memory_released == {"weights", "kv_cache"}
        assert released() == {"weights": True, "kv_cache": True}
        time.sleep(2.5)  # five monitor passes at 0.5 s, failure threshold 2
        assert http.pool.engines[0].restarts == restarts and http.pool.engines[0].in_service
        http.resume_memory(["weights"])  # what Planes.sync_weights does
        sync_weights(trainer, http, sync, 1)
        http.resume_memory(["kv_cache"])
        assert released() == {"weights": False, "kv_cache": False} and not http.memory_released
        sync_weights(trainer, local, TensorSync(local), 1)
        want = _ids(local.generate(PROMPTS, GREEDY))
        assert _ids(http.generate(PROMPTS, GREEDY)) == want
        http.release_memory()  # a rollout on released engines takes the memory back first
        assert _ids(http.generate(PROMPTS, GREEDY)) == want
        assert not http.memory_released
    finally:  # the module's engine as the other tests expect it
        if http.memory_released:
            http.resume_memory(sorted(http.memory_released))


def test_engines_die_with_the_process_that_started_them(model_dir: Path, tmp_path: Path) -> None:
    """An engine started with --parent-pid exits when that process is gone (SIGKILLed flows
    leave no orphans)."""
    code = (
        "import sys, time\n"
        "from rl_core.rollout.launch import embedded_engine_command, start_process, wait_healthy\n"
        f"cmd = embedded_engine_command({str(model_dir)!r}, num_threads=1)(0, int(sys.argv[1]))\n"
        f"p = start_process(cmd, {str(tmp_path / 'engine.log')!r})\n"
        "wait_healthy(f'http://127.0.0.1:{sys.argv[1]}', timeout_s=120, proc=p)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code, str(free_port())],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        engine_pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _alive(engine_pid)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(engine_pid):
            time.sleep(0.2)
        assert not _alive(engine_pid), "the engine outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Running and not a zombie (an exited orphan waits for init to reap it)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text(errors="replace")
    except FileNotFoundError:
        return False


def test_an_engine_whose_port_was_taken_starts_again_on_another(one_started) -> None:
    """A port is free when chosen but another process may take it before the engine binds
    (a restart reuses its predecessor's): the pool starts the engine again on a new port
    (the module's engine was asked to start on a port a socket held)."""
    http, _, taken, port = one_started
    (engine,) = http.pool.engines
    assert port != taken and engine.in_service
    assert "address already in use" in engine.log_path.read_text()
    assert http.client.server_info(url=engine.url)["internal_states"]
