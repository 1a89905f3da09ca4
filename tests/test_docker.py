"""The container files of ``docker/``, checked statically: there is no Docker engine here.

Each Dockerfile is read by a small parser (instructions, continuation lines, comments, ARG /
ENV / COPY / FROM / CMD); ``docker/compose.yaml`` by ``yaml.safe_load`` after Compose's own
variable interpolation, with the values of ``docker/.env.example``. The checks are the ones
a build or ``docker compose up`` would otherwise fail on late, or never notice: COPY sources
that are not in the build context (the repository root), unpinned base images, GPU images
whose environment drifts from ``rl_core.cluster.platform.PLATFORM_ENV_PRESETS``, a CPU image
that would pull a CUDA torch or not run the demo, and services that point at a host, port,
database or bucket the stack does not have. The check functions return lists of problems;
the last tests feed them broken copies of the real files to show each one can fail.

What this cannot prove (docs/docker.md says so too): that an image builds, that a base tag
still exists, or that a service starts. Never starts Docker, never touches the network.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from rl_core.cluster.platform import PLATFORM_ENV_PRESETS

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = {kind: DOCKER / f"Dockerfile.{kind}" for kind in ("cpu", "cuda", "rocm")}
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
DOCS = ROOT / "docs" / "docker.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"

# Every variable name of the preset table: a GPU image must set exactly its own column of it.
PRESET_NAMES = set().union(*PLATFORM_ENV_PRESETS.values())
ROCM_RUN_FLAGS = (
    "--device /dev/kfd", "--device /dev/dri", "--group-add video", "--ipc=host",
    "--shm-size 32g", "--security-opt seccomp=unconfined", "--cap-add SYS_PTRACE",
)  # fmt: skip
# Variables whose URL a browser on the host opens (Prefect UI links), not a container.
BROWSER_URLS = {"PREFECT_UI_API_URL", "PREFECT_UI_URL"}

# ------------------------------------------------------------------ Dockerfile parsing


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword, its arguments (continuations joined), its line."""

    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON-array form (``CMD ["a", "b"]``) as a list; ``None`` for the shell form."""
        if self.args.startswith("["):
            value = json.loads(self.args)
            assert isinstance(value, list), self
            return value
        return None


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. Like Docker: a trailing backslash continues the line, comment
    lines are dropped (also inside a continuation), and so are empty continuation lines."""
    out: list[Instruction] = []
    buf: str | None = None
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if buf is None:
            buf, start = "", number
        line = raw.rstrip()
        if line.endswith("\\"):
            buf += line[:-1]
            continue
        keyword, _, args = (buf + line).strip().partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        buf = None
    assert buf is None, f"the last instruction (line {start}) ends in a continuation"
    return out


_DOCKER_VAR = re.compile(r"\$\{(\w+)(?::([-+])([^}]*))?\}|\$(\w+)")


