"""Reward functions: finding them (`load_reward_fn`: a builtin or ``package.module:function``,
``args`` bound), their two forms (`reward_form`: ``fn(completion, answer) -> float`` per
sample, or TRL's batched ``fn(prompts, completions, **columns) -> list[float | None]``, sync or
``async``) and calling them on a batch (an outcome per sample, never an exception).

Used by `rl_core.rewards.runner` in this process and in its worker processes, and by
``grpoflow validate``. Imports nothing heavy (workers import it on every start).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rl_core.rewards.builtins import (
    exact_match,
    multiple_choice,
    normalized_match,
    regex_match,
)
from rl_core.rewards.code import code_tests
from rl_core.rewards.math import format_reward, gsm8k_reward
from rl_core.rewards.results import Outcome, short
from rl_core.rewards.sandbox import require_sandbox

__all__ = ["BUILTIN_REWARDS", "PER_SAMPLE", "Item", "RewardFn", "as_score", "call_one", "call_whole", "describe",
           "load_reward_fn", "reward_form", "split_spec"]

RewardFn = Callable[..., Any]  # fn(completion, answer) or fn(prompts, completions, **columns)
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward, "format": lambda completion, answer: format_reward(completion),
    "exact_match": exact_match, "normalized_match": normalized_match,
    "multiple_choice": multiple_choice, "regex": regex_match, "code_tests": code_tests}
_SANDBOXED = {"code_tests"}  # builtins that run the completion's code (rl_core.rewards.sandbox)
# A scoring item: (index, completion, answer, prompt, columns).
Item = tuple[int, str, Any, Any, Mapping[str, Any]]
# `reward_form` of a sync per-sample function: the one form scored a sample at a time (every
# other form answers for a whole batch at once: `call_whole`).
PER_SAMPLE = ("single", False)


def _builtin_names() -> str:
    return ", ".join(repr(name) for name in BUILTIN_REWARDS)


def split_spec(spec: object) -> tuple[str, str]:
    """Validate the shape of a non-builtin spec; return (module, attribute path)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec {spec!r} is empty or not a string. Fix: use a builtin "
                         f"({_builtin_names()}) or a 'package.module:function' path.")
    module_name, sep, attr_path = spec.strip().partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(
            f"unknown reward spec {spec!r}: it is not a builtin ({_builtin_names()}) and not of "
            "the form 'package.module:function'. Fix: use a builtin name, or point at a "
            "function, e.g. 'my_rewards.math:score'.")
    return module_name, attr_path


def load_reward_fn(spec: str, args: Mapping[str, Any] | None = None) -> RewardFn:
    """Resolve ``spec`` (a builtin name or ``package.module:function``, the function may be
    dotted) to a reward function, ``args`` bound as keyword arguments, imported in *this*
    process (a worker's, for custom specs). Raises ValueError naming the spec, what is wrong
    and the fix (also for a function of neither form: `reward_form`)."""
    if isinstance(spec, str) and spec.strip() in BUILTIN_REWARDS:
        if spec.strip() in _SANDBOXED:
            require_sandbox()  # at start-up, naming the fix; never code run unisolated
        return _bind(spec, BUILTIN_REWARDS[spec.strip()], args)
    module_name, attr_path = split_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"reward spec {spec!r}: module {module_name!r} not found ({e}). Fix: check the "
                "spelling, install the package, or put its directory on PYTHONPATH.") from e
        raise ValueError(
            f"reward spec {spec!r}: module {module_name!r} was found but importing it failed "
            f"because a module it needs is missing ({e}). Fix: install that dependency.") from e
    except Exception as e:
        raise ValueError(
            f"reward spec {spec!r}: importing module {module_name!r} raised "
            f"{type(e).__name__}: {e}. Fix: debug with python -c 'import {module_name}'.") from e
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(name for name, value in vars(module).items()
                            if callable(value) and not name.startswith("_"))
            raise ValueError(
                f"reward spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}. "
                f"Fix: check the name after ':'; public callables there: "
                f"{', '.join(public[:10]) or 'none'}.") from None
    if not callable(obj):
        raise ValueError(
            f"reward spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable. "
            "Fix: point at a function fn(completion: str, answer) -> float.")
    return _bind(spec, obj, args)


