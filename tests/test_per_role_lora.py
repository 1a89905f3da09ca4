"""Per-role LoRA adapters (``train.lora.per_role``) for multi-role episodes.

Pinned here, on the real trainer (peft), the in-process engine and the GRPO flow:

- Each role has its own adapter on the one base model; an adapter changes only from its own
  role's samples (a role whose advantages are all 0 keeps its adapter bit-for-bit while the
  other role's moves), in one optimizer step over both; old-policy log-probs score each row
  under its role's adapter.
- The per-role weight sync loads every adapter on the engine under its name, verified by each
  one's checksum, and each role's turns are sampled from its adapter: the requests carry its
  name and the engine's log-probs equal the trainer's under that role's adapter. Planes
  without a trainer serve a per-role export's adapters (its evaluation).
- Checkpoint and resume are exact (the resumed run's adapters equal the uninterrupted run's);
  the export writes the base and each role's adapter in ``model/adapters/<role>/``.
- Config errors name the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rl_core.agents import ChatTokens, EpisodeLimits
from rl_core.agents.roles import RoleEpisodeRunner, RoleStep, role_adapters
from rl_core.config import AlgorithmConfig, LoraConfig, TrainConfig, load_config
from rl_core.data.records import Record
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.inprocess import InProcessPlane
from rl_core.training import lora as lora_lib
from rl_core.training.torch_trainer import TorchTrainer, _role_adapters
from rl_core.types import Batch, Sample
from rl_core.weight_sync import sync_weights, weights_checksum
from rl_core.weight_sync.roles import RoleAdapterSync
from rl_core.weight_sync.transports import TensorSync

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
LORA = LoraConfig(rank=4, alpha=8.0, per_role=True)
ROLES = ("a", "b")
TASKS = [Record(f"t{i}", f"What is {i + 2} + {i + 1}?", f"#### {2 * i + 3}") for i in range(2)]


class Relay:
    """Roles a and b: a speaks, b answers, a speaks again."""

    roles = ROLES

    def reset(self, task: Record) -> list[dict]:
        self.turn = 0
        return [{"role": "user", "content": task.question}]

    def step(self, turn) -> RoleStep:  # noqa: ANN001
        self.turn += 1
        if self.turn == 1:
            return RoleStep([{"role": "user", "content": "What is 2 + 3?"}], reward=0.5, role="b")
        if self.turn == 2:
            return RoleStep([{"role": "user", "content": "Go on."}], role="a")
        return RoleStep(done=True, rewards={"b": 1.0})


def _trainer(model: Path) -> TorchTrainer:
    # beta1 = 0: an adapter without gradient in a step does not move by Adam's momentum
    trainer = TorchTrainer(model, TrainConfig(lr=1e-2, weight_decay=0.0, betas=(0.0, 0.999),
                                              lora=LORA),
                           AlgorithmConfig(kl_coef=0.0), max_response_len=16, roles=ROLES)
    with torch.no_grad():  # B starts at 0 (adapter == base): make the two adapters differ
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return trainer


def _adapter(trainer: TorchTrainer, role: str) -> dict[str, torch.Tensor]:
    with trainer.exporting(role):
        return {k: v.clone() for k, v in trainer.export_weights().items()}


def _samples(n: int = 4) -> list[Sample]:
    out = []
    for i in range(n):
        role = ROLES[i % 2]
        completion = [20 + i, 21, 22 + i, 23]
        out.append(Sample([5 + i, 6, 7], completion, [-1.0] * 4, {"type": "length"},
                          meta={"role": role}))
    return out


def _batch(samples: list[Sample], advantages: list[float], roles: bool = True) -> Batch:
    batch = Batch.from_samples(samples, advantages, pad_id=0)
    batch.roles = [s.meta["role"] for s in samples] if roles else None
    return batch


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path):
    return AutoTokenizer.from_pretrained(demo_model)


def test_each_adapter_trains_on_its_own_roles_samples_only(demo_model: Path,
                                                           tmp_path: Path) -> None:
    trainer = _trainer(demo_model)
    names = [n for n in trainer.model.peft_config]
    assert names == ["policy-a", "policy-b"] and trainer.role_adapters == {
        "a": "policy-a", "b": "policy-b"}
    samples = _samples()
    # old log-probs: each row under its own role's adapter
    per_row = trainer.compute_logprobs(_batch(samples, [0.0] * 4))
    for role in ROLES:
        alone = _batch(samples, [0.0] * 4)
        alone.roles = [role] * 4
        want = trainer.compute_logprobs(alone)
        rows = [i for i, s in enumerate(samples) if s.meta["role"] == role]
        assert torch.allclose(per_row[rows], want[rows], atol=1e-5)
    # a batch without roles (the weight probe's) is scored under the first role's adapter
    plain = trainer.compute_logprobs(_batch(samples, [0.0] * 4, roles=False))
    assert torch.allclose(plain[0], per_row[0], atol=1e-5)
    assert (plain[1] - per_row[1]).abs().max() > 1e-3
    # one role's advantages are all 0: its adapter must not move, the other's must
    for step, (still, moving) in enumerate((("a", "b"), ("b", "a")), 1):
        before = {r: _adapter(trainer, r) for r in ROLES}
        advantages = [0.0 if s.meta["role"] == still else (1.0 if i < 2 else -1.0)
                      for i, s in enumerate(samples)]
        metrics = trainer.train_step(_batch(samples, advantages))
        assert trainer.global_step == step and metrics["grad_norm"] > 0
        after = {r: _adapter(trainer, r) for r in ROLES}
        assert all(torch.equal(before[still][k], after[still][k]) for k in before[still])
        assert any(not torch.equal(before[moving][k], after[moving][k]) for k in before[moving])
    # a checkpoint holds every adapter (model/adapters/<role>/) and resumes exactly
    ckpt = trainer.save_state(tmp_path / "ckpt")
    for role in ROLES:
        assert (ckpt / "model" / "adapters" / role / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model" / "adapter_model.safetensors").exists()
    last = _batch(samples, [-1.0, 1.0, 1.0, -1.0])
    trainer.train_step(last)
    resumed = _trainer(demo_model)
    resumed.load_state(ckpt)
    resumed.train_step(last)
    for role in ROLES:
        a, b = _adapter(trainer, role), _adapter(resumed, role)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the export: the base itself (nothing merged) and each role's adapter beside it
    out = trainer.save_pretrained(tmp_path / "export")
    for role in ROLES:
        got = load_file(out / lora_lib.ROLE_ADAPTERS_DIR / role / "adapter_model.safetensors")
        want = _adapter(trainer, role)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert json.loads((out / "adapters" / role / "adapter_config.json").read_text())["r"] == 4
    assert not any(".lora_" in k for k in load_file(out / "model.safetensors"))


def test_each_roles_turns_sample_from_its_adapter(demo_model: Path, tokenizer,
                                                  tmp_path: Path) -> None:
    trainer = _trainer(demo_model)
    plane = InProcessPlane(demo_model)
    try:
        transport = RoleAdapterSync(plane, {r: TensorSync(plane, f"policy-{r}") for r in ROLES})
        metrics = sync_weights(trainer, plane, transport, 1)
        assert metrics["sync_bytes"] > 0
        assert plane.role_adapters == {"a": "policy-a", "b": "policy-b"}
        for role in ROLES:  # both loaded, each the trainer's adapter of its role
            with trainer.exporting(role):
                assert plane.engine.checksum(f"policy-{role}") == weights_checksum(
                    trainer.export_weights())
        seen: list[tuple[str | None, int]] = []
        generate = plane.generate

        def spy(prompts, params, **kw):  # noqa: ANN001, ANN202
            seen.append((plane.lora_name, len(prompts)))
            return generate(prompts, params, **kw)

        plane.generate = spy
        runner = RoleEpisodeRunner(plane, ChatTokens(tokenizer), Relay, ROLES,
                                   EpisodeLimits(max_turns=4, max_tokens=48, env_timeout_s=10))
        samples = runner.run(TASKS, n=2, params=SamplingParams(temperature=1.0,
                                                               max_new_tokens=6),
                             step=1, seed=3)
        # turns: a, b, a; each round one request batch per acting role, under its adapter
        assert [name for name, _ in seen] == ["policy-a", "policy-b", "policy-a"]
        assert plane.lora_name == "policy-a"  # restored after the round
        batch = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
        batch.roles = [s.meta["role"] for s in samples]
        logp = trainer.compute_logprobs(batch)
        for i, s in enumerate(samples):  # the engine's log-probs: the trainer's, same adapter
            mask = torch.tensor(s.loss_mask, dtype=torch.bool)
            engine = batch.rollout_logp[i][batch.response_mask[i]]
            mine = logp[i][batch.response_mask[i]]
            assert int(mask.sum()) == len(engine) > 0
            assert torch.allclose(engine, mine, atol=2e-4), s.meta["role"]
        # and the other role's adapter would not have given them
        swapped = Batch.from_samples(samples, [0.0] * len(samples), pad_id=0)
        swapped.roles = ["b" if r == "a" else "a" for r in batch.roles]
        other = trainer.compute_logprobs(swapped)
        assert (other - logp).abs().max() > 1e-2
    finally:
        plane.close()
    # planes without a trainer (the evaluation of a per-role export) serve its adapters
    out = trainer.save_pretrained(tmp_path / "export")
    plane = InProcessPlane(out)
    try:
        transport = RoleAdapterSync(plane, {r: TensorSync(plane, f"policy-{r}") for r in ROLES})
        assert transport.serve_exported(out) and not transport.serve_exported(tmp_path)
        assert plane.role_adapters == {"a": "policy-a", "b": "policy-b"}
        for role in ROLES:
            with trainer.exporting(role):
                assert plane.engine.checksum(f"policy-{role}") == weights_checksum(
                    trainer.export_weights())
    finally:
        plane.close()


def test_per_role_config_errors() -> None:
    demo = ROOT / "configs" / "tiny-cpu.yaml"
    selfplay = ROOT / "configs" / "selfplay-cpu.yaml"
    with pytest.raises(ValueError, match="train.lora.per_role=true .* train.lora.rank is 0"):
        load_config(selfplay, ["train.lora.per_role=true"])
    with pytest.raises(ValueError, match="train.lora.per_role=true: agent.env is not set"):
        load_config(demo, ["train.lora.rank=4", "train.lora.per_role=true"])
    with pytest.raises(ValueError, match="train.backend=torch"):
        load_config(selfplay, ["train.lora.rank=4", "train.lora.per_role=true",
                               "train.backend=megatron"])
    with pytest.raises(ValueError, match="per_role=true: cluster.mode='ray'"):
        load_config(selfplay, ["train.lora.rank=4", "train.lora.per_role=true",
                               "cluster.mode=ray"])
    with pytest.raises(ValueError, match="per_role=true: rollout.engine=sglang"):
        load_config(selfplay, ["train.lora.rank=4", "train.lora.per_role=true",
                               "rollout.engine=sglang"])
    cfg = load_config(selfplay, ["train.lora.rank=4", "train.lora.per_role=true"])
    assert role_adapters(cfg) == {"proposer": "policy-proposer", "solver": "policy-solver"}
    assert role_adapters(load_config(selfplay, ["train.lora.rank=4"])) == {}
    tools = load_config(demo, ["train.lora.rank=4", "train.lora.per_role=true",
                               "agent.env=tools", "agent.score_final_answer=true"])
    with pytest.raises(ValueError, match="agent.env='tools' declares no roles"):
        role_adapters(tools)
    with pytest.raises(ValueError, match=r"train.lora.per_role=true .* given roles \(\)"):
        _role_adapters(LORA, ())


# ---------------------------------------------------------------------------- the flow

RUN = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.per_role=true", "train.lr=2e-3",
       "tracking.backend=none", "train.prompts_per_step=2", "rollout.n_samples=4",
       "eval.every=0", "eval.num_examples=2",
       "train.num_threads=1", "rollout.engine_threads=1", "train.steps=2", "checkpoint.every=1"]


def _run(tmp: Path, cache: Path, name: str, resume: str = "never") -> dict:
    from flows.grpo_train import grpo_train

    return grpo_train(config=str(ROOT / "configs" / "selfplay-cpu.yaml"), show_progress=False,
                      overrides=[f"storage.root={tmp}", f"storage.cache_dir={cache}",
                                 f"run_name={name}", *RUN], resume=resume)


def test_per_role_grpo_flow_resumes_exactly(prefect_harness, tiny_cache: Path,
                                            tmp_path: Path) -> None:
    first = _run(tmp_path, tiny_cache, "first")
    run, model = Path(first["run_dir"]), Path(first["model_dir"])
    ckpt = run / "checkpoints" / "step-000001"
    for role in ("proposer", "solver"):
        assert (ckpt / "model" / "adapters" / role / "adapter_model.safetensors").is_file()
        assert (model / "adapters" / role / "adapter_config.json").is_file()
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["sync_bytes"] < 2e6 for m in metrics)  # two adapters, not the model
    shutil.copytree(ckpt, tmp_path / "resumed" / "checkpoints" / "step-000001")
    resumed = _run(tmp_path, tiny_cache, "resumed", resume="always")
    moved = False
    for role in ("proposer", "solver"):
        rel = Path("adapters") / role / "adapter_model.safetensors"
        a, b = load_file(model / rel), load_file(Path(resumed["model_dir"]) / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        moved = moved or any(a[k].abs().max() > 0 for k in a if "lora_B" in k)
    assert moved  # something trained
