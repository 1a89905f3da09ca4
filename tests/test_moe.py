"""Mixture-of-experts models end to end on CPU (issue 24, the torch side): HF round trips,
generation and SGLang's ``return_routed_experts`` on the embedded engine (both KV layouts,
in-process and over HTTP), routing replay (R3) in the torch trainer (the replayed forward
routes exactly as the rollout did; the rollout/train log-prob mismatch of a bfloat16 engine
drops), router metrics and the load-balancing loss, and the record through Batch, pickling
and the stream's JSON checkpoint rows.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EOS_ID, PAD_ID, TINY_VOCAB, tiny_tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig

from rl_core.config import AlgorithmConfig, ConfigError, TrainConfig, load_config
from rl_core.engine.core import EmbeddedEngine, EngineRequestError, GenerateRequest
from rl_core.engine.sampling import SamplingParams
from rl_core.models import read_weights
from rl_core.models.moe import RouterTap, build_tiny_moe, moe_dims, routers
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.stream import Group, _extend
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch, Sample, decode_routed_experts

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]


def save_moe(path: Path, arch: str = "qwen3_moe", *, experts: int = 4, seed: int = 0) -> Path:
    """A random tiny MoE model (weights wide enough for peaked routing) + tokenizer."""
    model = build_tiny_moe(arch, vocab_size=TINY_VOCAB, hidden_size=32, layers=2, heads=4,
                           kv_heads=2, experts=experts, experts_per_token=2,
                           moe_intermediate_size=16, max_position_embeddings=256,
                           bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_moe(tmp_path_factory.mktemp("moe") / "qwen3")


def _routing(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """(len(seq), layers, top_k): the model's own routing of ``seq`` (a full forward)."""
    with RouterTap(model) as tap, torch.no_grad():
        model(input_ids=torch.tensor([seq]))
        return tap.indices()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_hf_round_trip_is_exact(tmp_path, arch):
    path = save_moe(tmp_path / arch, arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    again = tmp_path / "again"
    model.save_pretrained(again)
    back = AutoModelForCausalLM.from_pretrained(again)
    own = model.state_dict()
    assert moe_dims(model) == (2, 2, 4)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in own.items())
    # read_weights fuses the checkpoint's per-expert tensors the way transformers does
    disk = read_weights(again)
    assert set(disk) == set(own) - {"lm_head.weight"}  # tied
    assert all(torch.equal(v, own[k]) for k, v in disk.items())
    ids = torch.tensor([PROMPTS[2]])
    assert torch.equal(model(input_ids=ids).logits, back(input_ids=ids).logits)


@pytest.mark.parametrize("layout", ["slots", "padded"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_engine_returns_the_routing_its_tokens_took(moe_dir, layout, arch):
    if arch != "qwen3_moe":
        moe_dir = save_moe(moe_dir.parent / arch, arch)
    ref = AutoModelForCausalLM.from_pretrained(moe_dir).eval()
    ref.set_experts_implementation("eager")
    with EmbeddedEngine(moe_dir, kv_layout=layout, background=False) as eng:
        assert eng.kv_layout == layout
        reqs = [GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=10, seed=i),
                                return_logprob=True, return_routed_experts=i != 1)
                for i, p in enumerate(PROMPTS)]
        outs = eng.generate_sync(reqs)
    assert outs[1].routed_experts is None  # not asked for
    for p, o in zip(PROMPTS, outs, strict=True):
        seq = p + o.output_ids
        want = _routing(ref, seq)[: len(seq) - 1]  # the last token is never run
        logits = ref(input_ids=torch.tensor([seq])).logits[0, len(p) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(o.output_ids)[:, None])
        assert o.output_logprobs == pytest.approx(logp[:, 0].tolist(), abs=1e-5)
        if o.routed_experts is not None:  # prefill rows, then one per decode step, exactly
            got = decode_routed_experts(o.routed_experts).reshape(-1, 2, 2)
            np.testing.assert_array_equal(got, want.numpy())


