"""Output a person reads: one line per step, evaluation lines, the final summary.

Formatting only: no I/O beyond returning strings. Never imports Prefect or MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["eval_markdown", "format_eval", "format_step", "format_summary"]

_PHASES = ("rollout", "reward", "logprobs", "train", "sync")


def format_step(step: int, total: int, m: Mapping[str, float], kind: str = "GRPO") -> str:
    """``step 12/60 | reward 0.41 acc 0.41 kl 0.0012 ent 0.53 len 14.2 | 1830 tok/s | ...``;
    an SFT step: ``step  12/300 | loss 2.3450 | lr 1.0e-03 | grad 1.23 | 554 tok | ...``"""
    width = len(str(total))
    if kind == "SFT":
        return (f"step {step:>{width}}/{total} | loss {m['loss']:.4f} | lr {m['lr']:.1e} "
                f"| grad {m['grad_norm']:.2f} | {m['tokens']:.0f} tok | pad "
                f"{m['pad_fraction']:.2f} | {m['tokens_per_s']:.0f} tok/s | {m['time/train']:.2f}s")
    phases = [ph for ph in (*_PHASES, "checkpoint") if f"time/{ph}" in m]
    times = " ".join(f"{ph} {m[f'time/{ph}']:.2f}" for ph in phases)
    # The step's wall time when the flow measured it (an overlapped rollout ran during the
    # previous step's training, so the phases need not add up to it); else their sum.
    total_s = (m["time/step"] + m.get("time/checkpoint", 0.0) if "time/step" in m
               else sum(m[f"time/{ph}"] for ph in phases))
    parts = [
        f"step {step:>{width}}/{total}",
        f"reward {m.get('reward_mean', 0.0):.3f}",
        f"acc {m.get('accuracy', 0.0):.3f}",
        f"kl {m.get('kl', 0.0):.4f}",
        f"ent {m.get('entropy', 0.0):.3f}",
        f"len {m.get('response_len_mean', 0.0):.1f}",
        f"{m.get('rollout_tokens_per_s', 0.0):.0f} tok/s",
        f"{total_s:.2f}s [{times}]",
    ]
    if m.get("reward_errors") or m.get("reward_timeouts"):
        parts.append(f"reward errors {m.get('reward_errors', 0):.0f} "
                     f"timeouts {m.get('reward_timeouts', 0):.0f}")
    return " | ".join(parts)


def format_eval(result: Mapping) -> str:
    """``eval @ step 20: greedy pass@1 0.415 | pass@4 0.781 | len 13.9 | trunc 0.000``; an SFT
    evaluation (with its held-out ``loss``): ``eval @ step 100: loss 0.8123 (n=100) | ...``"""
    if result.get("loss") is not None:
        line = f"eval @ step {result['step']}: loss {result['loss']:.4f} (n={result['num_examples']})"
        if result.get("pass_at_1") is not None:
            line += (f" | greedy accuracy {result['pass_at_1']:.3f} "
                     f"(n={result['accuracy_examples']}) | len {result['response_len_mean']:.1f}"
                     f" | trunc {result['truncation_rate']:.3f}")
        return line
    line = f"eval @ step {result['step']}: greedy pass@1 {result['pass_at_1']:.3f}"
    if result.get("pass_at_k") is not None:
        line += f" | pass@{result['k']} {result['pass_at_k']:.3f}"
    line += (f" | len {result['response_len_mean']:.1f} | trunc {result['truncation_rate']:.3f}"
             f" | n={result['num_examples']}")
    failed = result.get("reward_errors", 0), result.get("reward_timeouts", 0)
    return line + (" | reward errors {} timeouts {}".format(*failed) if any(failed) else "")


def format_summary(summary: Mapping) -> str:
    """The closing block: accuracy (SFT: held-out loss) before and after, time, and where the
    outputs are."""
    first, last, kind = summary["first_eval"], summary["last_eval"], summary.get("kind", "GRPO")
    lines = ["", "=" * 72, f"run {summary['run_name']} finished {summary['steps']} {kind} steps "
             f"in {summary['seconds']:.0f}s"]
    if kind == "SFT":
        lines.append(f"held-out loss: {first['loss']:.4f} (step {first['step']}) -> "
                     f"{last['loss']:.4f} (step {last['step']})")
    if first.get("pass_at_1") is not None and last.get("pass_at_1") is not None:
        gain = 100 * (last["pass_at_1"] - first["pass_at_1"])
        lines.append(f"held-out greedy accuracy: {first['pass_at_1']:.3f} (step {first['step']})"
                     f" -> {last['pass_at_1']:.3f} (step {last['step']})  [{gain:+.1f} points]")
    if first.get("pass_at_k") is not None and last.get("pass_at_k") is not None:
        lines.append(
            f"held-out pass@{last['k']}: {first['pass_at_k']:.3f} -> {last['pass_at_k']:.3f}")
    lines += [f"run directory:  {summary['run_dir']}",
              f"final model:    {summary['model_dir']} (Hugging Face format)",
              f"metrics:        {summary['metrics_path']}"]
    if kind == "SFT":
        lines.append(f"then GRPO:      grpoflow train <GRPO config> model.path={summary['model_dir']}")
    return "\n".join([*lines, "=" * 72])


def eval_markdown(result: Mapping, title: str) -> str:
    """An evaluation (GRPO's, or SFT's with its held-out ``loss``) as a markdown report: the
    numbers, then a few sample generations."""
    rows: list[tuple[str, object]] = [("step", result["step"]),
                                      ("weight version", result["weight_version"])]
    if result.get("loss") is not None:
        rows += [("held-out loss", f"{result['loss']:.4f}"), ("examples", result["num_examples"])]
    if result.get("pass_at_1") is not None:
        rows.append(("greedy pass@1", f"{result['pass_at_1']:.3f}"))
        if result.get("pass_at_k") is not None:
            rows.append((f"pass@{result['k']} (sampled)", f"{result['pass_at_k']:.3f}"))
        rows += [("mean response length", f"{result['response_len_mean']:.1f}"),
                 ("truncation rate", f"{result['truncation_rate']:.3f}"),
                 ("problems", result.get("accuracy_examples", result["num_examples"]))]
    lines = [f"# {title}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if result.get("samples"):
        lines += ["", "| question | completion | answer | correct |", "|---|---|---|---|"]
        for r in result["samples"]:
            cells = [r["question"], r["completion"], r["answer"], r["correct"]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")
