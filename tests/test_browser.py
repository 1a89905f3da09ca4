"""The UIs a user looks at, in a real browser: headless Chromium on a real ``prefect server``
and ``mlflow server`` after a 3-step demo run (opt-in, marker ``browser``).

    GRPOFLOW_BROWSER_TESTS=1 .venv/bin/python -m pytest -m browser tests/test_browser.py

Each page must render and show the run's name: the Prefect flow run page (with its task
graph's canvas), the MLflow run's metric charts (six charts, each with a line) and the
registered model with its ``candidate`` and ``champion`` aliases. The servers, the demo and
the DevTools driving are the ones of ``scripts/screenshots.py`` (``make screenshots``), which
also installs Chromium where it is missing; here a missing Chromium skips. Skipped unless
``GRPOFLOW_BROWSER_TESTS=1``: nothing of it runs in ``make test``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENABLED = os.environ.get("GRPOFLOW_BROWSER_TESTS") == "1"

pytestmark = [
    pytest.mark.browser,
    # the first test's setup builds the demo model and runs the demo: minutes on a busy machine
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        not ENABLED,
        reason="browser test: set GRPOFLOW_BROWSER_TESTS=1 (and have chromium, e.g. after "
        "`make screenshots` or `apt-get install chromium`) to run it",
    ),
]


def _screenshots() -> ModuleType:
    """scripts/screenshots.py as a module (scripts/ is not a package)."""
    name = "grpoflow_screenshots"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "screenshots.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def shots() -> ModuleType:
    return _screenshots()


@pytest.fixture(scope="module")
def chromium(shots: ModuleType) -> str:
    found = shots.find_chromium()
    if found is None:
        pytest.skip(
            "no chromium binary: `make screenshots` installs it (or apt-get install chromium)"
        )
    return found


@pytest.fixture(scope="module")
def site(
    shots: ModuleType,
    chromium: str,
    demo_model: Path,
    tiny_cache: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple]:
    """Both servers, a 3-step demo run with a small evaluation, the registry evaluation, and
    Chromium attached: (stack, demo, browser)."""
    root = tmp_path_factory.mktemp("browser")
    small = [
        "eval.every=0", "eval.num_examples=32", "eval.pass_k_examples=8",
        "train.prompts_per_step=8", "rollout.n_samples=4", "tracking.system_metrics=false",
    ]  # fmt: skip
    with shots.start_stack(root) as stack:
        demo = shots.run_demo(stack, 3, extra=small, shared_cache=tiny_cache, timeout=600)
        with shots.Browser(chromium, root) as browser:
            yield stack, demo, browser


def _page(shots: ModuleType, site, file: str):  # noqa: ANN202
    stack, demo, browser = site
    page = next(p for p in shots.pages(stack, demo) if p.file == file)
    return page, demo, browser


def test_prefect_flow_run_page_shows_the_run_and_its_task_graph(shots, site) -> None:
    page, demo, browser = _page(shots, site, "prefect-flow-run.png")
    text = shots.capture(browser, page, None, timeout=90)
    assert demo.flow_run_name in text and "Completed" in text
    assert browser.evaluate("document.querySelectorAll('canvas').length") >= 1


def test_mlflow_run_page_shows_the_run_and_its_metric_charts(shots, site) -> None:
    page, demo, browser = _page(shots, site, "mlflow-run-metrics.png")
    text = shots.capture(browser, page, None, timeout=90)
    assert demo.run_name in text
    for metric in ("reward_mean", "kl", "entropy", "loss"):
        assert metric in text, metric
    lines = browser.evaluate("document.querySelectorAll('.js-plotly-plot path.js-line').length")
    assert lines >= 6


def test_mlflow_registered_model_page_shows_its_aliases(shots, site) -> None:
    page, demo, browser = _page(shots, site, "mlflow-registered-model.png")
    assert set(demo.aliases) == {"candidate", "champion"}
    text = shots.capture(browser, page, None, timeout=90)
    assert demo.model_name in text and "Version 1" in text
    assert "candidate" in text and "champion" in text


def test_chromium_is_stopped_and_its_profile_removed(shots, chromium, tmp_path: Path) -> None:
    browser = shots.Browser(chromium, tmp_path)
    with browser:
        assert browser.evaluate("1 + 1") == 2
        proc = browser.service.proc
    assert proc.poll() is not None and not browser.profile.exists()