def substitute(text: str, values: dict[str, str | None]) -> str:
    """Docker's variable substitution (``$X``, ``${X}``, ``${X:-word}``, ``${X:+word}``);
    an unknown variable raises ``KeyError`` instead of silently becoming empty."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        value = values.get(name)
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        if value is None:
            raise KeyError(f"${{{name}}} has no value in {sorted(values)}")
        return value

    return _DOCKER_VAR.sub(sub, text)


def _assignments(args: str) -> dict[str, str | None]:
    """``ARG A=1 B`` / ``ENV A=1 B="x y"`` (and the legacy ``ENV A value``) as a dict."""
    tokens = shlex.split(args)
    if "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:]) or None}
    out: dict[str, str | None] = {}
    for token in tokens:
        name, eq, value = token.partition("=")
        out[name] = value if eq else None
    return out


@dataclass(frozen=True)
class Dockerfile:
    """A parsed single-stage Dockerfile: global ARGs (before FROM), FROM, the stage after it."""

    path: Path
    instructions: tuple[Instruction, ...]

    @classmethod
    def load(cls, path: Path, text: str | None = None) -> Dockerfile:
        text = path.read_text() if text is None else text
        return cls(path, tuple(parse_dockerfile(text)))

    @property
    def _from_index(self) -> int:
        froms = [i for i, ins in enumerate(self.instructions) if ins.keyword == "FROM"]
        assert len(froms) == 1, f"{self.path.name}: expected one stage, found {len(froms)} FROM"
        return froms[0]

    @property
    def global_args(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for ins in self.instructions[: self._from_index]:
            assert ins.keyword == "ARG", f"{self.path.name}:{ins.line}: only ARG may precede FROM"
            out.update(_assignments(ins.args))
        return out

    @property
    def stage(self) -> tuple[Instruction, ...]:
        return self.instructions[self._from_index + 1 :]

    def of(self, keyword: str) -> list[Instruction]:
        return [ins for ins in self.stage if ins.keyword == keyword]

    @property
    def stage_args(self) -> dict[str, str | None]:
        """ARGs of the stage with their values: a redeclared global ARG inherits its default."""
        out: dict[str, str | None] = {}
        for ins in self.of("ARG"):
            for name, value in _assignments(ins.args).items():
                out[name] = value if value is not None else self.global_args.get(name)
        return out

    @property
    def base_image(self) -> str:
        image = self.instructions[self._from_index].args.split()[0]
        return substitute(image, self.global_args)

    @property
    def env(self) -> dict[str, str]:
        """Every ENV of the stage, values as written (``${ARG}`` not substituted)."""
        out: dict[str, str] = {}
        for ins in self.of("ENV"):
            out.update({k: v or "" for k, v in _assignments(ins.args).items()})
        return out

    @property
    def cmd(self) -> list[str]:
        (cmd,) = self.of("CMD")[-1:]
        form = cmd.exec_form()
        assert form is not None, f"{self.path.name}: CMD should use the exec (JSON) form"
        return form

    def run_texts(self) -> list[str]:
        return [ins.args for ins in self.of("RUN")]


def copy_sources(ins: Instruction) -> list[str]:
    """The build-context sources of a COPY/ADD (none for ``--from``: another stage/image)."""
    tokens = ins.exec_form() or shlex.split(ins.args)
    if any(t.startswith("--from=") for t in tokens):
        return []
    paths = [t for t in tokens if not t.startswith("--")]
    assert len(paths) >= 2, f"line {ins.line}: COPY needs a source and a destination"
    return paths[:-1]


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _glob_match(pattern: str, path: str) -> bool:
    """Go's filepath.Match per path segment (``*`` never crosses ``/``), plus a leading ``**/``."""
    if pattern.startswith("**/"):
        segments = path.split("/")
        return any(_glob_match(pattern[3:], "/".join(segments[i:])) for i in range(len(segments)))
    p_segments, segments = pattern.split("/"), path.split("/")
    return len(p_segments) == len(segments) and all(
        fnmatch.fnmatchcase(s, p) for s, p in zip(segments, p_segments, strict=True)
    )


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore`` keeps ``rel`` out of the context: a pattern that matches the
    path or one of its parent directories excludes it; a later ``!pattern`` re-includes it."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        if any(_glob_match(pattern, p) for p in prefixes):
            ignored = not negate
    return ignored


def copy_problems(df: Dockerfile) -> list[str]:
    """COPY/ADD sources missing from the build context (the repository root) or ignored."""
    problems = []
    patterns = dockerignore_patterns()
    values = {**df.global_args, **df.stage_args}
    for ins in df.of("COPY") + df.of("ADD"):
        for source in copy_sources(ins):
            source = substitute(source, values)
            if re.match(r"[a-z]+://", source):
                problems.append(f"line {ins.line}: {source} is a URL; COPY from the repository")
                continue
            matches = list(ROOT.glob(source)) if source != "." else [ROOT]
            if not matches:
                problems.append(f"line {ins.line}: {source} is not in the build context")
            for match in matches:
                rel = match.resolve().relative_to(ROOT.resolve()).as_posix()
                if rel != "." and dockerignored(rel, patterns):
                    problems.append(f"line {ins.line}: {source} is excluded by .dockerignore")
    return problems


def preset_problems(df: Dockerfile, kind: str) -> list[str]:
    """Differences between the image's preset variables and ``PLATFORM_ENV_PRESETS[kind]``."""
    got = {k: v for k, v in df.env.items() if k in PRESET_NAMES}
    want = PLATFORM_ENV_PRESETS[kind]
    problems = [f"{k} missing (want {want[k]!r})" for k in sorted(set(want) - set(got))]
    problems += [f"{k} is not a {kind} preset" for k in sorted(set(got) - set(want))]
    problems += [
        f"{k}={got[k]!r}, the table says {want[k]!r}"
        for k in sorted(set(got) & set(want))
        if got[k] != want[k]
    ]
    return problems


def load(kind: str) -> Dockerfile:
    return Dockerfile.load(DOCKERFILES[kind])


def requires_python_floor() -> tuple[int, int]:
    spec = PYPROJECT["project"]["requires-python"]
    (floor,) = re.findall(r">=\s*(\d+)\.(\d+)", spec)
    return int(floor[0]), int(floor[1])


# ------------------------------------------------------------------ the Dockerfiles


