"""Scheduled evaluation and promotion against a real MLflow tracking store and registry.

The decision rule on its own; then the ``evaluate`` flow with ``registry=True`` on registered
model versions in a real SQLite tracking store: the first candidate becomes champion, a
better candidate is promoted, a worse one and a tie within the margin are not, a second run
evaluates nothing twice and changes nothing. The last test registers the demo model for
real (``mlflow.transformers``), lets the flow fetch it from the registry and evaluate it on
the held-out set, and checks the nested run, the version tags and the Prefect artifact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.evaluate import evaluate, registry_evaluation_key
from rl_core.config import load_config
from tasks.setup import prepare_data
from tasks.tracking.registry import Decision, RegistryVersion, decide, registry_client

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")
NAME = "grpoflow-registry-test"


def _v(version: str, alias: str = "candidate") -> RegistryVersion:
    return RegistryVersion(NAME, version, alias, None, "models:/x")


# ------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("cand", "champ", "promote"),
    [
        (0.50, 0.40, True),  # better by more than the margin
        (0.40, 0.50, False),  # worse
        (0.505, 0.50, False),  # a tie within the margin (0.01)
        (0.51, 0.50, False),  # exactly the margin is not "more than"
    ],
)
def test_decide_compares_with_a_margin(cand: float, champ: float, promote: bool) -> None:
    scores = {"2": {"pass_at_1": cand}, "1": {"pass_at_1": champ}}
    d = decide(_v("2"), _v("1", "champion"), scores, metric="pass_at_1", margin=0.01)
    assert isinstance(d, Decision) and d.promote is promote, d.reason


def test_decide_first_champion_and_same_version() -> None:
    scores = {"1": {"pass_at_1": 0.1}}
    assert decide(_v("1"), None, scores, metric="pass_at_1", margin=0.01).promote
    same = decide(_v("1"), _v("1", "champion"), scores, metric="pass_at_1", margin=0.0)
    assert not same.promote and "already champion" in same.reason
    assert not decide(None, _v("1", "champion"), scores, metric="pass_at_1", margin=0.0).promote
    with pytest.raises(KeyError, match="eval.promotion_metric='pass_at_k'"):
        decide(_v("1"), None, scores, metric="pass_at_k", margin=0.0)


# ------------------------------------------------------ the flow on a real registry


def _overrides(tmp: Path, cache: Path, uri: str) -> list[str]:
    return [
        f"storage.root={tmp}", f"storage.cache_dir={cache}", f"tracking.uri={uri}",
        f"model.name={NAME}", "eval.num_examples=16", "eval.pass_k_examples=4", "eval.pass_k=2",
    ]  # fmt: skip


def _register(client, source: Path, run_id: str | None = None) -> str:  # noqa: ANN001
    try:
        client.create_registered_model(NAME)
    except Exception as e:  # noqa: BLE001 - exists from an earlier call
        assert "already exists" in str(e).lower() or "ALREADY_EXISTS" in str(e)
    return str(client.create_model_version(NAME, source=source.as_uri(), run_id=run_id).version)


def _record(client, version: str, key: str, score: float) -> None:  # noqa: ANN001
    """An evaluation recorded earlier on this set (what the flow reuses instead of
    evaluating again)."""
    client.set_model_version_tag(NAME, version, f"eval.{key}.pass_at_1", str(score))
    client.set_model_version_tag(NAME, version, f"eval.{key}.run_id", "recorded-by-test")


def _aliases(client) -> dict[str, str]:  # noqa: ANN001
    return {a: str(v) for a, v in client.get_registered_model(NAME).aliases.items()}


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """An empty working directory: nothing may fall back to ./mlflow.db or ./mlruns."""
    path = tmp_path / "cwd"
    path.mkdir()
    monkeypatch.chdir(path)
    yield path
    assert not list(path.iterdir()), "MLflow wrote to the working directory"


def test_promotion_on_registered_versions(
    prefect_harness, tiny_cache: Path, tmp_path: Path, cwd: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = _overrides(tmp_path, tiny_cache, uri)
    client = registry_client(uri)
    cfg = load_config(DEMO, overrides)
    key = registry_evaluation_key(cfg, prepare_data(cfg.data, cfg.storage.cache_dir).eval_digest)
    (tmp_path / "src").mkdir()

    def candidate(score: float) -> str:
        version = _register(client, tmp_path / "src")
        _record(client, version, key, score)
        client.set_registered_model_alias(NAME, "candidate", version)
        return version

    def run() -> dict:
        return evaluate(config=DEMO, overrides=overrides, registry=True)

    v1 = candidate(0.30)
    out = run()
    assert out["promoted"] and "first candidate" in out["reason"]
    assert _aliases(client) == {"candidate": v1, "champion": v1}
    assert out["evaluated_now"] == []  # recorded on this set already: reused
    assert client.get_model_version(NAME, v1).tags["grpoflow.promoted_at"]

    v2 = candidate(0.40)  # better by more than the margin: promoted
    assert run()["promoted"] and _aliases(client)["champion"] == v2

    v3 = candidate(0.405)  # a tie within the margin (0.01): kept
    out = run()
    assert not out["promoted"] and "does not beat" in out["reason"]
    assert _aliases(client) == {"candidate": v3, "champion": v2}

    candidate(0.20)  # worse: kept
    assert not run()["promoted"] and _aliases(client)["champion"] == v2

    # idempotent: the same versions again change nothing
    again = run()
    assert not again["promoted"] and _aliases(client)["champion"] == v2
    assert "grpoflow.promoted_at" not in client.get_model_version(NAME, v3).tags

    with get_client(sync_client=True) as prefect:
        arts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"registry-{NAME}"]))
        )
    assert arts and "candidate vs champion" in str(arts[-1].data)


def test_registry_evaluation_without_a_store_names_the_fix(prefect_harness, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    state = evaluate(config=DEMO, registry=True, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match="set tracking.uri"):
        state.result()


def test_a_registered_model_is_fetched_evaluated_once_and_promoted(
    prefect_harness, demo_model: Path, tiny_cache: Path, tmp_path: Path, cwd: Path
) -> None:
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.tracking.registry import global_tracking_uri, pip_requirements

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = registry_client(uri)
    exp = client.create_experiment("trained", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp, run_name="a-training-run").info.run_id
    components = {
        "model": AutoModelForCausalLM.from_pretrained(demo_model),
        "tokenizer": AutoTokenizer.from_pretrained(demo_model),
    }
    # the registry store looks the logged model up through the global tracking URI
    with global_tracking_uri(uri):
        with mlflow.start_run(run_id=run_id):
            info = mlflow.transformers.log_model(
                components, name="model", task="text-generation",
                pip_requirements=pip_requirements(),
            )  # fmt: skip
        client.create_registered_model(NAME)
        version = str(
            client.create_model_version(NAME, source=info.model_uri, run_id=run_id,
                                        model_id=info.model_id).version  # fmt: skip
        )
    client.set_registered_model_alias(NAME, "candidate", version)

    overrides = _overrides(tmp_path, tiny_cache, uri)
    out = evaluate(config=DEMO, overrides=overrides, registry=True)
    assert out["evaluated_now"] == [version] and out["promoted"]
    assert _aliases(client) == {"candidate": version, "champion": version}
    tags = client.get_model_version(NAME, version).tags
    key = out["eval_key"]
    assert 0.0 <= float(tags[f"eval.{key}.pass_at_1"]) <= 1.0
    nested = client.get_run(tags[f"eval.{key}.run_id"])
    assert nested.data.tags["mlflow.parentRunId"] == run_id  # under the training run
    assert nested.data.metrics["pass_at_1"] == pytest.approx(float(tags[f"eval.{key}.pass_at_1"]))
    assert out["scores"][version]["pass_at_1"] == nested.data.metrics["pass_at_1"]
    local = Path(tiny_cache) / "registry" / NAME / f"v{version}"
    assert (local / "config.json").is_file(), "fetched once into the cache"

    # scheduled again: nothing evaluated twice, no second nested run, nothing promoted again
    again = evaluate(config=DEMO, overrides=overrides, registry=True)
    assert again["evaluated_now"] == [] and not again["promoted"]
    runs = client.search_runs([exp], filter_string="tags.`grpoflow.kind` = 'registry-evaluation'")
    assert len(runs) == 1

    # the plain evaluate flow takes a registry URI too
    direct = evaluate(config=DEMO, overrides=overrides, model=f"models:/{NAME}@champion")
    assert direct["num_examples"] == 16 and 0.0 <= direct["pass_at_1"] <= 1.0
