"""Token fidelity with a reasoning template: how often re-rendering an episode's conversation
differs from the tokens the model saw, and what each ``agent.template_mismatch`` policy trains.

Short runs of multi-turn episodes on the demo's tiny model (``--model``), with two chat
templates on its tokenizer:

* ``chatml``: the model's own, which only appends;
* ``qwen3``: Qwen3's behaviour cut down: the generation prompt opens an empty reasoning block
  (as Qwen3's does with thinking off) and assistant turns before the last user message are
  rendered without theirs.

Each episode is ``--turns`` model turns; the environment answers with a ``user`` message (a
new query: Qwen3 drops earlier reasoning) or a ``tool`` message (not a query: it keeps it).
Episodes run through :class:`rl_core.agents.EpisodeRunner` and through the OpenAI gateway (an
``openai`` client program per episode, ``user`` replies), under ``keep_prefix`` and
``new_sample``. Reported per run: prompts compared with the template's rendering, how many
differed, the training rows (episodes plus earlier segments), their tokens (what the trainer
computes over), the trained tokens, and the largest |trainer - engine| log-prob over trained
tokens (token exactness: ~1e-6). Prints a table and writes JSON (default
``benchmarks/results/template_fidelity.json``)::

    python -m benchmarks.template_fidelity --model DIR [--tasks 8] [--samples 4] [--turns 4]

``DIR``: the demo's model (``grpoflow bootstrap-model configs/tiny-cpu.yaml`` prints it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "template_fidelity.json"

QWEN3 = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content"
    " + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
)


class _Env:
    """Answers each model turn with a ``role`` message until ``turns`` turns."""

    def __init__(self, role: str, turns: int) -> None:
        self.role, self.turns = role, turns

    def reset(self, task: Any) -> list[dict]:  # noqa: ANN401
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Any) -> Any:  # noqa: ANN401
        from rl_core.agents import StepResult

        done = turn.index + 1 >= self.turns
        return StepResult([] if done else [{"role": self.role, "content": "Go on."}],
                          reward=float(turn.index % 2), done=done)


def _program(turns: int) -> Any:  # noqa: ANN401
    def solve(client: Any, task: Any) -> None:  # noqa: ANN401
        messages = [{"role": "user", "content": task.question}]
        for k in range(turns):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if k < turns - 1:
                messages.append({"role": "user", "content": "Go on."})

    return solve


def _measure(samples: list[Any], trainer: Any) -> dict[str, Any]:  # noqa: ANN401
    import torch

    from rl_core.types import Batch, expand_segments

    eps = [s.meta["episode"] for s in samples]
    assert all(e["status"] == "ok" for e in eps), [e["errors"] for e in eps]
    rows, adv = expand_segments(samples, torch.zeros(len(samples)))
    batch = Batch.from_samples(rows, adv, 0)
    diff = (trainer.compute_logprobs(batch) - batch.rollout_logp).abs()[batch.response_mask]
    checks = sum(e["template_checks"] for e in eps)
    mismatches = sum(e["template_mismatches"] for e in eps)
    return {"episodes": len(samples), "checks": checks, "mismatches": mismatches,
            "mismatch_frac": round(mismatches / max(checks, 1), 3), "rows": len(rows),
            "row_tokens": sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows),
            "trained_tokens": int(batch.response_mask.sum()),
            "max_logp_diff": float(diff.max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the demo's model directory")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="episodes per task")
    ap.add_argument("--turns", type=int, default=4, help="model turns per episode")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner
    from rl_core.agents.gateway import AgentGateway
    from rl_core.agents.programs import run_programs
    from rl_core.config import AlgorithmConfig, TrainConfig
    from rl_core.data.records import Record
    from rl_core.engine.sampling import SamplingParams
    from rl_core.rollout.inprocess import InProcessPlane
    from rl_core.training.torch_trainer import TorchTrainer

    records = [Record(f"t{i}", f"What is {i} + {i + 1}?", f"#### {2 * i + 1}")
               for i in range(args.tasks)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=64 * args.turns)
    trainer = TorchTrainer(args.model, TrainConfig(), AlgorithmConfig(), temperature=1.0)
    plane = InProcessPlane(args.model)
    runs = []
    print(f"{'template':<7} {'replies':<5} {'surface':<7} {'policy':<11} {'checked':>7} "
          f"{'differ':>6} {'rows':>4} {'row tok':>7} {'trained':>7} {'max dlogp':>9}")
    try:
        for template in ("chatml", "qwen3"):
            tok = AutoTokenizer.from_pretrained(args.model)
            if template == "qwen3":
                tok.chat_template = QWEN3
            chat = ChatTokens(tok)
            for surface, role in (("runner", "user"), ("runner", "tool"), ("gateway", "user")):
                for policy in ("keep_prefix", "new_sample"):
                    t0 = time.monotonic()
                    if surface == "runner":
                        runner = EpisodeRunner(
                            plane, chat, lambda role=role: _Env(role, args.turns), limits,
                            template_mismatch=policy)
                        samples = runner.run(records, n=args.samples, params=params, step=1,
                                             seed=0)
                    else:
                        with AgentGateway(plane, chat, template_mismatch=policy) as gateway:
                            samples = run_programs(gateway, _program(args.turns), records,
                                                   n=args.samples, params=params, step=1,
                                                   seed=0, limits=limits)
                    row = {"template": template, "replies": role, "surface": surface,
                           "policy": policy, **_measure(samples, trainer),
                           "seconds": round(time.monotonic() - t0, 2)}
                    runs.append(row)
                    print(f"{template:<7} {role:<5} {surface:<7} {policy:<11} "
                          f"{row['checks']:>7} {row['mismatches']:>6} {row['rows']:>4} "
                          f"{row['row_tokens']:>7} {row['trained_tokens']:>7} "
                          f"{row['max_logp_diff']:>9.1e}")
    finally:
        plane.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "tasks": args.tasks,
                                    "samples": args.samples, "turns": args.turns,
                                    "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
