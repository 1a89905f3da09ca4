"""Several LoRA adapters in one running batch of the embedded engine (``max_loras_per_batch``,
docs/lora.md): rows of different adapters and of the base model share prefill and decode
batches, each sample equal to the same request served alone and to PEFT's unmerged model;
admission takes up to N adapters and queues the next; unloading keeps its rules; N = 1 keeps
merging one adapter per batch.

One tiny model (tests/engine_helpers.py), adapters built in memory; engines without a
scheduler thread (``background=False``), so each test is a few decode steps on this thread.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import save_tiny_model

from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.lora import AdapterError
from rl_core.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS)}
MLP = ("gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("multi-lora") / "model", seed=3)


def adapter(model_dir: Path, seed: int, lm_head: bool = False) -> dict[str, torch.Tensor]:
    """Random A and B (B not zero: the adapter changes the model) for every target of the tiny
    model, by PEFT's saved names; ``lm_head`` too if asked."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (hidden // cfg.num_attention_heads)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, hidden), "gate_proj": (inter, hidden),
              "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    modules = [(f"model.layers.{i}.{'mlp' if p in MLP else 'self_attn'}.{p}", shapes[p])
               for i in range(layers) for p in TARGETS]
    if lm_head:
        modules.append(("lm_head", (cfg.vocab_size, hidden)))
    for module, (rows, cols) in modules:
        key = f"base_model.model.{module}"
        out[f"{key}.lora_A.weight"] = torch.randn(RANK, cols, generator=g) * 0.3
        out[f"{key}.lora_B.weight"] = torch.randn(rows, RANK, generator=g) * 0.3
    return out


ADAPTERS = {"a": (1, False), "b": (2, True), "c": (3, False)}


def engine_with(model_dir: Path, n: int, **kw: object) -> EmbeddedEngine:
    engine = EmbeddedEngine(model_dir, num_threads=1, background=False, max_loras_per_batch=n,
                            **kw)
    for name, (seed, head) in ADAPTERS.items():
        engine.load_lora_adapter(name, tensors=adapter(model_dir, seed, head),
                                 config={**CONFIG, "target_modules": [*TARGETS, "lm_head"]})
    return engine


def requests(loras: list[str | None], params: SamplingParams = GREEDY) -> list[GenerateRequest]:
    return [GenerateRequest(f"r{i}", [5 + i % 3, 6, 7 + i], params, True, -1, lora)
            for i, lora in enumerate(loras)]


def batches(engine: EmbeddedEngine) -> list[list[str | None]]:
    """The running batch's adapters at each decode step (recorded from ``on_step``)."""
    seen: list[list[str | None]] = []
    engine.on_step = lambda n: seen.append([s.req.lora for s in engine._running])
    return seen


@pytest.mark.parametrize("layout", ["slots", "padded"])
def test_mixed_batch_equals_each_request_alone(model_dir: Path, layout: str) -> None:
    loras = ["a", None, "b", "c", "a", None, "b", "c"]
    with engine_with(model_dir, 3, kv_layout=layout) as engine, \
            engine_with(model_dir, 1, kv_layout=layout) as merged:
        seen = batches(engine)
        mixed = engine.generate_sync(requests(loras))
        assert engine.stats["max_batch"] == len(loras)  # one batch: every row together
        assert {x for step in seen for x in step} == {"a", "b", "c", None}
        alone = [engine.generate_sync([r])[0] for r in requests(loras)]
        one = [merged.generate_sync([r])[0] for r in requests(loras)]  # merged, N = 1
        for m, a, o in zip(mixed, alone, one, strict=True):
            assert m.output_ids == a.output_ids == o.output_ids
            assert m.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-4)
            assert m.output_logprobs == pytest.approx(o.output_logprobs, abs=1e-4)
        # the adapters change the samples (else equality above proves nothing)
        assert len({tuple(m.output_ids) for m in mixed[:4]}) == 4
        assert engine._lora.active is None  # nothing merged: the base weights as loaded


