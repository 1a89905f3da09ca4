"""Deployments for real: a ``prefect server`` (SQLite), a ``process`` worker, ``grpoflow deploy``
from deployments/prefect.yaml, ``prefect deployment run`` with parameters.

Everything runs as separate processes on 127.0.0.1, as a user would start them: the server,
the worker (polling every second), the CLI calls. The deployed chain (``post-train``: SFT ->
GRPO -> registry evaluation) must complete with its GRPO version, trained from the SFT
export, made champion of the model the nightly evaluation evaluates, and MLflow must hold the
GRPO run tagged with the flow run that trained it; the nightly evaluation's cron schedule
must have produced scheduled runs. The soak tier also runs ``grpo-train/tiny-cpu`` alone. The worker is stopped before the server (the
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

from grpoflow.deploy import work_pools
from rl_core.host import free_port

ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
BIN = Path(sys.executable).parent


def _spec() -> dict:
    return yaml.safe_load(PREFECT_FILE.read_text())


def test_the_deployments_file_names_real_flows_and_configs() -> None:
    import importlib

    from grpoflow.tinker.serve import load_serve_config
    from rl_core.config import load_config
    from rl_core.sft import load_sft_config

    spec = _spec()
    by_flow: dict[str, list[str]] = {}
    for d in spec["deployments"]:
        path, func = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        by_flow.setdefault(flow.name, []).append(d["name"])
        params = d["parameters"]
        configs = {"sft-train": [(params.get("config"), load_sft_config)],
                   "tinker-service": [(params.get("config"), load_serve_config)],
                   "post-train": [(params.get("sft_config"), load_sft_config),
                                  (params.get("grpo_config"), load_config)]}.get(
            flow.name, [(params.get("config"), load_config)])
        for config, load in configs:
            assert config and (ROOT / config).is_file(), (d["name"], config)
            load(ROOT / config, params.get("overrides") or [])
        unknown = set(params) - set(flow.parameters.properties)
        assert not unknown, f"{d['name']}: {unknown} are not parameters of {flow.name}"
    assert by_flow == {
        "grpo-train": ["tiny-cpu", "qwen2.5-0.5b-gsm8k"],
        "evaluate": ["nightly", "tinker-nightly"],
        "sft-train": ["tiny-cpu"],
        "post-train": ["tiny-cpu"],
        "prepare-data": ["tiny-cpu"],
        "tinker-service": ["tiny-cpu"],
    }
    deployment = {(d["entrypoint"], d["name"]): d for d in spec["deployments"]}
    nightly = deployment["flows/evaluate.py:evaluate", "nightly"]
    assert nightly["schedule"]["cron"] == "0 3 * * *" and nightly["parameters"]["registry"]
    # the chain's GRPO stage registers the model the nightly evaluation evaluates
    chain = deployment["flows/pipeline.py:post_train", "tiny-cpu"]["parameters"]
    assert load_config(ROOT / chain["grpo_config"]).model.name == \
        load_config(ROOT / nightly["parameters"]["config"]).model.name
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
        # as the session's harness (tests/conftest.py): nothing here reads stored events or
        # uses automations, and storing every task-run event costs the server CPU
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
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


def _deploy_and_start_worker(env: dict[str, str], tmp_path: Path) -> _Proc:
    out = _run([sys.executable, "-m", "grpoflow.cli", "deploy"], env)
    assert "work pool 'grpoflow-process' created" in out, out
    return _Proc(
        "worker",
        [str(BIN / "prefect"), "worker", "start", "--pool", "grpoflow-process", "--limit", "1"],
        env,
        tmp_path / "worker.log",
    )


def test_deploy_run_and_schedule_on_a_real_server(
    prefect_server, demo_model: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    """The deployed chain (SFT -> GRPO -> registry evaluation) as one deployment run: MLflow
    holds its GRPO run tagged with the flow run that trained it; its version, trained from
    the SFT export, is champion of the model evaluate/nightly evaluates; the cron deployment
    has scheduled runs. (The grpo-train deployment run alone: the soak tier, below.)"""
    url, env = prefect_server
    worker = _deploy_and_start_worker(env, tmp_path)
    runs = tmp_path / "runs"
    try:
        # one MLflow store, runs/mlflow.db, as no tracking URI is set
        where = [f"storage.root={runs}", f"storage.cache_dir={tiny_cache}"]
        small = ["train.num_threads=1", "tracking.system_metrics=false"]
        evals = ["eval.num_examples=8", "eval.pass_k_examples=0"]
        chain_id = _deployment_run(
            env, "post-train/tiny-cpu", run_name="chain",
            sft_overrides=[*where, *small, "train.steps=2", "train.batch_size=8",
                           "train.micro_batch_size=8", "eval.every=0", "eval.num_examples=8",
                           "eval.greedy_examples=4"],
            grpo_overrides=[*where, *small, *evals, "train.steps=1", "train.prompts_per_step=4",
                            "rollout.n_samples=4", "rollout.engine=local", "eval.every=0"])
        state = _wait_final(url, chain_id, timeout_s=600, worker=worker)
        assert state == "COMPLETED", f"post-train ended {state}:\n{worker.tail()}"
        from mlflow import MlflowClient

        chain = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
        champion = chain.get_model_version_by_alias("grpoflow-tiny", "champion")
        assert champion.tags["grpoflow.base_model"] == str(runs / "chain-sft" / "model")
        assert champion.description.startswith("GRPO run chain-grpo, step 1.")
        sft = chain.get_model_version_by_alias("grpoflow-tiny-sft", "candidate")
        assert sft.description.startswith("SFT run chain-sft, step 2.")
        assert "GRPO: run chain-grpo (1 step, trained)" in _artifacts(url, chain_id)[
            "post-train-chain"]
        # MLflow's GRPO run is tagged with the flow run that trained it: a subflow of the chain
        grpo = chain.get_run(champion.run_id)
        assert grpo.info.status == "FINISHED" and grpo.data.params["train.steps"] == "1"
        assert grpo.data.tags["prefect.flow_run_id"] in _subflow_runs(url, chain_id)

        # the cron deployment has scheduled runs waiting
        scheduled = _scheduled_runs(url, "evaluate", "nightly")
        assert scheduled, "the nightly evaluation has no scheduled runs"
        assert all(r.expected_start_time.hour == 3 for r in scheduled)
    finally:
        worker.stop()  # before the server


@pytest.mark.soak
def test_the_grpo_train_deployment_runs_and_mlflow_holds_its_run(
    prefect_server, demo_model: Path, tiny_cache: Path, tmp_path: Path
) -> None:
    """``prefect deployment run grpo-train/tiny-cpu`` with overrides completes, and MLflow
    holds its run, tagged with the flow run's id (in make test: the chain above, whose GRPO
    stage is the same flow, run by the same worker)."""
    url, env = prefect_server
    worker = _deploy_and_start_worker(env, tmp_path)
    runs = tmp_path / "runs"
    overrides = [
        f"storage.root={runs}", f"storage.cache_dir={tiny_cache}", "run_name=deployed",
        "train.steps=1", "train.prompts_per_step=4", "rollout.n_samples=4", "eval.every=0",
        "eval.num_examples=16", "eval.pass_k_examples=0", "train.num_threads=1",
        "rollout.engine_threads=1", "tracking.system_metrics=false",
    ]  # fmt: skip
    try:
        flow_run_id = _deployment_run(env, "grpo-train/tiny-cpu", overrides=overrides)
        state = _wait_final(url, flow_run_id, timeout_s=600, worker=worker)
        assert state == "COMPLETED", f"flow run ended {state}:\n{worker.tail()}"
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")  # the project's one store
        found = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'",
        )
        assert len(found) == 1 and found[0].info.status == "FINISHED"
        assert found[0].data.params["train.steps"] == "1"
    finally:
        worker.stop()  # before the server


def _subflow_runs(url: str, parent_id: str) -> set[str]:
    """The ids of the flow runs started inside flow run ``parent_id`` (its subflows)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with _client(url) as client:
        found = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
    return {str(r.id) for r in found}


def _deployment_run(env: dict[str, str], name: str, **params: object) -> str:
    """``prefect deployment run NAME --param k=v ...``; the flow run's id."""
    cmd = [str(BIN / "prefect"), "deployment", "run", name]
    for key, value in params.items():
        cmd += ["--param", f"{key}={json.dumps(value) if isinstance(value, list) else value}"]
    started = _run(cmd, env)
    match = re.search(r"UUID:\s*([0-9a-f-]{36})", started)
    assert match, started
    return match.group(1)


def _artifacts(url: str, flow_run_id: str) -> dict[str, str]:
    """The flow run's artifacts: key -> data."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with _client(url) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: str(a.data) for a in found if a.key}


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
