"""``grpoflow deploy``: register deployments/prefect.yaml with a Prefect server.

Creates the work pools the file names (``process`` unless they exist), then runs ``prefect
--no-prompt deploy --all`` (or ``--name`` per pattern) from the repository root with
``GRPOFLOW_HOME`` set to it, the deployments' working directory. Needs ``PREFECT_API_URL``:
deployments registered with the ephemeral API would vanish with it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

__all__ = ["main", "work_pools"]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILE = ROOT / "deployments" / "prefect.yaml"


def work_pools(prefect_file: Path) -> list[str]:
    """The work pool names the deployments in ``prefect_file`` use, in order."""
    spec = yaml.safe_load(prefect_file.read_text())
    names: list[str] = []
    for d in spec.get("deployments") or []:
        name = (d.get("work_pool") or {}).get("name")
        if name and name not in names:
            names.append(name)
    return names


def _ensure_pools(names: list[str], pool_type: str) -> list[str]:
    """Create the pools that do not exist yet; returns the ones created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))
                created.append(name)
    return created


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="grpoflow deploy", description=(
        "Register deployments/prefect.yaml with the Prefect server at PREFECT_API_URL."))
    ap.add_argument("--prefect-file", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--name", action="append", default=[],
                    help="deploy only these (flow/deployment patterns); default: all")
    ap.add_argument("--pool-type", default="process", help="type of work pools created here")
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on `prefect deploy`")
    args = ap.parse_args(argv)
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        from prefect.settings import PREFECT_API_URL

        api = PREFECT_API_URL.value()
    if not api:
        print(
            "grpoflow deploy: no Prefect server configured. Start one (`prefect server start`) "
            "and `export PREFECT_API_URL=http://127.0.0.1:4200/api` (or `prefect config set "
            "PREFECT_API_URL=...`), then deploy again.",
            file=sys.stderr,
        )
        return 2
    prefect_file = args.prefect_file.resolve()
    if not prefect_file.is_file():
        print(f"grpoflow deploy: {prefect_file} not found", file=sys.stderr)
        return 2
    created = _ensure_pools(work_pools(prefect_file), args.pool_type)
    for name in created:
        print(f"work pool {name!r} created (type {args.pool_type})")
    env = {**os.environ, "GRPOFLOW_HOME": os.environ.get("GRPOFLOW_HOME", str(ROOT))}
    cmd = [str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy",
           "--prefect-file", str(prefect_file)]
    cmd += [a for n in args.name for a in ("--name", n)] if args.name else ["--all"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"grpoflow deploy: `prefect deploy` did not finish in {args.timeout:.0f}s",
              file=sys.stderr)
        return 1
    if done.returncode == 0:
        print(f"deployments registered with {api}; GRPOFLOW_HOME={env['GRPOFLOW_HOME']}")
    return done.returncode


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
