"""Distillation against GRPO on the same small student: held-out accuracy per step and per FLOP.

The student is a smaller embedded tiny model (hidden 96, 2 layers, warm-started like the
demo's, with the demo's tokenizer); the teacher (``--teacher``, a local Hugging Face
directory) is a larger model of the same tokenizer, e.g. the demo model after a GRPO run
(``runs/<run>/model``). Every mode trains its own copy of the student, in this one process,
on the same prompts in the same order (``configs/tiny-cpu.yaml``'s sampler and seed), and
the modes take turns step by step, so the machine's load hits each alike:

- ``grpo``: the task reward (GRPO's group advantages);
- ``distill``: on-policy distillation, the per-token reverse-KL advantage only
  (``teacher.kl_weight``, ``teacher.task_weight=0``);
- ``mix``: both (``teacher.task_weight=1``);
- ``sft``: SFT on the teacher's samples for the step's prompts (the forward KL, by Monte
  Carlo: ``--n-samples`` per prompt at temperature 1, all kept);
- ``sft_correct``: the same, keeping only the samples the reward marks correct (rejection
  sampling).

A mode may carry its own settings: ``distill:lr=1e-3,kl=0.5`` (``lr``, ``kl`` = kl_weight,
``task`` = task_weight, ``norm=1`` = teacher.normalize), so one invocation also compares
learning rates (the pilots). The defaults are what docs/benchmarks.md reports: GRPO at the
demo's lr 1e-4, distillation at 1e-3, SFT at 3e-4, each with ``--warmup-steps`` 5.

GRPO-family steps are ``grpo_train``'s step as rl_core runs it (rollout on the in-process
engine sharing the trainer's weights -> reward -> (teacher scoring) -> advantages ->
reference log-probs -> train -> weight version bump); SFT steps are the SFT flow's
(:func:`rl_core.teacher.teacher_examples` on a teacher plane, then
:meth:`~rl_core.training.sft.SFTTrainer.sft_step`). Every ``--eval-every`` steps each student
answers the same ``--eval-examples`` held-out problems greedily (``rl_core.evaluation``).

FLOPs, approximately (``N`` = parameters, every one counted once; ``P``/``G`` = prompt /
completion tokens of each sample; prefix sharing ignored): a forward pass costs ``2 N`` per
token, a training pass ``6 N``. GRPO: rollout ``2 N_s (P + G)``, reference log-probs
``2 N_s (P + G)``, training ``6 N_s (P + G)``; distillation adds the teacher's scoring
``2 N_t (P + G)``; SFT: the teacher's generation ``2 N_t (P + G)`` for every sample and
training ``6 N_s (P + G)`` for the kept ones. Evaluation is not counted. Prints a table and
writes JSON (default ``benchmarks/results/distill.json``). A benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.distill --teacher runs/<demo run>/model --steps 40``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, format_table, load1, run_meta, write_json

DEFAULT_OUT = RESULTS / "distill.json"
STUDENT = ["model.tiny_hidden_size=96", "model.tiny_layers=2",
           "model.tiny_intermediate_size=256", "model.tiny_target_accuracy=0.15"]
KINDS = ("grpo", "distill", "mix", "sft", "sft_correct")
DEFAULT_MODES = ["grpo", "distill", "distill:norm=1", "mix:norm=1", "sft"]


def _params(model_dir: Path) -> int:
    """Parameters in ``model_dir``'s safetensors (tied weights are stored once)."""
    from safetensors.torch import load_file

    return sum(t.numel() for f in model_dir.glob("*.safetensors") for t in load_file(f).values())


@dataclass
class Mode:
    """One student and how it learns."""

    label: str
    kind: str
    lr: float
    kl: float = 1.0
    task: float = 0.0
    norm: float = 0.0  # teacher.normalize
    state: Any = None  # planes (GRPO family) or (trainer, plane, teacher plane)
    flops: float = 0.0
    seconds: float = 0.0
    evals: list[dict[str, float]] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)


