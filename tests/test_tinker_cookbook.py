"""tinker-cookbook's own recipes against a real ``grpoflow serve-tinker`` process (issue 38).

The cookbook (``tinker-cookbook==0.6.1`` with the real ``tinker==0.38.0``) lives in its own
venv, built as a user would install it by scripts/tinker_cookbook_env.sh (idempotent;
``$TINKER_COOKBOOK_VENV``, else ``.cache/tinker-cookbook-venv``; 35-150 s the first time).
The service serves the demo's tiny model under a name the cookbook's registry knows
(configs/tinker-cookbook-cpu.yaml), and the recipes run in subprocesses from that venv
exactly as scripts/cookbook_recipes.py runs them (docs/tinker.md, "Running tinker-cookbook
recipes"):

* SL: ``tinker_cookbook.recipes.chat_sl.train`` on the cookbook's example conversations: the
  training NLL falls;
* RL: scripts/cookbook_arithmetic_rl.py (the cookbook's arithmetic recipe on one-digit sums,
  its ArithmeticEnv and ``rl.train.main``): the short run checks the loop's mechanics
  (sampling, groups with a signal, importance-sampling updates, metrics); the soak run is to
  checks that it learns: on a fixed held-out set, against a no-learning control.

Every process started here is reaped (the server by its context manager, the recipes by
``subprocess.run`` with a timeout).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(1800)]


def _load_helper():  # noqa: ANN202 - a module
    spec = importlib.util.spec_from_file_location("cookbook_recipes",
                                                  ROOT / "scripts" / "cookbook_recipes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cb = _load_helper()


@pytest.fixture(scope="module")
def cookbook_python() -> Path:
    """The cookbook venv's python. ``make test`` builds it before the suite, outside the
    tests' loopback-only network namespace (the build needs the package index); here the
    idempotent script only checks its stamp, or builds it where the index is reachable."""
    venv = Path(os.environ.get("TINKER_COOKBOOK_VENV") or cb.DEFAULT_VENV)
    done = subprocess.run(["bash", str(cb.ENV_SCRIPT), str(venv)], capture_output=True,
                          text=True, timeout=900, check=False)
    if done.returncode:
        pytest.fail(f"the tinker-cookbook venv ({venv}) is not built and building it failed "
                    "(no package index inside the tests' network namespace?): run "
                    f"scripts/tinker_cookbook_env.sh first\n{done.stdout[-2000:]}"
                    f"{done.stderr[-3000:]}")
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def service(demo_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """``grpoflow serve-tinker configs/tinker-cookbook-cpu.yaml`` with the demo model under
    the cookbook's name, tracking off; the recipes' environment (its offline hub cache)."""
    work = tmp_path_factory.mktemp("cookbook")
    cb.alias_tokenizer(demo_model, cb.MODEL_NAME, work / "hf")
    overrides = [f"base_models={{{cb.MODEL_NAME}: {demo_model}}}", f"root={work / 'root'}",
                 "tracking.backend=none", "api_keys_env=null"]
    with cb.serve_tinker(ROOT / "configs" / "tinker-cookbook-cpu.yaml", overrides,
                         work / "serve.log", cb.free_port(), timeout=300) as url:
        yield url, work, cb.recipe_env(work / "hf", url)


def _run(cmd: list[str], env: dict[str, str], log: Path, log_path: Path,
         timeout: float) -> list[dict]:
    cb.run_recipe(cmd, env, log, timeout=timeout)
    return cb.metrics(log_path)


def test_alias_tokenizer_resolves_offline(demo_model, tmp_path, cookbook_python):
    """The cookbook's own get_tokenizer(name) reads the served model's tokenizer offline."""
    cb.alias_tokenizer(demo_model, cb.MODEL_NAME, tmp_path / "hf")
    code = ("from tinker_cookbook.tokenizer_utils import get_tokenizer; "
            "from tinker_cookbook import model_info; "
            f"t = get_tokenizer({cb.MODEL_NAME!r}); "
            f"print(model_info.get_recommended_renderer_name({cb.MODEL_NAME!r}), "
            "t.encode('<|im_end|>', add_special_tokens=False), len(t))")
    out = subprocess.run([str(cookbook_python), "-c", code], capture_output=True, text=True,
                         env=cb.recipe_env(tmp_path / "hf", "http://127.0.0.1:9"), timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(demo_model))
    assert out.stdout.split()[0] == "qwen3_instruct"
    assert f"[{want.convert_tokens_to_ids('<|im_end|>')}]" in out.stdout
    assert out.stdout.split()[-1] == str(len(want))


def test_sl_recipe_loss_falls(service, cookbook_python):
    """The stock chat SL recipe, 6 steps of 8 conversations: the train NLL falls."""
    url, work, env = service
    rows = _run(cb.sl_command(cookbook_python, url, work / "sl", 6), env, work / "sl.log",
                work / "sl", timeout=600)
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 6, nll
    assert max(nll[-2:]) < nll[0] - 1.0, nll  # 8.3 -> about 6 on the tiny model
    assert (work / "sl" / "checkpoints.jsonl").read_text().count("tinker://") >= 2  # final


def test_rl_recipe_runs(service, cookbook_python):
    """The arithmetic RL recipe, 2 short steps (4 groups of 4, the second sampled after the
    first's update): sampling, rewards with a signal, importance-sampling updates, the
    cookbook's metrics. The sampler is not seeded (the recipe sends no seed), so nothing here
    depends on what it draws."""
    url, work, env = service
    rows = _run(cb.rl_command(cookbook_python, url, work / "rl", 2, groups=4, group_size=4,
                              max_tokens=12), env, work / "rl.log", work / "rl", timeout=900)
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 2, rows
    for r in steps:
        assert r["env/all/total_episodes"] == 16
        assert 0 < r["env/all/ac_tokens_per_turn"] <= 12
        assert -0.1 - 1e-9 <= r["env/all/reward/total"] <= 1.0
        # Whether a group is mixed (a signal) is chance: the recipe sends no seed, and a clean
        # clone's run (4d59c75) drew none in 2 steps; the metrics must be there, not luck.
        assert 0.0 <= r["env/all/correct"] <= 1.0
        assert 0.0 <= r["env/all/by_group/frac_mixed"] <= 1.0


def _held_out(rows: list[dict]) -> list[tuple[int, float]]:
    """The recipe's test-set evaluations: (step, fraction of the 100 sums' samples correct)."""
    return [(r["step"], r["test/env/all/correct"]) for r in rows if "test/env/all/correct" in r]


STEPS, GROUPS, LR = 6, 16, 1e-3  # 16 groups of 8 episodes a step; ~80 s on an idle machine


@pytest.mark.soak
def test_rl_recipe_learns_held_out(service, cookbook_python):
    """The arithmetic RL recipe learns, measured on a fixed held-out set rather than on its
    training batches (which come in a fixed order: a no-learning run's training reward rose
    as much as a learning one's). The recipe's own test-set evaluator scores every sum x + y,
    x, y in 0..9, four samples each at temperature 1 (400 samples; binomial std <= 0.025, of
    a difference <= 0.035), at step 0 (the base model) and after the last step:

    * the run (STEPS steps of GROUPS groups of 8 at LR) gains more than 0.10;
    * a no-learning control (lr 1e-12, same measurement) moves less than 0.10, and ends
      more than 0.10 below the run.
    """
    url, work, env = service
    rows = _run(cb.rl_command(cookbook_python, url, work / "rl-learn", STEPS, groups=GROUPS,
                              learning_rate=LR, eval_group_size=4),
                env, work / "rl-learn.log", work / "rl-learn", timeout=3600)
    control = _run(cb.rl_command(cookbook_python, url, work / "rl-control", 2, groups=GROUPS,
                                 learning_rate=1e-12, eval_group_size=4),
                   env, work / "rl-control.log", work / "rl-control", timeout=1800)
    (s0, before), (s1, after) = _held_out(rows)
    (c0, c_before), (c1, c_after) = _held_out(control)
    assert (s0, s1, c0, c1) == (0, STEPS, 0, 2)
    assert abs(c_after - c_before) < 0.10, (c_before, c_after)
    assert after > before + 0.10, (before, after)
    assert after > c_after + 0.10, (after, c_after)
