"""Tests for rl_core.training.distributed: trainer ranks as Ray actors in one gloo group.

The claim under test: N data-parallel ranks make the same update as one rank on the same
global batch (every loss aggregation mode, odd batch sizes, uneven response lengths per
rank, mini-batches, micro-batches, a rank holding only padding), for DDP and for FSDP2
(both run on gloo here). The single-rank reference is a plain TorchTrainer in this process.
Real Ray, started once for the module; one torch thread per rank.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from conftest import PAD_ID, make_batch
from engine_helpers import save_tiny_model
from rank_pool import kept_ranks  # noqa: F401 - the module-scoped `ranks` fixture

from rl_core.config import AlgorithmConfig, TrainConfig
from rl_core.training.distributed import (
    TrainerGroup,
    TrainerRankError,
    shard_for_logprobs,
    shard_for_training,
)
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch

pytestmark = pytest.mark.usefixtures("one_thread")

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
# Global batch sizes, one per step: odd, uneven per rank, and 3 = a second mini-batch of
# one row, so one rank of two holds only padding there.
BATCH_SIZES = (7, 5, 3, 8)
# Metrics that must agree; train_tokens_per_s is a timing.
SKIP_METRICS = {"train_tokens_per_s"}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-tied"), seed=1, tie=True)


def random_batch(n: int, seed: int) -> Batch:
    """Prompts of 1-5 tokens, responses of 1-11: uneven token counts on every rank."""
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        length = int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(3, 64, (length,), generator=g).tolist()

    prompts = [ids(1, 6) for _ in range(n)]
    responses = [ids(1, 12) for _ in range(n)]
    logps = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    return make_batch(prompts, responses, logps, torch.randn(n, generator=g), PAD_ID)


# The product's default bound (300 s): the first call's budget also covers starting the
# rank processes (Ray workers importing torch and transformers), which took over 120 s
# under a loaded CI machine (a QLoRA group timed out there with both ranks still loading).
GROUP = {"num_ranks": 2, "num_threads_per_rank": 1, "timeout_s": 300.0}


def assert_weights_close(got: dict, expected: dict, atol: float) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=atol, rtol=0, msg=k)


def assert_metrics_close(got: dict, expected: dict, step: int) -> None:
    assert got.keys() == expected.keys()
    for k in expected.keys() - SKIP_METRICS:  # float32 round-off grows with the value
        assert got[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-5), (step, k)


def prepare(trainer, batch: Batch) -> Batch:
    """What the loop does before train_step: old and reference log-probs where needed."""
    if trainer.needs_old_logp:
        batch.old_logp = trainer.compute_logprobs(batch)
    if trainer.has_ref_model:
        batch.ref_logp = trainer.compute_logprobs(batch, reference=True)
    return batch


# ------------------------------------------------------------------ sharding (no Ray)


def test_training_shards_cover_every_row_once_with_global_counts():
    batch = random_batch(7, seed=0)
    shards = shard_for_training(batch, world=3, mini_batches=2)
    assert len(shards) == 3
    minis = torch.arange(7).chunk(2)  # rows 0-3 and 4-6, as one rank cuts them
    for local, plan in shards:
        assert [len(m.rows) for m in plan] == [2, 1]  # ceil(4/3), ceil(3/3): equal per rank
        for m, rows in zip(plan, minis, strict=True):
            assert m.tokens == float(batch.response_mask[rows].sum())
            assert m.seqs == float(len(rows))
        assert local.size == 3
    # Every real response token is on exactly one rank; padding rows carry none.
    total = sum(int(local.response_mask.sum()) for local, _ in shards)
    assert total == int(batch.response_mask.sum())
    # Rank 1 holds rows 2, a padding copy of row 0, and 5.
    local = shards[1][0]
    for i, row in ((0, 2), (1, 0), (2, 5)):
        n = int(batch.attention_mask[row].sum())
        assert local.input_ids[i, :n].tolist() == batch.input_ids[row, :n].tolist()
    assert not local.response_mask[1].any()
    assert local.response_mask[0].sum() == batch.response_mask[2].sum()


def test_logprob_shards_are_equal_in_size_and_in_order():
    batch = random_batch(5, seed=1)
    shards = shard_for_logprobs(batch, world=2)
    assert [local.size for local, _ in shards] == [3, 3]
    assert torch.cat([rows for _, rows in shards]).tolist() == list(range(5))
    (first, _), (second, rows) = shards
    torch.testing.assert_close(first.input_ids[:3], batch.select(torch.arange(3)).input_ids)
    assert rows.tolist() == [3, 4]


# ----------------------------------------------------------- N ranks == one rank


@pytest.mark.parametrize(
    ("data_parallel", "num_ranks", "tied"),
    [("ddp", 2, False), ("fsdp2", 3, True)],
    ids=["ddp-2-ranks", "fsdp2-3-ranks-tied"],
)
def test_ranks_make_the_single_rank_update(
    ranks, model_dir, tied_model_dir, tmp_path, data_parallel, num_ranks, tied
):
    path = tied_model_dir if tied else model_dir
    # Two mini-batches of micro-batches of 2; KL on (reference log-probs) and TIS on (old
    # log-probs), so every log-prob path of the loop runs on the ranks; a schedule and
    # weight decay, so the checkpoint must carry the scheduler and the optimizer state.
    train = TrainConfig(
        lr=1e-3, steps=10, mini_batches=2, micro_batch_size=2,
        lr_schedule="cosine", warmup_steps=1, weight_decay=0.01,
    )  # fmt: skip
    algo = AlgorithmConfig(kl_coef=0.05, tis_cap=2.0)
    single = TorchTrainer(path, train, algo)
    with ranks.group(path, train, algo, **{**GROUP, "num_ranks": num_ranks},
                     data_parallel=data_parallel) as group:
        assert group.needs_old_logp == single.needs_old_logp
        assert group.has_ref_model and group.ref_model is not None
        check_logprobs(group, single)
        check_training(group, single, algo)
        check_checkpoints(group, single, tmp_path)
        check_weight_source(group, tmp_path)


def check_logprobs(group: TrainerGroup, single: TorchTrainer, atol: float = 1e-6) -> None:
    """Policy and reference log-probs: the same values, in the batch's row order (``atol``:
    bitsandbytes' 4-bit kernels round differently with the rank's thread count)."""
    batch = random_batch(7, seed=10)
    for reference in (False, True):
        got = group.compute_logprobs(batch, reference=reference)
        expected = single.compute_logprobs(batch, reference=reference)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def check_training(group: TrainerGroup, single: TorchTrainer, algo: AlgorithmConfig) -> None:
    """One step per aggregation mode, each on a fresh batch: the same metrics and weights.

    The mode is switched on every rank and on the single trainer alike (``train_step``
    reads ``trainer.algo``), so one group start covers all four modes.
    """
    for step, (mode, size) in enumerate(zip(LOSS_AGG_MODES, BATCH_SIZES, strict=True)):
        mode_cfg = algo.model_copy(update={"loss_agg": mode})
        single.algo = mode_cfg
        group.apply(lambda t, cfg=mode_cfg: setattr(t, "algo", cfg))
        expected = single.train_step(prepare(single, random_batch(size, seed=step)))
        got = group.train_step(prepare(group, random_batch(size, seed=step)))
        assert_metrics_close(got, expected, step)
        assert group.global_step == single.global_step == 2 * (step + 1)
        assert_weights_close(group.export_weights(), single.export_weights(), atol=1e-5)
    # The policy moved: this compared a real training run, not two idle models.
    assert expected["kl"] > 1e-4


def check_checkpoints(group: TrainerGroup, single: TorchTrainer, tmp_path) -> None:
    """Checkpoints have the single-rank layout, in both directions, and resume exactly."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(group.save_pretrained(tmp_path / "hf"))
    assert_weights_close(saved.state_dict(), single.model.state_dict(), atol=1e-5)

    # Group -> one trainer: the same weights, optimizer moments and schedule.
    group_ckpt = group.save_state(tmp_path / "group")
    resumed = TorchTrainer(single.model.name_or_path, single.train_cfg, single.algo)
    resumed.load_state(group_ckpt)
    assert resumed.global_step == single.global_step
    assert resumed.scheduler.get_last_lr() == single.scheduler.get_last_lr()
    assert_weights_close(resumed.export_weights(), single.export_weights(), atol=1e-5)
    opt, expected = resumed.optimizer.state_dict(), single.optimizer.state_dict()
    assert opt["state"].keys() == expected["state"].keys()
    for k in expected["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(
                opt["state"][k][name], expected["state"][k][name], atol=1e-6, rtol=1e-4
            )

    # One trainer -> group: every rank rewinds to it (after a step of its own), and the
    # next step is the single trainer's again.
    single_ckpt = single.save_state(tmp_path / "single")
    batch = random_batch(6, seed=20)
    group.train_step(prepare(group, random_batch(6, seed=21)))
    group.load_state(single_ckpt)
    assert group.global_step == single.global_step
    expected = single.train_step(prepare(single, batch))
    got = group.train_step(prepare(group, random_batch(6, seed=20)))
    assert_metrics_close(got, expected, step=-1)
    assert_weights_close(group.export_weights(), single.export_weights(), atol=1e-5)


