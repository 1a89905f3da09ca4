"""Supervised fine-tuning (``grpoflow sft``, flows/sft.py) on real parts: the bare tiny model
(``embedded:tiny-init``: the demo's tokenizer and architecture, random weights), its chat
template, peft, the rollout engine, Prefect's test API, MLflow on SQLite.

Pinned here:

- Loss masking: prompt rows train on the completion and its end-of-turn token only; chat rows
  on each assistant turn through its end-of-turn token (not the template's text after it,
  never the user's or system's turns); the prompt is rendered as ``grpo_train`` renders it.
- Bad rows are reported by file and line; a GRPO config given to ``grpoflow sft`` is named.
- Packing gives the unpacked loss and gradients to float tolerance; micro-batching gives the
  same update (exact gradient accumulation); LoRA trains the adapters only and exports a
  merged model with the wrapped model's logits.
- The flow through Prefect lowers held-out loss, tracks to MLflow, registers the model, and
  its export runs in ``grpo_train`` as ``model.path``; a run resumed from a checkpoint ends
  bit-identical to an uninterrupted one (full weights, and LoRA with dropout).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rl_core.base_model import build_bare_tiny
from rl_core.config import ConfigError
from rl_core.data.prompts import render_prompt
from rl_core.data.records import DataValidationError
from rl_core.sft import (
    Example,
    SFTConfig,
    SFTDataConfig,
    load_sft_config,
    read_examples,
    synthetic_examples,
    tokenize_example,
)
from rl_core.training.sft import SFTTrainer

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
SFT = str(ROOT / "configs" / "sft-tiny-cpu.yaml")
DATA = SFTDataConfig()


@pytest.fixture(scope="module")
def bare(tiny_cache: Path) -> Path:
    return build_bare_tiny(SFTConfig().model, DATA, tiny_cache)


@pytest.fixture(scope="module")
def tok(bare: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bare)


def _trained_text(tok, t) -> str:
    return tok.decode([i for i, y in zip(t.ids, t.labels, strict=True) if y != -100])


# ----------------------------------------------------------------------------- masking


def test_prompt_rows_train_on_the_completion_only(tok) -> None:
    ex = Example("a", "test row 1", prompt="What is 2 + 3?", completion="2 + 3 = 5\n#### 5")
    t = tokenize_example(tok, ex, DATA)
    prompt = render_prompt(tok, "What is 2 + 3?")  # exactly what grpo_train sends the engine
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(t.ids[: t.prompt_len]) == prompt
    assert all(y == -100 for y in t.labels[: t.prompt_len])
    assert t.labels[t.prompt_len:] == t.ids[t.prompt_len:]  # every completion token trains
    assert _trained_text(tok, t) == "2 + 3 = 5\n#### 5<|im_end|>"
    assert t.ids[-1] == tok.eos_token_id and t.scorable
    literal = tokenize_example(tok, ex, DATA.model_copy(update={"render_prompts": False}))
    assert tok.decode(literal.ids[: literal.prompt_len]) == "What is 2 + 3?"
    assert _trained_text(tok, literal) == _trained_text(tok, t)


def test_chat_rows_train_on_assistant_turns_only(tok) -> None:
    turns = (("system", "Be brief."), ("user", "What is 1 + 2?"), ("assistant", "#### 3"),
             ("user", "And 3 - 1?"), ("assistant", "3 - 1 = 2\n#### 2"))
    t = tokenize_example(tok, Example("c", "chat.jsonl line 4", messages=turns), DATA)
    assert tok.decode(t.ids) == tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in turns], tokenize=False)[:-1]  # the last "\n"
    # each assistant turn with its end-of-turn token; never the "\n" the template adds after
    assert _trained_text(tok, t) == "#### 3<|im_end|>3 - 1 = 2\n#### 2<|im_end|>"
    spans = [i for i, y in enumerate(t.labels) if y != -100]
    assert tok.decode(t.ids[spans[0] - 3: spans[0]]) == "<|im_start|>assistant\n"
    assert tok.decode(t.ids[: t.prompt_len]).endswith("And 3 - 1?<|im_end|>\n"
                                                       "<|im_start|>assistant\n")
    assert t.reference == "3 - 1 = 2\n#### 2"
    # data.system_prompt goes before a conversation that has none
    sys = tokenize_example(tok, Example("d", "x", messages=turns[1:]),
                           DATA.model_copy(update={"system_prompt": "Be brief."}))
    assert sys.ids == t.ids and sys.labels == t.labels


def test_errors_name_the_file_and_row(tmp_path: Path, tok) -> None:
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "p", "completion": "c"}\n\n'
                   '{"messages": [{"role": "user", "content": "hi"}]}\n'
                   '{"question": "q", "answer": "a"}\nnot json\n')
    with pytest.raises(DataValidationError) as err:
        read_examples(str(bad), "train", DATA)
    msg = str(err.value)
    assert str(bad) in msg and "3 of 4 rows" in msg
    assert "line 3: 'messages' has no non-empty assistant turn" in msg
    assert "line 4: neither 'messages' nor 'prompt' + 'completion'" in msg
    assert "line 5: invalid JSON" in msg
    # GSM8K-style columns map onto prompt/completion; Parquet reads the same way
    table = pa.table({"question": ["What is 1 + 1?"], "answer": ["#### 2"]})
    pq.write_table(table, tmp_path / "gsm.parquet")
    mapped = DATA.model_copy(update={"prompt_field": "question", "completion_field": "answer"})
    [ex] = read_examples(str(tmp_path / "gsm.parquet"), "train", mapped)
    assert (ex.prompt, ex.completion, ex.origin) == ("What is 1 + 1?", "#### 2",
                                                     f"{tmp_path / 'gsm.parquet'} row 1")
    with pytest.raises(ValueError, match="gsm.parquet row 1: nothing to train on"):
        tokenize_example(tok, ex, mapped.model_copy(update={"max_seq_len": 8}))


def test_config_errors_name_the_field(capsys) -> None:
    from grpoflow.cli import main as cli_main

    with pytest.raises(ConfigError, match="train.pack_length .* is shorter"):
        load_sft_config(SFT, ["train.packing=true", "train.pack_length=16"])
    with pytest.raises(ConfigError, match="is a GRPO config"):
        load_sft_config(ROOT / "configs" / "tiny-cpu.yaml")
    assert cli_main(["sft", SFT, "train.lrr=0.1"]) == 2
    err = capsys.readouterr().err
    assert "train.lrr: unknown key" in err and "batch_size" in err


# ----------------------------------------------------------------------------- the step


def _examples(tok, n: int, data: SFTDataConfig = DATA) -> list:
    train, _ = synthetic_examples(data.model_copy(update={"synthetic_train_size": 400}))
    return [tokenize_example(tok, e, data) for e in train[:n]]


def _trainer(bare: Path, **train) -> SFTTrainer:
    cfg = SFTConfig.model_validate({"train": {"lr": 1e-3, **train}, "data": {"max_seq_len": 64}})
    return SFTTrainer(bare, cfg.train, pad_id=0, pack_length=cfg.pack_length)


def test_packing_gives_the_unpacked_loss_and_gradients(bare: Path, tok) -> None:
    from rl_core.training.packing import plan_first_fit
    from rl_core.training.sft import demonstrations_batch

    examples = _examples(tok, 12)
    assert len({len(e.ids) for e in examples}) > 1  # rows of different lengths share a pack
    trainer = _trainer(bare, packing=True, pack_length=256)
    batch = demonstrations_batch(examples, pad_id=0)
    plan = plan_first_fit(batch.input_ids.long(), batch.attention_mask, 256)
    # 12 examples in a few rows, positions restarting at each example
    assert plan.input_ids.shape[0] <= 3 and int((plan.position_ids[0] == 0).sum()) > 1
    assert plan.attention_mask.dim() == 4
    grads = {}
    for pack_length in (None, 256):
        trainer.pack_length = pack_length
        trainer.model.zero_grad(set_to_none=True)
        trainer.forward_slots = 0
        _, logp = trainer._forward(trainer.model, batch)
        total = -logp[batch.response_mask].sum()
        total.backward()
        grads[pack_length] = (float(total.detach()),
                              [p.grad.clone() for p in trainer.model.parameters()])
        assert trainer.forward_slots == (batch.input_ids.numel() if pack_length is None
                                         else plan.input_ids.numel())
    (unpacked, ga), (packed, gb) = grads[None], grads[256]
    assert packed == pytest.approx(unpacked, rel=1e-5)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    # and the step's loss is the mean of that sum over the labelled tokens
    m = trainer.sft_step(examples, step=1)
    assert m["loss"] == pytest.approx(packed / m["tokens"], rel=1e-5)
    assert 0 < m["pad_fraction"] < 0.5


def test_sfts_gradient_is_the_policy_gradient_with_advantage_one(bare: Path, tok) -> None:
    """SFT is GRPO's step with algorithm.loss=nll: on demonstrations laid out as samples with
    advantage 1, its gradient equals the on-policy clipped surrogate's (ratio 1)."""
    from rl_core.config import AlgorithmConfig
    from rl_core.training.sft import demonstrations_batch
    from rl_core.training.torch_trainer import MiniBatch, TorchTrainer

    examples = _examples(tok, 6)
    batch = demonstrations_batch(examples, pad_id=0)
    assert batch.advantages.tolist() == [1.0] * 6
    sft = _trainer(bare)
    grpo = TorchTrainer(bare, sft.train_cfg, AlgorithmConfig())
    mini = MiniBatch(torch.arange(batch.size), float(batch.response_mask.sum()), float(batch.size))
    grads = []
    for trainer in (sft, grpo):
        trainer.model.zero_grad(set_to_none=True)
        loss, metrics = trainer._micro_loss(batch, float(batch.response_mask.shape[1]), mini)
        loss.backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    assert metrics["pg_loss"] == pytest.approx(-1.0)  # -A * ratio, token-mean
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batching_gives_the_same_update(bare: Path, tok) -> None:
    examples = _examples(tok, 8)
    runs = []
    for micro in (8, 3):
        trainer = _trainer(bare, micro_batch_size=micro, batch_size=8)
        m = trainer.sft_step(examples, step=1)
        runs.append((m["loss"], m["tokens"], [p.detach().clone() for p in trainer.model.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6) and runs[0][1] == runs[1][1]
    for a, b in zip(runs[0][2], runs[1][2], strict=True):  # one AdamW step of lr 1e-3 apart
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_lora_trains_adapters_and_exports_the_merged_model(bare: Path, tok,
                                                           tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    trainer = _trainer(bare, lora={"rank": 4, "alpha": 8.0}, lr=1e-2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    examples = _examples(tok, 8)
    trainer.sft_step(examples, step=1)
    trainer.sft_step(examples, step=2)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    out = trainer.save_pretrained(tmp_path / "model")
    assert (out / "model.safetensors").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    trainer.model.eval()
    ids = torch.tensor([examples[0].ids])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trainer.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- the flow

SMALL = ["tracking.backend=none", "train.num_threads=1", "data.synthetic_train_size=600",
         "data.synthetic_test_size=64", "train.batch_size=16", "train.micro_batch_size=16",
         "eval.num_examples=64", "eval.greedy_examples=0", "train.warmup_steps=2"]


def _sft(tmp: Path, cache: Path, name: str, *extra: str, resume: str = "never") -> dict:
    from flows.sft import sft_train

    overrides = [f"storage.root={tmp}", f"storage.cache_dir={cache}", f"run_name={name}",
                 *SMALL, *extra]
    return sft_train(config=SFT, overrides=overrides, show_progress=False, resume=resume)


def test_sft_flow_lowers_loss_tracks_and_feeds_grpo(prefect_harness, tiny_cache: Path,
                                                    tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.grpo_train import grpo_train
    from flows.sft import sft_train

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}", "run_name=sft",
                 *SMALL, "train.steps=12", "train.steps_per_task=4", "eval.every=6",
                 "checkpoint.every=6", "eval.greedy_examples=8", "tracking.backend=mlflow",
                 f"tracking.uri={uri}", "tracking.system_metrics=false"]
    state = sft_train(config=SFT, overrides=overrides, show_progress=False, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    first, last = summary["first_eval"], summary["last_eval"]
    assert last["loss"] < first["loss"] - 1.0, (first["loss"], last["loss"])
    assert last["accuracy_examples"] == 8 and 0.0 <= last["pass_at_1"] <= 1.0
    run = Path(summary["run_dir"])
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 13))
    assert {"loss", "lr", "grad_norm", "tokens", "pad_fraction", "tokens_per_s"} <= set(steps[0])
    assert [e["step"] for e in summary["evals"]] == [0, 6, 12]
    assert (run / "checkpoints" / "step-000012" / "MANIFEST.json").is_file()

    with get_client(sync_client=True) as client:  # one task run per verb, named by its steps
        names = {r.name for r in client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))}
    assert {"train-steps-1-4", "train-steps-5-6", "train-steps-7-10", "train-steps-11-12",
            "evaluate-step-0", "evaluate-step-6", "evaluate-step-12", "checkpoint-step-6",
            "checkpoint-step-12"} <= names, sorted(names)
    for verb in ("prepare-sft-data", "build-bare-model", "start-sft", "export-model"):
        assert any(n.startswith(verb) for n in names), (verb, sorted(names))

    client = MlflowClient(uri)
    tracked = client.get_run(summary["tracking"]["run_id"])
    assert tracked.data.params["train.steps"] == "12"
    assert tracked.data.params["model.path"] == "embedded:tiny-init"
    assert [m.step for m in client.get_metric_history(tracked.info.run_id, "loss")] == \
        list(range(1, 13))
    assert [m.step for m in client.get_metric_history(tracked.info.run_id, "eval/loss")] == \
        [0, 6, 12]
    version = client.get_model_version_by_alias("grpoflow-tiny-sft", "candidate")
    assert version.run_id == tracked.info.run_id

    # SFT -> RL: the export is grpo_train's model.path as is
    grpo = grpo_train(config=str(ROOT / "configs" / "tiny-cpu.yaml"), show_progress=False,
                      overrides=[f"storage.root={tmp_path}", f"storage.cache_dir={tiny_cache}",
                                 "run_name=rl", f"model.path={summary['model_dir']}",
                                 "tracking.backend=none", "train.steps=2",
                                 "train.prompts_per_step=4", "rollout.n_samples=4",
                                 "rollout.engine=local", "eval.every=0",
                                 "eval.num_examples=8", "eval.pass_k_examples=0"])
    assert grpo["steps"] == 2 and Path(grpo["model_dir"], "model.safetensors").is_file()
    rl_steps = (Path(grpo["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rl_steps] == [1, 2]


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_sft_flow_resumes_bit_identical(prefect_harness, tiny_cache: Path, tmp_path: Path,
                                        variant: str) -> None:
    extra = ["train.steps=4", "checkpoint.every=2", "eval.every=0", "eval.num_examples=16",
             *(["train.lora.rank=4", "train.lora.dropout=0.1", "train.lr=1e-2"]
               if variant == "lora" else [])]
    straight = _sft(tmp_path, tiny_cache, "straight", *extra)
    ckpt = Path(straight["run_dir"]) / "checkpoints" / "step-000002"
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / ckpt.name)
    resumed = _sft(tmp_path, tiny_cache, "resumed", *extra, resume="always")
    assert resumed["resumed_from_step"] == 2
    metrics = (Path(resumed["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [3, 4]
    a = load_file(Path(straight["model_dir"]) / "model.safetensors")
    b = load_file(Path(resumed["model_dir"]) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["last_eval"]["loss"] == straight["last_eval"]["loss"]
    if variant == "lora":
        assert (ckpt / "model" / "adapter_model.safetensors").is_file()
        assert not (ckpt / "model" / "model.safetensors").exists()  # the adapter, not the model
