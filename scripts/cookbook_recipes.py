"""Run tinker-cookbook's own recipes against ``grpoflow serve-tinker`` on the tiny CPU model.

What a user does, in three steps (docs/tinker.md, "Running tinker-cookbook recipes"):

1. ``scripts/tinker_cookbook_env.sh``: a separate venv with ``tinker==0.38.0`` and
   ``tinker-cookbook==0.6.1`` (``--no-deps``: its ``tml-renderers`` pin is not on the index here);
2. ``grpoflow serve-tinker configs/tinker-cookbook-cpu.yaml``: the tiny model served under a
   name the cookbook's ``model_info`` registry knows (``Qwen/Qwen3-4B-Instruct-2507``);
3. the recipes, unchanged, from that venv: ``python -m tinker_cookbook.recipes.chat_sl.train``
   (supervised) and ``python -m tinker_cookbook.recipes.math_rl.train`` (RL, its default
   ``env=arithmetic``), with ``base_url=`` and ``model_name=`` (plus size knobs).

The cookbook loads the tokenizer by the model's name (``AutoTokenizer.from_pretrained``), and
there is no hub here: :func:`alias_tokenizer` puts the served model's own tokenizer files into
a Hugging Face cache under that name, and the recipes run with ``HF_HUB_OFFLINE=1``.

``python scripts/cookbook_recipes.py [--sl-steps N] [--rl-steps N] [--url URL]`` does all of it
(starting its own server unless ``--url`` names one) and prints the curves. Standard library
only: it runs under any Python; the recipes run in the cookbook venv. Never downloads a model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_SCRIPT = ROOT / "scripts" / "tinker_cookbook_env.sh"
DEFAULT_VENV = Path(os.environ.get("TINKER_COOKBOOK_VENV")
                    or ROOT / ".cache" / "tinker-cookbook-venv")
MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"  # in the cookbook's registry; renderer qwen3_instruct
API_KEY = "tml-cookbook-local"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "config.json", "generation_config.json")


def build_env(venv: Path = DEFAULT_VENV) -> Path:
    """The cookbook venv (built once; idempotent): its python."""
    subprocess.run(["bash", str(ENV_SCRIPT), str(venv)], check=True)
    return venv / "bin" / "python"


def alias_tokenizer(model_dir: Path, name: str, hf_home: Path) -> Path:
    """Place ``model_dir``'s tokenizer files in ``hf_home``'s hub cache as repo ``name``
    (revision ``main``), so that ``AutoTokenizer.from_pretrained(name)`` with
    ``HF_HUB_OFFLINE=1`` reads them. Returns the snapshot directory."""
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()
    repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
    snap = repo / "snapshots" / digest
    snap.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(digest)
    return snap


def recipe_env(hf_home: Path, url: str) -> dict[str, str]:
    """The recipes' environment: the key, the offline hub cache, no telemetry, one thread."""
    return {**os.environ, "TINKER_API_KEY": API_KEY, "TINKER_BASE_URL": url,
            "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0",
            # bytecode is written once (the installs do not compile it), as the Makefile does
            "PYTHONDONTWRITEBYTECODE": "",
            # the cookbook fetches a pricing table from its docs site at start-up (and only
            # warns when it fails): a dead loopback proxy keeps every byte on this machine
            "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
            "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def sl_command(python: Path, url: str, log_path: Path, steps: int) -> list[str]:
    """The cookbook's chat SL recipe on its own example conversations (the stock recipe's
    ``dataset=*.jsonl`` form), ``steps`` steps of 8 conversations over several epochs."""
    data = ("import tinker_cookbook, pathlib; print(pathlib.Path(tinker_cookbook.__file__)"
            ".parent / 'example_data' / 'conversations.jsonl')")
    jsonl = subprocess.run([str(python), "-c", data], check=True, capture_output=True,
                           text=True).stdout.strip()
    return [str(python), "-m", "tinker_cookbook.recipes.chat_sl.train", f"base_url={url}",
            f"model_name={MODEL_NAME}", f"dataset={jsonl}", f"log_path={log_path}",
            "batch_size=8", "lora_rank=8", "learning_rate=2e-3", "max_length=256",
            "num_epochs=100", f"max_steps={steps}", "save_every=0", "eval_every=0",
            "infrequent_eval_every=0", "behavior_if_log_dir_exists=delete"]


def rl_command(python: Path, url: str, log_path: Path, steps: int, groups: int = 8,
               group_size: int = 8, max_tokens: int = 16,
               learning_rate: float = 2e-3, eval_group_size: int = 0,
               extra: tuple[str, ...] = ()) -> list[str]:
    """The cookbook's arithmetic RL recipe on one-digit sums (scripts/cookbook_arithmetic_rl.py:
    the stock ``math_rl/train.py env=arithmetic`` asks for sums up to 200, which the tiny model
    never gets right, so no group has a signal): its ArithmeticEnv and ``rl.train.main``.
    ``groups`` groups of ``group_size`` episodes a step (one sample request each);
    ``eval_group_size`` > 0: the held-out test set (all 100 sums, that many samples each)
    scored at step 0 and after the last step; ``extra``: more of the script's ``key=value``."""
    return [str(python), str(ROOT / "scripts" / "cookbook_arithmetic_rl.py"), f"base_url={url}",
            f"model_name={MODEL_NAME}", f"log_path={log_path}", "loss_fn=importance_sampling",
            f"group_size={group_size}", f"groups_per_batch={groups}",
            f"learning_rate={learning_rate}",
            "lora_rank=8", f"max_tokens={max_tokens}", f"max_steps={steps}",
            f"eval_group_size={eval_group_size}", *extra]


def stock_rl_command(python: Path, url: str, log_path: Path, steps: int) -> list[str]:
    """The stock recipe itself (``env=arithmetic``), for the record: it runs, but its rewards
    stay at -0.1 on the tiny model (docs/tinker.md)."""
    return [str(python), "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={url}",
            f"model_name={MODEL_NAME}", "env=arithmetic", f"log_path={log_path}",
            "loss_fn=importance_sampling", "group_size=8", "groups_per_batch=8",
            "learning_rate=2e-3", "lora_rank=8", "max_tokens=8", f"max_steps={steps}",
            "save_every=0", "eval_every=0", "behavior_if_log_dir_exists=delete"]


def metrics(log_path: Path) -> list[dict]:
    """The recipe's per-step metrics (``metrics.jsonl``, written by the cookbook's ml_log)."""
    path = log_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_recipe(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> None:
    """Run one recipe to completion (bounded); its output to ``log``."""
    with log.open("ab") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} exited {proc.returncode}:\n"
                           f"{log.read_text()[-4000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_tinker(config: Path, overrides: list[str], log: Path, port: int,
                 timeout: float = 600.0) -> Iterator[str]:
    """``grpoflow serve-tinker config`` in its own process (this interpreter's venv: the
    project's), up when its health check answers (bounded by ``timeout``); killed and reaped
    on exit. Yields the URL."""
    exe = Path(sys.executable).parent / "grpoflow"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "grpoflow.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    url = f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen([*cmd, "serve-tinker", str(config), f"port={port}", *overrides],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve-tinker exited {proc.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve-tinker not up in {timeout:.0f} s:\n"
                                   f"{log.read_text()[-3000:]}")
            time.sleep(0.2)  # polling the health check (bounded above), not synchronisation
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--model-dir", type=Path, required=True,
                    help="the served model's directory (its tokenizer goes into the cache)")
    ap.add_argument("--url", help="a running serve-tinker serving the model as " + MODEL_NAME)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "tinker-cookbook")
    ap.add_argument("--sl-steps", type=int, default=30)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--groups", type=int, default=8, help="RL groups (of 8) a step")
    ap.add_argument("--rl-lr", type=float, default=2e-3, help="RL learning rate")
    ap.add_argument("--only", choices=["sl", "rl"], help="run one recipe")
    args = ap.parse_args(argv)
    python = build_env(args.venv)
    args.work.mkdir(parents=True, exist_ok=True)
    alias_tokenizer(args.model_dir, MODEL_NAME, args.work / "hf")
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(serve_tinker(
            ROOT / "configs" / "tinker-cookbook-cpu.yaml",
            [f"base_models={{{MODEL_NAME}: {args.model_dir}}}", f"root={args.work / 'root'}",
             "tracking.backend=none"], args.work / "serve.log", free_port()))
        env = recipe_env(args.work / "hf", url)
        for kind, cmd, key in (
                ("sl", sl_command(python, url, args.work / "sl", args.sl_steps), "train_mean_nll"),
                ("rl", rl_command(python, url, args.work / "rl", args.rl_steps, args.groups,
                                  learning_rate=args.rl_lr),
                 "env/all/reward/total")):
            if args.only and kind != args.only:
                continue
            started = time.monotonic()
            run_recipe(cmd, env, args.work / f"{kind}.log", timeout=3600)
            rows = metrics(args.work / kind)
            curve = [round(r[key], 4) for r in rows if key in r]
            print(f"{kind}: {len(rows)} steps in {time.monotonic() - started:.0f} s; {key}: {curve}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