def test_unmerged_logprobs_equal_peft(model_dir: Path) -> None:
    """Seeded samples of a mixed batch score as PEFT's unmerged model (the trainer's)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=5)
    loras = ["b", None, "a", "b"]
    with engine_with(model_dir, 4) as engine:
        outs = engine.generate_sync(requests(loras, params))
    assert engine.stats["max_batch"] == len(loras)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA,
                                           target_modules=[*TARGETS, "lm_head"]))
    for req, out in zip(requests(loras, params), outs, strict=True):
        ids = torch.tensor([req.input_ids + out.output_ids])
        if req.lora is None:
            with peft.disable_adapter(), torch.no_grad():
                logits = peft(input_ids=ids).logits[0]
        else:
            zero = {k: torch.zeros_like(v) for k, v in adapter(model_dir, 0, True).items()}
            set_peft_model_state_dict(peft, zero | adapter(model_dir, *ADAPTERS[req.lora]))
            with torch.no_grad():
                logits = peft(input_ids=ids).logits[0]
        n = len(req.input_ids)
        logp = torch.log_softmax(logits[n - 1 : -1].float(), -1)
        want = logp.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0].tolist()
        assert out.output_logprobs == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("n", [1, 2])
def test_admission_takes_up_to_n_adapters_and_queues_the_next(model_dir: Path, n: int) -> None:
    short = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    loras = ["a", "b", "c", None]
    reqs = [GenerateRequest(f"q{i}", [5, 6, 7 + i], GREEDY if lo == "b" else short, True, -1, lo)
            for i, lo in enumerate(loras)]
    with engine_with(model_dir, n) as engine:
        seen = batches(engine)
        outs = engine.generate_sync(reqs)
    assert all(len(o.output_ids) == o.completion_tokens > 0 for o in outs)
    assert max(len({x for x in step if x is not None}) for step in seen) == n
    assert set(seen[0]) == ({"a"} if n == 1 else {"a", "b"})  # c (and what follows it) waits
    assert any("c" in step for step in seen)  # admitted once a place was free
    if n == 1:  # merged, one adapter (or the base) per batch
        assert engine._lora.rows is None and all(len(set(step)) <= 1 for step in seen)
    else:
        assert engine._lora.active is None


def test_unload_rules_with_several_adapters_per_batch(model_dir: Path) -> None:
    with engine_with(model_dir, 2) as engine:
        # queued, then its adapter unloaded before admission: aborted with the reason
        fut = engine.submit(requests(["c"])[0])
        engine.unload_lora_adapter("c")
        out = fut.result(timeout=30)
        assert out.finish_reason["type"] == "abort" and "LoRA 'c' unloaded" in \
            out.finish_reason["message"]
        # while running: refused for an adapter a row uses; another one unloads
        refused: list[str] = []

        def step(k: int) -> None:
            if k == 1:
                try:
                    engine.unload_lora_adapter("a")
                except AdapterError as e:
                    refused.append(str(e))
                engine.unload_lora_adapter("b")

        engine.on_step = step
        outs = engine.generate_sync(requests(["a", None]))
        assert refused and "serves 1 running request(s)" in refused[0]
        assert all(o.finish_reason["type"] == "length" for o in outs)
        assert engine.lora_names == ["a"]
        engine.on_step = None
        engine.unload_lora_adapter("a")  # idle now: allowed
        assert engine.lora_names == []


def test_several_per_batch_refuses_what_it_cannot_apply_unmerged(model_dir: Path) -> None:
    with EmbeddedEngine(model_dir, num_threads=1, background=False,
                        max_loras_per_batch=2) as engine:
        g = torch.Generator().manual_seed(0)
        tensors = {"base_model.model.model.embed_tokens.lora_A.weight":
                   torch.randn(RANK, 32, generator=g),
                   "base_model.model.model.embed_tokens.lora_B.weight":
                   torch.randn(64, RANK, generator=g)}
        with pytest.raises(AdapterError, match="not the weight of an nn.Linear"):
            engine.load_lora_adapter("e", tensors=tensors, config=CONFIG)
    with pytest.raises(ValueError, match="max_loras_per_batch must be >= 1"):
        EmbeddedEngine(model_dir, num_threads=1, background=False, max_loras_per_batch=0)