def test_routed_experts_over_http_into_the_sample(moe_dir):
    from engine_helpers import save_tiny_model

    from rl_core.engine.server import ServerThread, create_app
    from rl_core.rollout.client import SyncSGLangClient

    with EmbeddedEngine(moe_dir) as eng:
        server = ServerThread(create_app(eng)).start()
        try:
            with SyncSGLangClient(server.url) as client:
                params = {"max_new_tokens": 6, "sampling_seed": 3}
                one = client.generate(PROMPTS[0], params, return_routed_experts=True)
                batch = client.generate_batch(PROMPTS[:2], params, return_routed_experts=True)
                plain = client.generate(PROMPTS[0], params)
        finally:
            server.stop()
    for s in [one, *batch]:
        rows = len(s.prompt_ids) + len(s.completion_ids) - 1
        assert decode_routed_experts(s.routed_experts).shape == (rows * 2 * 2,)
        assert "routed_experts" not in s.meta  # one copy, in the field
    assert one.routed_experts == batch[0].routed_experts  # same seed, same tokens, same routes
    assert plain.routed_experts is None and plain.completion_ids == one.completion_ids
    # a dense model refuses the field (the server answers 400 with this message)
    with EmbeddedEngine(save_tiny_model(moe_dir.parent / "dense")) as eng, pytest.raises(
            EngineRequestError, match="mixture-of-experts"):
        eng.generate_sync([GenerateRequest("d", [5, 6], return_routed_experts=True)])


def _samples(plane: InProcessPlane, n: int = 2, tokens: int = 12,
             prompts: list[list[int]] = PROMPTS) -> list[Sample]:
    prompts = [p for p in prompts for _ in range(n)]
    params = [SamplingParams(max_new_tokens=tokens, seed=i) for i in range(len(prompts))]
    return plane.generate(prompts, params)


def _trainer(path: Path, replay: bool, **train: object) -> TorchTrainer:
    cfg = TrainConfig(lr=1e-2, moe={"routing_replay": replay, "aux_loss_coef": 0.01}, **train)
    return TorchTrainer(path, cfg, AlgorithmConfig())