def test_parser_joins_continuations_and_drops_comments():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11.14-slim\n"
        "FROM ${BASE}\n"
        "ENV A=1 \\\n"
        "    # a comment inside the continuation\n"
        '    B="two words" \\\n'
        "    C=3\n"
        "\n"
        "COPY --chown=1:1 pyproject.toml README.md ./\n"
        'CMD ["grpoflow", "train"]\n'
    )
    df = Dockerfile.load(Path("Dockerfile.test"), text)
    assert [i.keyword for i in df.instructions] == ["ARG", "FROM", "ENV", "COPY", "CMD"]
    assert df.instructions[2].line == 4
    assert df.env == {"A": "1", "B": "two words", "C": "3"}
    assert df.base_image == "python:3.11.14-slim"
    assert copy_sources(df.of("COPY")[0]) == ["pyproject.toml", "README.md"]
    assert df.cmd == ["grpoflow", "train"]
    with pytest.raises(AssertionError, match="continuation"):
        parse_dockerfile("FROM x\nRUN a \\\n")
    with pytest.raises(KeyError):
        substitute("lmsysorg/sglang:${VERSION}", {})


@pytest.mark.parametrize(
    "path",
    [*sorted(p for p in DOCKER.iterdir() if p.name != ".env"), ROOT / ".dockerignore"],
    ids=lambda p: p.name,
)
def test_every_file_starts_with_a_comment_saying_what_it_is(path):
    first = path.read_text().splitlines()[0]
    assert re.match(rf"(#|--) {re.escape(path.name)}: \S", first), first


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_copy_sources_exist_in_the_build_context(kind):
    df = load(kind)
    assert df.of("COPY"), f"{kind}: copies nothing from the repository"
    assert copy_problems(df) == []


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_base_images_are_pinned_tags(kind):
    df = load(kind)
    for name, value in df.global_args.items():
        assert value, f"{kind}: build argument {name} of the FROM line needs a default"
    image = df.base_image
    assert "$" not in image
    repo, _, tag = image.rpartition(":")
    assert repo and "/" not in tag and tag != "latest" and re.search(r"\d", tag), image
    pattern = {
        "cpu": r"python:3\.\d+\.\d+-slim(-\w+)?",
        "cuda": r"lmsysorg/sglang:v\d+\.\d+\.\d+(\.post\d+)?-cu1[2-9]\d",
        "rocm": r"lmsysorg/sglang:v\d+\.\d+\.\d+(\.post\d+)?-rocm7[02]0-mi3[05]x",
    }[kind]
    assert re.fullmatch(pattern, image), image


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_global_args_used_in_the_stage_are_redeclared_there(kind):
    # An ARG declared before FROM is empty after it unless the stage declares it again.
    df = load(kind)
    declared = set(df.stage_args)
    for ins in df.stage:
        for m in _DOCKER_VAR.finditer(ins.args):
            name = m.group(1) or m.group(4)
            if name in df.global_args:
                assert name in declared, f"{kind}:{ins.line}: ${name} is empty here; add ARG {name}"
    for ins in df.of("ENV") + df.of("COPY") + df.of("WORKDIR") + df.of("USER"):
        substitute(ins.args, {**df.stage_args, **df.env, "PATH": ""})  # resolves or raises


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_gpu_images_set_exactly_the_platform_presets(kind):
    assert preset_problems(load(kind), kind) == []


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_gpu_images_install_grpoflow_without_replacing_their_torch(kind):
    df = load(kind)
    extras = df.stage_args["EXTRAS"].split(",")
    assert "megatron" in extras and "sglang" not in extras
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"]), extras
    (install,) = [r for r in df.run_texts() if "pip install" in r]
    # torch pinned to the image's own build, written before the install that honours it.
    pin = re.search(r"> (/\S+)", install).group(1)
    assert install.index(f"> {pin}") < install.index(f"--constraint {pin}")
    assert "import torch" in install and '--editable ".[${EXTRAS}]"' in install
    # the declared Python range holds (SGLang's 3.12 is in it), with a readable stop below it
    assert "--ignore-requires-python" not in install
    guard = re.search(r"sys\.version_info\[:2\]; sys\.exit\(0 if v >= \((\d+), (\d+)\)", install)
    assert guard and tuple(map(int, guard.groups())) == requires_python_floor()
    assert install.index("sys.version_info") < install.index("pip install")


def test_rocm_gpu_targets_follow_the_gpu_family():
    df = load("rocm")
    args = df.stage_args
    assert df.global_args["ROCM_VARIANT"] in {"rocm700", "rocm720"}
    family_arch = dict(re.findall(r"(mi3[05]x):(gfx9\d\d)\|?", " ".join(df.run_texts())))
    assert family_arch == {"mi30x": "gfx942", "mi35x": "gfx950"}
    assert family_arch[args["GPU_FAMILY"]] == args["GPU_ARCH"]
    for name in ("PYTORCH_ROCM_ARCH", "GPU_TARGETS"):
        assert substitute(df.env[name], args) == args["GPU_ARCH"], name
    assert df.base_image.endswith(f"-{args['GPU_FAMILY']}")