def check_weight_source(group: TrainerGroup, tmp_path) -> None:
    """The transports' trainer side runs on the ranks: rank 0 writes (disk) or puts (object
    store) the weights and takes their checksum there; only the checksum, an object
    reference and the layout come back to this process, never the weights."""
    from rl_core.models import read_weights
    from rl_core.weight_sync import weights_checksum
    from rl_core.weight_sync.source import from_arrays
    from rl_core.weight_sync.transports import DiskSync

    weights = group.export_weights()  # for the comparison only
    expected = weights_checksum(weights)
    assert group.write_weights(tmp_path / "written") == expected
    written = read_weights(tmp_path / "written")
    assert all(torch.equal(written[k], weights[k]) for k in written)
    ref, checksum, nbytes = group.put_weights()
    assert checksum == expected and nbytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert weights_checksum(from_arrays(ray.get(ref))) == expected
    assert group.weight_layout() == {k: (str(t.dtype).removeprefix("torch."), list(t.shape))
                                     for k, t in weights.items()}  # fmt: skip

    class NoPull:  # the group, minus the one method that moves weights here
        def __getattr__(self, name):  # noqa: ANN001, ANN204
            if name == "export_weights":
                raise AssertionError("the disk transport pulled the weights to the driver")
            return getattr(group, name)

    staged = DiskSync(None, tmp_path / "staging", 60).stage(NoPull(), 3)
    assert staged.checksum == expected and staged.payload.name == "v000003"


