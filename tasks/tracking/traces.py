"""Multi-turn episodes as MLflow traces: some of each step's episodes (``meta["episode"]``)
become one trace each on the run, tagged with the sample ledger's keys, with spans for the
episode, retried attempts, reset, model turns and environment answers (docs/agents.md).
A daemon thread (``grpoflow-mlflow-traces``) writes them with a ``TracingClient`` bound to the
run's URI and keeps up to ``MAX_QUEUED`` through an outage (docs/tracking.md, 'Episode traces').

Never blocks or fails the training step; never writes an unredacted string; never sets MLflow's
global tracking URI, experiment or tracer provider.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rl_core.secrets import MASK, is_secret_name, redact
from tasks.tracking.handle import RUN_NAME_TAG, STEP_TAG, TrackingHandle, logger
from tasks.tracking.outbox import RETRY_DELAYS, Outbox, bound_mlflow_http

__all__ = ["choose_episodes", "close_traces", "episode_trace", "flush_traces", "log_traces"]

MAX_QUEUED = 256  # traces kept while the server is away (one is ~5-50 kB)
MAX_TEXT = 8000  # characters of one message, turn text or error in a trace
PREVIEW = 1000  # characters of the request/response previews in the traces list
SENDER = "grpoflow-mlflow-traces"
UID_TAG, KIND_TAG = "grpoflow.uid", "grpoflow.kind"  # KIND: "episode", as runs have theirs
_ERROR = re.compile(r"attempt (\d+): (\w+): (\w+): (.*)", re.S)  # EpisodeRunner._fail's format


# ------------------------------------------------------------------ which episodes


def choose_episodes(samples: Sequence[Any], limit: int) -> list[Any]:
    """Up to ``limit`` episode samples, deterministically, in the samples' order: failed ones
    first, then one per group from groups spread over the step, each group's ranked best, worst,
    second best, ... (a GRPO group's contrast)."""
    episodes = [(i, s) for i, s in enumerate(samples)
                if isinstance(getattr(s, "meta", None), Mapping)
                and isinstance(s.meta.get("episode"), Mapping)]
    if limit <= 0 or not episodes:
        return []
    failed = [(i, s) for i, s in episodes if s.meta["episode"].get("status") == "failed"]
    chosen = failed[:limit]
    groups: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
    for i, s in episodes:
        if s.meta["episode"].get("status") != "failed":
            groups[s.group].append((i, s))
    ranked = [_best_worst(groups[g]) for g in sorted(groups)]
    depth = 0
    while len(chosen) < limit and (row := [g[depth] for g in ranked if len(g) > depth]):
        need = limit - len(chosen)
        if need < len(row):  # spread over the step, not the first groups only
            row = [row[k * len(row) // need] for k in range(need)]
        chosen += row
        depth += 1
    return [s for _, s in sorted(chosen, key=lambda t: t[0])]


def _best_worst(members: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    by_reward = sorted(members, key=lambda t: (-float(t[1].reward), t[0]))
    out = []
    while by_reward:
        out.append(by_reward.pop(0))
        if by_reward:
            out.append(by_reward.pop())
    return out


# ------------------------------------------------------------------ one trace


def _clip(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more]"


def _clean(value: Any, limit: int = MAX_TEXT) -> Any:
    """``value`` as a JSON-able value with every string redacted and clipped, and the string
    values of secret-named keys masked (an environment's ``info`` may carry anything)."""
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): MASK if isinstance(v, str) and v and is_secret_name(str(k))
                else _clean(v, limit) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_clean(v, limit) for v in value]
    return _clip(redact(value), limit)


@dataclass
class _Clock:
    """Lays the episode's spans end to end from ``at`` (ns since the epoch)."""
    at: int

    def take(self, seconds: float) -> tuple[int, int]:
        start, self.at = self.at, self.at + max(int(float(seconds) * 1e9), 0)
        return start, self.at


class _Builder:
    """Spans of one trace on a private OpenTelemetry tracer: nothing is exported by it."""

    def __init__(self, name: str, kind: str, start_ns: int) -> None:
        from mlflow.entities import LiveSpan
        from mlflow.tracing.utils import generate_mlflow_trace_id_from_otel_trace_id

        self._live = LiveSpan
        root = _tracer().start_span(name, start_time=start_ns)
        otel_id = root.get_span_context().trace_id
        self.trace_id = generate_mlflow_trace_id_from_otel_trace_id(otel_id)
        self.spans: list[Any] = []  # (otel span, LiveSpan), parents first
        self.root = self._wrap(root, kind)

    def _wrap(self, otel_span: Any, kind: str) -> Any:
        span = self._live(otel_span, self.trace_id, kind)
        self.spans.append((otel_span, span))
        return span

    def child(self, parent: Any, name: str, kind: str, start_ns: int,
              inputs: Any = None) -> Any:
        from opentelemetry import trace as otel

        ctx = otel.set_span_in_context(parent._span)
        span = self._wrap(_tracer().start_span(name, context=ctx, start_time=start_ns), kind)
        if inputs is not None:
            span.set_inputs(_clean(inputs))
        return span

    @staticmethod
    def end(span: Any, end_ns: int, outputs: Any = None,
            attributes: Mapping[str, Any] | None = None,
            error: tuple[str, str] | None = None) -> None:
        """End ``span`` at ``end_ns``; ``error``: (kind, message) marks it failed."""
        from mlflow.entities import SpanEvent, SpanStatus, SpanStatusCode

        if outputs is not None:
            span.set_outputs(_clean(outputs))
        span.set_attributes({k: _clean(v) for k, v in (attributes or {}).items()
                             if v is not None})
        if error is None:
            span.set_status(SpanStatus(SpanStatusCode.OK))
        else:
            kind, message = error[0], _clip(redact(error[1]))
            span.add_event(SpanEvent("exception", end_ns, {"exception.type": kind,
                                                           "exception.message": message}))
            span.set_status(SpanStatus(SpanStatusCode.ERROR, f"{kind}: {message}"[:PREVIEW]))
        # LiveSpan.end would also run MLflow's client-side cost estimate and agent hints:
        # the OpenTelemetry span's end is all that finishing a span needs here.
        span._span.end(end_time=max(end_ns, span.start_time_ns))

    def spans_done(self) -> list[Any]:
        return [s.to_immutable_span() for _, s in self.spans]


_TRACER: Any = None
_TRACER_LOCK = threading.Lock()


def _tracer() -> Any:
    """Our own tracer provider, not registered anywhere: its spans reach no exporter."""
    global _TRACER
    with _TRACER_LOCK:
        if _TRACER is None:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            provider = TracerProvider(resource=Resource({"service.name": "grpoflow"}),
                                      shutdown_on_exit=False)
            _TRACER = provider.get_tracer("grpoflow.episodes")
        return _TRACER


def _attempt_errors(errors: Sequence[Any], attempts: int) -> dict[int, tuple[str, str, str]]:
    """attempt index -> (where, kind, message) from the episode's error strings."""
    out: dict[int, tuple[str, str, str]] = {}
    for n, text in enumerate(errors):
        if m := _ERROR.match(str(text)):
            out[int(m[1]) - 1] = (m[2], m[3], m[4])
        else:  # another runner's wording: the n-th error belongs to the n-th attempt
            out[min(n, attempts - 1)] = ("episode", "error", str(text))
    return out


def _ledger(sample: Any, step: int, trained: bool | None) -> dict[str, str]:
    ep = sample.meta["episode"]
    tags = {UID_TAG: sample.uid, STEP_TAG: step, "grpoflow.record_id": sample.record_id,
            "grpoflow.group": sample.group, "grpoflow.reward": f"{float(sample.reward):g}",
            "grpoflow.correct": str(bool(sample.correct)).lower(),
            "grpoflow.status": ep.get("status", "ok"), "grpoflow.finish": ep.get("finish", ""),
            "grpoflow.weight_version": sample.weight_version, KIND_TAG: "episode"}
    if trained is not None:
        tags["grpoflow.trained"] = str(trained).lower()
    return {k: _clip(redact(v), 250) for k, v in tags.items()}


def episode_trace(sample: Any, step: int, *, experiment_id: str, run_id: str,
                  run_name: str = "", trained: bool | None = None,
                  logged_at: float | None = None) -> Any:
    """The MLflow ``Trace`` of one episode sample; pure, no I/O. Spans sit end to end from the
    episode's ``started_at`` (else ending at ``logged_at``, default now): the durations are the
    record's, the absolute times then approximate."""
    from mlflow.entities import SpanType, Trace, TraceData, TraceInfo, TraceLocation, TraceState
    from mlflow.tracing.constant import SpanAttributeKey, TraceMetadataKey, TraceTagKey

    ep = sample.meta["episode"]
    entries = [e for e in ep.get("trace") or [] if isinstance(e, Mapping)]
    attempts = max(int(ep.get("attempts") or 1), 1 + max((int(e.get("attempt", 0))
                                                          for e in entries), default=0))
    failed = ep.get("status") == "failed"
    errors = _attempt_errors(ep.get("errors") or [], attempts)
    by_attempt: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for e in entries:
        by_attempt[int(e.get("attempt", 0))].append(e)
    spent = [sum(float(e.get("seconds") or 0.0) for e in by_attempt[a]) for a in range(attempts)]
    spent[-1] = max(spent[-1], float(ep.get("seconds") or 0.0))  # the last attempt's wall time
    total_ns = int(sum(spent) * 1e9)
    if isinstance(started := ep.get("started_at"), int | float):
        start_ns = int(started * 1e9)
    else:
        start_ns = int((time.time() if logged_at is None else logged_at) * 1e9) - total_ns

    name = f"episode {sample.uid}"
    b = _Builder(name, SpanType.AGENT, start_ns)
    first = next((e for e in by_attempt[attempts - 1] if e.get("role") == "reset"), None)
    messages = list(first.get("messages") or []) if first else []
    b.root.set_inputs(_clean({"task": sample.record_id, "messages": messages}))
    clock, usage = _Clock(start_ns), {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    for a in range(attempts):
        parent = b.root
        if attempts > 1:
            parent = b.child(b.root, f"attempt {a + 1}", SpanType.CHAIN, clock.at)
        # Per model turn: what it read since its last turn (not the whole, growing
        # conversation: the reset span and the turns before hold the rest) and how many
        # tokens the engine had in context.
        context, turn, read, said = 0, 0, [], ""
        for e in by_attempt[a]:
            role = e.get("role")
            if role == "reset":
                span = b.child(parent, "reset", SpanType.CHAIN, clock.at,
                               {"task": sample.record_id})
                context, read = int(e.get("tokens") or 0), list(e.get("messages") or [])
                b.end(span, clock.take(0)[1], {"messages": read}, {"tokens": context})
            elif role == "assistant":
                turn += 1
                start, end = clock.take(e.get("seconds") or 0.0)
                tokens, said = int(e.get("tokens") or 0), e.get("text") or ""
                turn_usage = {"input_tokens": context, "output_tokens": tokens,
                              "total_tokens": context + tokens}
                for k, v in turn_usage.items():
                    usage[k] += v
                span = b.child(parent, f"model (turn {turn})", SpanType.LLM, start,
                               {"messages": read, "context_tokens": context})
                b.end(span, end, {"role": "assistant", "content": said},
                      {"tokens": tokens, "weight_version": e.get("weight_version"),
                       "finish_reason": e.get("finish_reason"), "seconds": e.get("seconds"),
                       SpanAttributeKey.CHAT_USAGE: turn_usage})
                context += tokens
            elif role == "environment":
                calls = e.get("tool_calls") or 0
                n_calls = len(calls) if isinstance(calls, list | tuple) else int(calls)
                start, end = clock.take(e.get("seconds") or 0.0)
                kind, what = ((SpanType.TOOL, "tools") if n_calls else
                              (SpanType.CHAIN, "environment"))
                span = b.child(parent, f"{what} (turn {turn})", kind, start,
                               {"turn": turn, "assistant": said})
                read = list(e.get("messages") or [])
                b.end(span, end, {"messages": read, "reward": e.get("reward"),
                                  "done": e.get("done")},
                      {"reward": e.get("reward"), "done": e.get("done"), "tool_calls": n_calls,
                       "tokens": e.get("tokens"), "seconds": e.get("seconds")})
                context += int(e.get("tokens") or 0)
        error = errors.get(a) if a < attempts - 1 or failed else None
        if error is not None:  # the call that failed left no entry of its own
            where, kind, message = error
            span = b.child(parent, "reset" if where == "reset" else f"environment (turn {turn})",
                           SpanType.CHAIN, clock.at)
            b.end(span, clock.at, error=(kind, message))
        if attempts > 1:
            clock.at = max(clock.at, parent.start_time_ns + int(spent[a] * 1e9))
            b.end(parent, clock.at, attributes={"attempt": a + 1},
                  error=None if error is None else (error[1], error[2]))

    end_ns = max(clock.at, start_ns + total_ns)
    answer = sample.text or ""
    root_error = None
    if failed:
        last = errors.get(attempts - 1) or ("episode", "failed", "; ".join(map(str, ep.get(
            "errors") or ["failed"])))
        root_error = (last[1], last[2])
    b.end(b.root, end_ns, {"answer": answer, "reward": float(sample.reward),
                           "correct": bool(sample.correct), "finish": ep.get("finish")},
          {"uid": sample.uid, "step": step, "record_id": sample.record_id,
           "group": sample.group, "reward": float(sample.reward),
           "env_reward": ep.get("env_reward"), "correct": bool(sample.correct),
           "status": ep.get("status"), "finish": ep.get("finish"), "turns": ep.get("turns"),
           "attempts": attempts, "tool_calls": ep.get("tool_calls"),
           "masked_tokens": ep.get("masked_tokens"), "prompt_tokens": len(sample.prompt_ids),
           "completion_tokens": len(sample.completion_ids),
           "weight_version": sample.weight_version, "errors": list(ep.get("errors") or []),
           "info": ep.get("info") or {}, "seconds": ep.get("seconds")}, error=root_error)

    request = next((m.get("content") for m in reversed(messages)
                    if isinstance(m, Mapping) and m.get("role") == "user"), sample.record_id)
    metadata = {TraceMetadataKey.SOURCE_RUN: run_id,
                TraceMetadataKey.INPUTS: _clip(redact(request), PREVIEW),
                TraceMetadataKey.OUTPUTS: _clip(redact(answer), PREVIEW)}
    if usage["total_tokens"]:
        metadata[TraceMetadataKey.TOKEN_USAGE] = json.dumps(usage)
    tags = {TraceTagKey.TRACE_NAME: name, **_ledger(sample, step, trained)}
    if run_name:
        tags[RUN_NAME_TAG] = _clip(redact(run_name), 250)
    info = TraceInfo(
        trace_id=b.trace_id, trace_location=TraceLocation.from_experiment_id(str(experiment_id)),
        request_time=start_ns // 1_000_000, execution_duration=(end_ns - start_ns) // 1_000_000,
        state=TraceState.ERROR if failed else TraceState.OK, client_request_id=sample.uid,
        request_preview=metadata[TraceMetadataKey.INPUTS],
        response_preview=metadata[TraceMetadataKey.OUTPUTS],
        trace_metadata=metadata, tags=tags)
    return Trace(info, TraceData(spans=b.spans_done()))


# ------------------------------------------------------------------ sending


@dataclass
class _Item:
    """One episode to trace, or (``replace``) the step whose earlier traces are deleted first
    (a step redone after a resume or a plane restart has the same episodes' uids)."""
    step: int
    replace: bool = False
    sample: Any = None  # until its trace is built
    trained: bool | None = None
    logged_at: float = 0.0
    trace: Any = None  # built by the thread at the first try
    spans_logged: bool = False
    started: Any = None  # the TraceInfo the store returned


class _Sender(Outbox[_Item]):
    """The outbox of one run's traces (see the module docstring)."""

    thread_name = SENDER

    def __init__(self, handle: TrackingHandle) -> None:
        super().__init__(handle.tracking_uri)
        self.handle, self.queue = handle, deque()
        self.sent = self.dropped = self.refused = 0
        self.warned: set[str] = set()
        self.steps: set[int] = set()  # steps traced by this process
        self._client: Any = None

    def say(self, msg: str, level: int = logging.WARNING, once: str | None = None) -> None:
        if once is not None:
            if once in self.warned:
                return
            self.warned.add(once)
        super().say(msg, level)

    def put(self, items: list[_Item]) -> None:
        with self._changed:
            self.queue.extend(items)
            over = max(len(self.queue) - MAX_QUEUED, 0)
            for _ in range(over):
                self.queue.popleft()
            self.dropped += over
            self._changed.notify_all()
        if over:
            self.say(f"tracking: dropped the {over} oldest unsent episode traces (more than "
                     f"{MAX_QUEUED} waiting for MLflow)", once=f"dropped-{self.failing_since}")
        self.ensure_thread()

    def close(self, timeout: float) -> int:
        """:meth:`flush`, then stop the thread; the number of traces left unwritten."""
        self.flush(timeout)
        self.stop()
        with self._changed:
            return len(self.queue) + (self.inflight is not None)

    # the outbox's units: one trace, or one step's old traces to delete
    def _queued_locked(self) -> int:
        return len(self.queue)

    def _take_locked(self) -> _Item:
        return self.queue.popleft()

    def _put_back_locked(self, item: _Item) -> None:
        self.queue.appendleft(item)

    def _refuse_locked(self, item: _Item) -> None:
        self.refused += 1

    def _sent_locked(self, item: _Item) -> None:
        self.sent += not item.replace

    def _on_refused(self, item: _Item, what: str) -> None:
        self.say(f"tracking: MLflow at {self.uri} refused an episode trace of step {item.step} "
                 f"({what}); it is skipped (later refusals are not reported)", once="refused")

    def _on_outage(self, what: str, queued: int) -> None:
        self.say(f"tracking: episode traces cannot reach MLflow at {self.uri} ({what}); training "
                 f"goes on, {queued} traces are kept and sent when it answers again "
                 f"(retrying every {RETRY_DELAYS[0]:.0f}-{RETRY_DELAYS[1]:.0f}s)")

    def _on_back(self, seconds: float, queued: int) -> None:
        self.say(f"tracking: episode traces reach {self.uri} again after {seconds:.0f}s; "
                 f"sending the {queued} kept meanwhile", logging.INFO)

    def _prepare(self, item: _Item) -> bool:
        """The item's trace, built here rather than on the training step's thread (~10 ms
        each); an episode record it cannot read is skipped (warned about once)."""
        if item.replace or item.trace is not None:
            return True
        h = self.handle
        try:
            item.trace = episode_trace(item.sample, item.step, experiment_id=h.experiment_id,
                                       run_id=h.run_id, run_name=h.run_name,
                                       trained=item.trained, logged_at=item.logged_at)
            item.sample = None  # the trace holds what is needed
            return True
        except Exception as exc:
            self.say(f"tracking: episode {getattr(item.sample, 'uid', '?')} of step {item.step} "
                     f"not traced ({type(exc).__name__}: {exc}); training goes on (later "
                     "failures are not reported)", once="build")
            return False

    def _send(self, item: _Item) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracing.client import TracingClient
        from mlflow.tracing.constant import SpansLocation, TraceTagKey

        h = self.handle
        if self._client is None:  # made here: a SQLite store's first open is not instant
            bound_mlflow_http()
            self._client = TracingClient(h.tracking_uri)
        client = self._client
        if item.replace:
            self._replace(item)
            return
        trace = item.trace
        if not item.spans_logged:
            try:  # stores with span storage (SQL, a server over one) take spans first
                client.log_spans(h.experiment_id, trace.data.spans)
            except NotImplementedError:
                pass
            except MlflowException as exc:
                if "not supported" not in str(exc):
                    raise
            item.spans_logged = True
        if item.started is None:
            item.started = client.start_trace(trace.info)
        if item.started.tags.get(TraceTagKey.SPANS_LOCATION) != SpansLocation.TRACKING_STORE:
            # A store without span storage keeps them as the trace's artifact, as MLflow's
            # own exporter writes them (MlflowV3SpanExporter._log_trace).
            client._upload_trace_data(item.started, trace.data)

    def _replace(self, item: _Item) -> None:
        h = self.handle
        found = self._client.search_traces(
            locations=[h.experiment_id], run_id=h.run_id, include_spans=False, max_results=500,
            filter_string=f"tags.`{STEP_TAG}` = '{item.step}' and tags.`{KIND_TAG}` = 'episode'")
        if old := [t.info.trace_id for t in found]:
            self._client.delete_traces(h.experiment_id, trace_ids=old)


_SENDERS: dict[str, _Sender] = {}
_SENDERS_LOCK = threading.Lock()


def _sender(handle: TrackingHandle) -> _Sender:
    """The process's sender of ``handle``'s run (made on first use)."""
    with _SENDERS_LOCK:
        return _SENDERS.get(handle.run_id) or _SENDERS.setdefault(handle.run_id, _Sender(handle))


# ------------------------------------------------------------------ the API


def log_traces(handle: TrackingHandle | None, step: int, samples: Sequence[Any], limit: int,
               dropped: Sequence[Any] = ()) -> int:
    """Queue traces of up to ``limit`` of this step's episodes (:func:`choose_episodes` over
    ``samples`` and ``dropped``) and return at once how many; samples without ``meta["episode"]``
    are never traced. Not a task; never raises."""
    if handle is None or limit <= 0:
        return 0
    try:
        chosen = choose_episodes([*samples, *dropped], limit)
        if not chosen:
            return 0
        sender, trained, now = _sender(handle), {id(s) for s in samples}, time.time()
        items = [_Item(step, sample=s, trained=id(s) in trained, logged_at=now) for s in chosen]
        if handle.resumed or step in sender.steps:  # a redone step: its traces replace the last
            items.insert(0, _Item(step, replace=True))
        sender.steps.add(step)
        sender.put(items)
        return len(chosen)
    except Exception as exc:  # a trace is a view of the step, never a reason to stop it
        logger().warning(redact(f"tracking: episode traces of step {step} not queued "
                                f"({type(exc).__name__}: {exc}); training goes on"))
        return 0


def flush_traces(handle: TrackingHandle | None, timeout: float | None = None) -> bool:
    """Wait, at most ``timeout`` s (default ``tracking.flush_timeout_s``), until the queued
    traces of ``handle``'s run are written; whether they all were."""
    with _SENDERS_LOCK:
        sender = _SENDERS.get(handle.run_id) if handle is not None else None
    if sender is None:
        return True
    return sender.flush(handle.flush_timeout_s if timeout is None else timeout)


def close_traces(handle: TrackingHandle | None, timeout: float | None = None) -> int:
    """The end of the run's traces: :func:`flush_traces`, then the thread stops; returns how
    many traces were left unwritten (warned about; they are not kept on disk)."""
    if handle is None:
        return 0
    with _SENDERS_LOCK:
        sender = _SENDERS.pop(handle.run_id, None)
    if sender is None:
        return 0
    left = sender.close(handle.flush_timeout_s if timeout is None else timeout)
    if left or sender.dropped:
        sender.say(f"tracking: {left + sender.dropped} episode traces of run {handle.run_id} "
                   f"did not reach {handle.tracking_uri} ({sender.sent} did)")
    return left
