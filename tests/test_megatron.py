"""The megatron-core backend computes what the torch backend computes.

- HF <-> megatron conversion round-trips bit for bit for Qwen2 (tied and untied), Llama and
  Qwen3 at TP 1/2 and PP 1/2 (pure tensor code, no process group).
- In this process (one rank, gloo, as ``cluster.mode: local`` runs it): per-token log-probs
  equal the torch backend's to 1e-5, one GRPO update gives the same loss and parameters, the
  reference policy for the KL term, ``save_pretrained`` loads back into transformers, and a
  ``dist_checkpointing`` save/load resumes training identically.
- On Ray ranks over gloo: TP=2, PP=2, DP=2 with the distributed optimizer, and TP=2 with
  full activation recompute equal the torch backend (log-probs, the update);
  TP=2 and distributed-optimizer checkpoints resume identically.

float32 throughout, lr 1e-4 (the demo's): Adam divides by sqrt(v), so a gradient at
float-rounding level (~1e-10, where the two backends may even differ in sign) moves a weight
by up to ~2% of the lr; at lr 1e-3 that alone reaches 2e-5, beyond the 1e-5 bound, without
either side being wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PAD_ID, make_batch, tiny_qwen2
from rank_pool import kept_ranks  # noqa: F401 - the module-scoped `ranks` fixture

from rl_core.config import AlgorithmConfig, ConfigError, MegatronConfig, TrainConfig, load_config
from rl_core.training.megatron.convert import hf_to_mcore, mcore_to_hf, merge_tp
from rl_core.training.megatron.model import arch_from_hf
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
ALGO = AlgorithmConfig(entropy_coef=0.01, clip_high=0.28)


def batch_of(n: int = 8, seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(3, 64, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts = [ids(2, 6) for _ in range(n)]
    responses = [ids(1, 9) for _ in range(n)]
    logps = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    return make_batch(prompts, responses, logps, torch.randn(n, generator=g), PAD_ID)


def train_cfg(backend: str = "megatron", **megatron) -> TrainConfig:
    """Both backends: the same update (two mini-batches of micro-batches of 3 rows)."""
    return TrainConfig(
        lr=1e-4, steps=10, micro_batch_size=3, mini_batches=2, backend=backend,
        megatron=MegatronConfig(**megatron),
    )  # fmt: skip


def weights_equal(a: dict, b: dict, atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


# ------------------------------------------------------------------ conversion (no groups)


def _hf_models() -> dict[str, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return {
        "qwen2": tiny_qwen2(0),
        "qwen2-tied": tiny_qwen2(1, tie=True),
        "llama": LlamaForCausalLM(LlamaConfig(**common)),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)),
    }


@pytest.fixture(scope="module")
def hf_models() -> dict[str, torch.nn.Module]:
    return _hf_models()


@pytest.mark.parametrize("kind", ["qwen2", "qwen2-tied", "llama", "qwen3"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_hf_round_trips_bit_exactly(hf_models, kind: str, tp: int, pp: int) -> None:
    model = hf_models[kind]
    arch = arch_from_hf(model.config)
    hf = model.state_dict()
    vocab = arch.padded_vocab(tp, 128)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [
            hf_to_mcore(hf, arch, padded_vocab=vocab, tp_rank=r, tp=tp, pp_rank=stage, pp=pp)
            for r in range(tp)
        ]
        merged = {name: merge_tp(name, [s[name] for s in shards]) for name in shards[0]}
        back.update(mcore_to_hf(merged, arch, pp_rank=stage, pp=pp))
    weights_equal(hf, back)  # atol 0: bit-exact


def test_architectures_and_their_errors(hf_models) -> None:
    arch = arch_from_hf(hf_models["qwen3"].config)
    assert (arch.qk_norm, arch.qkv_bias, arch.head_dim) == (True, False, 16)
    assert arch_from_hf(hf_models["qwen2"].config).qkv_bias
    assert not arch_from_hf(hf_models["llama"].config).qkv_bias
    with pytest.raises(ValueError, match=r"train\.megatron\.tp=3 must divide"):
        arch.check_parallel(3, 1)
    with pytest.raises(ValueError, match=r"train\.megatron\.pp=4 must divide the number of layers"):
        arch.check_parallel(1, 4)
    from transformers import MixtralConfig

    with pytest.raises(ValueError, match="mixture-of-experts model the megatron backend does not map"):
        arch_from_hf(MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4))


def test_config_checks_the_layout_against_the_ranks() -> None:
    demo = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    cfg = load_config(demo, ["train.backend=megatron", "cluster.mode=ray",
                             "cluster.trainer_ranks=4", "train.megatron.tp=2"])  # fmt: skip
    assert cfg.train.megatron.tp == 2
    cases = {
        "train.megatron.tp=2": "use cluster.mode=ray with cluster.trainer_ranks",
        "cluster.mode=ray cluster.trainer_ranks=3 train.megatron.tp=2": "must divide",
        "cluster.mode=ray cluster.trainer_ranks=4 train.megatron.tp=2 train.megatron.dp=1":
            "leave train.megatron.dp unset",
        "train.megatron.sequence_parallel=true": r"needs train\.megatron\.tp > 1",
    }  # fmt: skip
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(demo, ["train.backend=megatron", *overrides.split()])


def test_auto_layout_is_the_planners() -> None:
    from rl_core.training.megatron.layout import resolve_layout

    demo = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    auto = ["train.backend=megatron", "train.megatron.tp=auto", "train.megatron.pp=auto"]
    local = load_config(demo, auto)
    layout, how = resolve_layout(local, "qwen2.5-0.5b", device="cpu")
    assert (layout.tp, layout.pp) == (1, 1) and "planner" in how
    # 32B on 16 x A100-40GB: FSDP does not fit, megatron TP 8 x PP 2 does (grpoflow plan).
    big = ["cluster.mode=ray", "cluster.trainer_ranks=16", "train.prompts_per_step=32",
           "rollout.n_samples=8", "rollout.max_new_tokens=1024", "data.max_prompt_tokens=256"]  # fmt: skip
    layout, how = resolve_layout(load_config(demo, auto + big), "qwen2.5-32b", device="a100-40gb")
    assert (layout.tp, layout.pp) == (8, 2), how
    assert "tp=8, pp=2, dp=1" in how
    explicit = load_config(demo, [*auto, *big, "train.megatron.tp=4"])
    layout, _ = resolve_layout(explicit, "qwen2.5-32b", device="a100-40gb")
    assert (layout.tp, layout.pp) == (4, 2)  # an explicit value wins
    fixed = load_config(demo, ["train.backend=megatron"])
    assert resolve_layout(fixed, "qwen2.5-0.5b") == (fixed.train.megatron, None)


# --------------------------------------------------------------- one rank, this process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-untied")
    tiny_qwen2(0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2-tied")
    tiny_qwen2(1, tie=True).save_pretrained(path)
    return path


@pytest.fixture
def megatron_trainer():
    """Make in-process MegatronTrainers; each is shut down (its process group too) after."""
    from rl_core.training.megatron import MegatronTrainer

    made = []

    def make(path: Path, algo: AlgorithmConfig = ALGO, **megatron) -> MegatronTrainer:
        trainer = MegatronTrainer(path, train_cfg(**megatron), algo, temperature=0.7)
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.shutdown()


def torch_trainer(path: Path, algo: AlgorithmConfig = ALGO) -> TorchTrainer:
    return TorchTrainer(path, train_cfg("torch"), algo, temperature=0.7)


@pytest.mark.parametrize("tied", [False, True])
def test_one_rank_equals_the_torch_backend(megatron_trainer, model_dir, tied_dir, tied) -> None:
    path = tied_dir if tied else model_dir
    batch = batch_of()
    ref, mg = torch_trainer(path), megatron_trainer(path)
    assert mg.needs_old_logp == ref.needs_old_logp
    want, got = ref.compute_logprobs(batch), mg.compute_logprobs(batch)
    assert (got - want).abs().max() < TOL
    assert torch.equal(got == 0, want == 0)  # zero exactly outside the responses
    batch.old_logp = want
    m_ref, m_mg = ref.train_step(batch), mg.train_step(batch)
    for key in ("loss", "pg_loss", "entropy", "clip_frac", "ratio_mean", "grad_norm", "lr"):
        assert m_mg[key] == pytest.approx(m_ref[key], abs=TOL), key
    assert mg.global_step == ref.global_step == 2
    weights_equal(ref.export_weights(), mg.export_weights(), atol=TOL)


def test_rollout_corrections_reach_the_megatron_loss(megatron_trainer, model_dir) -> None:
    """MIS, IcePop and sequence masking act the same in both backends (one shared loss)."""
    algo = AlgorithmConfig(clip_high=0.28, tis_cap=1.5, tis_mode="mask", icepop_low=0.5,
                           icepop_high=2.0, seq_mask_threshold=1.0)  # fmt: skip
    batch = batch_of(seed=7)
    ref, mg = torch_trainer(model_dir, algo), megatron_trainer(model_dir, algo)
    assert mg.needs_old_logp == ref.needs_old_logp
    batch.old_logp = ref.compute_logprobs(batch)
    noise = 0.6 * torch.randn(batch.old_logp.shape, generator=torch.Generator().manual_seed(0))
    batch.rollout_logp = torch.where(batch.response_mask, batch.old_logp + noise, 0.0)
    m_ref, m_mg = ref.train_step(batch), mg.train_step(batch)
    for key in ("loss", "tis_mean", "mis_masked_token_frac", "icepop_masked_token_frac",
                "seq_masked_sample_frac", "grad_norm"):  # fmt: skip
        assert m_mg[key] == pytest.approx(m_ref[key], abs=TOL), key
    assert 0 < m_ref["icepop_masked_token_frac"] < 1 and m_ref["mis_masked_token_frac"] > 0
    weights_equal(ref.export_weights(), mg.export_weights(), atol=TOL)


def test_reference_policy_and_hf_export(megatron_trainer, model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    algo = AlgorithmConfig(kl_coef=0.01)
    batch = batch_of(seed=3)
    ref, mg = torch_trainer(model_dir, algo), megatron_trainer(model_dir, algo)
    assert mg.has_ref_model
    before = mg.compute_logprobs(batch, reference=True)
    batch.ref_logp = ref.compute_logprobs(batch, reference=True)
    assert (before - batch.ref_logp).abs().max() < TOL
    m_ref, m_mg = ref.train_step(batch), mg.train_step(batch)
    assert m_mg["kl"] == pytest.approx(m_ref["kl"], abs=TOL)
    assert torch.equal(mg.compute_logprobs(batch, reference=True), before)  # frozen
    out = mg.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    weights_equal(mg.export_weights(), {k: v for k, v in loaded.state_dict().items()})


def test_checkpoint_resumes_training_identically(megatron_trainer, model_dir, tmp_path) -> None:
    batch = batch_of(seed=5)
    first = megatron_trainer(model_dir)
    first.train_step(batch)
    first.save_state(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model" / "model.safetensors").exists()
    straight = first.train_step(batch)
    want = first.export_weights()
    first.shutdown()
    second = megatron_trainer(model_dir)
    second.load_state(tmp_path / "ckpt")
    assert second.global_step == 2
    resumed = second.train_step(batch)
    assert resumed["loss"] == straight["loss"]
    weights_equal(want, second.export_weights())  # exactly: same state, same arithmetic


def test_bf16_trains_and_checkpoints(model_dir, tmp_path) -> None:
    """bf16 weights (megatron's Float16Module, fp32 main weights in the optimizer) on CPU."""
    from rl_core.training.megatron import MegatronTrainer

    batch = batch_of(seed=7)
    mg = MegatronTrainer(model_dir, train_cfg(), ALGO, temperature=0.7, dtype="bfloat16")
    try:
        ref = TorchTrainer(model_dir, train_cfg("torch"), ALGO, temperature=0.7, dtype="bfloat16")
        # bf16 keeps ~3 significant digits: the backends' op orders differ at that level
        assert (mg.compute_logprobs(batch) - ref.compute_logprobs(batch)).abs().max() < 0.1
        assert mg.train_step(batch)["loss"] == pytest.approx(ref.train_step(batch)["loss"], abs=1e-3)
        weights = mg.export_weights()
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}
        mg.save_state(tmp_path / "ckpt")  # no spawned queue server: see _in_process_results_queue
        mg.load_state(tmp_path / "ckpt")
        weights_equal(weights, mg.export_weights())
    finally:
        mg.shutdown()