def test_rocm_run_flags_are_in_the_dockerfile_and_the_docs():
    header = "\n".join(
        line for line in DOCKERFILES["rocm"].read_text().splitlines() if line.startswith("#")
    )
    docs = DOCS.read_text()
    for flag in ROCM_RUN_FLAGS:
        assert flag in header, f"Dockerfile.rocm's comments should show {flag}"
        assert flag in docs, f"docs/docker.md should show {flag}"


def test_cpu_image_installs_the_cpu_torch_wheel_before_grpoflow():
    df = load("cpu")
    args = {**df.global_args, **df.stage_args}
    makefile_torch = re.search(
        r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.M
    )
    assert args["TORCH_VERSION"] == makefile_torch.group(1) == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = df.run_texts()
    torch_run = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_run]
    project_runs = [i for i, r in enumerate(runs) if "--editable" in r]
    assert project_runs and min(project_runs) > torch_run
    pin = re.search(r"> (/\S+)", runs[torch_run]).group(1)
    for i in project_runs:
        assert f"--constraint {pin}" in runs[i], "grpoflow's install must keep the CPU torch"
    python = re.fullmatch(r"python:(\d+\.\d+\.\d+)-.*", df.base_image).group(1)
    assert python in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_cpu_image_runs_the_demo_as_an_unprivileged_user():
    from grpoflow.cli import build_parser, cmd_train

    df = load("cpu")
    assert df.cmd == ["grpoflow", "train", "configs/tiny-cpu.yaml"]
    assert "grpoflow" in PYPROJECT["project"]["scripts"]
    config = ROOT / df.cmd[2]
    assert config.is_file()
    assert build_parser().parse_args(df.cmd[1:]).func is cmd_train
    (workdir,) = df.of("WORKDIR")
    user = df.of("USER")[-1].args
    assert user not in {"root", "0"} and not user.startswith("0:")
    # The user owns what the demo writes: storage.root and storage.cache_dir, under WORKDIR.
    storage = yaml.safe_load(config.read_text())["storage"]
    chowned = [
        r.split("chown -R", 1)[1].split("&&")[0].split()[1:]
        for r in df.run_texts()
        if "chown -R" in r
    ]
    owned = {p for paths in chowned for p in paths}
    for path in (storage["root"], storage["cache_dir"]):
        assert any(path == p or path.startswith(p.rstrip("/") + "/") for p in owned), path
    assert workdir.args == "/app"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_default_commands_parse_with_the_cli(kind):
    from grpoflow.cli import build_parser

    cmd = load(kind).cmd
    assert cmd[0] == "grpoflow"
    build_parser().parse_args(cmd[1:])
    for arg in cmd[1:]:
        if arg.endswith((".yaml", ".yml")):
            assert (ROOT / arg).is_file(), arg


def test_dockerignore_keeps_local_state_out_and_the_code_in():
    patterns = dockerignore_patterns()
    excluded = [".venv/bin/python", "runs/tiny-cpu-1/metrics.jsonl", ".git/HEAD",
                ".cache/grpoflow/models/x", "docker/.env", "rl_core/__pycache__/x.pyc"]  # fmt: skip
    kept = ["pyproject.toml", "README.md", "rl_core/config/loop.py", "grpoflow/cli.py",
            "tasks/tracking/run.py", "configs/tiny-cpu.yaml", "docker/.env.example"]  # fmt: skip
    for rel in excluded:
        assert dockerignored(rel, patterns), f".dockerignore should exclude {rel}"
    for rel in kept:
        assert (ROOT / rel).exists(), rel
        assert not dockerignored(rel, patterns), f".dockerignore should keep {rel}"


# ------------------------------------------------------------------ compose

_COMPOSE_VAR = re.compile(r"\$(?:(\$)|\{([^}]*)\}|([A-Za-z_]\w*))")


def interpolate(text: str, env: dict[str, str]) -> tuple[str, set[str]]:
    """Compose's interpolation: ``${X}``, ``${X:-d}``, ``${X-d}``, ``${X:?err}``, ``${X?err}``,
    ``${X:+v}``, ``${X+v}``, ``$X``; ``$$`` is a literal ``$`` (for the container's shell).
    Returns the text and the names used. A required or undefined variable raises."""
    used: set[str] = set()

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        expr = m.group(2) if m.group(2) is not None else m.group(3)
        parsed = re.fullmatch(r"([A-Za-z_]\w*)(?:(:?[-?+])(.*))?", expr, re.S)
        assert parsed, f"cannot read ${{{expr}}}"
        name, op, word = parsed.groups()
        used.add(name)
        value = env.get(name)
        present = bool(value) if op and op.startswith(":") else value is not None
        if op is None:
            if value is None:
                raise KeyError(f"${{{name}}} is used but not defined")
            return value
        if op.endswith("-"):
            return value if present else word
        if op.endswith("?"):
            if not present:
                raise ValueError(f"{name}: {word}")
            return value
        return word if present else ""

    return _COMPOSE_VAR.sub(sub, text), used


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip().strip("'\"")
    return out


