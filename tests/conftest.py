"""Shared fixtures: a tiny random Qwen2 model and a word-level tokenizer that matches it.

Everything is built locally (no hub access) and small enough to run on one CPU thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 64
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def tiny_qwen2(seed: int = 0, *, tie: bool = False, init_std: float = 0.2):
    """A seeded random ``Qwen2ForCausalLM`` (vocab 64, hidden 32, 2 layers, 4/2 heads).

    ``init_std`` is larger than HF's default so next-token distributions are peaked
    enough that greedy decoding is not a constant echo of the prompt.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    return model.eval()


def hf_greedy(model, prompt, max_new_tokens: int, eos: int | None) -> list[int]:
    """``transformers`` greedy ``generate`` for one prompt: the reference decoders match."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=PAD_ID,
    )
    return out[0, len(prompt) :].tolist()


def word(i: int) -> str:
    """The tokenizer's surface form of token ``i`` (3 characters for every normal token)."""
    return {PAD_ID: "<pad>", EOS_ID: "<eos>", UNK_ID: "<unk>"}.get(i, f"a{i:02d}")


def tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` over a WordLevel vocab matching :func:`tiny_qwen2`.

    Token ``i`` is the word ``a<i:02d>`` (``<pad>``=0, ``<eos>``=1, ``<unk>``=2); words are
    whitespace-separated and decode joins them with single spaces.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_batch(prompts, responses, logprobs, advantages, pad_id: int = PAD_ID):
    """A :class:`rl_core.types.Batch` of samples given as parallel lists."""
    from rl_core.types import Batch, Sample

    if not len(prompts) == len(responses) == len(logprobs):
        raise ValueError("prompts, responses and log-probs differ in length")
    samples = [Sample(list(p), list(r), list(lp)) for p, r, lp in zip(prompts, responses, logprobs, strict=True)]
    return Batch.from_samples(samples, advantages, pad_id)


@pytest.fixture
def one_thread():
    """One torch thread for the test (light on shared machines; opt in with usefixtures)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_qwen2(0)


@pytest.fixture(scope="module")
def tiny_tok():
    return tiny_tokenizer()


# The modules that take longest (measured with GRPOFLOW_TEST_TIMELINE, longest first;
# docs/testing.md): they start first, so that the workers end together (the longest-first
# rule) instead of one heavy module running alone at the end. `make test` passes
# --no-loadscope-reorder: xdist's default reorder puts the modules with the most tests first,
# which left these few-test, long modules for last.
LONGEST_FIRST = (
    # the three longest that do not need the demo model: they run while it is built
    "test_rollout_planes", "test_megatron_moe", "test_distributed_trainer",
    "test_resume", "test_ray_planes", "test_chaos", "test_flow", "test_security", "test_moe",
    "test_lifecycle", "test_deployments", "test_megatron", "test_overlap", "test_scaling",
    "test_doctor",
    "test_tracking_outage", "test_lora", "test_preflight", "test_judge", "test_distill",
    "test_traces", "test_sft",
)


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001
    """The longest modules first (:data:`LONGEST_FIRST`; under pytest-randomly the order
    stays random). ``soak`` tests (minutes each) run only when asked: ``pytest -m soak`` or
    ``GRPOFLOW_SOAK=1``; the default run (CI) has a short variant of each."""
    soak = "soak" in (config.getoption("-m") or "") or os.environ.get("GRPOFLOW_SOAK") == "1"
    if not config.pluginmanager.has_plugin("randomly"):
        # the soak tier's longest is the hour-long chaos soak: it starts first
        order = ("test_chaos", *LONGEST_FIRST) if soak else LONGEST_FIRST
        rank = {name: i for i, name in enumerate(order)}
        items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable
    if soak:
        return
    skip = pytest.mark.skip(reason="soak test: run with `pytest -m soak` or GRPOFLOW_SOAK=1")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- session-wide services


@pytest.fixture(scope="module")
def restore_ray_auth_mode():
    """A local Ray start (``ray.init``) sets RAY_AUTH_MODE=token process-wide: modules that
    start one use this (``pytest.mark.usefixtures``) to leave the environment as found."""
    before = os.environ.get("RAY_AUTH_MODE")
    yield
    if before is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = before


@pytest.fixture(scope="session")
def prefect_harness():
    """A real Prefect API on a temporary SQLite database, started once per session (~12 s).
    Its event persister and automation triggers are off: no test reads stored events or uses
    automations, and storing every task-run event cost the API servers CPU that the flows
    share (task runs are still recorded from their events: the task-run recorder stays on)."""
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


SHARED_MODELS_ENV = "GRPOFLOW_TEST_SHARED_MODELS"


def _build_demo_model(cache: Path, threads: int = 2) -> Path:
    """The demo's tiny model (configs/tiny-cpu.yaml) in ``cache`` (~1 min on 2 cores, once)."""
    from rl_core.base_model import snapshot_model
    from rl_core.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return Path(snapshot_model(cfg.model, cfg.data, cache).path)
    finally:
        torch.set_num_threads(before)


SHARED_READY_ENV = "GRPOFLOW_TEST_SHARED_READY"
_BUILD = ("import sys, pathlib; from conftest import _build_demo_model; "
          "_build_demo_model(pathlib.Path(sys.argv[1]), 1)")
SHARED_WAIT_S = 900


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist the controller builds the demo model once, in a child process on
    one core, while the workers start on the tests that do not need it; each worker's cache
    links to it once it is built (``tiny_cache`` waits for the ready file)."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import tempfile
    import threading

    root = Path(os.environ.get("GRPOFLOW_TEST_CACHE") or tempfile.mkdtemp(prefix="grpoflow-models-"))
    root.mkdir(parents=True, exist_ok=True)
    ready = root / f"ready-{os.getpid()}"
    ready.unlink(missing_ok=True)

    def build() -> None:
        # In a child process: a build in this thread created loggers while pytest's logging
        # plugin iterated them on the main thread (INTERNALERROR: dictionary changed size).
        import subprocess
        import sys

        try:
            done = subprocess.run([sys.executable, "-c", _BUILD, str(root.resolve())], capture_output=True,
                                  text=True, timeout=SHARED_WAIT_S - 60, cwd=Path(__file__).parent,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            ready.write_text("ok" if done.returncode == 0 else
                             f"the demo model build failed (rc {done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
        except BaseException as e:  # noqa: BLE001 - told to every test that needs the model
            ready.write_text(f"the demo model build failed: {type(e).__name__}: {e}")

    os.environ[SHARED_MODELS_ENV] = str(root / "models")
    os.environ[SHARED_READY_ENV] = str(ready)
    threading.Thread(target=build, name="demo-model-build", daemon=True).start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The controller removes its ready file (a kept cache would collect them)."""
    if not hasattr(session.config, "workerinput") and (ready := os.environ.get(SHARED_READY_ENV)):
        Path(ready).unlink(missing_ok=True)


def _wait_for_shared_models() -> None:
    """Block until the controller's demo model build is done (bounded); raise its error."""
    import time

    ready = Path(os.environ[SHARED_READY_ENV])
    deadline = time.monotonic() + SHARED_WAIT_S
    while not ready.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller's demo model build did not finish within "
                               f"{SHARED_WAIT_S}s (waited for {ready})")
        time.sleep(0.5)
    if (text := ready.read_text()) != "ok":
        raise RuntimeError(text)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A cache directory shared by the flow tests: the demo's tiny model is built once.
    ``GRPOFLOW_TEST_CACHE`` keeps it across sessions (local iteration; CI builds afresh);
    under pytest-xdist each worker has its own cache whose models link to the one the
    controller built."""
    shared = os.environ.get(SHARED_MODELS_ENV)
    if (kept := os.environ.get("GRPOFLOW_TEST_CACHE")) and not shared:
        Path(kept).mkdir(parents=True, exist_ok=True)
        return Path(kept)
    cache = Path(tmp_path_factory.mktemp("grpoflow-cache"))
    if shared:
        _wait_for_shared_models()
        (cache / "models").mkdir()
        for entry in Path(shared).iterdir():
            if entry.name.startswith("tiny-"):
                (cache / "models" / entry.name).symlink_to(entry, target_is_directory=True)
    return cache


@pytest.fixture(scope="session")
def demo_model(tiny_cache: Path) -> Path:
    """The demo's tiny model (configs/tiny-cpu.yaml), built once per session (~1 min)."""
    return _build_demo_model(tiny_cache)


TIMELINE_ENV = "GRPOFLOW_TEST_TIMELINE"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201
    """``GRPOFLOW_TEST_TIMELINE=FILE``: one JSON line per test (worker, start, end, id), to
    see how the workers' time is spent (``scripts/test_timeline.py`` summarises it)."""
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:  # this process and its reaped children
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                    resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    start, cpu0 = time.time(), cpu()
    yield
    row = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
           "end": time.time(), "cpu": cpu() - cpu0, "id": item.nodeid}  # fmt: skip
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM, untrained (rl_core/models/tiny_vlm.py): built once per session."""
    from rl_core.models.tiny_vlm import TinyVLMSpec, build_bare_vlm

    return build_bare_vlm(TinyVLMSpec(train_size=200, test_size=20),
                          tmp_path_factory.mktemp("tiny-vlm"))
