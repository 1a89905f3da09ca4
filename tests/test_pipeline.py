"""The post-training chain (``post-train``, flows/pipeline.py; ``grpoflow post-train``) on real
parts: Prefect's test API, the SFT and GRPO flows as subflows, MLflow on SQLite with the model
registry, the registry evaluation.

Pinned here: the GRPO stage trains from the SFT stage's export (its ``model.path``, its
registered version's base model); each stage registers its own model, with a description that
says what trained it; the chain's evaluation makes the GRPO version champion; one MLflow store
for all (``<storage.root>/mlflow.db`` when none is named). Run again with the same name, the
chain skips both finished stages and registers nothing; with more GRPO steps it skips SFT and
resumes GRPO from its checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from engine_helpers import REPO_ROOT, SMALL_RUN

pytestmark = pytest.mark.timeout(900)

SFT_SMALL = ["train.num_threads=1", "data.synthetic_train_size=600", "data.synthetic_test_size=64",
             "train.batch_size=16", "train.micro_batch_size=16", "train.steps=4",
             "train.warmup_steps=1", "eval.every=0", "eval.num_examples=16",
             "eval.greedy_examples=8", "tracking.system_metrics=false"]
GRPO_SMALL = [*(o for o in SMALL_RUN if not o.startswith("tracking.")), "train.steps=2",
              "rollout.engine=local", "tracking.system_metrics=false"]


def _chain(tmp: Path, cache: Path, *grpo_extra: str, **kw) -> dict:
    from flows.pipeline import post_train

    where = [f"storage.root={tmp}", f"storage.cache_dir={cache}"]
    return post_train(sft_config=str(REPO_ROOT / "configs" / "sft-tiny-cpu.yaml"),
                      grpo_config=str(REPO_ROOT / "configs" / "tiny-cpu.yaml"),
                      sft_overrides=[*where, *SFT_SMALL],
                      grpo_overrides=[*where, *GRPO_SMALL, *grpo_extra], run_name="chain",
                      show_progress=False, **kw)


def test_post_train_chains_sft_into_grpo_registers_and_resumes(
        prefect_harness, tiny_cache: Path, tmp_path: Path, monkeypatch) -> None:
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t0 = time.monotonic()
    state = _chain(tmp_path, tiny_cache, return_state=True)
    first_s = time.monotonic() - t0
    assert state.is_completed(), state
    out = state.result()
    sft, grpo = out["sft"], out["grpo"]
    assert (sft["run_name"], grpo["run_name"]) == ("chain-sft", "chain-grpo")
    assert not sft["skipped"] and not grpo["skipped"] and sft["steps"] == 4 and grpo["steps"] == 2

    # GRPO trained from the SFT export
    assert grpo["base_model"] == sft["model_dir"] == str(tmp_path / "chain-sft" / "model")
    grpo_cfg = yaml.safe_load((tmp_path / "chain-grpo" / "config.yaml").read_text())
    assert grpo_cfg["model"]["path"] == sft["model_dir"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # one store for the chain
    assert client.get_run(grpo["mlflow_run_id"]).data.params["model.path"] == sft["model_dir"]
    assert client.get_run(sft["mlflow_run_id"]).data.params["model.path"] == "embedded:tiny-init"

    # each stage registered its model; the chain's evaluation made the GRPO version champion
    sft_v = client.get_model_version_by_alias("grpoflow-tiny-sft", "candidate")
    rl_v = client.get_model_version_by_alias("grpoflow-tiny", "candidate")
    assert (sft["registered"], grpo["registered"]) == ("grpoflow-tiny-sft v1", "grpoflow-tiny v1")
    assert sft_v.run_id == sft["mlflow_run_id"] and rl_v.run_id == grpo["mlflow_run_id"]
    assert sft_v.description.startswith("SFT run chain-sft, step 4."), sft_v.description
    assert rl_v.description.startswith("GRPO run chain-grpo, step 2."), rl_v.description
    assert rl_v.tags["grpoflow.base_model"] == sft["model_dir"]
    ev = out["evaluation"]
    assert ev["versions"] == {"candidate": "1"} and ev["evaluated_now"] == ["1"] and ev["promoted"]
    assert str(client.get_model_version_by_alias("grpoflow-tiny", "champion").version) == "1"
    acc = out["accuracy"]
    assert all(0.0 <= acc[k] <= 1.0 for k in ("before_sft", "after_sft", "after_rl")), acc
    assert acc["after_rl"] == grpo["last_eval"]["pass_at_1"]
    assert json.loads((tmp_path / "chain-grpo" / "post-train.json").read_text()) == out

    with get_client(sync_client=True) as pc:  # the stages are subflow runs of the chain's run
        children = pc.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(
                any_=[state.state_details.flow_run_id])))
        names = sorted(pc.read_flow(r.flow_id).name for r in children)
    assert names == ["evaluate", "grpo-train", "sft-train"], names

    # the same name again: both stages finished, nothing trained, registered or evaluated
    t0 = time.monotonic()
    again = _chain(tmp_path, tiny_cache)
    again_s = time.monotonic() - t0
    assert again["sft"]["skipped"] and again["grpo"]["skipped"]
    assert again["grpo"]["mlflow_run_id"] == grpo["mlflow_run_id"]
    assert again["evaluation"]["evaluated_now"] == [] and not again["evaluation"]["promoted"]
    for model in ("grpoflow-tiny", "grpoflow-tiny-sft"):
        assert [str(v.version) for v in client.search_model_versions(f"name='{model}'")] == ["1"]

    # one more GRPO step: SFT skipped, GRPO resumed from its checkpoint at step 2
    t0 = time.monotonic()
    more = _chain(tmp_path, tiny_cache, "train.steps=3")
    more_s = time.monotonic() - t0
    assert more["sft"]["skipped"] and not more["grpo"]["skipped"]
    assert more["grpo"]["resumed_from_step"] == 2 and more["grpo"]["registered"] == "grpoflow-tiny v2"
    assert more["grpo"]["mlflow_run_id"] == grpo["mlflow_run_id"]  # the same MLflow run, resumed
    steps = (tmp_path / "chain-grpo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in steps] == [1, 2, 3]
    assert more["evaluation"]["evaluated_now"] == ["2"]
    print(f"chain {first_s:.0f}s, again {again_s:.0f}s, resumed {more_s:.0f}s")


def test_post_train_cli_checks_both_configs_first(capsys) -> None:
    from grpoflow.cli import main as cli_main

    sft, grpo = (str(REPO_ROOT / "configs" / c) for c in ("sft-tiny-cpu.yaml", "tiny-cpu.yaml"))
    assert cli_main(["post-train", sft, grpo, "train.steps=3"]) == 2
    assert "prefix each override with its stage" in capsys.readouterr().err
    assert cli_main(["post-train", sft, grpo, "--grpo-override", "train.stepz=3"]) == 2
    assert "train.stepz: unknown key" in capsys.readouterr().err
    assert cli_main(["post-train", sft, grpo, "grpo.train.stepz=3"]) == 2  # the same, prefixed
    assert "train.stepz: unknown key" in capsys.readouterr().err
    assert cli_main(["post-train", grpo, grpo]) == 2  # the configs the wrong way round
    assert "is a GRPO config" in capsys.readouterr().err


def test_post_train_refuses_a_grpo_model_path(prefect_harness, tmp_path: Path) -> None:
    from flows.pipeline import post_train
    from rl_core.config import ConfigError

    with pytest.raises(ConfigError, match="drop model.path from the GRPO overrides"):
        post_train(sft_config=str(REPO_ROOT / "configs" / "sft-tiny-cpu.yaml"),
                   grpo_config=str(REPO_ROOT / "configs" / "tiny-cpu.yaml"),
                   grpo_overrides=[f"storage.root={tmp_path}", "model.path=elsewhere"])