def parse_mode(spec: str, args: argparse.Namespace) -> Mode:
    """``kind[:lr=..,kl=..,task=..]``."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise SystemExit(f"unknown mode {kind!r}; one of {', '.join(KINDS)}")
    lr = args.lr_sft if kind.startswith("sft") else args.lr_distill if kind != "grpo" else args.lr
    m = Mode(spec, kind, lr, kl=args.kl_weight, task=1.0 if kind == "mix" else 0.0)
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        if k not in ("lr", "kl", "task", "norm"):
            raise SystemExit(f"{spec}: unknown setting {k!r} (lr, kl, task, norm)")
        setattr(m, k, float(v))
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-examples", type=int, default=200)
    ap.add_argument("--prompts-per-step", type=int, default=32)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO's learning rate")
    ap.add_argument("--lr-distill", type=float, default=1e-3)
    ap.add_argument("--lr-sft", type=float, default=3e-4)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--warmup-steps", type=int, default=5, help="linear LR warmup, every mode "
                    "(AdamW's first steps move every weight by about lr)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "grpoflow")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    modes = [parse_mode(s, args) for s in args.modes]
    teacher = args.teacher.resolve()
    doc: dict[str, Any] = {**run_meta("benchmarks.distill", argv), "teacher": str(teacher),
                           "teacher_params": _params(teacher), "steps": args.steps,
                           "prompts_per_step": args.prompts_per_step,
                           "n_samples": args.n_samples}
    with tempfile.TemporaryDirectory(prefix="grpoflow-distill-") as tmp:
        bench = _Bench(args, teacher, Path(tmp))
        doc["student_params"] = bench.n_s
        try:
            for m in modes:
                bench.start(m)
            for m in modes:
                m.evals.append(bench.evaluate(m, 0))
            for step in range(1, args.steps + 1):
                indices = bench.sampler.next_batch()
                for m in modes:  # interleaved: the same load on every mode
                    bench.step(m, step, indices)
                if step % args.eval_every == 0 or step == args.steps:
                    for m in modes:
                        m.evals.append(bench.evaluate(m, step))
                line = " | ".join(f"{m.label} {m.steps[-1]['reward_mean']:.2f}" for m in modes)
                print(f"step {step}: reward {line} (load {load1():.1f})", flush=True)
        finally:
            bench.close(modes)
    doc["results"] = {m.label: _summary(m, args.steps) for m in modes}
    print(format_table(
        ["mode", "lr", "pass@1 before", "after", "best", "gain/step", "PFLOP", "gain/PFLOP",
         "s/step", "rev KL first", "rev KL last"],
        [[m.label, m.lr, r["pass_at_1"][0], r["pass_at_1"][-1], max(r["pass_at_1"]),
          r["gain_per_step"], r["pflops"], r["gain_per_pflop"], r["seconds_per_step"],
          r["reverse_kl_first"], r["reverse_kl_last"]]
         for m, r in zip(modes, doc["results"].values(), strict=True)]))
    write_json(args.out, doc)
    return 0


def _summary(m: Mode, steps: int) -> dict[str, Any]:
    acc = [e["pass_at_1"] for e in m.evals]
    gain = acc[-1] - acc[0]
    kl = [s["distill/reverse_kl"] for s in m.steps if "distill/reverse_kl" in s]
    rewards = [s["reward_mean"] for s in m.steps]
    return {
        "kind": m.kind, "lr": m.lr, "kl_weight": m.kl, "task_weight": m.task,
        "eval_steps": [e["step"] for e in m.evals], "pass_at_1": acc,
        "flops_at_eval": [e["flops"] for e in m.evals],
        "gain_per_step": gain / steps, "pflops": m.flops / 1e15,
        "gain_per_pflop": gain / max(m.flops / 1e15, 1e-12),
        "reverse_kl_first": kl[0] if kl else float("nan"),
        "reverse_kl_last": statistics.fmean(kl[-5:]) if kl else float("nan"),
        "reward_mean": rewards, "seconds_per_step": m.seconds / max(len(m.steps), 1),
        "steps": m.steps,
    }


class _ForwardScorer:
    """The teacher's prefill scores (:meth:`~rl_core.rollout.http.HttpPlane.score`'s
    answer) from one batched forward pass of the teacher model per prompt group: the same
    numbers (tests/test_distill.py checks the engine's scores against this computation), but
    the embedded engine prefills each scoring request alone, which took 95 s for one step's
    256 sequences on this machine against 8.6 s for generating them."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path).eval()

    def score(self, prompt: list[int], completions: list[list[int]]) -> list[list[float]]:
        import torch

        rows = [[*prompt, *c] for c in completions]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        with torch.no_grad():
            logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask)
                                     .logits.float(), -1)
        start = len(prompt) - 1  # the logits at position p score token p + 1
        return [logp[i, start : start + len(c)].gather(-1, ids[i, start + 1 : start + 1 + len(c)]
                                                        [:, None]).squeeze(-1).tolist()
                for i, c in enumerate(completions)]

    def close(self) -> None:
        pass


