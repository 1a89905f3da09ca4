"""Mixture-of-experts models in the megatron backend: the same model as transformers', sharded
by expert parallelism, replaying given routing, reporting router metrics.

- HF <-> megatron conversion round-trips bit for bit for Qwen3-MoE (with a dense layer) and
  Qwen2-MoE (shared expert) at EP 1/2 and PP 1/2, from both HF expert layouts (transformers 5's
  fused tensors, the hub's per-expert tensors).
- One rank, this process: log-probs equal ``Qwen3MoeForCausalLM``'s / ``Qwen2MoeForCausalLM``'s
  (through the torch backend), one GRPO update with the load-balancing loss and its router
  metrics equal the torch backend's, routing replay routes exactly as given (also when full
  recompute re-runs the routers).
- Two Ray ranks over gloo at EP=2 (the all-to-all and the all-gather dispatchers): log-probs,
  the update, the router metrics and the exported HF weights equal one rank's; an
  expert-sharded ``dist_checkpointing`` checkpoint resumes identically.

float32, lr 1e-4, as tests/test_megatron.py (which says why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import EOS_ID, PAD_ID, TINY_VOCAB
from rank_pool import kept_ranks  # noqa: F401 - the module-scoped `ranks` fixture
from test_megatron import ALGO, batch_of, train_cfg, weights_equal

from rl_core.config import AlgorithmConfig, ConfigError, MoeConfig, load_config
from rl_core.models.moe import hub_layout
from rl_core.training.megatron.convert import hf_to_mcore, mcore_to_hf, merge_tp
from rl_core.training.megatron.model import arch_from_hf
from rl_core.training.torch_trainer import TorchTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
EXPERTS, TOPK = 4, 2
ROUTER_METRICS = ("moe/load_max_over_mean", "moe/load_cv", "moe/router_entropy", "moe/aux_loss")
REPLAY = MoeConfig(routing_replay=True)


def tiny_moe(kind: str = "qwen3_moe", seed: int = 0, **extra):
    """A seeded random MoE causal LM: vocab 64, hidden 32, 2 layers, 4 experts of width 16,
    top-2. The routers get std 1 (HF initialises them to zero: every token a tie)."""
    from transformers import (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts=EXPERTS, num_experts_per_tok=TOPK,
        initializer_range=0.2, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=8, norm_topk_prob=True, **common, **extra))
    else:
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(shared_expert_intermediate_size=24, **common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    return model.eval()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe")
    tiny_moe().save_pretrained(path)
    return path


# ------------------------------------------------------------------ conversion (no groups)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize(("ep", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_moe_round_trips_bit_exactly(kind: str, ep: int, pp: int) -> None:
    extra = {"mlp_only_layers": [1]} if kind == "qwen3_moe" else {}
    model = tiny_moe(kind, **extra)
    arch = arch_from_hf(model.config)
    assert arch.moe_layers == ((True, False) if extra else (True, True))
    fused = model.state_dict()  # transformers 5: experts as (E, 2I, H) / (E, H, I)
    for source in (fused, hub_layout(fused)):
        back: dict[str, torch.Tensor] = {}
        for stage in range(pp):
            shards = [hf_to_mcore(source, arch, padded_vocab=128, pp_rank=stage, pp=pp,
                                  ep_rank=r, ep=ep) for r in range(ep)]  # fmt: skip
            merged = {}
            for r, shard in enumerate(shards):  # what export_weights does after its gather
                for name, t in shard.items():
                    if ".local_experts." in name:
                        prefix, index = name.split(".local_experts.")
                        e, rest = index.split(".", 1)
                        name = f"{prefix}.local_experts.{r * EXPERTS // ep + int(e)}.{rest}"
                    merged[name] = merge_tp(name, [t])
            back.update(mcore_to_hf(merged, arch, pp_rank=stage, pp=pp))
        weights_equal(fused, back)


def test_hub_layout_is_what_save_pretrained_writes(tmp_path) -> None:
    from safetensors.torch import load_file

    model = tiny_moe("qwen2_moe")
    model.save_pretrained(tmp_path)
    weights_equal(load_file(tmp_path / "model.safetensors"), hub_layout(model.state_dict()))


def test_moe_layouts_and_their_errors() -> None:
    arch = arch_from_hf(tiny_moe().config)
    assert (arch.experts, arch.topk, arch.moe_ffn, arch.norm_topk) == (4, 2, 16, True)
    arch.check_parallel(1, 2, 4)
    with pytest.raises(ValueError, match=r"train\.megatron\.ep=3 must divide the number of experts"):
        arch.check_parallel(1, 1, 3)
    with pytest.raises(ValueError, match=r"tp=2 with a mixture-of-experts model.*"
                                         r"train\.megatron\.sequence_parallel=true"):
        arch.check_parallel(2, 1, 1)
    arch.check_parallel(2, 1, 1, sequence_parallel=True)
    dense = arch_from_hf(__import__("conftest").tiny_qwen2(0).config)
    with pytest.raises(ValueError, match="expert parallelism needs a mixture-of-experts model"):
        dense.check_parallel(1, 1, 2)
    demo = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    ray4 = ["train.backend=megatron", "cluster.mode=ray", "cluster.trainer_ranks=4",
            "train.megatron.tp=2", "train.megatron.sequence_parallel=true"]
    assert load_config(demo, [*ray4, "train.megatron.ep=4"]).train.megatron.ep == 4  # folded
    with pytest.raises(ConfigError, match=r"ep=8 must divide the ranks of a pipeline stage \(4"):
        load_config(demo, [*ray4, "train.megatron.ep=8"])


# --------------------------------------------------------------- one rank, this process


@pytest.fixture
def megatron_trainer():
    from rl_core.training.megatron import MegatronTrainer

    made = []

    def make(path: Path, algo: AlgorithmConfig = ALGO, **kw) -> MegatronTrainer:
        train = kw.pop("train", None) or train_cfg(**kw)
        made.append(MegatronTrainer(path, train, algo, temperature=0.7))
        return made[-1]

    yield make
    for trainer in made:
        trainer.shutdown()


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_one_rank_equals_the_torch_backend(megatron_trainer, tmp_path, kind) -> None:
    """Log-probs equal the torch backend's (transformers' MoE forward); for Qwen3-MoE one GRPO
    update with the load-balancing loss in it too (train.moe.aux_loss_coef), and the router
    metrics (one micro-batch: the two backends' aggregations coincide)."""
    tiny_moe(kind).save_pretrained(tmp_path)
    batch = batch_of()
    one_micro = dict(micro_batch_size=8, mini_batches=1, moe=MoeConfig(aux_loss_coef=0.1))
    ref = TorchTrainer(tmp_path, train_cfg("torch").model_copy(update=one_micro), ALGO,
                       temperature=0.7)
    mg = megatron_trainer(tmp_path, train=train_cfg().model_copy(update=one_micro))
    want, got = ref.compute_logprobs(batch), mg.compute_logprobs(batch)
    assert (got - want).abs().max() < TOL
    if kind == "qwen2_moe":
        return
    batch.old_logp = want
    m_ref, m_mg = ref.train_step(batch), mg.train_step(batch)
    for key in ("loss", "pg_loss", "entropy", "grad_norm", *ROUTER_METRICS):
        assert m_mg[key] == pytest.approx(m_ref[key], abs=TOL), key
    assert 1 < m_mg["moe/load_max_over_mean"] < EXPERTS / TOPK and m_mg["moe/aux_loss"] > TOPK
    weights_equal(ref.export_weights(), mg.export_weights(), atol=TOL)


def test_routing_replay_routes_exactly_as_given(megatron_trainer, moe_dir) -> None:
    """Given experts (SGLang's routed_experts: every token but the last, per MoE layer) are
    the experts each router uses; tokens without them route freely; replaying a forward's own
    routing reproduces its log-probs bit for bit, and another routing changes them."""
    mg = megatron_trainer(moe_dir, train=train_cfg().model_copy(update={"moe": REPLAY}))
    batch = batch_of(n=3, seed=11)
    b, length = batch.input_ids.shape
    layers = len(mg.arch.moe_layer_ids)
    g = torch.Generator().manual_seed(0)
    routed = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK]
                          for _ in range(b * (length - 1) * layers)]).reshape(b, length - 1, layers, TOPK)
    free = mg.compute_logprobs(batch)
    batch.routed_experts = routed.reshape(b, length - 1, layers * TOPK).to(torch.int16)
    natural = [u.reshape(length, b, TOPK).transpose(0, 1) for u in mg.routing.used()]
    replayed = mg.compute_logprobs(batch)
    for layer, used in enumerate(mg.routing.used()):
        used = used.reshape(length, b, TOPK).transpose(0, 1)  # megatron's tokens: [S, B]
        assert torch.equal(used[:, :-1], routed[:, :, layer].long())
        assert torch.equal(used[:, -1], natural[layer][:, -1])  # not given: routed freely
    assert (replayed - free).abs().max() > 1e-3  # another routing, other log-probs
    batch.routed_experts = torch.stack(natural, dim=2)[:, :-1].reshape(b, length - 1, -1)
    assert torch.equal(mg.compute_logprobs(batch), free)  # its own routing: the same numbers
    # Training replays too, also when full recompute re-runs the routers in the backward pass
    # (a queue hands them their forward's experts): the last call is the last row's re-run.
    batch.routed_experts = routed.reshape(b, length - 1, layers * TOPK).to(torch.int16)
    batch.old_logp = replayed
    mg.shutdown()
    full = megatron_trainer(moe_dir, train=train_cfg(recompute="full").model_copy(
        update={"moe": REPLAY}))
    metrics = full.train_step(batch)  # mini-batches [0, 1] and [2]: one micro-batch each
    assert metrics["moe/replayed_tokens"] == 1.0  # every token that predicts one was given
    width = int(batch.attention_mask[2].sum())
    for layer, used in enumerate(full.routing.used()):
        assert torch.equal(used[: width - 1], routed[2, : width - 1, layer].long())
    assert all(not tap.queue for tap in full.routing.taps)


