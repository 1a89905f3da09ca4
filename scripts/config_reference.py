"""Generate the config reference of docs/configuration.md from the schema.

    python scripts/config_reference.py           # rewrite the section in docs/configuration.md
    python scripts/config_reference.py --check   # exit 1 if it is out of date (the test does)

Every field of the GRPO config (``rl_core.config.ExperimentConfig``) and of the SFT config
(``rl_core.sft.SFTConfig``): its dotted path, type, default and description, one table per
section, between the markers below.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def _type(annotation: Any) -> str:  # noqa: ANN401
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _default(value: Any) -> str:  # noqa: ANN401
    if isinstance(value, BaseModel):
        return ""
    text = json.dumps(value, default=str)
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, description) of every leaf field, sections depth first."""
    out: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += rows(ann, f"{path}.")
            continue
        out.append((path, _type(ann), _default(field.default), _cell(field.description or "")))
    return out


def reference() -> str:
    """The generated markdown, markers excluded."""
    from rl_core.config import ExperimentConfig
    from rl_core.sft import SFTConfig

    parts = ["Generated from the schema by `python scripts/config_reference.py` (a test keeps "
             "it in sync): every field, its type, default and meaning."]
    for title, model in (("GRPO (`grpoflow train`, `rl_core.config.ExperimentConfig`)",
                          ExperimentConfig),
                         ("SFT (`grpoflow sft`, `rl_core.sft.SFTConfig`)", SFTConfig)):
        parts += ["", f"### {title}", ""]
        section = None
        for path, typ, default, desc in rows(model):
            head = path.split(".")[0] if "." in path else "(top level)"
            if head != section:
                section = head
                parts += ["", f"`{head}`" if head != "(top level)" else head, "",
                          "| field | type | default | description |", "|---|---|---|---|"]
            parts.append(f"| `{path}` | {typ} | {default} | {desc} |")
    return "\n".join(parts) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the doc is out of date")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{reference()}{END}{tail}"
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
