"""LoRA RL (``train.lora``): the trainer's adapters, adapter-only weight sync, the engine's
SGLang LoRA protocol, checkpoints, the merged export, and a LoRA GRPO run through the flow.

Pinned here, on real parts (peft, the in-process engine core, an HTTP engine process):

- After a sync that moves only the adapter, the engine samples from the trainer's model:
  each token's log-prob equals the trainer's teacher-forced log-prob (in process and over
  HTTP, verified by the adapter's checksum), and requests without ``lora_path`` still get
  the base model, which is also the trainer's reference (adapter disabled, no second copy).
- The engine's protocol: load/unload by name (a name loaded twice, an unknown name, a
  request for an adapter not loaded: refused with the reason); requests for two adapters and
  the base in one call each get their own weights.
- Only the adapters train; a checkpoint holds the adapter and restores it exactly; the
  export merges the adapter into a Hugging Face model whose logits equal the wrapped model's.
- Config errors name the field (megatron, non-disk transports).
- The flow: LoRA GRPO steps through Prefect, resumed from a checkpoint, end bit-identical
  to an uninterrupted run; the export has the merged model and the adapter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import run_demo_flow, save_tiny_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_core.config import AlgorithmConfig, LoraConfig, TrainConfig, load_config
from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.lora import AdapterError
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool
from rl_core.training import lora as lora_lib
from rl_core.training.torch_trainer import TorchTrainer
from rl_core.types import Batch
from rl_core.weight_sync import sync_weights
from rl_core.weight_sync.transports import DiskSync, TensorSync

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5 + i, 6, 7 + i] for i in range(4)]
LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=7)


def _trainer(model_dir: Path, kl: float = 0.0) -> TorchTrainer:
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2, lora=LORA),
                           AlgorithmConfig(kl_coef=kl), max_response_len=16)
    with torch.no_grad():  # B starts at 0 (adapter == base): give it something to carry
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return trainer


def _scored(trainer: TorchTrainer, samples: list, reference: bool = False) -> list[list[float]]:
    batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
    logp = trainer.compute_logprobs(batch, reference=reference)
    return [logp[i][batch.response_mask[i]].tolist() for i in range(len(samples))]


def _close(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=2e-4)


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=11)


def _check_plane(trainer: TorchTrainer, plane) -> None:  # noqa: ANN001
    """Adapter samples score as the trainer's model; base samples as its reference."""
    tuned = plane.generate(PROMPTS, PARAMS)
    assert all(s.weight_version == 1 for s in tuned)
    _close([s.logprobs for s in tuned], _scored(trainer, tuned))
    name, plane.lora_name = plane.lora_name, None  # requests without lora_path
    try:
        base = plane.generate(PROMPTS, PARAMS)
    finally:
        plane.lora_name = name
    _close([s.logprobs for s in base], _scored(trainer, base, reference=True))
    assert [s.completion_ids for s in base] != [s.completion_ids for s in tuned]


def test_adapter_sync_in_process_matches_the_trainer(model_dir: Path) -> None:
    trainer = _trainer(model_dir, kl=0.01)
    assert trainer.ref_model is None and trainer.has_ref_model  # the base is the reference
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in trainer.model.parameters() if p.requires_grad}
    plane = InProcessPlane(model_dir)
    try:
        metrics = sync_weights(trainer, plane, TensorSync(plane, "policy"), 1)
        adapter = sum(t.numel() * 4 for t in trainer.export_weights().values())
        assert metrics["sync_bytes"] == adapter  # the adapter only
        assert plane.lora_name == "policy"
        _check_plane(trainer, plane)
        # the next sync replaces the adapter under the same name
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_A" in name:
                    p.mul_(-1.0)
        sync_weights(trainer, plane, TensorSync(plane, "policy"), 2)
        again = plane.generate(PROMPTS, PARAMS)
        _close([s.logprobs for s in again], _scored(trainer, again))
    finally:
        plane.close()