# --------------------------------------------------------------------- ranks on Ray


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("layout", [
    {"ep": 2},  # all-to-all dispatcher (the default)
    {"ep": 2, "moe_dispatcher": "allgather", "distributed_optimizer": True},
    # TP with sequence parallelism: attention split by heads, each rank routing its half of
    # the sequence to the (replicated) experts
    {"tp": 2, "sequence_parallel": True},
    # ... and the experts split over the same two ranks (EP across TP: "parallel folding")
    {"tp": 2, "sequence_parallel": True, "ep": 2},
], ids=["ep2-alltoall", "ep2-allgather-distopt", "tp2-sp", "tp2-sp-ep2"])  # fmt: skip
def test_expert_parallel_equals_one_rank(ranks, megatron_trainer, moe_dir, tmp_path,
                                         layout) -> None:
    batch = batch_of(n=9)
    one = megatron_trainer(moe_dir)
    want = one.compute_logprobs(batch)
    batch.old_logp = want
    m_one = one.train_step(batch)
    with ranks.group(moe_dir, train_cfg(**layout), ALGO, num_ranks=2, temperature=0.7,
                     timeout_s=180) as group:
        dp = 2 // layout.get("tp", 1)
        assert group._dp_size == dp and sum(group._reports) == dp
        batch2 = batch_of(n=9)
        assert (group.compute_logprobs(batch2) - want).abs().max() < TOL
        batch2.old_logp = want
        m_ep = group.train_step(batch2)
        for key in ("loss", "entropy", "grad_norm", *ROUTER_METRICS):
            assert m_ep[key] == pytest.approx(m_one[key], abs=TOL), key
        exported = group.export_weights()  # the experts of both EP ranks, full HF tensors
        assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == EXPERTS
        weights_equal(one.export_weights(), exported, atol=TOL)
        group.save_state(tmp_path / "ckpt")  # expert-sharded dist_checkpointing
        saved = group.export_weights()
        straight = group.train_step(batch2)
        after = group.export_weights()
        group.load_state(tmp_path / "ckpt")
        assert group.train_step(batch2)["loss"] == straight["loss"]
        weights_equal(after, group.export_weights())
    batch3 = batch_of(n=9)
    batch3.old_logp = want
    if layout.get("distributed_optimizer"):  # its format reshards across DP only
        other = megatron_trainer(moe_dir, distributed_optimizer=True)
        with pytest.raises(ValueError, match="resumes at the tp/pp/ep it was written at"):
            other.load_state(tmp_path / "ckpt")
        other.train_step(batch3)  # a fresh process resumes (at its own layout)
        other.save_state(tmp_path / "one")
        fresh = megatron_trainer(moe_dir, distributed_optimizer=True)
        fresh.load_state(tmp_path / "one")
        weights_equal(fresh.export_weights(), other.export_weights())
        assert fresh.train_step(batch3)["loss"] == other.train_step(batch3)["loss"]
        return
    # the checkpoint resumes on another layout (one rank: no TP, no EP), optimizer included
    other = megatron_trainer(moe_dir)
    other.load_state(tmp_path / "ckpt")
    weights_equal(other.export_weights(), saved)
    assert other.train_step(batch3)["loss"] == pytest.approx(straight["loss"], abs=TOL)
    weights_equal(other.export_weights(), after, atol=TOL)