def _bind(spec: str, fn: RewardFn, args: Mapping[str, Any] | None) -> RewardFn:
    if args:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if params and not takes_any and (unknown := sorted(set(args) - set(params))):
            raise ValueError(
                f"reward {spec!r} takes no argument {', '.join(map(repr, unknown))} (its "
                f"parameters: {', '.join(params)}); matches neither reward form with these "
                "args. Fix: the args of reward.args or a reward.extra entry")
        fn = functools.partial(fn, **args)
    reward_form(fn, spec)  # raises for a function of neither form, or args it does not take
    return fn


def reward_form(fn: RewardFn, spec: str = "") -> tuple[str, bool]:
    """(``"single"`` or ``"batched"``, whether it is async) for a reward function: batched
    when it has a parameter named ``completions`` (TRL's ``fn(prompts, completions,
    **columns)``), single when it can be called as ``fn(completion, answer)``. Raises
    ValueError for neither."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    is_async = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None))  # noqa: B004 - an object's async __call__
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables carry no signature; the call will tell
        return "single", is_async
    params = signature.parameters
    if "completions" in params:
        try:
            signature.bind_partial(prompts=[], completions=[])
            return "batched", is_async
        except TypeError as e:
            problem = str(e)
    else:
        try:
            signature.bind("", "")
            return "single", is_async
        except TypeError as e:
            problem = str(e)
    name = spec or getattr(target, "__name__", repr(target))
    raise ValueError(
        f"reward {name!r}: {getattr(target, '__name__', 'fn')}{signature} matches neither "
        f"reward form ({problem}). Fix: write fn(completion, answer) -> float, or TRL's batched "
        "fn(prompts, completions, **columns) -> list[float | None] (docs/data-and-rewards.md)")


def describe(exc: BaseException) -> str:
    return short(f"{type(exc).__name__}: {exc}")


def as_score(value: object) -> Outcome:
    if value is None or isinstance(value, str | bytes):
        return "error", short(f"returned {type(value).__name__} {value!r}, expected a float")
    try:
        score = float(value)  # type: ignore[arg-type]
    except Exception as e:
        return "error", short(f"returned {type(value).__name__}, expected a float ({e})")
    if not math.isfinite(score):
        return "error", f"returned non-finite score {score}"
    return "ok", score


def call_one(fn: RewardFn, completion: str, answer: Any) -> Outcome:  # noqa: ANN401
    try:
        value = fn(completion, answer)
    except (Exception, SystemExit) as e:  # sys.exit() in a user function is a bad sample
        return "error", describe(e)
    return as_score(value)


def batch_kwargs(fn: RewardFn, items: Sequence[Item],
                 deadline: float | None = None) -> dict[str, Any]:
    """``prompts``, ``completions`` and each column (a list aligned with them; None where a
    row lacks it) that the function takes (all of them with ``**kwargs``), and ``deadline``
    (``time.monotonic()`` by which the caller stops waiting) to one that names it."""
    names = dict.fromkeys(k for *_, cols in items for k in cols)
    kw: dict[str, Any] = {k: [cols.get(k) for *_, cols in items] for k in names}
    kw.update(prompts=[it[3] for it in items], completions=[it[1] for it in items])
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kw
    if deadline is not None and "deadline" in params:
        kw["deadline"] = deadline
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def call_whole(fn: RewardFn, form: tuple[str, bool], items: Sequence[Item],
                timeout_s: float) -> list[Outcome]:
    """Score ``items`` in one go: a batched function's one call (None: no score, "skip"), or
    an async single-sample function's calls run concurrently, each bounded by ``timeout_s``."""
    n = len(items)
    try:
        if form[0] == "single":
            async def one(completion: str, answer: Any) -> Outcome:  # noqa: ANN401
                try:
                    return as_score(await asyncio.wait_for(fn(completion, answer), timeout_s))
                except TimeoutError:
                    return "timeout", None
                except (Exception, SystemExit) as e:
                    return "error", describe(e)

            async def run_all() -> list[Outcome]:
                return list(await asyncio.gather(*(one(it[1], it[2]) for it in items)))

            return asyncio.run(run_all())
        # the bound the runner puts on a batched call: timeout_s per sample
        value = fn(**batch_kwargs(fn, items, time.monotonic() + timeout_s * max(n, 1)))
        if inspect.isawaitable(value):
            async def wait(v: Any) -> Any:  # noqa: ANN401
                return await v

            value = asyncio.run(wait(value))
    except (Exception, SystemExit) as e:
        return [("error", describe(e))] * n
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence) \
            or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, Sequence) else type(value).__name__
        return [("error", f"returned {got}, expected a list of {n} scores (float or None)")] * n
    return [("skip", None) if v is None else as_score(v) for v in value]