def load_compose(text: str | None = None) -> dict:
    text = COMPOSE.read_text() if text is None else text
    rendered, _ = interpolate(text, read_env_file(ENV_EXAMPLE))
    return yaml.safe_load(rendered)


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def command_of(service: dict) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def flag(tokens: list[str], name: str) -> str:
    assert tokens.count(name) == 1, f"{name} once in {tokens}"
    return tokens[tokens.index(name) + 1]


def depends_of(service: dict) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def service_by_image(compose: dict, prefix: str) -> str:
    (name,) = [n for n, s in compose["services"].items() if s.get("image", "").startswith(prefix)]
    return name


def listen_ports(service: dict) -> set[int]:
    """The ports a service listens on, from its command (``--port``, ``--address :N``,
    ``--console-address :N``) or, for PostgreSQL, its image's default."""
    cmd = command_of(service)
    ports = {int(cmd[i + 1]) for i, t in enumerate(cmd[:-1]) if t == "--port"}
    ports |= {
        int(cmd[i + 1].rsplit(":", 1)[1])
        for i, t in enumerate(cmd[:-1])
        if t in ("--address", "--console-address")
    }
    if service.get("image", "").startswith("postgres:"):
        ports.add(5432)
    return ports


def published_ports(compose: dict) -> set[int]:
    """Host ports the stack publishes (on 127.0.0.1: port_problems checks that)."""
    out = set()
    for service in compose["services"].values():
        for entry in service.get("ports") or []:
            if isinstance(entry, dict):
                out.add(int(entry["published"]))
            else:
                out.add(int(str(entry).split("/")[0].split(":")[-2]))
    return out


def url_problems(compose: dict, name: str) -> list[str]:
    """URLs in a service's environment and command that do not name another service of the
    file and a port it listens on (``s3://bucket`` URLs name buckets, not hosts). The
    variables of BROWSER_URLS are for a browser on this host instead: 127.0.0.1 and a port
    the stack publishes."""
    services = compose["services"]
    service = services[name]
    texts = [
        *(v for k, v in env_of(service).items() if k not in BROWSER_URLS),
        *command_of(service),
    ]
    problems = []
    for key in BROWSER_URLS & set(env_of(service)):
        url = urlsplit(env_of(service)[key])
        if url.hostname != "127.0.0.1" or url.port not in published_ports(compose):
            problems.append(f"{name}: {key}={url.geturl()} is not a port published here")
    for text in texts:
        for raw in re.findall(r"[a-z][a-z0-9+.-]*://[^\s\"',]+", text):
            url = urlsplit(raw)
            if url.scheme == "s3":
                continue
            host = url.hostname or ""
            if host not in services:
                problems.append(f"{name}: {raw} names {host!r}, not a service of the stack")
                continue
            port = url.port or {"http": 80, "https": 443}.get(url.scheme, 5432)
            if port not in listen_ports(services[host]):
                problems.append(f"{name}: {raw}: {host} listens on {listen_ports(services[host])}")
    return problems


CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


def depends_problems(compose: dict) -> list[str]:
    services = compose["services"]
    problems = []
    for name, service in services.items():
        for target, condition in depends_of(service).items():
            if target not in services:
                problems.append(f"{name} depends on {target!r}, which is not a service")
            elif condition == "service_healthy" and not services[target].get("healthcheck"):
                problems.append(f"{name} waits for {target} to be healthy; it has no healthcheck")
            elif condition == "service_completed_successfully" and services[target].get(
                "restart", "no"
            ) not in ("no", False):
                problems.append(f"{name} waits for {target} to exit; it restarts instead")
            elif condition not in CONDITIONS:
                problems.append(f"{name}: unknown condition {condition!r}")
    return problems


def port_problems(compose: dict) -> list[str]:
    problems = []
    for name, service in compose["services"].items():
        for entry in service.get("ports") or []:
            if isinstance(entry, dict):
                host_ip, target = entry.get("host_ip"), int(entry["target"])
            else:
                parts = str(entry).split("/")[0].split(":")
                host_ip = parts[0] if len(parts) == 3 else None
                target = int(parts[-1])
            if host_ip != "127.0.0.1":
                problems.append(f"{name}: {entry} is published beyond 127.0.0.1")
            if target not in listen_ports(service):
                problems.append(f"{name}: {entry} maps to {target}, not a port it listens on")
    return problems