@pytest.mark.parametrize("pack", [False, True])
def test_replayed_forward_routes_exactly_as_the_rollout(moe_dir, pack):
    plane = InProcessPlane(moe_dir, routed_experts=True, dtype="bfloat16")
    # packed: long shared prompts, short completions (where packing is the cheaper layout)
    prompts = [list(range(3 + k, 40 + k)) for k in range(2)] if pack else PROMPTS
    try:
        samples = _samples(plane, n=4, tokens=4 if pack else 12, prompts=prompts)
    finally:
        plane.close()
    batch = Batch.from_samples(samples, [1.0, -1.0] * (len(samples) // 2), PAD_ID)
    assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.int16
    trainer = _trainer(moe_dir, replay=True, pack_groups=pack)
    trainer.compute_logprobs(batch)  # the trainer hooks its routers at its first forward
    with RouterTap(trainer.model) as tap:  # after the trainer's own hooks: sees what was used
        trainer.compute_logprobs(batch)
        used = tap.indices()
    b, cols, _ = batch.routed_experts.shape
    if not pack:
        used = used.view(b, cols + 1, 2, 2)[:, :-1]
        rollout = batch.routed_experts.view(b, cols, 2, 2)
        real = batch.attention_mask[:, 1:]
        assert torch.equal(used[real].long(), rollout[real].long())
    else:  # packed rows: every recorded token routes as its rollout did
        from rl_core.training.packing import plan_packing

        cfg = trainer.model.config
        plan = plan_packing(batch.input_ids.long(), batch.attention_mask, batch.prompt_lens,
                            params=trainer._n_params, layers=cfg.num_hidden_layers,
                            hidden=cfg.hidden_size)
        assert plan is not None
        real = batch.attention_mask[:, 1:]
        got = used.view(-1, 2, 2)[plan.src[real]]
        want = batch.routed_experts.view(b, cols, 2, 2)[real]
        assert torch.equal(got.long(), want.long())


def test_replay_cuts_the_mismatch_of_bfloat16_planes(tmp_path):
    """The realistic mismatch source: both planes compute in bfloat16 (SGLang's and the
    trainer's kernels on GPUs), with different kernels and batch shapes (here: the engine's
    packed prefill and KV-cached decode against the trainer's padded full forward). Rounding
    then tips near-tied router scores to other experts, and those tokens' log-probs move far
    more than rounding alone moves them; replayed, no token routes differently."""
    path = save_moe(tmp_path / "m8", experts=8, seed=1)
    plane = InProcessPlane(path, routed_experts=True, dtype="bfloat16")
    try:
        samples = _samples(plane, n=4, tokens=16)
    finally:
        plane.close()
    batch = Batch.from_samples(samples, [0.0] * len(samples), PAD_ID)
    b, cols, _ = batch.routed_experts.shape
    real = batch.attention_mask[:, 1:]
    rollout = batch.routed_experts.view(b, cols, 2, 2).long().sort(-1).values
    gaps, flips = {}, {}
    for replay in (False, True):
        trainer = TorchTrainer(path, TrainConfig(moe={"routing_replay": replay}),
                               AlgorithmConfig(), dtype="bfloat16")
        trainer.compute_logprobs(batch)
        with RouterTap(trainer.model) as tap:
            logp = trainer.compute_logprobs(batch)
            used = tap.indices().view(b, cols + 1, 2, 2)[:, :-1].long().sort(-1).values
        flips[replay] = int((used != rollout)[real].any(-1).sum())
        gaps[replay] = (logp - batch.rollout_logp)[batch.response_mask].abs()
    assert flips[False] > 0 and flips[True] == 0, flips
    assert gaps[True].mean() < gaps[False].mean() and gaps[True].max() < 0.5 * gaps[False].max()


def test_train_step_reports_router_metrics_and_trains_the_router(moe_dir):
    plane = InProcessPlane(moe_dir, routed_experts=True)
    try:
        samples = _samples(plane)
    finally:
        plane.close()
    batch = Batch.from_samples(samples, [1.0, -1.0] * len(PROMPTS), PAD_ID)
    trainer = _trainer(moe_dir, replay=True, micro_batch_size=3)
    before = trainer.model.model.layers[0].mlp.gate.weight.detach().clone()
    metrics = trainer.train_step(batch)
    assert metrics["moe/replayed_tokens"] == 1.0
    for key in ("moe/load_max_over_mean", "moe/load_cv", "moe/router_entropy", "moe/aux_loss"):
        assert np.isfinite(metrics[key]), key
    assert 1.0 <= metrics["moe/load_max_over_mean"] <= 4 / 2  # at most E / k
    assert 0.0 < metrics["moe/router_entropy"] <= np.log(4) + 1e-6
    assert not torch.equal(before, trainer.model.model.layers[0].mlp.gate.weight)


def test_aux_loss_is_transformers_load_balancing_loss(moe_dir):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from rl_core.models.moe import router_metrics

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    ids = torch.tensor([PROMPTS[2], PROMPTS[0] + [PAD_ID] * 3])
    mask = (ids != PAD_ID).long()
    with RouterTap(model, keep_logits=True) as tap:
        model(input_ids=ids, attention_mask=mask)
        aux, metrics = router_metrics(tap.logits, tap.indices(), mask.bool().reshape(-1),
                                      per_layer=True)
    want = load_balancing_loss_func(tuple(tap.logits), 4, 2, mask)
    torch.testing.assert_close(aux, want)
    assert aux.requires_grad and metrics["moe/aux_loss"] == pytest.approx(float(want.detach()))
    assert metrics["moe/load_cv"] == pytest.approx(
        (metrics["moe/load_cv_l0"] + metrics["moe/load_cv_l1"]) / 2)


def test_replay_needs_an_moe_model(tmp_path):
    from engine_helpers import save_tiny_model

    with pytest.raises(ConfigError, match="train.moe.routing_replay"):
        load_config(None, ["train.moe.routing_replay=true"])
    load_config(None, ["train.moe.routing_replay=true", "model.tiny_arch=qwen3_moe"])
    load_config(ROOT / "configs" / "agent-calculator.yaml",  # episodes carry routing too
                ["train.moe.routing_replay=true", "model.tiny_arch=qwen3_moe"])
    dense = save_tiny_model(tmp_path / "dense")
    with pytest.raises(ConfigError, match="train.moe.routing_replay=true"):
        _trainer(dense, replay=True)
    assert _trainer(dense, replay=False).moe is None


def test_the_record_survives_batches_pickling_and_stream_rows():
    full = np.arange(9 * 4).reshape(9, 2, 2)
    from rl_core.types import encode_routed_experts

    s = Sample([1, 2, 3], [4, 5], [-0.1, -0.2], {"type": "abort"}, uid="1:a:0", versions=[0, 0],
               routed_experts=encode_routed_experts(full[:4]))
    # a partial rollout's next segment re-ran the prefix: its routing covers everything
    seg = Sample([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [-0.3] * 5, {"type": "stop", "matched": 10},
                 weight_version=1, routed_experts=encode_routed_experts(full))
    _extend(s, seg, 8, 1)
    assert s.routed_experts == seg.routed_experts and len(s.completion_ids) == 7
    _extend(s, Sample([1], [], [], {"type": "abort"}, weight_version=2), 8, 2)  # nothing new
    assert s.routed_experts == seg.routed_experts
    assert pickle.loads(pickle.dumps(s)).routed_experts == s.routed_experts  # Ray's transfer
    row = json.loads(json.dumps(Group(0, 1, 0, [s], [7]).row()))  # the stream's checkpoint
    assert Group.from_row(row).samples[0].routed_experts == s.routed_experts
    batch = Batch.from_samples([s, Sample([1, 2], [3], [-0.5])], [1.0, 1.0], PAD_ID)
    assert batch.routed_experts.shape == (2, 9, 4)
    assert torch.equal(batch.routed_experts[0], torch.from_numpy(full.reshape(9, 4)).short())
    assert (batch.routed_experts[1] == -1).all()
    assert torch.equal(batch.select(torch.tensor([0])).routed_experts, batch.routed_experts[:1])
    with pytest.raises(ValueError, match="routed_experts holds"):
        Batch.from_samples([Sample([1], [2, 3, 4, 5, 6], [0.0] * 5,
                                   routed_experts=s.routed_experts)], [1.0], PAD_ID)


# ---------------------------------------------------------------------------- the flow


def _moe_demo_dir(path: Path) -> Path:
    """A random tiny Qwen3-MoE over the demo's tokenizer (the synthetic task's text)."""
    from rl_core.data.synthetic import generate_splits
    from rl_core.models.tiny import build_tokenizer

    train, _ = generate_splits(400, 10, seed=0, digits=(1, 1), operations=("+", "-"),
                               steps=(1, 2))
    tok = build_tokenizer([f"user\n{r.question}\nassistant\n{r.answer}" for r in train], 256)
    model = build_tiny_moe("qwen3_moe", vocab_size=len(tok), hidden_size=32, layers=2, heads=4,
                           kv_heads=2, experts=4, experts_per_token=2, moe_intermediate_size=32,
                           max_position_embeddings=512, bos_token_id=None,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(
        path)
    return path


def test_moe_grpo_flow_with_replay_syncs_checkpoints_and_resumes(prefect_harness, tiny_cache,
                                                                 tmp_path):
    """Three steps with routing replay on the HTTP plane: every step's disk sync is verified
    by the engine's checksum of the (fused) expert weights, the router metrics reach MLflow,
    the registry holds the MoE model, and a run resumed from step 2 ends with the same
    weights (expert tensors included)."""
    from engine_helpers import run_demo_flow
    from safetensors.torch import load_file

    from tasks.tracking.registry import registry_client

    model = _moe_demo_dir(tmp_path / "moe-init")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [f"model.path={model}", "rollout.engine=embedded", "train.moe.routing_replay=true", "train.moe.aux_loss_coef=0.1",
            "train.lr=1e-2", "train.steps=3", "checkpoint.every=2", "train.prompts_per_step=4",
            "rollout.max_new_tokens=8"]
    first = run_demo_flow(tmp_path, tiny_cache, "first", *args, "tracking.backend=mlflow",
                          f"tracking.uri={uri}", "tracking.system_metrics=false")
    run = Path(first["run_dir"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "moe/load_cv" in r]
    assert len(trained) == 3 and all(r["sync_bytes"] > 0 for r in trained)
    assert all(r["moe/replayed_tokens"] == 1.0 for r in trained)  # every token, over HTTP
    client = registry_client(uri)
    history = client.get_metric_history(first["tracking"]["run_id"], "moe/router_entropy")
    assert len(history) == 3
    mv = client.get_model_version(first["tracking"]["registered_model"],
                                  first["tracking"]["version"])
    assert mv.source
    final = load_file(Path(first["model_dir"]) / "model.safetensors")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in final  # the HF layout on disk
    start = load_file(model / "model.safetensors")
    assert not torch.equal(final["model.layers.0.mlp.gate.weight"],
                           start["model.layers.0.mlp.gate.weight"])
    ckpt = run / "checkpoints" / "step-000002"
    import shutil

    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / "step-000002")
    resumed = run_demo_flow(tmp_path, tiny_cache, "resumed", *args, resume="always")
    again = load_file(Path(resumed["model_dir"]) / "model.safetensors")
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)


def test_the_demo_config_builds_a_tiny_qwen3_moe():
    import hashlib
    from dataclasses import asdict, replace

    from rl_core.models.hub import tiny_spec_for
    from rl_core.models.tiny import TinyModelSpec, build_model, build_tokenizer

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "tiny-moe-cpu.yaml")
    assert cfg.train.moe.routing_replay
    spec = tiny_spec_for(cfg.model, cfg.data)
    assert (spec.arch, spec.experts, spec.experts_per_token) == ("qwen3_moe", 8, 2)
    assert spec.digest() != replace(spec, arch="qwen2_moe").digest()
    dense = {k: v for k, v in asdict(TinyModelSpec()).items()  # cached dense models stay valid
             if k not in ("arch", "experts", "experts_per_token", "moe_intermediate_size",
                          "tool_demos", "long_frac", "long_steps")}
    want = hashlib.sha256(json.dumps(dense, sort_keys=True).encode()).hexdigest()[:12]
    assert TinyModelSpec().digest() == want
    tok = build_tokenizer(["user\n1 + 2 = ?\nassistant\n#### 3"], 300)
    model = build_model(spec, tok)
    assert model.config.model_type == "qwen3_moe" and moe_dims(model) == (4, 2, 8)
    assert model.config.norm_topk_prob and model.config.tie_word_embeddings


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_broadcast_sends_experts_by_checkpoint_name_and_the_engine_holds_them(
        moe_dir: Path, tmp_path: Path, arch: str) -> None:
    """``weight_sync: distributed`` sends every expert as its own tensor, by the checkpoint
    names SGLang's loader takes (not transformers' fused runtime names), in buckets that
    cut layers' experts apart; the embedded engine (its own process, over HTTP) copies each
    into its expert's slice, reports the trainer's checksum, and samples what the trainer's
    weights sample."""
    from rl_core.rollout.http import HttpPlane
    from rl_core.rollout.launch import embedded_engine_command
    from rl_core.rollout.pool import EnginePool
    from rl_core.weight_sync import sync_weights
    from rl_core.weight_sync.broadcast import BroadcastSync
    from rl_core.weight_sync.checksum import weights_checksum

    if arch != "qwen3_moe":
        moe_dir = save_moe(tmp_path / arch, arch)
    trainer = _trainer(moe_dir, replay=False)
    with torch.no_grad():  # the trainer's weights differ from what the engine loaded
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    layout = trainer.weight_layout()
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in layout)
    assert layout["model.layers.1.mlp.experts.3.up_proj.weight"] == ("float32", [16, 32])
    pool = EnginePool(embedded_engine_command(moe_dir, num_threads=1), 1,
                      log_dir=tmp_path / "engines", router=False, startup_timeout_s=120)
    plane = HttpPlane(pool, request_batch_size=4, weight_sync_timeout_s=60)
    sync = BroadcastSync(plane, "gloo", 60, 4 * 16 * 32 * 5)  # five experts' tensors a bucket
    plane.start()
    try:
        sync_weights(trainer, plane, sync, 1)  # verifies the engine's checksum
        assert sync.num_buckets > 4
        url = pool.engine_urls[0]
        assert pool.client.weights_checksum(url=url) == weights_checksum(trainer.export_weights())
        params = SamplingParams(max_new_tokens=6, temperature=0.0)
        outs = plane.generate(PROMPTS, params)
    finally:
        sync.close()
        plane.close()
        trainer.close_weight_broadcast()
    ref = trainer.model.eval()
    for prompt, sample in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=6, do_sample=False,
                                attention_mask=torch.ones_like(ids))[0, len(prompt):]
        assert sample.completion_ids == want.tolist()[:len(sample.completion_ids)]


