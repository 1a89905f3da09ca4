"""Fixtures for the SGLang protocol conformance suite.

Set ``GRPOFLOW_SGLANG_URL=http://host:port`` to run the suite against that server (a real
SGLang, or anything behind the router); unset, a session fixture serves the embedded engine
over a tiny random Qwen2 on 127.0.0.1. The tests only use token ids 3..30 (valid in any
vocabulary), greedy or seeded sampling, and protocol-level facts, so the same assertions hold
for both. Numerical tolerances are loose against an external server (bf16 kernels on GPU).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from engine_helpers import save_tiny_model

URL_ENV = "GRPOFLOW_SGLANG_URL"


@pytest.fixture(scope="session")
def external() -> bool:
    return bool(os.environ.get(URL_ENV))


@pytest.fixture(scope="session")
def sglang_url(tmp_path_factory, external) -> Iterator[str]:
    if external:
        yield os.environ[URL_ENV].rstrip("/")
        return
    from rl_core.engine.core import EmbeddedEngine
    from rl_core.engine.server import ServerThread, create_app

    model_dir = save_tiny_model(tmp_path_factory.mktemp("conformance") / "model", seed=3)
    # A context long enough that a long generation is still running when it is aborted.
    engine = EmbeddedEngine(model_dir, context_length=4096, num_threads=1)
    server = ServerThread(create_app(engine)).start()
    try:
        yield server.url
    finally:
        server.stop()
        engine.close()


@pytest.fixture(scope="session")
def client(sglang_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sglang_url, timeout=httpx.Timeout(120.0, connect=10.0)) as c:
        yield c


@pytest.fixture(scope="session")
def logprob_atol(external) -> float:
    return 0.1 if external else 1e-4


@pytest.fixture(scope="session")
def context_length(client) -> int:
    """The served context length (SGLang may report it as null and give max_req_input_len)."""
    info = client.get("/server_info").json()
    if info.get("context_length"):
        return int(info["context_length"])
    if info.get("max_req_input_len"):
        return int(info["max_req_input_len"]) + 1
    return 2048  # every model this suite targets serves at least this much