class _Bench:
    """The shared pieces: config, data, the student's and the teacher's models, the sampler."""

    def __init__(self, args: argparse.Namespace, teacher: Path, tmp: Path) -> None:
        from rl_core.base_model import snapshot_model
        from rl_core.config import load_config
        from rl_core.data.sampler import PromptSampler
        from rl_core.data.synthetic import generate_splits

        self.args, self.teacher, self.tmp = args, teacher, tmp
        self.cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
            *STUDENT, f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts_per_step}",
            f"rollout.n_samples={args.n_samples}", "rollout.engine=local",
            f"train.warmup_steps={args.warmup_steps}",
            "rollout.weight_sync=shared", f"train.num_threads={args.threads}",
            "tracking.backend=none", f"storage.cache_dir={args.cache_dir}"])
        d = self.cfg.data
        self.train, test = generate_splits(d.synthetic_train_size, d.synthetic_test_size, d.seed,
                                           **d.synthetic_knobs())
        self.test = test[: args.eval_examples]
        self.student = snapshot_model(self.cfg.model, d, args.cache_dir).path
        self.n_s, self.n_t = _params(Path(self.student)), _params(teacher)
        self.sampler = PromptSampler(len(self.train), self.cfg.train.prompts_per_step,
                                     self.cfg.seed)
        self.scorer = _ForwardScorer(teacher)

    def _cfg(self, m: Mode) -> Any:
        over = {"train": self.cfg.train.model_copy(update={"lr": m.lr})}
        if m.kind in ("distill", "mix"):
            over["teacher"] = self.cfg.teacher.model_copy(update={
                "path": str(self.teacher), "engine": "local", "kl_weight": m.kl,
                "task_weight": m.task, "normalize": bool(m.norm)})
        return self.cfg.model_copy(update=over)

    def start(self, m: Mode) -> None:
        from rl_core.planes import bring_up_planes, get_planes

        if not m.kind.startswith("sft"):
            handle = bring_up_planes(self._cfg(m), self.student, self.train, self.test,
                                     self.tmp / m.label.replace(":", "_"))
            planes = get_planes(handle)
            if planes.teacher is not None:  # checked and started; scored by a forward pass
                planes.teacher.close()
                planes.teacher = self.scorer
            m.state = planes, handle
            return
        from transformers import AutoTokenizer

        from rl_core.data.prompts import encode_prompts
        from rl_core.rewards import RewardRunner
        from rl_core.rollout.inprocess import InProcessPlane
        from rl_core.sft import SFTDataConfig, SFTTrainConfig
        from rl_core.training.sft import SFTTrainer

        c = self.cfg
        train = SFTTrainConfig(steps=self.args.steps, batch_size=1, micro_batch_size=256,
                               lr=m.lr, lr_schedule=c.train.lr_schedule,
                               warmup_steps=c.train.warmup_steps,
                               min_lr_ratio=c.train.min_lr_ratio, grad_clip=c.train.grad_clip,
                               num_threads=self.args.threads, seed=c.seed)
        data = SFTDataConfig(max_seq_len=512, teacher={
            "path": str(self.teacher), "engine": "local", "samples_per_prompt": self.args.n_samples,
            "max_new_tokens": c.rollout.max_new_tokens,
            "keep": "correct" if m.kind == "sft_correct" else "all"})
        tok = AutoTokenizer.from_pretrained(self.student)
        trainer = SFTTrainer(self.student, train, pad_id=tok.pad_token_id, pack_length=512)
        m.state = {"trainer": trainer, "tok": tok, "data": data,
                   "plane": InProcessPlane(self.student, share=trainer.model),
                   "teacher": InProcessPlane(self.teacher),
                   "rewards": RewardRunner.from_config(c.reward),
                   "eval_prompts": encode_prompts(tok, [r.question for r in self.test])}

    def step(self, m: Mode, step: int, indices: list[int]) -> None:
        started = time.perf_counter()
        metrics = (self._sft_step if m.kind.startswith("sft") else self._grpo_step)(
            m, step, indices)
        m.seconds += time.perf_counter() - started
        m.flops += metrics["flops"]
        m.steps.append({"step": step, **metrics})

    def _grpo_step(self, m: Mode, step: int, indices: list[int]) -> dict[str, float]:
        """``flows/grpo_train.grpo_step`` as rl_core runs it (no Prefect)."""
        from rl_core.engine.sampling import SamplingParams
        from rl_core.grpo import advantages_for, rollout_groups, score_samples, summarize_samples
        from rl_core.teacher import distill_advantages, score_with_teacher
        from rl_core.types import Batch

        p, _ = m.state
        r, n = p.config.rollout, p.config.rollout.n_samples
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens)
        samples = rollout_groups(p.rollout, [p.train_records[i] for i in indices],
                                 [p.train_prompts[i] for i in indices], n=n, params=params,
                                 step=step, seed=p.config.seed)
        score_samples(samples, p.reward_runner, step)
        metrics = summarize_samples(samples, n)
        if p.teacher is not None:
            metrics.update(score_with_teacher(p.teacher, samples))
        batch = Batch.from_samples(samples, advantages_for(samples, n, p.config.algorithm.advantage),
                                   p.pad_token_id)
        if p.teacher is not None:
            batch.advantages = distill_advantages(batch, samples, p.config.teacher)
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        forwards = 1  # the rollout
        if p.trainer.needs_old_logp:
            batch.old_logp = p.trainer.compute_logprobs(batch)
            forwards += 1
        if p.trainer.has_ref_model:
            batch.ref_logp = p.trainer.compute_logprobs(batch, reference=True)
            forwards += 1
        metrics.update({k: v for k, v in p.trainer.train_step(batch).items()
                        if isinstance(v, int | float)})
        p.sync_weights(step)
        metrics["flops"] = (2 * forwards + 6) * self.n_s * tokens + (
            2 * self.n_t * tokens if p.teacher is not None else 0)
        return metrics

    def _sft_step(self, m: Mode, step: int, indices: list[int]) -> dict[str, float]:
        """The SFT flow's data (teacher samples of the step's prompts) and its step."""
        from rl_core.sft import Example, tokenize_example
        from rl_core.teacher import teacher_examples

        s = m.state
        rows = [self.train[i] for i in indices]
        data = s["data"].model_copy(update={"teacher": s["data"].teacher.model_copy(
            update={"seed": step})})
        examples = [Example(r.id, f"train {i}", prompt=r.question, completion=r.answer)
                    for i, r in zip(indices, rows, strict=True)]
        kept, counts = teacher_examples(s["teacher"], s["tok"], examples, data)
        tokenized = [tokenize_example(s["tok"], e, data) for e in kept]
        metrics = s["trainer"].sft_step(tokenized, step)
        trained = sum(len(t.ids) for t in tokenized)
        metrics.update({"reward_mean": counts["correct"] / counts["samples"],
                        "kept": counts["kept"],
                        "flops": 2 * self.n_t * (counts["prompt_tokens"]
                                                 + counts["completion_tokens"])
                        + 6 * self.n_s * trained})
        return metrics

    def evaluate(self, m: Mode, step: int) -> dict[str, float]:
        from rl_core.evaluation import evaluate

        if m.kind.startswith("sft"):
            s = m.state
            plane, prompts, rewards = s["plane"], s["eval_prompts"], s["rewards"]
            with plane.paused() as engines:  # the trainer changed the weights it serves
                for engine in engines:
                    engine.weights_changed_in_place(step)
        else:
            p, _ = m.state
            plane, prompts, rewards = p.rollout, p.eval_prompts, p.reward_runner
        result = evaluate(plane, self.test, prompts, rewards,
                          max_new_tokens=self.cfg.rollout.max_new_tokens, k=1)
        print(f"eval @ step {step}: {m.label} pass@1 {result.pass_at_1:.3f} "
              f"({m.flops / 1e12:.2f} TFLOP)", flush=True)
        return {"step": step, "pass_at_1": result.pass_at_1, "flops": m.flops}

    def close(self, modes: list[Mode]) -> None:
        from rl_core.planes import tear_down

        for m in modes:
            if isinstance(m.state, tuple):
                tear_down(m.state[1])
            elif isinstance(m.state, dict):
                for k in ("plane", "teacher", "rewards"):
                    m.state[k].close()


if __name__ == "__main__":
    raise SystemExit(main())
