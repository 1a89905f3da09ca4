"""Throughput of ``grpoflow serve-tinker`` through the real Tinker SDK, with 1 and 4 tenants.

A ``grpoflow serve-tinker`` process serves one base model (default: the demo's tiny model,
``embedded:tiny``, 1.7M parameters; ``--model-dir`` names another local directory) with
tracking off. For each tenant count in ``--tenants`` (default 1 and 4), that many threads,
each its own ``tinker.ServiceClient`` and LoRA training client (rank ``--rank``), run at once:

* **forward_backward**: ``--fb-calls`` calls of ``cross_entropy`` on ``--batch`` datums of
  ``--seq-len`` tokens each, each followed by an ``optim_step`` (as every training loop does);
  reported as trained tokens per second over all tenants (wall clock of the phase);
* **sampling**: ``save_weights_and_get_sampling_client``, then ``--sample-calls`` calls of
  ``sample(num_samples=--num-samples, max_tokens=--max-tokens, temperature 1)`` with a fixed
  seed; reported as samples (sequences) per second and sampled tokens per second.

The service runs requests for one base model on one worker thread (docs/tinker.md), so more
tenants share that thread: the 4-tenant rates are the service's aggregate under contention.
Prints a table and writes JSON (default ``benchmarks/results/tinker_throughput.json``). A
benchmark, never a test.

Run: ``.venv/bin/python -m benchmarks.tinker_throughput`` (about 2 minutes on 2 idle cores).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks import GRPOFLOW, RESULTS, ROOT, format_table, run_meta, write_json

DEFAULT_OUT = RESULTS / "tinker_throughput.json"
BASE = "grpoflow/tiny"
KEY = "tml-benchmark-{}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str, work: Path, timeout: float = 900.0) -> Iterator[str]:
    """``grpoflow serve-tinker`` on a free loopback port, up when /healthz answers; reaped."""
    port = _free_port()
    cfg = work / "serve.yaml"
    cfg.write_text(f"base_models: {{{BASE}: {model}}}\nport: {port}\nroot: {work / 'root'}\n"
                   "log_level: warning\napi_keys_env: null\ntracking: {backend: none}\n")
    log = work / "serve.log"
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    with log.open("ab") as out:
        proc = subprocess.Popen([*GRPOFLOW, "serve-tinker", str(cfg)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve-tinker exited {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve-tinker not up in {timeout:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _in_threads(n: int, fn: Callable[[int], Any]) -> tuple[float, list[Any]]:
    """``fn(i)`` for i in 0..n-1 on n threads started together; (wall seconds, results)."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return wall, results


def measure(url: str, tenants: int, args: argparse.Namespace) -> dict[str, Any]:
    """One tenant count: the forward_backward phase, then the sampling phase."""
    import tinker

    clients = [tinker.ServiceClient(base_url=url, api_key=KEY.format(i)) for i in range(tenants)]
    training = [c.create_lora_training_client(base_model=BASE, rank=args.rank, seed=i).result()
                for i, c in enumerate(clients)]
    data = [tinker.Datum(
        model_input=tinker.ModelInput.from_ints([(7 * j + k) % 200 + 10 for k in range(args.seq_len)]),
        loss_fn_inputs={"target_tokens": [(7 * j + k + 1) % 200 + 10 for k in range(args.seq_len)],
                        "weights": [1.0] * args.seq_len}) for j in range(args.batch)]
    adam = tinker.AdamParams(learning_rate=1e-3)

    def fb(i: int) -> None:
        tc = training[i]
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()

    _in_threads(tenants, fb)  # one untimed round (first-call costs)

    def fb_timed(i: int) -> None:
        tc = training[i]
        for _ in range(args.fb_calls):
            f = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(adam).result()
            f.result()

    fb_wall, _ = _in_threads(tenants, fb_timed)
    fb_tokens = tenants * args.fb_calls * args.batch * args.seq_len
    samplers = [tc.save_weights_and_get_sampling_client(name=f"bench-{tenants}").result()
                for tc in training]
    prompt = tinker.ModelInput.from_ints(list(range(10, 10 + args.prompt_len)))
    params = tinker.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
    samplers[0].sample(prompt, num_samples=1, sampling_params=params).result()  # warm-up

    def sample(i: int) -> int:
        got = 0
        for _ in range(args.sample_calls):
            out = samplers[i].sample(prompt, num_samples=args.num_samples,
                                     sampling_params=params).result()
            got += sum(len(s.tokens) for s in out.sequences)
        return got

    s_wall, tokens = _in_threads(tenants, sample)
    samples = tenants * args.sample_calls * args.num_samples
    for c in clients:
        with contextlib.suppress(Exception):
            c.close("success")
    return {"tenants": tenants, "fb_calls": tenants * args.fb_calls, "fb_tokens": fb_tokens,
            "fb_seconds": fb_wall, "fb_tokens_per_s": fb_tokens / fb_wall,
            "samples": samples, "sampled_tokens": sum(tokens), "sample_seconds": s_wall,
            "samples_per_s": samples / s_wall, "sampled_tokens_per_s": sum(tokens) / s_wall}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="embedded:tiny",
                    help="the served model: embedded:tiny or a local HF directory")
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--fb-calls", type=int, default=5)
    ap.add_argument("--sample-calls", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    meta = run_meta("benchmarks.tinker_throughput", argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as tmp, \
            serve(args.model_dir, Path(tmp)) as url:
        for n in args.tenants:
            r = measure(url, n, args)
            rows.append(r)
            print(f"{n} tenant(s): forward_backward {r['fb_tokens_per_s']:.0f} tokens/s, "
                  f"sampling {r['samples_per_s']:.1f} samples/s "
                  f"({r['sampled_tokens_per_s']:.0f} tokens/s)", flush=True)
    print(format_table(
        ["tenants", "fb tokens/s", "fb wall s", "samples/s", "sampled tokens/s", "sample wall s"],
        [[r["tenants"], round(r["fb_tokens_per_s"]), round(r["fb_seconds"], 1),
          round(r["samples_per_s"], 1), round(r["sampled_tokens_per_s"]),
          round(r["sample_seconds"], 1)] for r in rows]))
    write_json(args.out, {"meta": meta, "settings": {k: str(v) for k, v in vars(args).items()},
                          "results": rows})


if __name__ == "__main__":
    main(sys.argv[1:])