def test_an_expert_slice_of_the_wrong_shape_or_index_loads_nothing(moe_dir: Path) -> None:
    """Per-expert names are checked like any other: an unknown expert or a wrong shape fails
    the update with nothing loaded."""
    with EmbeddedEngine(moe_dir, background=False) as eng:
        before = eng.checksum()
        good = torch.zeros(16, 32)
        for named, match in (
                ({"model.layers.0.mlp.experts.4.gate_proj.weight": good}, "unknown names"),
                ({"model.layers.0.mlp.experts.0.down_proj.weight": good}, "shape mismatches")):
            with pytest.raises(EngineRequestError, match=match):
                eng.update_weights_from_tensors(
                    {"model.layers.0.mlp.experts.1.up_proj.weight": good, **named})
        assert eng.checksum() == before
        eng.update_weights_from_tensors({"model.layers.0.mlp.experts.1.up_proj.weight": good})
        fused = eng._weights.named()["model.layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(fused[1, 16:], good) and fused[1, :16].abs().sum() > 0


def test_agent_episodes_carry_the_routing_of_every_token(tmp_path: Path) -> None:
    """A multi-turn episode's sample carries its last model turn's routing (that request
    held every earlier token: the prompt, the model's turns, the observations), which is
    exactly the routing of one forward over the whole episode; the episode then replays."""
    from test_agents import TASKS, CountdownEnv
    from test_agents_openai import multi_turn

    from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner
    from rl_core.agents.gateway import AgentGateway
    from rl_core.agents.programs import run_programs

    model_dir = _moe_demo_dir(tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # peaked routing: no near-ties between engine and reference
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(model_dir)
    from transformers import AutoTokenizer

    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))
    plane = InProcessPlane(model_dir, routed_experts=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    limits = EpisodeLimits(max_turns=4, max_tokens=200)
    try:
        samples = EpisodeRunner(plane, chat, lambda: CountdownEnv(turns=3), limits,
                                retries=0).run(TASKS[:2], n=2, params=params, step=1, seed=0)
        with AgentGateway(plane, chat) as gateway:  # OpenAI-speaking programs
            programs = run_programs(gateway, multi_turn(turns=2), TASKS[:2], n=1,
                                    params=params, step=1, seed=0, limits=limits, retries=0)
    finally:
        plane.close()
    ref = model.eval()
    ref.set_experts_implementation("eager")
    for s in samples + programs:
        assert s.meta["episode"]["turns"] >= 2 and 0 in s.loss_mask  # observations inside
        seq = s.prompt_ids + s.completion_ids
        got = decode_routed_experts(s.routed_experts).reshape(len(seq) - 1, 2, 2)
        np.testing.assert_array_equal(got, _routing(ref, seq)[: len(seq) - 1].numpy())
    trainer = _trainer(model_dir, replay=True)
    batch = Batch.from_samples(samples, [1.0, -1.0] * 2, int(chat.tokenizer.pad_token_id))
    assert trainer.train_step(batch)["moe/replayed_tokens"] == 1.0


def _family(kind: str) -> torch.nn.Module:
    """A random two-layer model of another MoE family, routing peaked (no near-ties)."""
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(
            intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **common))
    elif kind == "gpt_oss":
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            layer_types=["full_attention"] * 2, **common))
    else:  # DeepSeek-V3's sigmoid, group-limited routing with a scaling factor
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, routed_scaling_factor=2.5, **{**common, "num_key_value_heads": 4}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_other_families_are_captured_and_replay_their_own_gate_weights(kind: str) -> None:
    """Routers of other families (softmax renormalised always, softmax over the top-k
    logits, DeepSeek's scaled sigmoid) are tapped; replaying a forward's own routing gives
    its logits exactly (so the replayed experts' weights are the router's own), another
    routing changes them, and the router still gets a gradient."""
    model = _family(kind)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with RouterTap(model) as tap:
        with torch.no_grad():
            free = model(input_ids=ids).logits
        own = tap.indices()
        assert own.shape == (8, 2, 2)
        tap.replay(own)
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, free, atol=1e-6, rtol=0)
        experts = routers(model)[0].num_experts
        other = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(t))[:2]
                             for t in range(16)]).reshape(8, 2, 2)
        tap.replay(other)
        out = model(input_ids=ids).logits
        assert (out - free).abs().max() > 1e-3
        assert torch.equal(tap.indices(), other.to(torch.int32))
        out.sum().backward()
    router = routers(model)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_sglang_broadcast_needs_a_per_expert_checkpoint_layout(tmp_path: Path) -> None:
    """The broadcast sends experts by checkpoint name only for families whose checkpoints
    name them one by one; Mixtral (w1/w2/w3) with SGLang and a broadcast is refused before
    any engine starts, naming the transport that works."""
    from rl_core.models.moe import names_experts_one_by_one
    from rl_core.planes import start_rollout

    cfg = load_config(ROOT / "configs" / "tiny-moe-cpu.yaml",
                      ["rollout.engine=sglang", "rollout.weight_sync=distributed"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral",
                                                      "num_local_experts": 8}))
    assert not names_experts_one_by_one(tmp_path)
    with pytest.raises(ConfigError, match="use rollout.weight_sync=disk"):
        start_rollout(cfg, tmp_path, tmp_path / "work")
    assert not (tmp_path / "work").exists()  # nothing was started