def test_sequence_parallel_replays_and_balances_as_one_rank(ranks, megatron_trainer,
                                                            moe_dir) -> None:
    """Under TP=2 with sequence parallelism each rank routes half of the sequence: given
    experts are cut the same way (replayed log-probs and a replayed, load-balanced update
    equal one rank's), and the counts and the balance loss's ``f`` cover both halves."""
    moe = MoeConfig(routing_replay=True, aux_loss_coef=0.1)
    batch = batch_of(n=6, seed=5)
    b, length = batch.input_ids.shape
    g = torch.Generator().manual_seed(1)
    routed = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK]
                          for _ in range(b * (length - 1) * 2)]).reshape(b, length - 1, -1)
    batch.routed_experts = routed.to(torch.int16)
    one = megatron_trainer(moe_dir, train=train_cfg().model_copy(update={"moe": moe}))
    free = one.compute_logprobs(batch_of(n=6, seed=5))
    want = one.compute_logprobs(batch)
    assert (want - free).abs().max() > 1e-3  # the given routing changes the numbers
    batch.old_logp = want
    m_one = one.train_step(batch)
    with ranks.group(
        moe_dir, train_cfg(tp=2, sequence_parallel=True).model_copy(update={"moe": moe}), ALGO,
        num_ranks=2, temperature=0.7, timeout_s=180,
    ) as group:
        batch2 = batch_of(n=6, seed=5)
        batch2.routed_experts = routed.to(torch.int16)
        assert (group.compute_logprobs(batch2) - want).abs().max() < TOL
        batch2.old_logp = want
        m_sp = group.train_step(batch2)
        weights_equal(one.export_weights(), group.export_weights(), atol=TOL)
    assert m_sp["moe/replayed_tokens"] == m_one["moe/replayed_tokens"] == 1.0
    for key in ("loss", *ROUTER_METRICS):
        assert m_sp[key] == pytest.approx(m_one[key], abs=TOL), key
    # a norm of ~12 summed in another order (float32: a relative 2e-6 measured)
    assert m_sp["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-5)
