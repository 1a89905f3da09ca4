"""Session affinity against random placement: the agent demo's episodes on 2 engines.

Two embedded engine processes with the prefix cache on (``--cache-tokens`` each), behind no
router, play the agent demo's calculator episodes (``configs/agent-calculator.yaml``: its
model, its tools, 3 turns, 128 tokens) with :class:`rl_core.agents.EpisodeRunner`:

* ``affinity``: every turn of an episode to one engine (the routing keys, as the runner sends
  them: ``rl_core.rollout.affinity``);
* ``random``: no keys, one request per prompt, round-robin over the engines (so the turns of
  an episode land wherever the rotation puts them: what a router without session affinity or
  prefix awareness does).

``--env chatter`` replaces the calculator environment (whose untrained policy rarely calls the
tool, so most episodes are one turn) by one that answers every turn with "Go on." for 3 turns:
every episode is multi-turn. Rounds alternate the two, so load drifting over the run hits both; each figure is the median
of ``--repeats`` rounds after one untimed one. Reported per mode: the rollout's wall time and
the prefix-cache hit rate (cached / looked-up prompt tokens, summed over both engines'
``/server_info``). Prints a table and writes JSON (default
``benchmarks/results/session_affinity_<env>.json``)::

    python -m benchmarks.session_affinity --model DIR [--env calculator|chatter] [--tasks 16]
        [--samples 4] [--repeats 3]

``DIR``: the agent demo's model (``grpoflow bootstrap-model configs/agent-calculator.yaml``
prints it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def _hits(urls: list[str]) -> tuple[int, int]:
    hit = queried = 0
    for url in urls:
        with urllib.request.urlopen(f"{url}/server_info", timeout=30) as r:
            state = json.loads(r.read())["internal_states"][0]
        hit += state["prefix_cache_hit_tokens"]
        queried += state["prefix_cache_queried_tokens"]
    return hit, queried


class _Chatter:
    """Three turns, each answered with "Go on." (every episode multi-turn)."""

    def reset(self, task: Any) -> list[dict]:  # noqa: ANN401
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Any) -> Any:  # noqa: ANN401
        from rl_core.agents import StepResult

        done = turn.index >= 2
        return StepResult([] if done else [{"role": "user", "content": "Go on."}], done=done)


class _Unkeyed:
    """The plane without routing keys: each prompt its own request, round-robin."""

    def __init__(self, plane: Any) -> None:  # noqa: ANN401
        self.plane = plane

    def generate(self, prompts: Any, params: Any, **kw: Any) -> Any:  # noqa: ANN401
        kw.pop("routing_keys", None)
        return self.plane.generate(prompts, params, **kw)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the agent demo's model directory")
    ap.add_argument("--env", choices=["calculator", "chatter"], default="calculator")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: benchmarks/results/session_affinity_<env>.json")
    args = ap.parse_args(argv)
    args.out = args.out or RESULTS / f"session_affinity_{args.env}.json"

    from transformers import AutoTokenizer

    from rl_core.agents import ChatTokens, EpisodeRunner, environment_factory, limits_from_config
    from rl_core.config import load_config
    from rl_core.data.synthetic import generate_splits
    from rl_core.engine.sampling import SamplingParams
    from rl_core.rollout.http import HttpPlane
    from rl_core.rollout.launch import embedded_engine_command
    from rl_core.rollout.pool import EnginePool

    cfg = load_config(str(ROOT / "configs" / "agent-calculator.yaml"), [])
    d = cfg.data
    records, _ = generate_splits(args.tasks, 1, 0, digits=tuple(d.synthetic_digits),
                                 steps=tuple(d.synthetic_steps),
                                 operations=tuple(d.synthetic_operations))
    tok = AutoTokenizer.from_pretrained(args.model)
    params = SamplingParams(temperature=cfg.rollout.temperature,
                            max_new_tokens=cfg.rollout.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        pool = EnginePool(embedded_engine_command(args.model, num_threads=1,
                                                  prefix_cache_tokens=args.cache_tokens),
                          2, log_dir=tmp, router=False, startup_timeout_s=300)
        plane = HttpPlane(pool, request_batch_size=1, deterministic=False).start()
        try:
            make_env = (environment_factory(cfg.agent, tok) if args.env == "calculator"
                        else _Chatter)
            runners = {mode: EpisodeRunner(p, ChatTokens(tok), make_env,
                                           limits_from_config(cfg.agent))
                       for mode, p in (("affinity", plane), ("random", _Unkeyed(plane)))}
            rows: dict[str, list[dict[str, float]]] = {m: [] for m in runners}
            for rep in range(args.repeats + 1):
                for mode, runner in (runners.items() if rep % 2 == 0
                                     else reversed(list(runners.items()))):
                    h0, q0 = _hits(pool.engine_urls)
                    t0 = time.perf_counter()
                    samples = runner.run(records[: args.tasks], n=args.samples, params=params,
                                         step=rep, seed=rep)
                    seconds = time.perf_counter() - t0
                    h1, q1 = _hits(pool.engine_urls)
                    turns = sum(s.meta["episode"]["turns"] for s in samples)
                    if rep:  # the first round warms both
                        rows[mode].append({"seconds": seconds, "turns": turns,
                                           "hit_rate": (h1 - h0) / max(q1 - q0, 1)})
        finally:
            plane.close()
    result: dict[str, Any] = {"model": args.model, "env": args.env, "tasks": args.tasks,
                              "samples": args.samples,
                              "repeats": args.repeats, "engines": 2}
    for mode, rs in rows.items():
        result[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    result["speedup"] = result["random"]["seconds"] / result["affinity"]["seconds"]
    print(f"{'mode':10s} {'seconds':>8s} {'turns':>6s} {'hit rate':>9s}")
    for mode in rows:
        r = result[mode]
        print(f"{mode:10s} {r['seconds']:8.2f} {r['turns']:6.0f} {r['hit_rate']:9.1%}")
    print(f"affinity is {result['speedup']:.2f}x random placement's speed")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
