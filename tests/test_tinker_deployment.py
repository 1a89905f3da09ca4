"""Issue 38, item 5: the Tinker-compatible service as a Prefect deployment, and the scheduled
evaluation of a tenant's saved sampler weights like any registered version.

* The evaluation, in process (the session's Prefect API): a tenant trains a few steps with the
  REAL ``tinker`` SDK against the service (grpoflow.tinker on the demo's tiny model, MLflow
  lineage into a SQLite store), saves sampler weights (registered by the lineage as
  ``tinker-alice-<run>`` v1, a PEFT adapter), then ``evaluate(registered_like="tinker-%")``
  merges the adapter onto ``model.path``, scores it on the held-out set and records the
  metrics (a nested run under the tenant's run, ``eval.<key>.*`` tags on the version); a
  second scheduled run evaluates nothing twice; ``model=models:/NAME/1`` takes it too.
* The deployment, for real: a ``prefect server``, ``grpoflow deploy`` of
  deployments/prefect.yaml and a ``process`` worker (tests/test_deployments.py's fixtures);
  ``prefect deployment run tinker-service/tiny-cpu`` starts the service, the SDK trains on it,
  the service killed with SIGKILL fails the health check and the flow's retry starts it again
  on the same port, and ``prefect flow-run cancel`` stops it (CANCELLED, the port closed, the
  process gone). The soak tier also runs ``evaluate/tinker-nightly`` through the worker on
  what the deployed service registered.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import tinker  # the dev extra installs it: a missing one fails, not skips
from test_deployments import (  # noqa: E402
    BIN,
    _client,
    _deployment_run,
    _Proc,
    _run,
    _wait_final,
    prefect_server,  # noqa: F401 - the fixture
)

from grpoflow.tinker.auth import hash_key  # noqa: E402
from grpoflow.tinker.lineage import registered_name  # noqa: E402
from rl_core.host import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")
BASE = "grpoflow/tiny"
ALICE = "tml-alice-deploy-key"
ADAM = {"learning_rate": 5e-3, "eps": 1e-8}
pytestmark = [pytest.mark.filterwarnings("ignore:Adapter .* was active which is now deleted"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")]


def train_and_save(url: str, steps: int = 3) -> dict:
    """Alice's training client: ``steps`` cross-entropy steps on an arithmetic answer, then a
    named sampler save: its training run id, the losses, the text's token ids and their
    log-probs under the saved sampler weights (the service's engine)."""
    with tinker.ServiceClient(base_url=url, api_key=ALICE) as sc:
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        ids = tc.get_tokenizer().encode("12 + 7 = 19", add_special_tokens=False)
        datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                             loss_fn_inputs={"target_tokens": ids[1:],
                                             "weights": [1.0] * (len(ids) - 1)})
        losses = []
        for _ in range(steps):
            fb = tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(tinker.AdamParams(**ADAM)).result()
            losses.append(fb.result().metrics["loss:sum"])
        path = tc.save_weights_for_sampler("s1").result().path
        assert path == f"tinker://{tc.model_id}/sampler_weights/s1"
        sampler = sc.create_sampling_client(model_path=path).result()
        logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(ids)).result()
        return {"run": tc.model_id, "losses": losses, "ids": ids, "logprobs": logprobs}


def eval_overrides(tmp: Path, cache: Path, uri: str) -> list[str]:
    return [f"storage.root={tmp / 'runs'}", f"storage.cache_dir={cache}", f"tracking.uri={uri}",
            "eval.num_examples=8", "eval.pass_k_examples=0", "train.num_threads=1",
            "rollout.engine_threads=1"]