def created_buckets(compose: dict) -> dict[str, set[str]]:
    """Service -> buckets its ``mc mb`` commands create on the MinIO service of the stack."""
    minio = service_by_image(compose, "minio/minio:")
    out = {}
    for name, service in compose["services"].items():
        script = " ".join(command_of(service))
        if "mc mb" not in script:
            continue
        aliases = dict(re.findall(r"mc alias set (\S+) (\S+)", script))
        for alias, url in aliases.items():
            assert urlsplit(url).hostname == minio, f"{name}: alias {alias} is not {minio}"
        out[name] = {
            bucket
            for alias, bucket in re.findall(r"mc mb(?:\s+--[\w-]+)*\s+([\w-]+)/([\w.-]+)", script)
            if alias in aliases
        }
    return out


def created_databases(compose: dict) -> set[str]:
    """Databases the PostgreSQL service creates: POSTGRES_DB and its init scripts' CREATEs."""
    postgres = compose["services"][service_by_image(compose, "postgres:")]
    names = {env_of(postgres)["POSTGRES_DB"]}
    for volume in postgres.get("volumes") or []:
        source, _, target = str(volume).partition(":")
        if target.startswith("/docker-entrypoint-initdb.d/"):
            sql = (DOCKER / source).read_text()
            names |= set(re.findall(r"CREATE DATABASE\s+(\w+)", sql, re.I))
    return names


