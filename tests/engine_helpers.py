"""Helpers for the embedded-engine tests: a tiny HF model on disk and a gloo trainer process.

Imported by tests/test_engine.py, tests/test_engine_server.py and tests/conformance/.
Everything is built locally; nothing is downloaded.

The saved model gets a character-level byte-BPE tokenizer rather than conftest's WordLevel
one: transformers 5's ``AutoTokenizer`` rebuilds any qwen2 checkpoint's tokenizer as a
``Qwen2Tokenizer`` (byte-level BPE from vocab + merges), which loses a WordLevel pipeline
(``"a05 a06"`` encodes to ``[]``) but keeps a single-character byte-level vocabulary intact.
"""

from __future__ import annotations

import os
import socket
import string
import subprocess
import sys
from pathlib import Path

import torch
from conftest import EOS_ID, PAD_ID, TINY_VOCAB, UNK_ID, tiny_qwen2

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