# ------------------------------------------------------------------------- failure


def test_calls_are_bounded_and_name_the_rank(ray_session):
    # Defined here so Ray ships the class by value (workers cannot import this module).
    class Stub:
        """A light stand-in rank for the bounded-call tests (no model, starts in seconds)."""

        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

        def boom(self) -> None:
            raise ValueError("boom")

        def shutdown(self) -> None:
            pass

    stub = ray.remote(Stub).options(num_cpus=0)
    group = TrainerGroup([stub.remote(), stub.remote()], timeout_s=1.0, max_response_len=None)
    a, b = group.actors
    try:
        # The first call waits for the actors to start; then the group's 1 s bound applies.
        assert group._call("nap", [a.nap.remote(0), b.nap.remote(0.1)], timeout_s=60) == [0, 0.1]
        with pytest.raises(TrainerRankError, match=r"boom failed: trainer rank 1 raised: Value"):
            group._call("boom", [a.nap.remote(0), b.boom.remote()])
        group._broken = None  # (a real group stays unusable; these stubs hold no collective)
        started = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"trainer rank\(s\) \[1\] did not answer within 1 s"
        ):
            group._call("nap", [a.nap.remote(0), b.nap.remote(30)])
        assert time.monotonic() - started < 5
        with pytest.raises(TrainerRankError, match="unusable"):
            group._call("nap", [a.nap.remote(0), b.nap.remote(0)])
    finally:
        group.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_weights_cross_the_object_store_as_numpy(ray_session, dtype):
    from rl_core.weight_sync.source import from_arrays, to_arrays

    t = (torch.randn(3, 5) * 100).to(dtype)
    got = from_arrays(ray.get(ray.put(to_arrays({"w": t}))))["w"]
    assert got.dtype == dtype
    torch.testing.assert_close(got, t, atol=0, rtol=0)