def mlflow_problems(compose: dict) -> list[str]:
    """MLflow's store is a Postgres database of the stack, its artifacts a bucket minio-init
    creates on the MinIO service, with that service's credentials."""
    services = compose["services"]
    mlflow, env, cmd = (
        services["mlflow"],
        env_of(services["mlflow"]),
        command_of(services["mlflow"]),
    )
    postgres = service_by_image(compose, "postgres:")
    minio = service_by_image(compose, "minio/minio:")
    pg_env, minio_env = env_of(services[postgres]), env_of(services[minio])
    problems = []
    store = urlsplit(env.get("MLFLOW_BACKEND_STORE_URI") or flag(cmd, "--backend-store-uri"))
    if store.scheme != "postgresql" or store.hostname != postgres:
        problems.append(f"backend store {store.geturl()} is not the {postgres} service")
    db = store.path.lstrip("/")
    if db not in created_databases(compose) or db == pg_env["POSTGRES_DB"]:
        problems.append(f"database {db!r} is not a database of its own that {postgres} creates")
    if (store.username, store.password) != (pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"]):
        problems.append("backend store credentials are not the postgres service's")
    artifacts = urlsplit(flag(cmd, "--artifacts-destination"))
    buckets = set().union(*created_buckets(compose).values())
    if artifacts.scheme != "s3" or artifacts.hostname not in buckets:
        problems.append(f"artifacts {artifacts.geturl()} are not in a created bucket {buckets}")
    endpoint = urlsplit(env.get("MLFLOW_S3_ENDPOINT_URL", ""))
    if endpoint.hostname != minio:
        problems.append(f"MLFLOW_S3_ENDPOINT_URL {endpoint.geturl()!r} is not {minio}")
    keys = (env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY"))
    if keys != (minio_env["MINIO_ROOT_USER"], minio_env["MINIO_ROOT_PASSWORD"]):
        problems.append("MLflow's S3 key is not MinIO's")
    for init in created_buckets(compose):
        if depends_of(mlflow).get(init) != "service_completed_successfully":
            problems.append(f"mlflow starts before {init} has created the buckets")
    return problems


def test_compose_uses_only_variables_of_env_example_and_requires_credentials():
    text = COMPOSE.read_text()
    example = read_env_file(ENV_EXAMPLE)
    _, used = interpolate(text, example)
    assert used == set(example), "docker/.env.example and compose.yaml disagree on variables"
    for name, value in example.items():
        if re.search(r"PASSWORD|SECRET|TOKEN", name):
            assert "dev" in value, f"{name}: .env.example holds dev placeholders only"
    for name in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"):
        missing = {k: v for k, v in example.items() if k != name}
        with pytest.raises(ValueError, match=name):
            interpolate(text, missing)


def test_compose_services_and_dependencies_hold_together():
    compose = load_compose()
    assert {"postgres", "minio", "prefect-server", "prefect-worker", "mlflow"} <= set(
        compose["services"]
    )
    assert depends_problems(compose) == []


def test_compose_builds_from_the_repository_root():
    compose = load_compose()
    built = {n: s["build"] for n, s in compose["services"].items() if "build" in s}
    assert {"prefect-server", "prefect-worker", "mlflow"} <= set(built)
    for name, build in built.items():
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT.resolve(), f"{name}: the build context must be the repository"
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']}"
    for name, service in compose["services"].items():
        image = service.get("image", "")
        tag = image.rpartition(":")[2]
        if "build" not in service:
            assert ":" in image and tag != "latest" and re.search(r"\d", tag), (name, image)


def test_compose_ports_bind_loopback_and_bind_mounts_exist():
    compose = load_compose()
    assert port_problems(compose) == []
    published = {n for n, s in compose["services"].items() if s.get("ports")}
    assert published == {"minio", "prefect-server", "mlflow"}
    for name, service in compose["services"].items():
        for volume in service.get("volumes") or []:
            source = str(volume).split(":")[0]
            if source.startswith((".", "/")):
                assert (DOCKER / source).exists(), f"{name}: bind mount {source} does not exist"


def test_prefect_server_runs_on_the_postgres_service():
    compose = load_compose()
    server = compose["services"]["prefect-server"]
    postgres = service_by_image(compose, "postgres:")
    pg_env = env_of(compose["services"][postgres])
    url = urlsplit(env_of(server)["PREFECT_API_DATABASE_CONNECTION_URL"])
    assert url.scheme == "postgresql+asyncpg"
    assert url.hostname == postgres and url.port in listen_ports(compose["services"][postgres])
    assert url.path.lstrip("/") == pg_env["POSTGRES_DB"]
    assert (url.username, url.password) == (pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"])
    cmd = command_of(server)
    assert cmd[:3] == ["prefect", "server", "start"] and flag(cmd, "--host") == "0.0.0.0"
    assert depends_of(server)[postgres] == "service_healthy"
    assert url_problems(compose, "prefect-server") == []


def test_mlflow_server_uses_postgres_minio_and_a_bucket_the_init_creates():
    compose = load_compose()
    assert mlflow_problems(compose) == []
    cmd = command_of(compose["services"]["mlflow"])
    assert cmd[:2] == ["mlflow", "server"] and flag(cmd, "--workers") == "1"
    assert env_of(compose["services"]["mlflow"])["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert url_problems(compose, "mlflow") == []


def test_mlflow_allows_the_host_headers_it_is_called_with():
    # MLflow answers 403 to a Host header outside --allowed-hosts (fnmatch patterns).
    compose = load_compose()
    allowed = flag(command_of(compose["services"]["mlflow"]), "--allowed-hosts").split(",")
    callers = [
        urlsplit(url).netloc
        for name, service in compose["services"].items()
        if name != "mlflow"
        for url in env_of(service).values()
        if urlsplit(url).hostname == "mlflow"
    ]
    published = [f"127.0.0.1:{p.split(':')[1]}" for p in compose["services"]["mlflow"]["ports"]]
    assert callers, "nothing in the stack calls MLflow"
    for host in callers + published:
        assert any(fnmatch.fnmatchcase(host, pattern) for pattern in allowed), host


def test_worker_polls_a_process_pool_and_reaches_the_stack_by_service_name():
    compose = load_compose()
    worker = compose["services"]["prefect-worker"]
    cmd, env = command_of(worker), env_of(worker)
    assert cmd[:3] == ["prefect", "worker", "start"] and flag(cmd, "--type") == "process"
    assert flag(cmd, "--pool") == read_env_file(ENV_EXAMPLE)["PREFECT_WORK_POOL"]
    assert url_problems(compose, "prefect-worker") == []
    assert urlsplit(env["PREFECT_API_URL"]).hostname == "prefect-server"
    assert urlsplit(env["PREFECT_API_URL"]).path == "/api"
    assert urlsplit(env["MLFLOW_TRACKING_URI"]).hostname == "mlflow"
    assert urlsplit(env["AWS_ENDPOINT_URL_S3"]).hostname == service_by_image(
        compose, "minio/minio:"
    )
    assert worker["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    # Flow runs of the registered deployments start in GRPOFLOW_HOME: the image's checkout.
    assert env["GRPOFLOW_HOME"] == load("cpu").of("WORKDIR")[-1].args


def test_worker_polls_the_process_pool_of_the_deployments():
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    pools = {d["work_pool"]["name"] for d in spec["deployments"] if d.get("work_pool")}
    pool = flag(command_of(load_compose()["services"]["prefect-worker"]), "--pool")
    assert pool == spec["definitions"]["work_pools"]["process"]["name"] and pool in pools


# ------------------------------------------------------------------ docs


def commands(text: str, prefix: str) -> list[list[str]]:
    """Commands starting with ``prefix`` in a text's shell lines (``#`` comment lines of a
    Dockerfile, fenced blocks of Markdown): continuations and open quotes joined, ``&&`` and
    ``;`` chains split, each command as its tokens."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    head = prefix.split()
    found, buf = [], ""
    for line in lines:
        if not buf and not line.lstrip().startswith(prefix):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        try:
            tokens = shlex.split(buf, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            buf += "\n"
            continue
        buf = ""
        chain: list[list[str]] = [[]]
        for token in tokens:
            if token in ("&&", ";", "||"):
                chain.append([])
            else:
                chain[-1].append(token)
        found += [cmd for cmd in chain if cmd[: len(head)] == head]
    assert not buf, f"unterminated command: {buf}"
    return found


def test_build_commands_use_the_repository_root_as_context():
    sources = {"docs/docker.md": DOCS.read_text()}
    sources.update({f"docker/{p.name}": p.read_text() for p in DOCKERFILES.values()})
    built: dict[str, set[str]] = {}
    for where, text in sources.items():
        found = commands(text, "docker build ")
        assert found, f"{where} shows no docker build command"
        for cmd in found:
            dockerfile = flag(cmd, "-f")
            assert (ROOT / dockerfile).is_file(), f"{where}: {dockerfile}"
            assert cmd[-1] == ".", f"{where}: build from the repository root: {' '.join(cmd)}"
            if where.startswith("docker/Dockerfile"):
                assert dockerfile == where, f"{where} shows how to build {dockerfile}"
            built.setdefault(dockerfile, set()).add(flag(cmd, "-t"))
    assert set(built) == {f"docker/{p.name}" for p in DOCKERFILES.values()}
    # The KubeRay manifests run images these commands build, from the right Dockerfile.
    for manifest in (ROOT / "deployments" / "kuberay").glob("*.yaml"):
        for image in re.findall(r"image:\s*(grpoflow:\S+)", manifest.read_text()):
            kind = "rocm" if "rocm" in image else "cuda"
            assert image in built[f"docker/Dockerfile.{kind}"], f"{manifest.name}: {image}"


def test_docs_cover_the_stack():
    docs = DOCS.read_text()
    compose = load_compose()
    for name in compose["services"]:
        assert f"`{name}`" in docs, f"docs/docker.md should say what {name} is"
    for cmd in commands(docs, "docker compose "):
        assert flag(cmd, "-f") == "docker/compose.yaml" and flag(cmd, "--env-file") == "docker/.env"
    needles = ["PREFECT_API_URL", "tracking.uri=", "storage.s3_endpoint_url=",
               "http://127.0.0.1:4200", "http://127.0.0.1:5000", "statically"]  # fmt: skip
    for needle in needles:
        assert needle in docs, needle


# ------------------------------------------------------------------ the checks can fail


BROKEN_DOCKERFILES = {
    "preset-value": ("rocm", "NCCL_MIN_NCHANNELS=112", "NCCL_MIN_NCHANNELS=32", "rocm"),
    "preset-missing": ("rocm", "HIP_FORCE_DEV_KERNARG=1 \\", "\\", "rocm"),
    "preset-of-rocm-in-cuda": (
        "cuda", "CUDA_DEVICE_MAX_CONNECTIONS=1", "HSA_NO_SCRATCH_RECLAIM=1", "cuda",
    ),
    "copy-missing-file": ("cpu", "COPY pyproject.toml", "COPY setup.cfg pyproject.toml", None),
    "copy-ignored-dir": ("cpu", "COPY pyproject.toml", "COPY runs pyproject.toml", None),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BROKEN_DOCKERFILES))
def test_dockerfile_checks_catch_broken_copies(case):
    kind, old, new, platform = BROKEN_DOCKERFILES[case]
    text = DOCKERFILES[kind].read_text()
    assert old in text, old
    df = Dockerfile.load(DOCKERFILES[kind], text.replace(old, new, 1))
    assert (preset_problems(df, platform) if platform else copy_problems(df)) != []


BROKEN_COMPOSE = {
    "worker-on-its-own-loopback": (
        "PREFECT_API_URL: http://prefect-server:4200/api",
        "PREFECT_API_URL: http://127.0.0.1:4200/api",
        lambda c: url_problems(c, "prefect-worker"),
    ),
    "wrong-port": (
        "MLFLOW_TRACKING_URI: http://mlflow:5000",
        "MLFLOW_TRACKING_URI: http://mlflow:5001",
        lambda c: url_problems(c, "prefect-worker"),
    ),
    "ui-url-not-published": (
        "PREFECT_UI_URL: http://127.0.0.1:4200",
        "PREFECT_UI_URL: http://127.0.0.1:4300",
        lambda c: url_problems(c, "prefect-worker"),
    ),
    "bucket-nobody-creates": (
        "s3://${MLFLOW_BUCKET:-mlflow}/artifacts",
        "s3://artifacts/mlflow",
        mlflow_problems,
    ),
    "mlflow-in-prefects-database": (
        "@postgres:5432/mlflow",
        "@postgres:5432/prefect",
        mlflow_problems,
    ),
    "published-on-every-interface": ('"127.0.0.1:5000:5000"', '"5000:5000"', port_problems),
    "dependency-not-a-service": (
        "      minio:\n        condition: service_healthy",
        "      minio-server:\n        condition: service_healthy",
        depends_problems,
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_COMPOSE))
def test_compose_checks_catch_broken_copies(case):
    old, new, check = BROKEN_COMPOSE[case]
    text = COMPOSE.read_text()
    assert old in text, old
    assert check(load_compose(text.replace(old, new, 1))) != []
