"""Output a person reads: one line per step, evaluation lines, the final summary.

Formatting only: no I/O beyond returning strings. Never imports Prefect or MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["format_eval", "format_step", "format_summary"]

_PHASES = ("rollout", "reward", "logprobs", "train", "sync")


def format_step(step: int, total: int, m: Mapping[str, float]) -> str:
    """``step 12/60 | reward 0.41 acc 0.41 kl 0.0012 ent 0.53 len 14.2 | 1830 tok/s | ...``"""
    width = len(str(total))
    times = " ".join(f"{ph} {m.get(f'time/{ph}', 0.0):.2f}" for ph in _PHASES)
    total_s = sum(m.get(f"time/{ph}", 0.0) for ph in _PHASES)
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
    extra = []
    if m.get("reward_errors") or m.get("reward_timeouts"):
        extra.append(
            f"reward errors {m.get('reward_errors', 0):.0f} "
            f"timeouts {m.get('reward_timeouts', 0):.0f}"
        )
    return " | ".join(parts + extra)


def format_eval(result: Mapping) -> str:
    """``eval @ step 20: greedy pass@1 0.415 | pass@4 0.781 | len 13.9 | trunc 0.000``"""
    line = f"eval @ step {result['step']}: greedy pass@1 {result['pass_at_1']:.3f}"
    if result.get("pass_at_k") is not None:
        line += f" | pass@{result['k']} {result['pass_at_k']:.3f}"
    line += (
        f" | len {result['response_len_mean']:.1f} | trunc {result['truncation_rate']:.3f}"
        f" | n={result['num_examples']}"
    )
    return line


def format_summary(summary: Mapping) -> str:
    """The closing block: accuracy before and after, time, and where the outputs are."""
    first, last = summary["first_eval"], summary["last_eval"]
    gain = 100 * (last["pass_at_1"] - first["pass_at_1"])
    lines = [
        "",
        "=" * 72,
        f"run {summary['run_name']} finished {summary['steps']} GRPO steps "
        f"in {summary['seconds']:.0f}s",
        f"held-out greedy accuracy: {first['pass_at_1']:.3f} (step {first['step']}) -> "
        f"{last['pass_at_1']:.3f} (step {last['step']})  [{gain:+.1f} points]",
    ]
    if first.get("pass_at_k") is not None and last.get("pass_at_k") is not None:
        lines.append(
            f"held-out pass@{last['k']}: {first['pass_at_k']:.3f} -> {last['pass_at_k']:.3f}"
        )
    lines += [
        f"run directory:  {summary['run_dir']}",
        f"final model:    {summary['model_dir']} (Hugging Face format)",
        f"metrics:        {summary['metrics_path']}",
        "=" * 72,
    ]
    return "\n".join(lines)
