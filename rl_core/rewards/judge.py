"""LLM judges and reward models: a judge model on engines of its own scores completions.

`JudgeRunner` (``reward.fn: judge``, or from an environment via `active_judge`) renders one
prompt per sample, decodes greedily on its engine pool (:func:`rl_core.planes.start_judge`) and
reads a score; requests are batched, bounded by ``timeout_s`` and retried. `JudgeRunner.score`
has `RewardRunner.score`'s contract (failures score 0 and are counted; the fault budget raises
`JudgeError`) and is thread-safe. docs/judges.md. Never imports prefect or mlflow, nor
transformers before a judge starts; never raises for a bad sample; never waits without a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_core.data.records import prompt_text
from rl_core.errors import RolloutError, RolloutRequestError
from rl_core.rewards.results import FailedStepStreak, RewardFunctionError, RewardResult, ScoreBook

if TYPE_CHECKING:  # the config module imports no rewards code; only the types are needed
    from rl_core.config import RewardConfig

__all__ = ["DEFAULT_TEMPLATES", "JudgeError", "JudgeRunner", "Judgement", "active_judge",
           "parse_judgement"]

log = logging.getLogger(__name__)

DEFAULT_TEMPLATES = {
    "score": (
        "Question:\n{question}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
        "Rate how well the response answers the question, judged against the reference answer, "
        "on a scale from 0 to {max_score}. End with one line of the form \"Score: <number>\"."),
    "verdict": (
        "Question:\n{question}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n"
        "Is the response's final answer correct according to the reference answer? Answer "
        "\"yes\" or \"no\"."),
}

# Reasoning judges (Qwen3, DeepSeek-R1) think first: a number inside the thoughts is not the
# score. An unterminated block means the judge never got to its answer.
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL | re.IGNORECASE)
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_LABELED_SCORE = re.compile(r"\bscore\b[^\d\n-]{0,12}?" + _NUMBER, re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_LABELED_VERDICT = re.compile(
    r"\b(?:verdict|judgement|judgment|answer|correct)\b\**\s*[:=]\W{0,4}(yes|no)\b", re.IGNORECASE)
_ANY_VERDICT = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_ABORT_WAIT_S = 5.0  # bound on aborting a timed-out request (best effort)
_RECENT = 64  # judgements kept for `recent`

_open_judges: list[JudgeRunner] = []  # started and not closed, oldest first (`active_judge`)
_open_lock = threading.Lock()


class JudgeError(RewardFunctionError):
    """The judge failed every sample of ``steps`` consecutive steps (``reward.max_failed_steps``):
    the run must stop. A `RewardFunctionError`, so the step's tasks treat it as one."""

    def __init__(self, spec: str, steps: int, last_error: str) -> None:
        self.spec, self.steps, self.last_error = spec, steps, last_error
        RuntimeError.__init__(
            self, f"reward judge {spec!r} failed every sample of {steps} consecutive steps "
            f"(reward.max_failed_steps={steps}); last error: {last_error}. Fix: read the judge "
            "engines' logs (judge/ in the run directory); raise reward.judge.timeout_s or "
            "reward.judge.retries if it timed out; if its outputs hold no score, make "
            "reward.judge.template ask for one in the form reward.judge.mode expects or raise "
            "reward.judge.max_new_tokens; or set reward.max_failed_steps=0 to carry on.")


@dataclass
class Judgement:
    """One judged sample, for people (`JudgeRunner.recent`): what the judge read and said."""

    question: str | None
    response: str
    answer: str
    prompt: str  # the rendered prompt text (chat template applied)
    prompt_tokens: int  # as the engine counted them (0: never reached one)
    output: str | None  # the judge's text (None: no answer)
    score: float | None  # in [0, 1] (None: failed)
    error: str | None = None


def parse_judgement(text: str, mode: str, max_score: float = 10.0) -> float:
    """The score in [0, 1] a judge's output ``text`` gives (``mode``: ``score`` or ``verdict``);
    ValueError says what is missing or out of range. Rules: docs/judges.md, 'How its answer
    becomes a score'."""
    visible = _THINK.sub(" ", text)
    if mode == "score":
        found = [m.group(1) for m in _LABELED_SCORE.finditer(visible)][-1:] or [
            m.group(1) for m in _ANY_NUMBER.finditer(visible)][:1]
        if not found:
            raise ValueError(f"no score in the judge's output {text!r}")
        value = float(found[0])
        if not 0.0 <= value <= max_score:
            raise ValueError(f"score {value:g} is outside [0, reward.judge.max_score={max_score:g}]"
                             f" in the judge's output {text!r}")
        return value / max_score
    if mode == "verdict":
        found = [m.group(1) for m in _LABELED_VERDICT.finditer(visible)][-1:] or [
            m.group(1) for m in _ANY_VERDICT.finditer(visible)][:1]
        if not found:
            raise ValueError(f"no yes/no verdict in the judge's output {text!r}")
        return 1.0 if found[0].lower() == "yes" else 0.0
    raise ValueError(f"reward.judge.mode must be 'score' or 'verdict', got {mode!r}")