# ------------------------------------------------------------------ the file
def test_the_tinker_deployments_are_declared() -> None:
    """deployments/prefect.yaml: the service's deployment and the schedule that evaluates
    what its tenants save, on the base model the service serves."""
    import yaml

    from flows.tinker_service import tinker_service
    from grpoflow.tinker.serve import load_serve_config
    from rl_core.config import load_config

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    by_name = {(d["entrypoint"], d["name"]): d for d in spec["deployments"]}
    service = by_name["flows/tinker_service.py:tinker_service", "tiny-cpu"]
    nightly = by_name["flows/evaluate.py:evaluate", "tinker-nightly"]
    served = load_serve_config(ROOT / service["parameters"]["config"])
    assert served.host == "127.0.0.1" and service["work_pool"]["name"] == "grpoflow-process"
    assert tinker_service.retries >= 1  # an unhealthy service is restarted by a retry
    assert nightly["schedule"]["cron"] == "30 3 * * *"
    assert nightly["parameters"]["registered_like"] == "tinker-%"
    evaluated = load_config(ROOT / nightly["parameters"]["config"])
    assert evaluated.model.path in served.base_models.values()  # adapters merge onto it


# ------------------------------------------------------------------ the evaluation, in process
@pytest.fixture
def service(demo_model: Path, tmp_path: Path):
    """The service in this process on the demo model (alice's key), lineage into SQLite."""
    import torch

    from grpoflow.tinker.app import create_app
    from grpoflow.tinker.lineage import MlflowLineage
    from rl_core.engine.server import ServerThread
    from rl_core.tinker.backend import LoraBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    backend = LoraBackend({BASE: demo_model}, num_threads=1)
    tracker = MlflowLineage(uri, "tinker-eval-test", root=tmp_path / "root", flush_timeout_s=60)
    app = create_app(backend, root=tmp_path / "root", tenants={"alice": [hash_key(ALICE)]},
                     tracker=tracker, poll_timeout_s=5)
    thread = ServerThread(app).start()
    try:
        yield {"url": thread.url, "uri": uri, "tracker": tracker}
    finally:
        app.state.tinker.close()
        thread.stop()
        backend.close()
        tracker.close()
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.timeout(300)
def test_a_tenants_sampler_weights_are_evaluated_like_any_registered_version(
        service, demo_model: Path, tiny_cache: Path, tmp_path: Path, capsys) -> None:
    import torch
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from flows.evaluate import evaluate

    tenant = train_and_save(service["url"])
    run, losses = tenant["run"], tenant["losses"]
    assert losses[-1] < losses[0], losses
    assert service["tracker"].flush(60), "the lineage did not reach MLflow in 60 s"
    client = MlflowClient(service["uri"], registry_uri=service["uri"])
    name = registered_name("alice", run)
    (mv,) = client.search_model_versions(f"name = '{name}'")
    assert str(mv.version) == "1" and mv.tags["tinker.tenant"] == "alice"

    overrides = eval_overrides(tmp_path, tiny_cache, service["uri"])
    out = evaluate(config=DEMO, overrides=overrides, registered_like="tinker-%")
    assert out["evaluated_now"] == [f"{name}/1"] and out["versions"] == {name: "1"}
    key = out["eval_key"]
    tags = client.get_model_version(name, "1").tags
    assert 0.0 <= float(tags[f"eval.{key}.pass_at_1"]) <= 1.0
    nested = client.get_run(tags[f"eval.{key}.run_id"])
    assert nested.data.tags["mlflow.parentRunId"] == mv.run_id  # under the tenant's run
    assert nested.data.tags["grpoflow.alias"] == "latest"
    assert nested.data.metrics["pass_at_1"] == pytest.approx(out["scores"][f"{name}/1"]
                                                              ["pass_at_1"])
    # what was scored: the base with the adapter merged in (the trained adapter changes it)
    (merged,) = (tiny_cache / "registry" / name).glob("v1-on-*")
    assert (merged / "adapter" / "adapter_config.json").is_file()
    new, old = load_file(merged / "model.safetensors"), load_file(demo_model / "model.safetensors")
    changed = [k for k in old if not torch.equal(new[k], old[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed), changed
    # ... and it computes what the service's sampler computes with the saved weights
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.tensor([tenant["ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    mine = logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()
    assert tenant["logprobs"][0] is None
    assert mine == pytest.approx(tenant["logprobs"][1:], abs=1e-4)

    # the schedule again, from the CLI (`grpoflow evaluate --registered-like`): nothing
    # evaluated twice
    import json

    from grpoflow.cli import main as cli_main

    capsys.readouterr()
    assert cli_main(["evaluate", DEMO, "--registered-like", "tinker-%", *overrides]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["evaluated_now"] == [] and again["versions"] == {name: "1"}
    assert again["scores"][f"{name}/1"]["pass_at_1"] == pytest.approx(
        out["scores"][f"{name}/1"]["pass_at_1"], abs=1e-6)
    runs = client.search_runs([nested.info.experiment_id],
                              filter_string="tags.`grpoflow.kind` = 'registry-evaluation'")
    assert len(runs) == 1
    # a version that does not fit the base costs that version only, and fails the run
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(merged / "adapter", broken)
    cfg = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**cfg,
                                                            "target_modules": ["nope_proj"]}))
    client.log_artifacts(mv.run_id, str(broken), "checkpoints/sampler_weights/broken")
    client.create_registered_model("tinker-bob-broken")
    client.create_model_version("tinker-bob-broken", run_id=mv.run_id,
                                source=f"runs:/{mv.run_id}/checkpoints/sampler_weights/broken")
    with pytest.raises(RuntimeError, match=r"1 of 2 .*tinker-bob-broken/1.*model\.path"):
        evaluate(config=DEMO, overrides=overrides, registered_like="tinker-%")

    # and the plain evaluation takes the version's registry URI
    direct = evaluate(config=DEMO, overrides=overrides, model=f"models:/{name}/1")
    assert direct["num_examples"] == 8 and direct["pass_at_1"] == pytest.approx(
        out["scores"][f"{name}/1"]["pass_at_1"], abs=1e-6)


# ------------------------------------------------------------------ the flow, in process
def _service_pids(port: int) -> list[int]:
    """The pids of ``python -m grpoflow.tinker.serve supervised ... port=PORT``."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"grpoflow.tinker.serve" in argv and f"port={port}".encode() in argv and \
                    _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


@pytest.mark.timeout(180)
def test_the_supervised_service_stops_when_its_stdin_closes(demo_model: Path, tiny_cache: Path,
                                                            tmp_path: Path) -> None:
    """The guarantee behind "never outlives its flow": the flow's process gone (its end of
    the stdin pipe closed, as the kernel closes it even after SIGKILL), the service stops
    by itself, gracefully (exit code 0), without any signal."""
    from flows.tinker_service import ServiceProcess

    port = free_port()
    svc = ServiceProcess(str(ROOT / "configs" / "tinker-tiny-cpu.yaml"),
                         [f"port={port}", f"root={tmp_path}", f"cache_dir={tiny_cache}",
                          "tracking.backend=none"], tmp_path / "service.log")
    svc.start()
    try:
        assert svc.wait_ready(150) == f"http://127.0.0.1:{port}" and _healthy(svc.url)
        svc.proc.stdin.close()
        assert svc.proc.wait(60) == 0, svc.tail()
        assert "stdin closed" in svc.tail() and not _healthy(svc.url)
    finally:
        svc.stop(10)


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.timeout(300)
def test_the_service_flow_restarts_a_dead_service_and_stops_it(demo_model: Path,
                                                                tiny_cache: Path,
                                                                tmp_path: Path) -> None:
    """The flow on the session's Prefect API (the deployment's flow, short of the worker):
    the service killed with SIGKILL fails the attempt (the error names the exit code) and the
    flow's retry serves again on the same port; at ``max_runtime_s`` it stops the service
    gracefully and completes. (Through a real server, worker and ``prefect flow-run cancel``:
    the soak test below.)"""
    import threading

    from flows.tinker_service import tinker_service

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    overrides = [f"port={port}", f"root={tmp_path / 'tinker'}", f"cache_dir={tiny_cache}",
                 "tracking.backend=none", "log_level=warning"]
    box: dict = {}

    def run() -> None:
        flow = tinker_service.with_options(retries=1, retry_delay_seconds=0)
        box["state"] = flow(overrides=overrides, health_every_s=0.5, max_runtime_s=8,
                            stop_timeout_s=20, return_state=True)

    thread = threading.Thread(target=run, name="tinker-service-flow", daemon=True)
    thread.start()
    pids: list[int] = []
    try:
        for attempt in (1, 2):
            deadline = time.monotonic() + 180
            while not (_healthy(url) and (found := [p for p in _service_pids(port)
                                                    if p not in pids])):
                assert thread.is_alive() and time.monotonic() < deadline, \
                    f"attempt {attempt}: the service did not answer: {box}"
                time.sleep(0.2)
            pids += found
            if attempt == 1:
                os.kill(found[0], signal.SIGKILL)  # dead: the health check fails the attempt
        thread.join(60)
        assert not thread.is_alive()
        state = box["state"]
        assert state.is_completed(), state
        summary = state.result()
        assert summary["url"] == url and summary["pid"] == pids[1] != pids[0]
        assert summary["stopped"].startswith("stopped in") and summary["failed_checks"] == 0
        assert not _healthy(url) and not any(_alive(p) for p in pids)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        thread.join(60)


# ------------------------------------------------------------------ the deployment, for real
def _healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + "/api/v1/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _flow_run(api: str, flow_run_id: str):  # noqa: ANN202
    with _client(api) as client:
        return client.read_flow_run(flow_run_id)


def _until(what: str, check, timeout_s: float, api: str, flow_run_id: str,  # noqa: ANN001
           worker: _Proc) -> None:
    """Wait (bounded) until ``check()``; fail early when the flow run ends."""
    deadline = time.monotonic() + timeout_s
    while not check():
        run = _flow_run(api, flow_run_id)
        if run.state is not None and run.state.is_final():
            raise AssertionError(f"{what}: the flow run ended {run.state.type.value}:\n"
                                 f"{worker.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s:\n{worker.tail()}")
        time.sleep(0.5)


def _service_pid(api: str, flow_run_id: str, attempt: int) -> int:
    """The service's pid from the ``ready`` artifact of the flow run's ``attempt``-th start."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort

    with _client(api) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])), sort=ArtifactSort.CREATED_DESC)
    ready = [str(a.data) for a in found if ": ready" in str(a.data)]
    assert len(ready) >= attempt, ready
    return int(re.search(r"\| pid \| `(\d+)` \|", ready[0]).group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return False


def _deployed_service(server: tuple, tiny_cache: Path, tmp_path: Path):
    """``grpoflow deploy``, a worker (two slots: the service and an evaluation), and
    ``tinker-service/tiny-cpu`` started on a free port; (api, env, worker, flow run, url)."""
    api, env = server
    out = _run([sys.executable, "-m", "grpoflow.cli", "deploy"], env)
    assert "work pool 'grpoflow-process' created" in out, out
    worker = _Proc("worker", [str(BIN / "prefect"), "worker", "start", "--pool",
                              "grpoflow-process", "--limit", "2"], env, tmp_path / "worker.log")
    port = free_port()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [f"port={port}", f"root={tmp_path / 'tinker'}", f"cache_dir={tiny_cache}",
                 f"tracking.uri={uri}", f"tenants={{alice: ['{hash_key(ALICE)}']}}",
                 "log_level=warning"]
    flow_run_id = _deployment_run(env, "tinker-service/tiny-cpu", overrides=overrides,
                                  health_every_s=1, max_failures=2, stop_timeout_s=20)
    return api, env, worker, flow_run_id, f"http://127.0.0.1:{port}", uri


@pytest.mark.soak
@pytest.mark.timeout(420)
def test_the_service_deployment_serves_restarts_when_unhealthy_and_stops_when_cancelled(
        prefect_server, demo_model: Path, tiny_cache: Path, tmp_path: Path) -> None:  # noqa: F811
    api, env, worker, flow_run_id, url, _ = _deployed_service(prefect_server, tiny_cache,
                                                              tmp_path)
    pids: list[int] = []
    try:
        _until("the service answers", lambda: _healthy(url), 240, api, flow_run_id, worker)
        pids.append(_service_pid(api, flow_run_id, 1))
        losses = train_and_save(url, steps=2)["losses"]  # the real SDK, deployed service
        assert losses[1] < losses[0], losses

        # killed: the health check fails the run, and the flow's retry starts it again
        os.kill(pids[0], signal.SIGKILL)
        _until("restarted by the flow's retry",
               lambda: _flow_run(api, flow_run_id).run_count >= 2 and _healthy(url), 120,
               api, flow_run_id, worker)
        pids.append(_service_pid(api, flow_run_id, 2))
        assert pids[1] != pids[0] and not _alive(pids[0])

        # cancelled: the flow run ends CANCELLED and the service with it
        _run([str(BIN / "prefect"), "flow-run", "cancel", flow_run_id], env)
        assert _wait_final(api, flow_run_id, timeout_s=90, worker=worker) == "CANCELLED"
        deadline = time.monotonic() + 30
        while _alive(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pids[1]) and not _healthy(url)
    finally:
        _cleanup(api, env, worker, flow_run_id, pids)


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_the_nightly_tinker_evaluation_deployment_scores_the_deployed_services_weights(
        prefect_server, demo_model: Path, tiny_cache: Path, tmp_path: Path) -> None:  # noqa: F811
    from mlflow import MlflowClient

    api, env, worker, flow_run_id, url, uri = _deployed_service(prefect_server, tiny_cache,
                                                                tmp_path)
    pids: list[int] = []
    try:
        _until("the service answers", lambda: _healthy(url), 240, api, flow_run_id, worker)
        pids.append(_service_pid(api, flow_run_id, 1))
        run = train_and_save(url, steps=2)["run"]
        client = MlflowClient(uri, registry_uri=uri)
        name = registered_name("alice", run)
        _until("the sampler weights registered",
               lambda: bool(client.search_model_versions(f"name = '{name}'")), 60, api,
               flow_run_id, worker)
        eval_id = _deployment_run(env, "evaluate/tinker-nightly",
                                  overrides=eval_overrides(tmp_path, tiny_cache, uri))
        assert _wait_final(api, eval_id, timeout_s=400, worker=worker) == "COMPLETED"
        tags = client.get_model_version(name, "1").tags
        assert any(k.startswith("eval.") and k.endswith(".pass_at_1") for k in tags), tags
        _run([str(BIN / "prefect"), "flow-run", "cancel", flow_run_id], env)
        assert _wait_final(api, flow_run_id, timeout_s=90, worker=worker) == "CANCELLED"
    finally:
        _cleanup(api, env, worker, flow_run_id, pids)


def _cleanup(api: str, env: dict[str, str], worker: _Proc, flow_run_id: str,
             pids: list[int]) -> None:
    """Whatever a failed test left: the flow run cancelled, the worker stopped (before the
    server), any service process killed."""
    run = _flow_run(api, flow_run_id)
    if run.state is not None and not run.state.is_final():
        subprocess.run([str(BIN / "prefect"), "flow-run", "cancel", flow_run_id], env=env,
                       capture_output=True, timeout=60, cwd=ROOT)
        with contextlib.suppress(AssertionError):
            _wait_final(api, flow_run_id, timeout_s=60, worker=worker)
    worker.stop()
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
