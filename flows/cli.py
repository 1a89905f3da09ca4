"""The ``grpoflow`` command line.

    grpoflow train [CONFIG] [section.key=value ...]     run the GRPO flow
    grpoflow evaluate [CONFIG] [--model PATH] [...]     greedy pass@1 and sampled pass@k
    grpoflow bootstrap-model [--out DIR] [CONFIG] [...] build the embedded tiny model

Flows run on Prefect's ephemeral API unless ``PREFECT_API_URL`` points at a server:
nothing to install or start. This module lives in ``flows/`` because it starts flows;
``rl_core`` stays free of Prefect.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

__all__ = ["main"]


def _env_defaults() -> None:
    """Settings for Prefect read at import time; a user's environment wins."""
    # Prefect's own INFO lines would interleave with the step lines and the progress bar;
    # they still reach the Prefect API (and its UI) at INFO.
    for handler in ("CONSOLE", "CONSOLE_FLOW_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_HANDLERS_{handler}_LEVEL", "WARNING")
    # The ephemeral API's first start migrates a fresh SQLite database: 20 s (Prefect's
    # default bound) is not enough on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Telemetry writes race the flow's own writes on the ephemeral SQLite database.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Per-file "Loading weights" bars drown the step lines; the run has its own bar.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (e.g. configs/tiny-cpu.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides: algorithm.kl_coef=0.001")


def _split(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A first positional with '=' is an override, not a config path."""
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    return config, overrides


def cmd_train(args: argparse.Namespace) -> int:
    from flows.grpo_train import grpo_train

    config, overrides = _split(args)
    summary = grpo_train(config=config, overrides=overrides, show_progress=not args.quiet)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from flows.evaluate import evaluate
    from rl_core.report import format_eval

    config, overrides = _split(args)
    result = evaluate(config=config, overrides=overrides, model=args.model)
    print(format_eval(result))
    for row in result["samples"][: args.show]:
        mark = "ok " if row["correct"] == "True" else "bad"
        print(f"  [{mark}] {row['question']!r} -> {row['completion']!r} (answer {row['answer']})")
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from rl_core.config import load_config
    from rl_core.models.hub import tiny_spec_for
    from rl_core.models.tiny import bootstrap_tiny_model

    config, overrides = _split(args)
    cfg = load_config(config, overrides)
    spec = tiny_spec_for(cfg.model, cfg.data)
    out = Path(args.out or Path(cfg.storage.cache_dir) / "models" / f"tiny-{spec.digest()}")

    def progress(step: int, loss: float, acc: float | None) -> None:
        if acc is not None:
            print(f"warm start step {step}: loss {loss:.3f} validation greedy accuracy {acc:.3f}")

    path = bootstrap_tiny_model(out, spec, force=args.force, progress=progress)
    info = json.loads((path / "grpoflow_tiny.json").read_text())
    print(
        f"tiny model: {path} ({info['parameters'] / 1e6:.2f}M parameters, "
        f"{info['sft_steps']} warm-start steps, validation greedy accuracy "
        f"{info['val_greedy_accuracy']:.3f}, built in {info['seconds']}s)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpoflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run GRPO training (Prefect flow grpo-train)")
    _config_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar or step lines")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="evaluate a model on the held-out set")
    _config_args(p)
    p.add_argument("--model", help="HF directory or hub id (default: model.path)")
    p.add_argument("--show", type=int, default=4, help="sample generations to print")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("bootstrap-model", help="build the embedded tiny model")
    _config_args(p)
    p.add_argument("--out", help="output directory (default: the cache entry)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=cmd_bootstrap)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("rl_core").addHandler(handler)
    logging.getLogger("rl_core").setLevel(logging.INFO)
    _env_defaults()
    from rl_core.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"grpoflow: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
