"""``grpoflow validate``: a config checked without starting a run (no Prefect, MLflow or
engine), each problem a ``fail`` line naming the field and the fix, in seconds; and where
each plane runs: every shipped GPU config puts its trainer on the GPU when one is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpoflow.cli import main
from rl_core.config import load_config
from rl_core.validate import describe_planes, validate

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "tiny-cpu.yaml")


def _by_check(findings) -> dict[str, object]:  # noqa: ANN001
    return {f.what: f for f in findings}


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_demo_config_passes(tiny_cache: Path, demo_model: Path, capsys) -> None:
    assert main(["validate", DEMO, f"storage.cache_dir={tiny_cache}"]) == 0
    out = capsys.readouterr().out
    assert "resolved config (secrets masked):" in out and "kl_coef" in out
    for check in ("pre-flight", "model", "data", "prompt", "prompt length", "reward", "planes"):
        assert f"ok    {check}: " in out, check
    assert "trainer: one torch trainer in the flow's process on cpu" in out


def test_a_bad_field_mapping_names_the_field(tmp_path: Path, tiny_cache: Path,
                                             demo_model: Path) -> None:
    data = _jsonl(tmp_path / "qa.jsonl", [{"prompt": "What is 1 + 1?", "solution": "2"}] * 4)
    cfg = load_config(DEMO, [f"storage.cache_dir={tiny_cache}", f"data.source={data}",
                             "data.answer_field=solution"])
    found = _by_check(validate(cfg))["data"]
    assert found.status == "fail" and "question" in found.detail and "prompt" in found.detail


def test_a_prompt_longer_than_the_context_fails(tmp_path: Path, tiny_cache: Path,
                                                demo_model: Path) -> None:
    long = "What is " + " + ".join(["1"] * 300) + "?"  # ~600 tokens, the context is 512
    data = _jsonl(tmp_path / "long.jsonl", [{"question": long, "answer": "300"},
                                            {"question": "What is 1 + 1?", "answer": "2"}])
    cfg = load_config(DEMO, [f"storage.cache_dir={tiny_cache}", f"data.source={data}",
                             "data.max_prompt_tokens=1024"])
    found = _by_check(validate(cfg))["prompt length"]
    assert found.status == "fail", found
    assert "row 1" in found.detail and "context of 512" in found.detail
    assert "rollout.max_new_tokens" in found.detail


def test_a_reward_that_raises_on_a_gold_answer_fails(tiny_cache: Path, demo_model: Path,
                                                     capsys) -> None:
    argv = ["validate", DEMO, f"storage.cache_dir={tiny_cache}",
            "reward.fn=reward_plugins:raising_reward"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    line = next(x for x in captured.out.splitlines() if x.startswith("fail  reward"))
    assert "raised" in line and "gold answer" in line and "reward.fn" in line
    assert "1 check(s) failed" in captured.err
    assert main([*argv[:-1], "reward.fn=reward_plugins:no_such_fn", "--json"]) == 2
    (reward,) = [f for f in json.loads(capsys.readouterr().out) if f["what"] == "reward"]
    assert reward["status"] == "fail" and "no_such_fn" in reward["detail"]
    # a signature the run cannot call: named, with the form it needs
    assert main([*argv[:-1], "reward.fn=reward_plugins:one_arg", "--json"]) == 2
    (reward,) = [f for f in json.loads(capsys.readouterr().out) if f["what"] == "reward"]
    assert "matches neither reward form" in reward["detail"]
    assert "fn(prompts, completions, **columns)" in reward["detail"]
    # beside a judge (started by the run, not here), each reward.extra entry is still called
    assert main([*argv[:-1], "reward.fn=judge", f"reward.judge.model={demo_model}",
                 "reward.extra=[{fn: 'reward_plugins:raising_reward'}]", "--json"]) == 2
    judge, extra = [f for f in json.loads(capsys.readouterr().out) if f["what"] == "reward"]
    assert judge["status"] == "ok" and "reward.fn=judge" in judge["detail"]
    assert extra["status"] == "fail" and "reward.extra[0]" in extra["detail"]


GPU_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                     if "cpu" not in p.name and not p.name.startswith("agent-"))


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.stem for p in GPU_CONFIGS])
def test_every_shipped_gpu_config_trains_on_the_gpu(path: Path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    planes = describe_planes(load_config(path))
    assert " on cuda " in planes["trainer"] or "on GPU" in planes["trainer"], planes
    assert "CPU" not in planes["engines"], planes


def test_the_cpu_demo_trains_on_the_cpu_and_cuda_is_refused_without_a_gpu() -> None:
    from rl_core.config import ConfigError

    planes = describe_planes(load_config(DEMO))
    assert "on cpu" in planes["trainer"]
    with pytest.raises(ConfigError, match="train.device=cuda, but torch sees no GPU"):
        describe_planes(load_config(DEMO, ["train.device=cuda"]))


def test_findings_never_show_a_secret(tmp_path: Path, tiny_cache: Path,
                                      demo_model: Path) -> None:
    """A credential in what a finding quotes (here a gold answer, in the reward's error) is
    masked (doctor prints the findings too)."""
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    data = _jsonl(tmp_path / "qa.jsonl", [{"question": f"What is 1 + {i}?",
                                           "answer": f"see {token}\n#### {1 + i}"}
                                          for i in range(2)])
    cfg = load_config(DEMO, [f"storage.cache_dir={tiny_cache}", f"data.source={data}",
                             "reward.fn=reward_plugins:raising_reward"])
    findings = _by_check(validate(cfg))
    assert findings["reward"].status == "fail" and "boom on" in findings["reward"].detail
    assert token not in json.dumps([f.__dict__ for f in findings.values()])


def test_embedded_engine_processes_take_the_gpus_in_turn(monkeypatch) -> None:
    """`rollout.engine: embedded` in local mode follows rollout.device: with two GPUs seen,
    engine i serves on cuda:(i mod 2); on the CPU no device flag; on Ray an engine actor with
    a GPU uses the one it is given."""
    import torch

    from rl_core.planes import rollout_engine_spec

    over = ["rollout.engine=embedded", "rollout.num_engines=3"]
    command, _ = rollout_engine_spec(load_config(DEMO, over), "m").command()
    assert "--device" not in command(0, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    command, _ = rollout_engine_spec(load_config(DEMO, over), "m").command()
    assert [command(i, 1)[command(i, 1).index("--device") + 1] for i in range(3)] == [
        "cuda:0", "cuda:1", "cuda:0"]
    assert "engine process(es) on cuda" in describe_planes(load_config(DEMO, over))["engines"]
    ray = [*over, "cluster.mode=ray", "cluster.gpus_per_engine=1"]
    command, _ = rollout_engine_spec(load_config(DEMO, ray), "m").command()
    assert command(2, 1)[command(2, 1).index("--device") + 1] == "cuda"


def test_images_are_checked_and_a_text_only_run_is_named(tmp_path: Path, tiny_cache: Path,
                                                         demo_model: Path) -> None:
    """Rows with images (docs/vlm.md): a bad image fails the data check naming its row and
    image; good ones pass it, and a text model for them fails the prompt check by name."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(out, format="PNG")
    (tmp_path / "red.png").write_bytes(out.getvalue())
    (tmp_path / "bad.png").write_bytes(b"not a png")
    rows = [{"question": "What is 1 + 1?", "answer": "2", "image": "red.png"},
            {"question": "What is 2 + 2?", "answer": "4", "image": ["red.png", "bad.png"]}]
    data = _jsonl(tmp_path / "qa.jsonl", rows)
    cfg = load_config(DEMO, [f"storage.cache_dir={tiny_cache}", f"data.source={data}",
                             "data.image_field=image"])
    found = _by_check(validate(cfg))["data"]
    assert found.status == "fail" and "line 2: field 'image', image 2: the image does not " \
        "decode" in found.detail, found
    _jsonl(tmp_path / "qa.jsonl", rows[:1])
    findings = _by_check(validate(cfg))
    assert findings["data"].status == "ok" and "1 with images" in findings["data"].detail
    found = findings["prompt"]
    assert found.status == "fail" and "carry images but model.path is a text model" in \
        found.detail, found
