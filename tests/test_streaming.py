"""Fully asynchronous rollouts (``rollout.streaming``): the stream of groups and partial
rollouts across weight updates.

Pinned here, on real engines (the in-process engine core and an HTTP engine process):

- A sample generated in segments is the sample its weights would score: every token's
  log-prob equals the teacher-forced log-prob under the weights that produced it, also when
  the weights change between segments (the tokens before the update score under the old
  weights, the rest under the new ones, each tagged with its version).
- An update interrupts long generations instead of waiting for them (SGLang's pause with
  ``mode=abort``): the aborted samples come back with their tokens, and the next round
  continues them with the new weights to their full length.
- Admission keeps generation at most ``max_staleness`` batches ahead, and a finished group
  older than the bound is never trained on.
- Through the flow: the ledger holds every sample once, none older than the bound, and the
  checkpoint holds the samples in flight with their tokens (the exact resume of a streamed
  run after a SIGKILL, and its bit-for-bit repeat, are in tests/test_resume.py).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import run_demo_flow, save_tiny_model

from rl_core.config import AlgorithmConfig, TrainConfig, load_config
from rl_core.data.records import Record
from rl_core.data.sampler import PromptSampler
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.rollout.stream import GroupStream
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch
from rl_core.weight_sync import sync_weights
from rl_core.weight_sync.transports import DiskSync, TensorSync

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
RECORDS = [Record(id=f"r{i}", question=f"q{i}", answer="1") for i in range(6)]
PROMPTS = [[5 + i, 6, 7 + i] for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


def _stream(per_step: int = 2, *, k: int = 1, tokens: int | None = 3, max_new: int = 12,
            n: int = 2) -> GroupStream:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
    return GroupStream(RECORDS, PROMPTS, PromptSampler(len(RECORDS), per_step, seed=0), n=n,
                       params=params, seed=0, per_step=per_step, max_staleness=k,
                       partial_tokens=tokens)


def _trainer(model_dir: Path) -> TorchTrainer:
    return TorchTrainer(model_dir, TrainConfig(lr=1e-2), AlgorithmConfig(), max_response_len=16)


def _scored(trainer: TorchTrainer, samples: list) -> list[list[float]]:
    """Teacher-forced log-probs of each sample's completion under ``trainer``'s weights."""
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
    logp = trainer.compute_logprobs(batch)
    return [logp[i][batch.response_mask[i]].tolist() for i in range(len(samples))]


def _nudge(trainer: TorchTrainer) -> None:
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))


def test_segments_across_an_update_score_under_the_weights_that_made_them(model_dir: Path) -> None:
    torch.manual_seed(0)
    plane, trainer = InProcessPlane(model_dir), _trainer(model_dir)
    try:
        stream = _stream()
        stream.limit = 2
        stream.round(plane, 0)  # admits 2 batches (the next step's and one ahead): 4 groups
        assert stream.admitted == 2 and len(stream.in_flight) == 4
        head = [list(s.completion_ids) for g in stream.in_flight for s in g.samples]
        assert all(len(ids) == 3 for ids in head)  # one segment: partial_tokens each
        before = _trainer(model_dir)  # the weights of version 0
        _nudge(trainer)
        sync_weights(trainer, plane, TensorSync(plane), 1)
        while stream.in_flight:
            stream.round(plane, plane.weight_version)
        groups = stream.finished
        samples = [s for g in groups for s in g.samples]
        assert len(samples) == 8 and all(len(s.completion_ids) == 12 for s in samples)
        for s, ids in zip(samples, head, strict=True):
            assert s.completion_ids[:3] == ids  # the tokens before the update are kept
            assert s.versions == [0] * 3 + [1] * 9
            assert s.weight_version == 0  # its oldest token's
            assert s.meta["segments"] == 4
        old, new = _scored(before, samples), _scored(trainer, samples)
        for s, o, w in zip(samples, old, new, strict=True):
            assert s.logprobs[:3] == pytest.approx(o[:3], abs=1e-4)
            assert s.logprobs[3:] == pytest.approx(w[3:], abs=1e-4)
            assert s.logprobs[3:] != pytest.approx(o[3:], abs=1e-4)  # the update mattered
    finally:
        plane.close()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_round_is_held_across_the_update_and_continues(model_dir: Path,
                                                                 mode: str) -> None:
    """``rollout.pause_mode`` retract / in_place: the update holds the round's requests
    instead of ending them; they continue with the new weights in the same request, and the
    engine says which version made each token. Retract recomputes their KV under the new
    weights (every later token scores under them); in place keeps the old KV (cheaper, but
    the later tokens are not the new weights' own)."""
    torch.manual_seed(0)
    plane, trainer = InProcessPlane(model_dir), _trainer(model_dir)
    plane.pause_mode = mode
    paused = threading.Event()

    def pause_at_step_4(n: int) -> None:  # on the scheduler: the pause lands at this step
        if n == 4 and not paused.is_set():
            plane.engine.pause(mode)
            paused.set()

    plane.engine.on_step = pause_at_step_4
    try:
        stream, metrics = _stream(tokens=None), {}
        stream.limit = 1
        worker = threading.Thread(target=lambda: metrics.update(stream.round(plane, 0)))
        worker.start()
        assert paused.wait(60), "the round never reached decode step 4"
        before = _trainer(model_dir)  # the weights of version 0
        _nudge(trainer)
        sync_weights(trainer, plane, TensorSync(plane), 1)
        worker.join(60)
        assert not worker.is_alive() and not stream.in_flight  # one round, not cut
        samples = [s for g in stream.finished for s in g.samples]
        assert len(samples) == 4 and all(len(s.completion_ids) == 12 for s in samples)
        old, new = _scored(before, samples), _scored(trainer, samples)
        for s, o, w in zip(samples, old, new, strict=True):
            a = s.versions.count(0)
            assert 0 < a < 12 and s.versions == [0] * a + [1] * (12 - a), s.versions
            assert s.meta["segments"] == 1 and s.weight_version == 0
            assert s.logprobs[:a] == pytest.approx(o[:a], abs=1e-4)
            if mode == "retract":
                assert s.meta["recomputed_tokens"] == len(s.prompt_ids) + a
                assert s.logprobs[a:] == pytest.approx(w[a:], abs=1e-4)
            else:  # the old KV: neither weights' own log-probs after the update
                assert s.meta["recomputed_tokens"] == 0
                assert s.logprobs[a:] != pytest.approx(w[a:], abs=1e-4)
        assert metrics["stream_reprefill_tokens"] == sum(s.meta["recomputed_tokens"]
                                                         for s in samples)
    finally:
        plane.close()


def test_admission_stays_within_the_staleness_bound_and_stale_groups_never_train(
    model_dir: Path,
) -> None:
    plane = InProcessPlane(model_dir)
    try:
        stream = _stream(per_step=2, k=2, tokens=None)
        stream.round(plane, 0)
        assert stream.admitted == 3  # the batches steps 1..3 train on, no more
        stream.round(plane, 0)
        assert stream.admitted == 3 and len(stream.finished) == 6
        ready, stale = stream.take(1)
        assert [g.index for g in ready] == [0, 1] and not stale
        plane.engine.update_weight_version(1)  # (the same weights, relabelled)
        plane.weight_version = 1
        stream.round(plane, 1)  # one more batch: version 1 may run ahead to step 4
        assert stream.admitted == 4
        # step 4 trains with version 3: the version-0 groups are 3 versions old (> 2)
        ready, stale = stream.take(4)
        assert [g.index for g in stale] == [2, 3, 4, 5] and [g.index for g in ready] == [6, 7]
        assert not stream.groups
    finally:
        plane.close()


def _engine_process(model_dir: Path, tmp_path: Path) -> tuple[HttpPlane, DiskSync]:
    pool = EnginePool(embedded_engine_command(model_dir, num_threads=1), 1,
                      log_dir=tmp_path / "engines", health_interval_s=0.5, health_timeout_s=10,
                      startup_timeout_s=120)  # fmt: skip
    plane = HttpPlane(pool, request_batch_size=8, weight_sync_timeout_s=60).start()
    return plane, DiskSync(plane, tmp_path / "staging", 60)


def _wait_decoding(plane: HttpPlane) -> None:
    """Until the engine holds KV (a round is decoding), bounded."""
    deadline = time.monotonic() + 60
    while not plane.client.loads()["loads"][0]["num_used_tokens"] and time.monotonic() < deadline:
        time.sleep(0.02)


def test_an_update_aborts_long_generations_and_the_next_round_continues_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """Timing mode (SGLang's way): the round asks for everything; the update's pause aborts
    it; the samples keep their tokens and finish with the new weights."""
    plane, sync = _engine_process(model_dir, tmp_path)
    trainer = _trainer(model_dir)
    _nudge(trainer)
    try:
        stream = _stream(per_step=6, k=1, tokens=None, max_new=240, n=8)
        stream.limit = 2
        errors: list[BaseException] = []

        def first_round() -> None:
            try:
                stream.round(plane, 0)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        worker = threading.Thread(target=first_round)
        worker.start()
        _wait_decoding(plane)
        started = time.monotonic()
        sync_weights(trainer, plane, sync, 1)
        synced_in = time.monotonic() - started
        worker.join(60)
        assert not worker.is_alive() and not errors, errors
        cut = [s for g in stream.in_flight for s in g.samples]
        assert cut and all(s.aborted for s in cut), "the update waited for the generations"
        assert all(0 <= len(s.completion_ids) < 240 for s in cut)
        kept = {s.uid: list(s.completion_ids) for s in cut}
        while stream.in_flight:
            stream.round(plane, plane.weight_version)
        samples = [s for g in stream.finished for s in g.samples]
        assert len(samples) == 96 and all(len(s.completion_ids) == 240 for s in samples)
        for s in samples:
            assert s.completion_ids[: len(kept[s.uid])] == kept[s.uid]
            assert s.versions == [0] * len(kept[s.uid]) + [1] * (240 - len(kept[s.uid]))
        assert any(len(ids) > 0 for ids in kept.values())  # some were cut mid-generation
        assert synced_in < 30
    finally:
        plane.close()


def test_retract_and_in_place_updates_hold_the_requests_of_an_engine_process(
    model_dir: Path, tmp_path: Path
) -> None:
    """SGLang's other pause modes over HTTP: the update neither waits for the round's long
    generations nor ends them; the requests finish after it, in the same round, and each
    token carries the version the engine made it with (``weight_version_spans``)."""
    plane, sync = _engine_process(model_dir, tmp_path)
    trainer = _trainer(model_dir)
    try:
        for version, mode in enumerate(("retract", "in_place"), start=1):
            plane.pause_mode = mode
            _nudge(trainer)
            stream = _stream(per_step=6, k=1, tokens=None, max_new=240, n=8)
            stream.limit = 1
            worker = threading.Thread(target=stream.round, args=(plane, version - 1))
            worker.start()
            _wait_decoding(plane)
            started = time.monotonic()
            sync_weights(trainer, plane, sync, version)
            assert time.monotonic() - started < 30, f"{mode}: the update waited for the round"
            worker.join(120)
            assert not worker.is_alive() and not stream.in_flight, mode
            samples = [s for g in stream.finished for s in g.samples]
            assert len(samples) == 48 and all(len(s.completion_ids) == 240 for s in samples)
            spans = [s.versions.count(version - 1) for s in samples]
            for s, a in zip(samples, spans, strict=True):
                assert s.versions == [version - 1] * a + [version] * (240 - a), mode
                assert s.meta["segments"] == 1 and not s.aborted
                assert (s.meta["recomputed_tokens"] > 0) == (mode == "retract" and a > 0)
            assert any(0 < a < 240 for a in spans), f"{mode}: no request spans the update"
    finally:
        plane.close()


# ---------------------------------------------------------------------------- the flow

STREAM_RUN = ["rollout.engine=embedded", "rollout.streaming=true", "rollout.max_staleness=2", "rollout.partial_tokens=8"]


def _run(tmp: Path, cache: Path, name: str, *extra: str, resume: str = "never") -> Path:
    out = run_demo_flow(tmp, cache, name, *STREAM_RUN, *extra, resume=resume)
    return Path(out["run_dir"])


def _ledger(run: Path) -> dict[int, list[dict]]:
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return {r["step"]: r["samples"] for r in rows}


def test_streaming_needs_staleness_and_says_what_it_does_not_combine_with() -> None:
    demo = ROOT / "configs" / "tiny-cpu.yaml"
    with pytest.raises(ValueError, match="max_staleness is 0"):
        load_config(demo, ["rollout.streaming=true"])
    with pytest.raises(ValueError, match="dynamic_sampling"):
        load_config(demo, ["rollout.streaming=true", "rollout.max_staleness=1",
                           "algorithm.dynamic_sampling=true"])
    cfg = load_config(demo, ["rollout.streaming=true", "rollout.max_staleness=3"])
    assert cfg.rollout.segment_tokens == 8  # ceil(32 / 4)
    sglang = load_config(demo, ["rollout.engine=sglang", "rollout.streaming=true",
                                "rollout.max_staleness=1"])
    assert sglang.rollout.segment_tokens is None  # the update's abort ends a round


def test_a_streamed_run_trains_every_sample_once_within_the_bound(
    prefect_harness, tiny_cache: Path, tmp_path: Path
) -> None:
    """One streamed flow run: the ledger holds every admitted sample once, none trained
    older than the bound, some continued across an update; the checkpoint holds the samples
    in flight with their tokens. (That streamed runs repeat bit for bit and that a resume,
    after a SIGKILL, continues the in-flight samples from those tokens and ends with the
    uninterrupted run's samples and weights is tests/test_resume.py's
    ``[stream-2-kill-mid-step]``.)"""
    run = _run(tmp_path, tiny_cache, "first", "train.steps=5", "checkpoint.every=2",
               "checkpoint.keep_last=3")  # fmt: skip
    ledger = _ledger(run)
    uids = [r["uid"] for rows in ledger.values() for r in rows]
    assert len(uids) == len(set(uids)), "a sample in the ledger twice"
    # every prompt drawn is there: the batches admitted up to version 3 (the last round
    # runs while step 4 trains: 3 + 1 + max_staleness), 8 prompts x 4 samples each
    batches = [int(u.split(":")[0]) for u in uids]
    assert sorted(set(batches)) == list(range(1, 7))
    assert all(batches.count(b) == 32 for b in range(1, 7))
    unused = [r for r in ledger[5] if r.get("unused")]
    assert unused and not any(r["trained"] for r in unused)
    for step, rows in ledger.items():
        trained = [r for r in rows if r["trained"]]
        assert len(trained) == 8 * 4, step
        assert all(step - 1 - r["weight_version"] <= 2 for r in trained), step
    assert any("versions" in r for rows in ledger.values() for r in rows), \
        "no sample continued across a weight update"  # fmt: skip
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(m["partial_sample_frac"] > 0 for m in metrics)

    rows = json.loads((run / "checkpoints" / "step-000002" / "rollouts.json").read_text())
    assert rows and any(r["finished_round"] is None for r in rows)  # in flight, with tokens
    assert any(s["completion_ids"] for r in rows for s in r["samples"])
    # trained on engine processes; the final evaluation ran in-process (no engine started)
    assert (run / "engines" / "engine-0.log").is_file()
    assert not list((run / "final-eval").rglob("engine-*.log"))
    evals = [json.loads(x) for x in (run / "evals.jsonl").read_text().splitlines()]
    assert evals[-1]["step"] == 5
