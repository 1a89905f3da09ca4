"""Helpers for the embedded-engine tests: a tiny HF model on disk, the reference every sample
is checked against, and a gloo trainer process.

Imported by tests/test_engine.py, tests/test_engine_server.py, tests/test_sampler.py,
tests/test_http_fuzz.py and tests/conformance/. Everything is built locally; nothing is
downloaded.

The reference (:func:`assert_matches_hf`) is ``transformers`` and the sampler, one sample at
a time and without any KV cache: one unpadded forward pass over prompt + output gives the
logits that scored every output position, ``sample_next`` on those logits with the request's
seed and the position must give the output token, and ``log_softmax(logits / T)`` its
log-prob. A sample that passes is what a batch of one, run step by step, would have drawn.

The saved model gets a character-level byte-BPE tokenizer rather than conftest's WordLevel
one: transformers 5's ``AutoTokenizer`` rebuilds any qwen2 checkpoint's tokenizer as a
``Qwen2Tokenizer`` (byte-level BPE from vocab + merges), which loses a WordLevel pipeline
(``"a05 a06"`` encodes to ``[]``) but keeps a single-character byte-level vocabulary intact.
"""

from __future__ import annotations

import os
import string
import subprocess
import sys
from pathlib import Path

import torch
from conftest import EOS_ID, PAD_ID, TINY_VOCAB, UNK_ID, tiny_qwen2

from rl_core.engine.sampling import SamplingParams, sample_next

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


# Ids 3.. are single characters; "Ġ" is byte-level BPE's space.
CHARS = ["Ġ", *string.digits, *string.ascii_lowercase, *string.ascii_uppercase[:24]]


def char_tokenizer():
    """A byte-level BPE tokenizer with one token per character (64 ids, matching tiny_qwen2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": UNK_ID}
    for c in CHARS:
        vocab[c] = len(vocab)
    assert len(vocab) == TINY_VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def save_tiny_model(path: Path, seed: int = 0, *, tie: bool = False) -> Path:
    """A random tiny Qwen2 + :func:`char_tokenizer` + generation_config (eos) in ``path``."""
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    tiny_qwen2(seed, tie=tie).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(path)
    return path


def start_trainer_broadcast(
    weights_file: Path, port: int, group_name: str, world_size: int = 2, timeout_s: float = 60
) -> subprocess.Popen:
    """tests/gloo_trainer.py in its own process: trainer rank 0 broadcasting every tensor of
    a safetensors file (sorted by name) over a gloo group it hosts on 127.0.0.1:``port``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]),
    }
    args = [str(weights_file), str(port), group_name, str(world_size), str(timeout_s)]
    return subprocess.Popen(
        [sys.executable, str(TESTS_DIR / "gloo_trainer.py"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Block until the trainer process prints its ready line (it then hosts the store)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if "ready" in line:
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"trainer process not ready (exit code {proc.poll()})")


def bucket_meta(named: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) in the order the trainer broadcasts them (sorted names)."""
    items = sorted(named.items())
    return (
        [n for n, _ in items],
        [str(t.dtype).removeprefix("torch.") for _, t in items],
        [list(t.shape) for _, t in items],
    )


def hf_reference(model, prompt: list[int], output: list[int],
                 params: SamplingParams) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """(tokens, log-probs) the engine must report for ``output`` (see the module docstring):
    token ``t`` is ``sample_next`` on the logits of ``prompt + output[:t]`` with the request's
    seed at position ``t``; its log-prob ``log_softmax(logits / T)`` (unscaled when greedy)."""
    n = len(output)
    if n == 0:
        return [], torch.zeros(0)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(prompt) + list(output)])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + n]
    p = params
    tokens, _ = sample_next(
        logits, torch.full((n,), float(p.temperature)), torch.full((n,), int(p.top_k)),
        torch.full((n,), float(p.top_p)), torch.full((n,), float(p.min_p)),
        torch.full((n,), p.seed or 0, dtype=torch.long), torch.arange(n))  # fmt: skip
    logp = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1)
    return tokens.tolist(), logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def assert_matches_hf(out, model, prompt: list[int], params: SamplingParams, *,
                      eos: int | None = EOS_ID, finished: bool = True) -> None:  # fmt: skip
    """``out`` (a GenerateOutput) is the sample :func:`hf_reference` draws: same tokens, log-probs
    to 1e-5; if ``finished`` (not aborted), it ends at its first stop token or at
    ``max_new_tokens`` with SGLang's finish reason (stop strings are checked by their tests)."""
    tokens, logp = hf_reference(model, prompt, out.output_ids, params)
    assert out.output_ids == tokens
    torch.testing.assert_close(torch.tensor(out.output_logprobs), logp, atol=1e-5, rtol=0)
    if not finished or params.stop:
        return
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos or eos is None else {eos})
    assert not stops & set(out.output_ids[:-1]), "generation ran past a stop token"
    n = len(out.output_ids)
    if n and out.output_ids[-1] in stops:
        assert out.finish_reason == {"type": "stop", "matched": out.output_ids[-1]}
    else:
        assert out.finish_reason == {"type": "length", "length": n}
        assert n == params.max_new_tokens


# A demo flow run small enough for a test: 8 prompts x 4 samples, no tracking, one thread each.
SMALL_RUN = ["train.prompts_per_step=8", "rollout.n_samples=4", "eval.every=0",
             "eval.num_examples=8", "eval.pass_k_examples=0", "tracking.backend=none",
             "train.num_threads=1", "rollout.engine_threads=1"]  # fmt: skip


def run_demo_flow(tmp: Path, cache: Path, name: str, *overrides: str,
                  resume: str = "never") -> dict:
    """``grpo_train`` of configs/tiny-cpu.yaml in this process with :data:`SMALL_RUN` and
    ``overrides``; its summary."""
    from flows.grpo_train import grpo_train

    args = [f"storage.root={tmp}", f"storage.cache_dir={cache}", f"run_name={name}",
            *SMALL_RUN, *overrides]  # fmt: skip
    return grpo_train(config=str(REPO_ROOT / "configs" / "tiny-cpu.yaml"), overrides=args,
                      show_progress=False, resume=resume)