def test_killed_rank_fails_the_next_call_naming_it(ranks, model_dir):
    batch = random_batch(4, seed=3)
    # On the kept ranks (or fresh ones): the broken group is shut down, not kept.
    with ranks.group(model_dir, TrainConfig(lr=1e-3), AlgorithmConfig(), **GROUP) as group:
        group.train_step(batch)
        ray.kill(group.actors[1], no_restart=True)
        started = time.monotonic()
        with pytest.raises(TrainerRankError, match=r"train_step failed: trainer rank 1 died") as e:
            group.train_step(batch)
        assert time.monotonic() - started < 15.0  # at once, not at the 120 s bound
        assert e.value.ranks == [1]
        # The group stays unusable until it is rebuilt, and says so at once.
        with pytest.raises(TrainerRankError, match="unusable"):
            group.export_weights()
    assert group.num_ranks == 0


@pytest.mark.parametrize(("data_parallel", "quantize"), [("ddp", None), ("fsdp2", None),
                                                         ("ddp", "nf4")],
                         ids=["ddp", "fsdp2", "ddp-qlora"])
def test_lora_ranks_make_the_single_rank_update(ranks, model_dir, tmp_path, data_parallel,
                                                quantize):
    """LoRA (train.lora; QLoRA: a 4-bit base) on two DDP or FSDP2 ranks: the same log-probs (the reference: the base with
    the adapter disabled), the same adapter after a step, an adapter-only checkpoint the
    single trainer resumes from, and the same merged export."""
    from transformers import AutoModelForCausalLM

    from rl_core.config import LoraConfig

    train = TrainConfig(lr=1e-2, steps=10, micro_batch_size=2,
                        lora=LoraConfig(rank=4, quantize=quantize))
    algo = AlgorithmConfig(kl_coef=0.05)
    single = TorchTrainer(model_dir, train, algo)
    with ranks.group(model_dir, train, algo, **GROUP, data_parallel=data_parallel) as group:
        check_logprobs(group, single, atol=1e-5 if quantize else 1e-6)
        expected = single.train_step(prepare(single, random_batch(6, seed=3)))
        got = group.train_step(prepare(group, random_batch(6, seed=3)))
        assert_metrics_close(got, expected, 0)
        adapter = group.export_weights()
        assert adapter and all(".lora_" in k for k in adapter)
        assert_weights_close(adapter, single.export_weights(), atol=1e-5)
        resumed = TorchTrainer(model_dir, train, algo)
        resumed.load_state(group.save_state(tmp_path / "group"))
        assert_weights_close(resumed.export_weights(), single.export_weights(), atol=1e-5)
        assert {p.name for p in (tmp_path / "group" / "model").iterdir()} == {
            "adapter_config.json", "adapter_model.safetensors"}
        merged = AutoModelForCausalLM.from_pretrained(group.save_pretrained(tmp_path / "hf"))
        want = AutoModelForCausalLM.from_pretrained(single.save_pretrained(tmp_path / "one"))
        assert_weights_close(merged.state_dict(), want.state_dict(), atol=1e-5)
