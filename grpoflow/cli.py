"""The ``grpoflow`` command line.

Subcommands: ``grpoflow --help``. Flows run on Prefect's ephemeral API unless
``PREFECT_API_URL`` points at a server. A config that cannot work is refused before any flow
runs (:func:`rl_core.preflight.preflight`): ``grpoflow: <one paragraph>`` on stderr, exit 2. A
failure inside a flow is reported the same way (exit 1; 2 for config, model, storage and
checkpoint errors), Prefect's tracebacks only with ``--debug`` (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _env_defaults() -> None:
    """Settings for Prefect read at import time; a user's environment wins."""
    # Prefect's own INFO lines would interleave with the step lines and the progress bar;
    # they still reach the Prefect API (and its UI) at INFO.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    # The ephemeral API's first start migrates a fresh SQLite database: 20 s (Prefect's
    # default bound) is not enough on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Telemetry writes race the flow's own writes on the ephemeral SQLite database.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Per-file "Loading weights" bars drown the step lines; the run has its own bar.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _config_args(p: argparse.ArgumentParser, example: str = "configs/tiny-cpu.yaml",
                 override: str = "algorithm.kl_coef=0.001") -> None:
    p.add_argument("config", nargs="?", help=f"YAML config (e.g. {example})")
    p.add_argument("overrides", nargs="*", help=f"dotted overrides: {override}")
    p.add_argument("--debug", action="store_true",
                   help="on failure, show Prefect's failure logs and the full traceback")


def _split(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A first positional with '=' is an override, not a config path."""
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():
        overrides.insert(0, config)
        config = None
    return config, overrides


def _checked(args: argparse.Namespace, extra: Sequence[str] = (), revision: str | None = None,
             **checks: bool) -> tuple[str | None, list[str]]:
    """Load the config (+ ``extra`` overrides, ``model.revision``) and run the pre-flight
    checks on it, before any flow starts; returns (config path, overrides)."""
    from rl_core.config import load_config
    from rl_core.preflight import preflight

    config, overrides = _split(args)
    cfg = load_config(config, [*overrides, *extra])
    if revision:  # assigned, not an override: YAML would read a tag like 1.0 as a number
        cfg.model.revision = revision
    preflight(cfg, **checks)
    return config, overrides


def _flow(target: str, debug: bool) -> Callable[..., Any]:
    """Import the flow ``module:name``; from here on Prefect's console logging is set up, so
    its failure records (a failed task or flow run, with the traceback) are kept off the
    console unless ``debug``: :func:`main` prints the failure as one paragraph."""
    module, name = target.split(":")
    flow = getattr(importlib.import_module(module), name)
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            for old in [f for f in handler.filters if isinstance(f, _ConsoleFilter)]:
                handler.removeFilter(old)
            handler.addFilter(_ConsoleFilter(debug))
    return flow


class _ConsoleFilter(logging.Filter):
    """On Prefect's console handler: drop ``rl_core`` records (the CLI's own handler prints
    them) and, unless debugging, Prefect's ERROR records (they still reach the Prefect API)."""

    def __init__(self, debug: bool) -> None:
        super().__init__()
        self.debug = debug

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("rl_core"):
            return False
        return self.debug or not (record.name.startswith("prefect") and record.levelno >= 40)


