"""Deployments for real: a ``prefect server`` (SQLite), a ``process`` worker, ``grpoflow deploy``
from deployments/prefect.yaml, ``prefect deployment run`` with parameters.

Everything runs as separate processes on 127.0.0.1, as a user would start them: the server,
the worker (polling every second), the CLI calls. The deployed demo run must complete and
MLflow must hold its run (tagged with the flow run's id); the nightly evaluation's cron
schedule must have produced scheduled runs. The worker is stopped before the server (the
other order hangs the shutdown). Static checks of the file itself come first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from engine_helpers import free_port

from grpoflow.deploy import work_pools

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
BIN = Path(sys.executable).parent


def _spec() -> dict:
    return yaml.safe_load(PREFECT_FILE.read_text())


def test_the_deployments_file_names_real_flows_and_configs() -> None:
    import importlib

    spec = _spec()
    by_flow: dict[str, list[str]] = {}
    for d in spec["deployments"]:
        path, func = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        by_flow.setdefault(flow.name, []).append(d["name"])
        config = d["parameters"].get("config")
        assert config and (ROOT / config).is_file(), (d["name"], config)
        from rl_core.config import load_config

        load_config(ROOT / config, d["parameters"].get("overrides") or [])
        unknown = set(d["parameters"]) - set(flow.parameters.properties)
        assert not unknown, f"{d['name']}: {unknown} are not parameters of {flow.name}"
    assert by_flow == {
        "grpo-train": ["tiny-cpu", "qwen2.5-0.5b-gsm8k"],
        "evaluate": ["nightly"],
        "prepare-data": ["tiny-cpu"],
    }
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
    assert nightly["schedule"]["cron"] == "0 3 * * *" and nightly["parameters"]["registry"]
    assert work_pools(PREFECT_FILE) == ["grpoflow-process", "grpoflow-gpu"]
    assert spec["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == (
        "{{ $GRPOFLOW_HOME }}"
    )


# --------------------------------------------------------------------- real processes


class _Proc:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``prefect server start`` on 127.0.0.1 with its own PREFECT_HOME (SQLite); yields the
    API URL and the environment every client process gets."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    }
    server = _Proc(
        "server",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        tmp_path / "server.log",
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited:\n{server.tail()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefect server not healthy in 180 s:\n{server.tail()}")
            time.sleep(0.5)
        yield url, env
    finally:
        server.stop()


def _run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_deploy_run_and_schedule_on_a_real_server(
    prefect_server, demo_model: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    url, env = prefect_server
    out = _run([sys.executable, "-m", "grpoflow.cli", "deploy"], env)
    assert "work pool 'grpoflow-process' created" in out, out
    worker = _Proc(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", "grpoflow-process", "--limit", "1"],
        env,
        tmp_path / "worker.log",
    )
    runs = tmp_path / "runs"
    overrides = [
        f"storage.root={runs}", f"storage.cache_dir={tiny_cache}", "run_name=deployed",
        "train.steps=1", "train.prompts_per_step=4", "rollout.n_samples=4", "eval.every=0",
        "eval.num_examples=16", "eval.pass_k_examples=0", "train.num_threads=1",
        "rollout.engine_threads=1", "tracking.system_metrics=false",
    ]  # fmt: skip
    try:
        started = _run(
            [str(BIN / "prefect"), "deployment", "run", "grpo-train/tiny-cpu",
             "--param", f"overrides={json.dumps(overrides)}"],
            env,
        )  # fmt: skip
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", started)
        assert match, started
        flow_run_id = match.group(1)
        state = _wait_final(url, flow_run_id, timeout_s=600, worker=worker)
        assert state == "COMPLETED", f"flow run ended {state}:\n{worker.tail()}"

        # MLflow holds the run, tagged with the flow run that produced it
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{runs / 'deployed' / 'mlflow.db'}")
        found = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'",
        )
        assert len(found) == 1 and found[0].info.status == "FINISHED"
        assert found[0].data.params["train.steps"] == "1"

        # the cron deployment has scheduled runs waiting
        scheduled = _scheduled_runs(url, "evaluate", "nightly")
        assert scheduled, "the nightly evaluation has no scheduled runs"
        assert all(r.expected_start_time.hour == 3 for r in scheduled)
    finally:
        worker.stop()  # before the server


def _client(url: str):  # noqa: ANN202
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Ctx:
        def __enter__(self):  # noqa: ANN204
            self._settings = temporary_settings({PREFECT_API_URL: url})
            self._settings.__enter__()
            self._client = get_client(sync_client=True)
            return self._client.__enter__()

        def __exit__(self, *exc: object) -> None:
            self._client.__exit__(*exc)
            self._settings.__exit__(*exc)

    return _Ctx()


def _wait_final(url: str, flow_run_id: str, *, timeout_s: float, worker: _Proc) -> str:
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        with _client(url) as client:
            run = client.read_flow_run(flow_run_id)
        state = run.state.type.value if run.state else None
        if run.state is not None and run.state.is_final():
            return state
        if worker.proc.poll() is not None:
            raise AssertionError(f"the worker exited:\n{worker.tail()}")
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} not final in {timeout_s}s ({state}):\n"
                         f"{worker.tail()}")  # fmt: skip


def _scheduled_runs(url: str, flow: str, deployment: str) -> list:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + 60
    while True:
        with _client(url) as client:
            dep = client.read_deployment_by_name(f"{flow}/{deployment}")
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
                ),
            )
        if runs or time.monotonic() > deadline:
            return runs
        time.sleep(2)
