"""The engine's prefix cache and session affinity (docs/rollout.md, "Prefix cache and session
affinity"): a finished request's KV serves later prompts that extend it, with the same tokens
and log-probs (to float rounding) as a full prefill; every turn of an episode goes to one
engine (directly, or through the real sglang-router's ``manual`` policy), so its next turn
finds its prefix cached; a dead engine's sessions move to their next choice.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rl_core.agents import ChatTokens, EpisodeLimits, EpisodeRunner, StepResult, Turn
from rl_core.data.records import Record
from rl_core.engine.core import EmbeddedEngine, GenerateRequest
from rl_core.engine.prefix_cache import PrefixCache
from rl_core.engine.sampling import SamplingParams
from rl_core.rollout.client import SGLangClient
from rl_core.rollout.http import HttpPlane
from rl_core.rollout.launch import embedded_engine_command
from rl_core.rollout.pool import EnginePool

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def _kv(n: int, fill: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.full((2, n, 4), fill)], [torch.full((2, n, 4), -fill)]


def test_the_cache_finds_the_longest_prefix_and_stays_within_its_budget() -> None:
    cache = PrefixCache(max_tokens=50, min_tokens=3)
    cache.insert(list(range(10)), *_kv(10, 1.0))
    cache.insert([0, 1, 2, 9, 9, 9], *_kv(6, 2.0))
    hit = cache.lookup([0, 1, 2, 3, 4, 5, 6, 77])
    assert hit is not None and hit.length == 7 and float(hit.keys[0][0, 0, 0]) == 1.0
    assert hit.keys[0].shape == (2, 7, 4)
    # Never the prompt's last token (its logits are needed); nothing below min_tokens.
    assert cache.lookup(list(range(10))).length == 9
    assert cache.lookup([0, 1, 5, 5]) is None
    # A longer sequence covers the entries it extends; the least recently used go first.
    cache.insert(list(range(12)), *_kv(12, 3.0))
    assert len(cache) == 2 and cache.tokens == 18
    cache.insert(list(range(100, 135)), *_kv(35, 4.0))  # 53 tokens > 50: evict the LRU
    assert len(cache) == 2 and cache.tokens == 47
    assert cache.lookup([0, 1, 2, 9, 9, 9, 1]).length == 3  # the 6-token entry is gone
    assert cache.stats["prefix_cache_evicted"] == 1
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0
    off = PrefixCache(0)
    off.insert(list(range(10)), *_kv(10, 1.0))
    assert not off.enabled and off.lookup(list(range(10))) is None


@pytest.fixture(scope="module")
def engines(demo_model: Path):
    cached = EmbeddedEngine(demo_model, prefix_cache_tokens=4096, background=False)
    plain = EmbeddedEngine(demo_model, background=False)
    yield cached, plain
    cached.close()
    plain.close()


def _same(a, b) -> None:
    assert a.output_ids == b.output_ids
    diff = max((abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)),
               default=0.0)
    assert diff < 1e-4, diff


def test_a_finished_requests_kv_serves_the_next_turn_exactly(engines) -> None:
    cached, plain = engines
    prompt = list(range(5, 40))
    (first,) = cached.generate_sync([GenerateRequest("t1", prompt, GREEDY, return_logprob=True)])
    assert first.cached_tokens == 0
    turn2 = prompt + first.output_ids + [7, 8, 9]  # the model's turn, then an observation
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=10)
    batch = [GenerateRequest("a", turn2, GREEDY, return_logprob=True),  # extends turn 1
             GenerateRequest("b", list(range(50, 70)), GREEDY, return_logprob=True),  # no hit
             GenerateRequest("c", prompt + [11, 12], sampled, return_logprob=True),  # a prefix
             GenerateRequest("d", turn2, GREEDY, return_logprob=True)]  # a's twin: shared
    before = dict(cached.prefix_cache_stats)
    out = cached.generate_sync(batch)
    ref = plain.generate_sync([GenerateRequest(f"r{r.rid}", r.input_ids, r.params,
                                               return_logprob=True) for r in batch])
    for o, r in zip(out, ref, strict=True):
        _same(o, r)
    computed = len(prompt) + len(first.output_ids) - 1  # the last output token was never fed
    assert [o.cached_tokens for o in out] == [computed, 0, len(prompt), computed]
    stats = cached.prefix_cache_stats
    assert stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == (
        2 * computed + len(prompt))
    # A request scoring its prompt computes all of it, cache or not.
    (scored,) = cached.generate_sync([GenerateRequest(
        "s", turn2, SamplingParams(max_new_tokens=1), return_logprob=True, logprob_start_len=0)])
    assert scored.cached_tokens == 0 and len(scored.input_logprobs) == len(turn2)


def test_new_weights_and_a_flush_empty_the_cache(engines) -> None:
    cached, _ = engines
    cached.generate_sync([GenerateRequest("w", list(range(3, 30)), GREEDY)])
    assert cached.prefix_cache_stats["prefix_cache_entries"] > 0
    cached.weights_changed_in_place("v2")  # its K/V came from the old weights
    assert cached.prefix_cache_stats["prefix_cache_entries"] == 0
    cached.generate_sync([GenerateRequest("w2", list(range(3, 30)), GREEDY)])
    assert cached.prefix_cache_stats["prefix_cache_entries"] > 0
    assert cached.flush_cache()
    assert cached.prefix_cache_stats["prefix_cache_entries"] == 0


def test_a_key_keeps_its_engine_until_that_engine_is_down() -> None:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    keys = [f"1:t{i}:{j}#0" for i in range(8) for j in range(4)]
    client = SGLangClient(urls)
    first = {k: client.route(k) for k in keys}
    counts = [list(first.values()).count(u) for u in urls]
    assert counts == [8, 8, 8, 8]  # new sessions spread evenly (round-robin)
    for _ in range(3):  # later turns, in any order: each to its session's engine
        assert all(client.route(k) == first[k] for k in reversed(keys))
    client._down_until[urls[0]] = time.monotonic() + 60  # engine 0 failed a request
    moved = {k: client.route(k) for k in keys}
    for k in keys:  # only its sessions move, to live engines, and stay there
        assert (moved[k] == first[k]) == (first[k] != urls[0]) and moved[k] != urls[0]
    del client._down_until[urls[0]]
    assert all(client.route(k) == moved[k] for k in keys)
    assert len(client._sticky) == len(keys)


class Chatter:
    """Three turns of "Go on." then done (a multi-turn episode whose prompts grow)."""

    def reset(self, task: Record) -> list[dict]:
        return [{"role": "user", "content": task.question}]

    def step(self, turn: Turn) -> StepResult:
        done = turn.index >= 2
        return StepResult([] if done else [{"role": "user", "content": "Go on."}],
                          reward=1.0, done=done)


def _server_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=10) as r:
        return json.loads(r.read())["internal_states"][0]


@pytest.mark.parametrize("router", [False, True], ids=["client", "sglang-router-manual"])
def test_every_turn_of_an_episode_lands_on_one_engine_and_hits_its_cache(
        demo_model: Path, tmp_path: Path, router: bool) -> None:
    pool = EnginePool(embedded_engine_command(demo_model, num_threads=1, prefix_cache_tokens=8192),
                      2, log_dir=tmp_path, router=router, router_policy="manual",
                      health_interval_s=0.5, startup_timeout_s=120)
    plane = HttpPlane(pool, request_batch_size=4).start()
    try:
        from transformers import AutoTokenizer

        runner = EpisodeRunner(plane, ChatTokens(AutoTokenizer.from_pretrained(demo_model)),
                               Chatter, EpisodeLimits(max_turns=3, max_tokens=96))
        tasks = [Record(f"t{i}", f"What is {i} + {i}?", f"#### {2 * i}") for i in range(4)]
        samples = runner.run(tasks, n=2, params=SamplingParams(temperature=1.0,
                                                               max_new_tokens=8), step=1, seed=0)
        infos = [_server_info(u) for u in pool.engine_urls]
        hits = sum(i["prefix_cache_hit_tokens"] for i in infos)
        assert all(i["prefix_cache_queried_tokens"] > 0 for i in infos)  # both engines served
        for s in samples:
            turns = [t for t in s.meta["episode"]["trace"] if t["role"] == "assistant"]
            assert len(turns) == 3
            if not router:  # the client sends each key to one engine: named on every turn
                assert len({t["engine"] for t in turns}) == 1
            assert all(t["cached_tokens"] > 0 for t in turns[1:]), turns  # the prefix was there
        assert hits > 0
    finally:
        plane.close()