def cmd_train(args: argparse.Namespace) -> int:
    config, overrides = _checked(args)
    grpo_train = _flow("flows.grpo_train:grpo_train", args.debug)
    summary = grpo_train(
        config=config, overrides=overrides, show_progress=not args.quiet, resume=args.resume
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from rl_core.sft import load_sft_config

    config, overrides = _split(args)
    load_sft_config(config, overrides)  # a bad config fails here, before any flow starts
    sft_train = _flow("flows.sft:sft_train", args.debug)
    summary = sft_train(config=config, overrides=overrides, show_progress=not args.quiet,
                        resume=args.resume)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def stage_overrides(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """``post-train``'s overrides, ``sft.K=V`` and ``grpo.K=V``, split by stage (unprefixed)."""
    from rl_core.config import ConfigError

    out: dict[str, list[str]] = {"sft": [], "grpo": []}
    for item in items:
        stage, _, key = item.partition(".")
        if stage not in out or "=" not in key:
            raise ConfigError(f"post-train: {item!r}: prefix each override with its stage, "
                              f"sft.<key>=V or grpo.<key>=V (e.g. sft.train.steps=100)")
        out[stage].append(key)
    return out["sft"], out["grpo"]


def cmd_post_train(args: argparse.Namespace) -> int:
    from rl_core.config import load_config
    from rl_core.preflight import preflight
    from rl_core.sft import load_sft_config

    sft, grpo = stage_overrides(args.overrides)
    args.sft_override, args.grpo_override = [*args.sft_override, *sft], [*args.grpo_override, *grpo]
    load_sft_config(args.sft_config, args.sft_override)  # bad configs fail before any flow
    preflight(load_config(args.grpo_config, args.grpo_override), model=False)
    post_train = _flow("flows.pipeline:post_train", args.debug)
    summary = post_train(sft_config=args.sft_config, grpo_config=args.grpo_config,
                         sft_overrides=args.sft_override, grpo_overrides=args.grpo_override,
                         run_name=args.run_name, show_progress=not args.quiet,
                         resume=args.resume)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        from flows.pipeline import format_post_train

        print(format_post_train(summary))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from rl_core.report import format_eval

    registered = args.registry or args.registered_like or (args.model or "").startswith("models:/")
    model = [f"model.path={args.model}"] if args.model and not registered else []
    config, overrides = _checked(args, model, model=not registered)  # the registry's model
    evaluate = _flow("flows.evaluate:evaluate", args.debug)
    if args.registry or args.registered_like:
        out = evaluate(config=config, overrides=overrides, registry=args.registry,
                       registered_like=args.registered_like)
        print(json.dumps(out, indent=2, default=str))
        return 0
    result = evaluate(config=config, overrides=overrides, model=args.model)
    print(format_eval(result))
    for row in result["samples"][: args.show]:
        mark = "ok " if row["correct"] == "True" else "bad"
        print(f"  [{mark}] {row['question']!r} -> {row['completion']!r} (answer {row['answer']})")
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    config, overrides = _checked(args, model=False)
    out = _flow("flows.assets:prepare_data_flow", args.debug)(config=config, overrides=overrides)
    status = "cached" if out["cached"] else "prepared"
    print(
        f"data {status}: {out['num_train']} train / {out['num_eval']} eval records\n"
        f"  {out['train_path']} (sha256 {out['train_digest'][:16]})\n"
        f"  {out['eval_path']} (sha256 {out['eval_digest'][:16]})"
    )
    return 0


def cmd_download_model(args: argparse.Namespace) -> int:
    uri = [f"model.path={args.uri}"] if args.uri else []
    config, overrides = _checked(args, uri, args.revision, data=False)
    download = _flow("flows.assets:download_model", args.debug)
    print(download(config=config, overrides=overrides, uri=args.uri, revision=args.revision))
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from rl_core.base_model import bootstrap_tiny_model
    from rl_core.config import load_config
    from rl_core.models.hub import tiny_spec_for

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


def cmd_serve_tinker(args: argparse.Namespace) -> int:
    """The Tinker-compatible service (grpoflow.tinker.serve) until Ctrl-C."""
    from grpoflow.tinker.serve import serve_from_cli

    return serve_from_cli(*_split(args))


def cmd_tracking(argv: list[str]) -> int:
    """``tracking replay FILE``: send ``<run_dir>/mlflow-unsent-metrics.jsonl`` to MLflow."""
    p = argparse.ArgumentParser(
        prog="grpoflow tracking",
        description="send the metrics a run could not deliver to its MLflow server",
    )
    p.add_argument("action", choices=["replay"])
    p.add_argument("file", help="<run_dir>/mlflow-unsent-metrics.jsonl")
    p.add_argument("--uri", help="tracking URI (default: MLFLOW_TRACKING_URI, else the file's)")
    args = p.parse_args(argv)
    from rl_core.secrets import redact
    from tasks.tracking import replay_unsent

    try:
        out = replay_unsent(args.file, args.uri)
    except Exception as exc:  # the file stays: nothing is lost, run it again later
        print(f"grpoflow: replay failed, {args.file} kept: {redact(str(exc))[:500]}",
              file=sys.stderr)
        return 1
    print(
        f"replayed {out['metrics']} metric values ({out['skipped']} already there) and "
        f"{out['tables']} tables of {out['runs']} run(s) from {args.file}"
    )
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    import yaml

    from rl_core.config import load_config
    from rl_core.secrets import redact_config
    from rl_core.validate import validate

    config, overrides = _split(args)
    cfg = load_config(config, overrides)
    findings = validate(cfg, rows=args.rows)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        print("resolved config (secrets masked):")
        print(yaml.safe_dump(redact_config(cfg.model_dump(mode="json")), sort_keys=False))
        for f in findings:
            print(f"{f.status:<4}  {f.what}: {f.detail}")
    failed = [f for f in findings if f.status == "fail"]
    if failed and not args.json:
        print(f"grpoflow: {len(failed)} check(s) failed; fix them before `grpoflow train`",
              file=sys.stderr)
    return 2 if failed else 0


def cmd_runs(args: argparse.Namespace) -> int:
    from rl_core.config import load_config
    from rl_core.rundir import format_runs, list_runs

    if args.root:
        root = args.root
    else:
        config, overrides = _split(args)
        root = load_config(config, overrides).storage.root
    runs = list_runs(root)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print(f"no runs under {Path(root).expanduser().resolve()}")
        return 0
    print(format_runs(runs))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from rl_core.config import load_config
    from rl_core.rundir import write_control

    run = Path(args.run)
    if not run.is_dir():
        run = Path(args.root or load_config(args.config).storage.root).expanduser() / args.run
    path = write_control(run, rollout__num_engines=args.engines)
    print(f"{path}: rollout.num_engines={args.engines} (the run applies it at its next step)")
    return 0


def _plain(text: str) -> str:
    """A docstring line for ``--help``: ``x`` and :role:`x` as plain x."""
    import re

    return re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"grpoflow {version('grpoflow')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "grpoflow (not installed)"


_REFERENCE = ("every config field, its type, default and meaning: docs/configuration.md; "
              "shipped configs: configs/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpoflow", description=_plain(__doc__.split("\n")[0]),
                                     epilog=_REFERENCE)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run GRPO training (Prefect flow grpo-train)",
                       epilog=_REFERENCE)
    _config_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar or step lines")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--resume", dest="resume", action="store_const", const="always", default="auto",
        help="continue from the latest complete checkpoint (of run_name, or of the newest "
        "run of this config); fail if there is none",
    )
    group.add_argument(
        "--no-resume", dest="resume", action="store_const", const="never",
        help="start over even if the run directory has a checkpoint",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised fine-tuning (Prefect flow sft-train); its "
                       "model feeds `train` as model.path (docs/sft.md)",
                       epilog="SFT config fields: docs/sft.md; shipped: configs/sft-*.yaml")
    _config_args(p, "configs/sft-tiny-cpu.yaml", "train.steps=100")
    p.add_argument("--quiet", action="store_true", help="no progress bar or step lines")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--resume", dest="resume", action="store_const", const="always",
                       default="auto", help="continue from the latest complete checkpoint")
    group.add_argument("--no-resume", dest="resume", action="store_const", const="never",
                       help="start over even if the run directory has a checkpoint")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("post-train", help="SFT, then GRPO from its export, then the registry "
                       "evaluation (Prefect flow post-train; docs/deployments.md)")
    p.add_argument("sft_config", help="SFT YAML config (e.g. configs/sft-tiny-cpu.yaml)")
    p.add_argument("grpo_config", help="GRPO YAML config (e.g. configs/tiny-cpu.yaml)")
    p.add_argument("overrides", nargs="*", metavar="STAGE.K=V",
                   help="dotted overrides prefixed with their stage: sft.train.steps=100 "
                   "grpo.train.steps=20 (not grpo.model.path: the SFT export)")
    p.add_argument("--sft-override", nargs="+", action="extend", default=[], metavar="K=V",
                   help="the same as sft.K=V")
    p.add_argument("--grpo-override", nargs="+", action="extend", default=[], metavar="K=V",
                   help="the same as grpo.K=V")
    p.add_argument("--run-name", help="names the chain and its runs <name>-sft, <name>-grpo; "
                   "the same name again skips finished stages and resumes the others")
    p.add_argument("--no-resume", dest="resume", action="store_const", const="never",
                   default="auto", help="run every stage again from scratch")
    p.add_argument("--quiet", action="store_true", help="no progress bars or step lines")
    p.add_argument("--json", action="store_true", help="print the chain's summary as JSON")
    p.add_argument("--debug", action="store_true",
                   help="on failure, show Prefect's failure logs and the full traceback")
    p.set_defaults(func=cmd_post_train)

    p = sub.add_parser("evaluate", help="evaluate a model on the held-out set")
    _config_args(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="HF directory, hub id or registry URI models:/NAME@ALIAS "
                       "(default: model.path)")
    which.add_argument("--registry", action="store_true", help="evaluate the registry's "
                       "candidate and champion and promote (needs tracking.uri)")
    which.add_argument("--registered-like", metavar="PATTERN", help="evaluate the newest version "
                       "of every registered model named like PATTERN (SQL LIKE, e.g. 'tinker-%%'; "
                       "needs tracking.uri); versions already scored on this data are not rerun")
    p.add_argument("--show", type=int, default=4, help="sample generations to print")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("prepare-data", help="validate and snapshot the data (flow)")
    _config_args(p)
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("download-model", help="fetch and verify the model (flow)")
    _config_args(p)
    p.add_argument("--uri", help="HF hub id or local directory (default: model.path)")
    p.add_argument("--revision", help="hub branch, tag or commit (default: model.revision)")
    p.set_defaults(func=cmd_download_model)

    sub.add_parser(
        "engine", help="`engine serve --model PATH --port P`: the embedded SGLang-compatible "
        "engine (see `grpoflow engine serve --help`)"
    )
    sub.add_parser(
        "doctor", help="what this machine has and what the config needs (see `doctor --help`)"
    )
    sub.add_parser(
        "plan", help="recommend TP/PP/DP for both planes (see `grpoflow plan --help`)"
    )
    sub.add_parser(
        "deploy", help="register deployments/prefect.yaml with the Prefect server at "
        "PREFECT_API_URL (see `grpoflow deploy --help`)"
    )
    sub.add_parser(
        "tracking", help="`tracking replay FILE`: send a run's unsent MLflow metrics "
        "(see `grpoflow tracking --help`)"
    )

    p = sub.add_parser("validate", help="check a config without starting a run: pre-flight, "
                       "model, data rows, prompts, reward, where the planes run",
                       epilog=_REFERENCE)
    _config_args(p)
    p.add_argument("--rows", type=int, default=8, help="data rows to read and check")
    p.add_argument("--json", action="store_true", help="the findings as JSON")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("runs", help="the runs under storage.root: status, steps, last and "
                       "best evaluation, model")
    _config_args(p)
    p.add_argument("--root", help="the runs' directory (default: the config's storage.root)")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("scale", help="change a running job's rollout engines (joined from the "
                       "staged weights, probed; drained before they leave)")
    p.add_argument("run", help="the run's directory, or its name under --root")
    p.add_argument("--engines", type=int, required=True, help="rollout.num_engines from now on")
    p.add_argument("--root", help="the runs' directory (default: --config's storage.root)")
    p.add_argument("--config", help="the run's config, for its storage.root")
    p.add_argument("--debug", action="store_true", help="the full traceback on failure")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("serve-tinker", help="serve the Tinker API: the real tinker SDK trains "
                       "and samples LoRA adapters here (grpoflow.tinker; "
                       "docs/tinker-protocol.md)")
    _config_args(p, "configs/tinker-tiny-cpu.yaml", "port=8001")
    p.set_defaults(func=cmd_serve_tinker)

    p = sub.add_parser("bootstrap-model", help="build the embedded tiny model")
    _config_args(p)
    p.add_argument("--out", help="output directory (default: the cache entry)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=cmd_bootstrap)
    return parser


# Seconds a stopped command may take to exit once its flow has torn the planes down.
EXIT_DEADLINE_S = 30.0


def main(argv: list[str] | None = None) -> int:
    entry = argv is None  # the process's own command line (not a test calling main())
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["engine", "serve"]:
        # The embedded engine has its own flags (rl_core.engine.server.main).
        from rl_core.engine.server import main as serve_main

        return serve_main(argv[2:])
    if argv[:1] == ["engine"]:  # the group alone, or --help: what it holds
        print("usage: grpoflow engine serve --model PATH [--port P] [...]\n\n"
              "  serve  the embedded SGLang-compatible engine "
              "(grpoflow engine serve --help)",
              file=sys.stdout if argv[1:2] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    if argv[:1] == ["doctor"]:
        from grpoflow.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["plan"]:
        from rl_core.cluster.planner import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["deploy"]:
        from grpoflow.deploy import main as deploy_main

        return deploy_main(argv[1:])
    if argv[:1] == ["tracking"]:
        return cmd_tracking(argv[1:])
    parser = build_parser()
    # Overrides may come after options too (`evaluate CONFIG --model M eval.k=8`).
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    from rl_core.secrets import RedactFilter

    rl_core_log = logging.getLogger("rl_core")
    for old in [h for h in rl_core_log.handlers if h.get_name() == "grpoflow-cli"]:
        rl_core_log.removeHandler(old)  # main() called again in one process (tests)
    handler = logging.StreamHandler()
    handler.set_name("grpoflow-cli")
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RedactFilter())  # credentials never reach the terminal
    rl_core_log.addHandler(handler)
    rl_core_log.setLevel(logging.INFO)
    _env_defaults()
    if entry and args.command in ("train", "sft", "post-train", "evaluate"):
        _stop_cleanly()
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - every failure ends as one paragraph
        return _failed(args, exc)
    except BaseException as exc:
        # Ctrl-C, or SIGTERM: ours (Terminated), or Prefect's TerminationSignal in a flow
        # that installed its own handler. The flow has torn its planes down on the way out.
        if isinstance(exc, Terminated) or type(exc).__name__ == "TerminationSignal":
            print("grpoflow: stopped by SIGTERM; the flow tore its planes down", file=sys.stderr)
            code = 143
        elif isinstance(exc, KeyboardInterrupt):
            print("grpoflow: interrupted", file=sys.stderr)
            code = 130
        else:
            raise
        _exit_soon(code)
        return code


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C (a flow run ends Crashed, its planes
    torn down)."""


def _stop_cleanly() -> None:
    """A run leaves nothing behind (grpoflow.reaper), and SIGTERM stops it the way Ctrl-C
    does (:class:`Terminated`): the flow run ends Crashed and tears its planes down."""
    import signal

    from grpoflow import reaper

    reaper.start()

    def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ANN401
        raise Terminated

    signal.signal(signal.SIGTERM, on_sigterm)


def _exit_soon(code: int) -> None:
    """Bound the interpreter's exit after a stop (a thread that does not end cannot hold it)."""
    from grpoflow import reaper

    reaper.exit_within(EXIT_DEADLINE_S, code)


def _failed(args: argparse.Namespace, exc: Exception) -> int:
    """A failure as one paragraph on stderr; the exit code (2: config, checkpoint, storage)."""
    from rl_core.checkpoint import CheckpointError  # not before: 1 s of imports
    from rl_core.config import ConfigError
    from rl_core.secrets import redact
    from rl_core.storage import StorageError

    if args.debug:
        traceback.print_exc()
    if isinstance(exc, ConfigError | CheckpointError | StorageError):
        print(f"grpoflow: {redact(str(exc))}", file=sys.stderr)
        return 2
    hint = "" if args.debug else "; run it again with --debug for the traceback"
    print(f"grpoflow: {args.command} failed: {redact(str(exc)) or type(exc).__name__} "
          f"({type(exc).__name__}{hint})", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