def active_judge() -> JudgeRunner:
    """The judge this process started last and has not closed (how an environment reaches the
    run's judge); LookupError if none."""
    with _open_lock:
        if _open_judges:
            return _open_judges[-1]
    raise LookupError("no judge is running in this process. Fix: set reward.fn=judge and "
                      "reward.judge.model (the planes start it), or start a JudgeRunner yourself")


def _template_fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


class JudgeRunner(ScoreBook):
    """A judge model on engines of its own, scoring completions (docs/judges.md).
    ``start_engines`` starts them and returns the pool, after the tokenizer is checked;
    ``questions``: record id -> question for callers that pass ``record_ids``. Engines stop in
    `close()` (or ``with``)."""

    def __init__(self, reward: RewardConfig, start_engines: Callable[[], Any], *,
                 log_dir: str | Path, questions: Mapping[str, str | None] | None = None) -> None:
        j = reward.judge
        if not j.model:
            raise ValueError("reward.judge.model is not set: name the judge model (a local Hugging "
                             "Face directory or hub id)")
        self.cfg, self.model = j, str(j.model)
        # Its fields were checked when the config loaded (RewardConfig).
        self.template = j.template or DEFAULT_TEMPLATES[j.mode]
        self.uses_question = "question" in _template_fields(self.template)
        self.format_weight, self.pass_threshold = reward.format_weight, reward.pass_threshold
        self.max_failed_steps = reward.max_failed_steps
        self.questions = dict(questions or {})
        self.spec = f"judge:{self.model}"
        self._stats = dict.fromkeys(("calls", "samples", "errors", "timeouts", "requests",
                                     "retries", "all_failed_calls"), 0)
        self._recent: deque[Judgement] = deque(maxlen=_RECENT)
        # Fault budget, as RewardRunner keeps it.
        self._streak = FailedStepStreak()
        self._failed_streak = 0
        self._fatal: JudgeError | None = None
        self._lock, self._closed = threading.Lock(), False
        # A fast tokenizer is not safe to share between threads (its Rust state is borrowed
        # mutably while encoding: "Already borrowed"); concurrent callers take turns here.
        self._tokenizer_lock = threading.Lock()

        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        except Exception as e:
            raise ValueError(f"reward.judge.model {self.model!r}: cannot load its tokenizer "
                             f"({type(e).__name__}: {e}); name a local Hugging Face directory "
                             "or a hub id") from e
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward.judge.model {self.model!r}: its tokenizer has no chat "
                             "template; use an instruction-tuned (chat) model as the judge")
        t0 = time.monotonic()
        try:
            self.pool = start_engines()  # stops what it started when it fails
        except Exception as e:
            raise RuntimeError(f"reward.judge: the judge engines for {self.model!r} did not start "
                               f"({e}); logs in {log_dir}") from e
        log.info("judge %s: %d %s engine(s) up in %.1fs", self.model, j.num_engines, j.engine,
                 time.monotonic() - t0)
        with _open_lock:
            _open_judges.append(self)

    # ------------------------------------------------------------------ prompts

    def render(self, response: str, answer: str, question: str | None = None) -> str:
        """The prompt text the judge reads for one sample: ``reward.judge.template`` filled in,
        as the user turn (after ``reward.judge.system_prompt``) of the judge's chat template."""
        from rl_core.data.prompts import render_prompt

        content = self.template.format(question=question or "", response=response, answer=answer,
                                       max_score=f"{self.cfg.max_score:g}")
        with self._tokenizer_lock:
            return render_prompt(self.tokenizer, content, system_prompt=self.cfg.system_prompt,
                                 use_chat_template=True)

    def _questions_for(self, n: int, questions: Sequence[str] | None,
                       record_ids: Sequence[str] | None) -> list[str | None]:
        if questions is not None:
            if len(questions) != n:
                raise ValueError(f"got {n} completions but {len(questions)} questions")
            return list(questions)
        if record_ids is not None:
            if len(record_ids) != n:
                raise ValueError(f"got {n} completions but {len(record_ids)} record_ids")
            return [self.questions.get(str(rid)) for rid in record_ids]
        return [None] * n

    # ------------------------------------------------------------------ scoring

    def score(self, completions: Sequence[str], answers: Sequence[str], *,
              step: int | None = None, budget: bool = True,
              questions: Sequence[str] | None = None,
              record_ids: Sequence[str] | None = None, prompts: Sequence[Any] | None = None,
              columns: Sequence[Any] | None = None) -> RewardResult:
        """Judge each completion against its answer and question (``questions``, the samples'
        ``prompts`` as text, or ``record_ids`` looked up) with `RewardRunner.score`'s contract,
        `JudgeError` for a spent budget (environments pass ``budget=False``). Safe from several
        threads at once. ``columns`` is not read."""
        if len(completions) != len(answers):
            raise ValueError(f"got {len(completions)} completions but {len(answers)} answers; "
                             "they must be aligned one to one")
        if questions is None and prompts is not None and all(p is not None for p in prompts):
            questions = [prompt_text(p) for p in prompts]
        qs = self._questions_for(len(completions), questions, record_ids)
        with self._lock:
            if self._closed:
                raise RuntimeError("JudgeRunner.score called after close()")
            if self._fatal is not None:
                raise self._fatal
        outcomes, judged = self._judge(list(completions), list(answers), qs)
        result = self._assemble(completions, outcomes)
        with self._lock:
            for key, n in (("calls", 1), ("samples", len(completions)),
                           ("errors", result.num_errors), ("timeouts", result.num_timeouts)):
                self._stats[key] += n
            self._recent.extend(judged)
            if budget:
                self._count_failed_call(result, object() if step is None else step)
        return result

    def _judge(self, completions: list[str], answers: list[str], questions: list[str | None],
               ) -> tuple[list[tuple[str, Any]], list[Judgement]]:
        """Outcomes ("ok", score) | ("error", message) | ("timeout", message) per sample, and
        what the judge read and said."""
        n = len(completions)
        outcomes: list[tuple[str, Any]] = [("error", "not judged")] * n
        prompts: list[str | None] = [None] * n
        for i in range(n):
            if self.uses_question and questions[i] is None:
                outcomes[i] = ("error", "no question for this sample: the caller passed neither "
                               "questions= nor a known record id (reward.judge.template uses "
                               "{question})")
                continue
            try:
                prompts[i] = self.render(completions[i], answers[i], questions[i])
            except Exception as e:  # a tokenizer/template failure costs this sample only
                outcomes[i] = ("error", f"rendering the judge prompt failed: {e}")
        todo = [i for i in range(n) if prompts[i] is not None]
        answered: dict[int, Any] = {}
        if todo:
            with self._tokenizer_lock:
                ids = self.tokenizer([prompts[i] for i in todo],
                                     add_special_tokens=False)["input_ids"]
            answered = self._generate(dict(zip(todo, (list(x) for x in ids), strict=True)))
        judged = []
        for i in range(n):
            got, output, tokens = answered.get(i), None, 0
            if isinstance(got, tuple):  # ("error" | "timeout", message)
                outcomes[i] = got
            elif got is not None:
                output = got.text  # the engine's detokenized text, as rewards read rollouts
                if not output and got.completion_ids:  # an engine that sends token ids only
                    with self._tokenizer_lock:
                        output = self.tokenizer.decode(got.completion_ids,
                                                       skip_special_tokens=True)
                tokens = int(got.meta.get("prompt_tokens") or len(got.prompt_ids))
                try:
                    outcomes[i] = ("ok", parse_judgement(output, self.cfg.mode, self.cfg.max_score))
                except ValueError as e:
                    hint = (" (the output was cut at reward.judge.max_new_tokens)"
                            if got.truncated else "")
                    outcomes[i] = ("error", f"{e}{hint}")
            kind, value = outcomes[i]
            judged.append(Judgement(questions[i], completions[i], answers[i], prompts[i] or "",
                                    tokens, output, value if kind == "ok" else None,
                                    None if kind == "ok" else str(value)))
        return outcomes, judged

    def _generate(self, prompts: dict[int, list[int]]) -> dict[int, Any]:
        """Greedy answers of the judge engines: sample index -> Sample, or (kind, message)."""
        j = self.cfg
        client = self.pool.client
        if client is None:
            return dict.fromkeys(prompts, ("error", "the judge engines are stopped"))
        order = list(prompts)
        batches = [order[k : k + j.batch_size] for k in range(0, len(order), j.batch_size)]
        call = uuid.uuid4().hex[:12]
        params = {"temperature": 0.0, "max_new_tokens": j.max_new_tokens}

        async def one_batch(b: int, members: list[int]) -> dict[int, Any]:
            return await self._batch(client.aio, f"judge-{call}-b{b}",
                                     [prompts[i] for i in members], members, params)

        async def run_all() -> dict[int, Any]:
            parts = await asyncio.gather(*(one_batch(b, m) for b, m in enumerate(batches)))
            return {i: got for part in parts for i, got in part.items()}

        # Each batch bounds itself; this outer bound only guards against a stuck event loop.
        backoff = sum(self._backoff(a) for a in range(1, j.retries + 1))
        bound = (j.retries + 1) * (j.timeout_s + _ABORT_WAIT_S) + backoff + 30.0
        try:
            return client.run(run_all(), timeout_s=bound)
        except TimeoutError:
            return dict.fromkeys(prompts, ("timeout", f"the judge gave no answer in {bound:.0f} s"))
        except RuntimeError as e:  # the client was closed under us (close() during score)
            return dict.fromkeys(prompts, ("error", f"judge engines unavailable: {e}"))

    def _backoff(self, attempt: int) -> float:
        return min(30.0, self.cfg.retry_backoff_s * 2 ** (attempt - 1))

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    async def _batch(self, aio: Any, tag: str, prompts: list[list[int]], members: list[int],
                     params: dict[str, Any]) -> dict[int, Any]:
        """One request for ``prompts`` (sample indices ``members``): ``timeout_s`` per attempt,
        ``retries`` more attempts after engine errors and timeouts, backoff in between. A request
        the engine refuses (4xx: e.g. a prompt past its context) is split, so that only the
        offending sample fails."""
        j, failure = self.cfg, ("error", "not sent")
        for attempt in range(j.retries + 1):
            if attempt:
                self._count("retries")
                await asyncio.sleep(self._backoff(attempt) * random.uniform(0.5, 1.0))
            prefix = f"{tag}-a{attempt}-"
            rids = [f"{prefix}{k}" for k in range(len(prompts))]
            self._count("requests")
            try:
                request = (aio.generate(prompts[0], params, return_logprob=False, rid=rids[0])
                           if len(prompts) == 1 else
                           aio.generate_batch(prompts, params, return_logprob=False, rid=rids))
                got = await asyncio.wait_for(request, j.timeout_s)
            except TimeoutError:
                failure = ("timeout", f"no answer within reward.judge.timeout_s={j.timeout_s:g} "
                           f"(attempt {attempt + 1} of {j.retries + 1})")
                # Free the engine: the request would otherwise run on and delay the next batch.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(aio.abort(prefix), _ABORT_WAIT_S)
                continue
            except RolloutRequestError as e:
                if len(prompts) == 1:
                    return {members[0]: ("error", f"the judge engine refused the prompt: {e}")}
                parts = await asyncio.gather(*(
                    self._batch(aio, f"{tag}-s{k}", [p], [m], params)
                    for k, (p, m) in enumerate(zip(prompts, members, strict=True))))
                return {i: got for part in parts for i, got in part.items()}
            except RolloutError as e:
                failure = ("error", f"judge engine error (attempt {attempt + 1} of "
                           f"{j.retries + 1}): {e}")
                continue
            samples = got if isinstance(got, list) else [got]
            return {m: s if not s.aborted else ("error", f"aborted by the judge engine: "
                                                 f"{s.finish_reason.get('message')}")
                    for m, s in zip(members, samples, strict=True)}
        return dict.fromkeys(members, failure)

    def _fatal_error(self, steps: int, last: str) -> JudgeError:
        return JudgeError(self.spec, steps, last)

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, int]:
        """Cumulative counters: calls, samples, errors, timeouts, requests (HTTP requests sent,
        retries included), retries, all_failed_calls."""
        with self._lock:
            return dict(self._stats)

    def recent(self) -> list[Judgement]:
        """The last judgements (up to 64), oldest first: what the judge read and answered."""
        with self._lock:
            return list(self._recent)

    @property
    def failed_streak(self) -> int:
        """Consecutive steps, up to the last budgeted `score` call, that failed every sample."""
        return self._failed_streak

    def health(self) -> dict[str, Any]:
        """The judge engines: how many, which serve, how often they were restarted."""
        p = self.pool
        return {"engines": len(p.engines), "in_service": p.in_service_urls(),
                "restarts": sum(e.restarts for e in p.engines)}

    def close(self) -> None:
        """Stop the judge engines (bounded; idempotent); `score` raises afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with _open_lock:
            if self in _open_judges:
                _open_judges.remove(self)
        self.pool.stop()

    def __enter__(self) -> JudgeRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