def test_a_torch_checkpoint_is_refused_with_the_fix(megatron_trainer, model_dir, tmp_path) -> None:
    torch_trainer(model_dir).save_state(tmp_path / "torch-ckpt")
    with pytest.raises(FileNotFoundError, match="resume it with train.backend=torch"):
        megatron_trainer(model_dir).load_state(tmp_path / "torch-ckpt")


# --------------------------------------------------------------------- ranks on Ray


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False)
    yield
    ray.shutdown()


def start_group(pool, path: Path, **megatron):
    """A two-rank group on the pool's processes (released or shut down at the block's end)."""
    return pool.group(path, train_cfg(**megatron), ALGO, num_ranks=2, temperature=0.7,
                      timeout_s=180)


LAYOUTS = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    # two data-parallel replicas, ZeRO-1: the optimizer state sharded across them
    "dp2-distributed-optimizer": {"distributed_optimizer": True},
    # full activation recompute changes memory and time, not numbers
    "tp2-recompute": {"tp": 2, "recompute": "full"},
    # sequence parallelism: norms on half the sequence each, weights' gradients summed
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_ranks_equal_the_torch_backend(ranks, tied_dir, tmp_path, layout) -> None:
    batch = batch_of(n=9)
    ref = torch_trainer(tied_dir)
    megatron = LAYOUTS[layout]
    tp = megatron.get("tp", 1)
    with start_group(ranks, tied_dir, **megatron) as group:
        dp = 2 // (tp * megatron.get("pp", 1))
        assert group._dp_size == dp and sum(group._reports) == dp
        want = ref.compute_logprobs(batch)
        assert (group.compute_logprobs(batch) - want).abs().max() < TOL
        batch.old_logp = want
        m_ref, m_mg = ref.train_step(batch), group.train_step(batch)
        for key in ("loss", "entropy", "grad_norm"):
            assert m_mg[key] == pytest.approx(m_ref[key], abs=TOL), key
        weights_equal(ref.export_weights(), group.export_weights(), atol=TOL)
        if layout in ("tp2", "dp2-distributed-optimizer", "tp2-sp"):  # checkpoints resume
            group.save_state(tmp_path / "ckpt")
            straight = group.train_step(batch)
            after = group.export_weights()
            group.load_state(tmp_path / "ckpt")
            assert group.train_step(batch)["loss"] == straight["loss"]
            weights_equal(after, group.export_weights())