def test_adapter_sync_over_http_matches_the_trainer(model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(model_dir)
    pool = EnginePool(embedded_engine_command(model_dir, num_threads=1), 1,
                      log_dir=tmp_path / "engines", startup_timeout_s=120)
    plane = HttpPlane(pool, request_batch_size=4, weight_sync_timeout_s=60).start()
    sync = DiskSync(plane, tmp_path / "staging", 60, "policy")
    pool.resync = sync.resync
    try:
        sync_weights(trainer, plane, sync, 1)  # verified: version and the adapter's checksum
        staged = next((tmp_path / "staging").glob("v*"))
        assert sorted(p.name for p in staged.iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors"]
        _check_plane(trainer, plane)
        url = pool.engine_urls[0]
        assert plane.client.weights_checksum(url=url, lora_name="policy") == \
            plane.client.weights_checksum(url=url, lora_name="policy")  # fmt: skip
        # a restarted engine gets the adapter back before it serves (resync)
        sync.resync(url)
        _check_plane(trainer, plane)
    finally:
        plane.close()


def test_engine_lora_protocol(model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(model_dir)
    a_dir = tmp_path / "a"
    trainer.write_weights(a_dir)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    b_dir = tmp_path / "b"
    trainer.write_weights(b_dir)
    engine = EmbeddedEngine(model_dir, num_threads=1)
    try:
        engine.load_lora_adapter("a", a_dir)
        engine.load_lora_adapter("b", b_dir)
        with pytest.raises(AdapterError, match="already loaded"):
            engine.load_lora_adapter("a", a_dir)
        with pytest.raises(AdapterError, match="not loaded"):
            engine.unload_lora_adapter("c")
        with pytest.raises(AdapterError, match="not a LoRA adapter directory"):
            engine.load_lora_adapter("c", tmp_path)
        with pytest.raises(ValueError, match="'zz' is not loaded"):
            engine.submit(GenerateRequest("x", [5, 6], PARAMS, lora="zz"))

        def run(loras: list[str | None]) -> list[list[int]]:
            reqs = [GenerateRequest(f"r{i}-{lo}", [5, 6, 7 + i], PARAMS, True, -1, lo)
                    for i, lo in enumerate(loras)]
            return [o.output_ids for o in engine.generate_sync(reqs)]

        alone = {lo: run([lo])[0] for lo in ("a", "b", None)}
        mixed = run(["a", "b", None, "a"])  # interleaved: each served by its own weights
        assert mixed[0] == alone["a"] and mixed[1] == run(["b", "b"])[1]
        assert mixed[2] == run([None, None, None])[2]
        assert len({tuple(x) for x in alone.values()}) == 3
        engine.unload_lora_adapter("a")
        assert engine.checksum() == EmbeddedEngine(model_dir).checksum()  # base untouched
    finally:
        engine.close()


def test_engine_lora_routes(model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(model_dir)
    trainer.write_weights(tmp_path / "a")
    pool = EnginePool(embedded_engine_command(model_dir, num_threads=1), 1,
                      log_dir=tmp_path / "engines", startup_timeout_s=120)
    with pool:
        url = pool.engine_urls[0]
        load = {"lora_name": "a", "lora_path": str(tmp_path / "a")}
        assert httpx.post(f"{url}/load_lora_adapter", json=load).json()["success"]
        again = httpx.post(f"{url}/load_lora_adapter", json=load)
        assert again.status_code == 400 and "already loaded" in again.json()["message"]
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "lora_path": "nope"}
        bad = httpx.post(f"{url}/generate", json=body)
        assert bad.status_code == 400 and "'nope' is not loaded" in bad.text
        ok = httpx.post(f"{url}/generate", json={**body, "lora_path": "a"})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
        got = httpx.get(f"{url}/weights_checksum", params={"lora_name": "a"}).json()
        assert got["checksum"] == lora_lib_checksum(trainer)
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a"}).json()["success"]


def lora_lib_checksum(trainer: TorchTrainer) -> str:
    from rl_core.weight_sync import weights_checksum

    return weights_checksum(trainer.export_weights())


def test_checkpoint_holds_the_adapter_and_export_merges_it(model_dir: Path,
                                                            tmp_path: Path) -> None:
    trainer = _trainer(model_dir)
    batch_samples = InProcessPlane(model_dir).generate(PROMPTS, PARAMS)
    batch = Batch.from_samples(batch_samples, [1.0, -1.0, 0.5, -0.5], pad_id=0)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    base_before = {k: v.clone() for k, v in trainer.model.state_dict().items()
                   if ".lora_" not in k}
    trainer.train_step(batch)
    after = trainer.model.state_dict()
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)  # base frozen
    trainer.save_state(tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt" / "model").iterdir()}
    assert files == {"adapter_config.json", "adapter_model.safetensors"}
    restored = _trainer(model_dir)
    restored.load_state(tmp_path / "ckpt")
    a, b = trainer.export_weights(), restored.export_weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert restored.global_step == trainer.global_step

    out = trainer.save_pretrained(tmp_path / "export")
    assert (out / lora_lib.ADAPTER_DIR / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert "lm_head.weight" in load_file(out / "model.safetensors") or merged.config.tie_word_embeddings


def test_qlora_trains_an_adapter_on_a_4bit_base(model_dir: Path, tmp_path: Path) -> None:
    """QLoRA (train.lora.quantize=nf4): the trainer's frozen base is 4-bit (bitsandbytes, on
    CPU here), only the adapter trains and travels; the engines serve the full-precision base
    with the synced adapter, and the export merges the adapter into that full-precision base."""
    import bitsandbytes as bnb

    qlora = LoraConfig(rank=4, alpha=8.0, quantize="nf4")
    trainer = TorchTrainer(model_dir, TrainConfig(lr=1e-2, lora=qlora), AlgorithmConfig(),
                           max_response_len=16)
    full = _trainer(model_dir)  # the same adapter shapes on the full-precision base
    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    linear = [m for n, m in full.model.named_modules() if n.endswith("base_layer")]
    assert len(quantized) == len(linear) > 0
    for q, f in zip(quantized, linear, strict=True):  # two 4-bit weights per byte
        assert q.weight.dtype == torch.uint8 and q.weight.numel() * 2 == f.weight.numel()
    assert trainer.ref_model is None  # no second copy

    plane = InProcessPlane(model_dir)
    try:
        samples = plane.generate(PROMPTS, PARAMS)
        # before training (B = 0) the trainer scores with the 4-bit base: close to, not equal
        # to, the full-precision engine (the QLoRA rollout/train mismatch; TIS corrects it)
        gap = [abs(a - b) for x, y in zip(_scored(trainer, samples), [s.logprobs for s in samples],
                                          strict=True) for a, b in zip(x, y, strict=True)]
        assert 0 < sum(gap) / len(gap) < 0.5
        batch = Batch.from_samples(samples, [1.0, -1.0, 0.5, -0.5], pad_id=0)
        batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        frozen = {k: v.clone() for k, v in trainer.model.state_dict().items()
                  if ".lora_" not in k and isinstance(v, torch.Tensor)}
        trainer.train_step(batch)
        after = trainer.model.state_dict()
        assert all(torch.equal(frozen[k], after[k]) for k in frozen)  # the 4-bit base is frozen
        adapter = trainer.export_weights()
        assert adapter.keys() == full.export_weights().keys()
        assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
        # the engine: the full-precision base + this adapter, as a full-precision trainer
        # holding the same adapter scores it
        full.model.load_state_dict(lora_lib.model_keys(adapter), strict=False)
        metrics = sync_weights(trainer, plane, TensorSync(plane, "policy"), 1)
        assert metrics["sync_bytes"] == sum(t.numel() * 4 for t in adapter.values())
        tuned = plane.generate(PROMPTS, PARAMS)
        _close([s.logprobs for s in tuned], _scored(full, tuned))
    finally:
        plane.close()

    trainer.save_state(tmp_path / "ckpt")  # the adapter and its optimizer, never the base
    assert {p.name for p in (tmp_path / "ckpt" / "model").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    restored = TorchTrainer(model_dir, TrainConfig(lr=1e-2, lora=qlora), AlgorithmConfig())
    restored.load_state(tmp_path / "ckpt")
    got = restored.export_weights()
    assert all(torch.equal(got[k], adapter[k]) for k in adapter)
    out = trainer.save_pretrained(tmp_path / "export")  # merged into the full-precision base
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    full.model.eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, full.model(input_ids=ids).logits,
                              atol=1e-4)


def test_lora_config_errors() -> None:
    demo = ROOT / "configs" / "tiny-cpu.yaml"
    with pytest.raises(ValueError, match="train.backend=torch"):
        load_config(demo, ["train.lora.rank=8", "train.backend=megatron"])
    with pytest.raises(ValueError, match="rollout.weight_sync='distributed'"):
        load_config(demo, ["train.lora.rank=8", "rollout.weight_sync=distributed"])
    cfg = load_config(demo, ["train.lora.rank=8"])
    assert cfg.train.lora.enabled and lora_lib.scaling(cfg.train.lora) == 2.0
    with pytest.raises(ValueError, match="train.lora.rank is 0"):
        load_config(demo, ["train.lora.quantize=nf4"])
    with pytest.raises(ValueError, match=r"target_modules \['qq'\] match no linear layer"):
        lora_lib.apply_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                            LoraConfig(rank=2, target_modules=["qq"]))


# ---------------------------------------------------------------------------- the flow

LORA_RUN = ["rollout.engine=embedded", "train.lora.rank=8", "train.lr=1e-3", "algorithm.kl_coef=0.01"]


def _run(tmp: Path, cache: Path, name: str, *extra: str, resume: str = "never") -> dict:
    return run_demo_flow(tmp, cache, name, *LORA_RUN, *extra, resume=resume)


def test_lora_grpo_flow_resumes_exactly(prefect_harness, tiny_cache: Path,
                                        tmp_path: Path) -> None:
    args = ["train.steps=3", "checkpoint.every=2"]  # the resumed run: step 3 again
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _run(tmp_path, tiny_cache, "first", *args, "tracking.backend=mlflow",
                 f"tracking.uri={uri}", "tracking.system_metrics=false")
    # the registry: the merged model, recording its base and the adapter (logged beside it)
    from tasks.tracking.registry import registry_client

    client = registry_client(uri)
    mv = client.get_model_version(first["tracking"]["registered_model"], first["tracking"]["version"])
    assert mv.tags["grpoflow.base_model"] == "embedded:tiny"
    assert mv.tags["grpoflow.lora.rank"] == "8" and "q_proj" in mv.tags["grpoflow.lora.target_modules"]
    assert {f.path for f in client.list_artifacts(mv.run_id, "adapter")} >= {
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    run = Path(first["run_dir"])
    model = Path(first["model_dir"])
    assert (model / lora_lib.ADAPTER_DIR / "adapter_config.json").is_file()
    assert (model / "model.safetensors").is_file() and (model / "tokenizer_config.json").is_file()
    cfg = json.loads((model / lora_lib.ADAPTER_DIR / "adapter_config.json").read_text())
    assert cfg["r"] == 8
    ckpt = run / "checkpoints" / "step-000002"
    assert (ckpt / "model" / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model" / "model.safetensors").exists()  # the adapter, not the model
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["sync_bytes"] < 1e6 for m in metrics)  # adapters, not the 7 MB model
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / "step-000002")
    resumed = _run(tmp_path, tiny_cache, "resumed", *args, resume="always")
    a = load_file(model / lora_lib.ADAPTER_DIR / "adapter_model.safetensors")
    b = load_file(Path(resumed["model_dir"]) / lora_lib.ADAPTER_DIR / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
