"""The command line's own surface: ``--version``, help for every group without markup, the
examples its help shows are ones the command accepts, ``post-train``'s stage-prefixed
overrides, and ``grpoflow runs`` over run directories (a real flow's run directory is listed
in tests/test_flow.py::test_grpo_flow_two_steps)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from grpoflow.cli import build_parser, main, stage_overrides

ROOT = Path(__file__).resolve().parents[1]
MARKUP = re.compile(r"``|:\w+:`")


def _help(argv: list[str], capsys) -> str:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0, argv
    return capsys.readouterr().out


def test_version(capsys) -> None:
    from importlib.metadata import version

    assert _help(["--version"], capsys).strip() == f"grpoflow {version('grpoflow')}"


def test_every_group_has_help_without_markup(capsys) -> None:
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    own = {"engine": ["engine", "--help"], "engine serve": ["engine", "serve", "--help"],
           "doctor": ["doctor", "--help"], "plan": ["plan", "--help"],
           "deploy": ["deploy", "--help"], "tracking": ["tracking", "--help"]}
    texts = {"grpoflow": _help(["--help"], capsys)}
    for name in commands:
        if name == "engine":
            assert main(own["engine"]) == 0
            texts[name] = capsys.readouterr().out
        else:
            texts[name] = _help(own.get(name, [name, "--help"]), capsys)
    texts["engine serve"] = _help(own["engine serve"], capsys)
    for name, text in texts.items():
        assert text.strip(), name
        assert not MARKUP.search(text), f"{name} --help shows markup:\n{text}"
    assert "docs/configuration.md" in texts["train"]
    assert "serve" in texts["engine"]


def test_a_group_without_its_command_says_what_it_holds(capsys) -> None:
    assert main(["engine"]) == 2
    err = capsys.readouterr().err
    assert "grpoflow engine serve" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_examples_in_help_are_accepted(command: str, capsys) -> None:  # noqa: ANN001
    """``train --help`` and ``sft --help`` show a config and an override that load."""
    from rl_core.config import load_config
    from rl_core.sft import load_sft_config

    text = " ".join(_help([command, "--help"], capsys).split())
    config = re.search(r"YAML config \(e\.g\. (\S+)\)", text).group(1)
    override = re.search(r"dotted overrides: (\S+)", text).group(1)
    (load_sft_config if command == "sft" else load_config)(str(ROOT / config), [override])


def test_post_train_takes_stage_prefixed_overrides() -> None:
    from rl_core.config import ConfigError

    assert stage_overrides(["sft.train.steps=5", "grpo.train.steps=2", "sft.seed=1"]) == (
        ["train.steps=5", "seed=1"], ["train.steps=2"])
    with pytest.raises(ConfigError, match=r"sft\.<key>=V or grpo\.<key>=V"):
        stage_overrides(["train.steps=5"])
    args, _ = build_parser().parse_known_args(
        ["post-train", "a.yaml", "b.yaml", "sft.train.steps=5", "--grpo-override", "seed=3"])
    assert args.overrides == ["sft.train.steps=5"] and args.grpo_override == ["seed=3"]


def _run(root: Path, name: str, *, kind: str, evals: list[dict], steps: int, total: int,
         summary: dict | None = None, checkpoint: int | None = None) -> None:
    path = root / name
    path.mkdir(parents=True)
    config = {"name": name, "train": {"steps": total}}
    if kind == "GRPO":
        config["algorithm"] = {"kl_coef": 0.0}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, steps + 1))
        + '{"step": 9')  # a line cut by a kill
    (path / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if checkpoint is not None:
        ckpt = path / "checkpoints" / f"step-{checkpoint:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "MANIFEST.json").write_text("{}")
        (path / "checkpoints" / "step-000009").mkdir()  # incomplete: no manifest


def test_runs_lists_status_steps_evaluations_and_model(tmp_path: Path, capsys) -> None:
    from rl_core.rundir import format_runs, list_runs

    _run(tmp_path, "grpo-a", kind="GRPO", steps=4, total=4,
         evals=[{"step": 0, "pass_at_1": 0.3}, {"step": 2, "pass_at_1": 0.5},
                {"step": 4, "pass_at_1": 0.45}],
         summary={"kind": "GRPO", "tracking": {"alias_uri": "models:/tiny@candidate"}})
    _run(tmp_path, "sft-b", kind="SFT", steps=3, total=10, checkpoint=2,
         evals=[{"step": 0, "loss": 2.5, "pass_at_1": None}, {"step": 2, "loss": 1.5}])
    (tmp_path / "not-a-run").mkdir()
    rows = {r["run"]: r for r in list_runs(tmp_path)}
    assert set(rows) == {"grpo-a", "sft-b"}
    a, b = rows["grpo-a"], rows["sft-b"]
    assert (a["kind"], a["status"], a["steps"], a["total_steps"]) == ("GRPO", "finished", 4, 4)
    assert a["last_eval"] == {"step": 4, "pass@1": 0.45}
    assert a["best_eval"] == {"step": 2, "pass@1": 0.5}
    assert a["model"] == "models:/tiny@candidate"
    assert (b["kind"], b["status"], b["steps"], b["total_steps"]) == ("SFT", "incomplete", 3, 10)
    assert b["best_eval"] == {"step": 2, "loss": 1.5}  # the lowest loss
    assert b["model"] == str(tmp_path / "sft-b" / "checkpoints" / "step-000002")

    assert main(["runs", "--root", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["RUN", "KIND", "STATUS", "STEPS", "LAST", "EVAL", "BEST", "EVAL",
                                "MODEL"]
    assert any(line.split()[:4] == ["grpo-a", "GRPO", "finished", "4/4"]
               and "pass@1 0.500 @2" in line for line in table)
    assert format_runs(list_runs(tmp_path)) == "\n".join(table)
    assert main(["runs", "--root", str(tmp_path), "--json"]) == 0
    assert {r["run"] for r in json.loads(capsys.readouterr().out)} == {"grpo-a", "sft-b"}
    assert main(["runs", "--root", str(tmp_path / "none")]) == 0
    assert "no runs under" in capsys.readouterr().out
