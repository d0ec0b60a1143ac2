"""OTLP spans: one per collective, grouped under one span per training step, per rank.

Every collective in ``view.new_records`` can become a span named after its op, with its real start
and end (``t_enter``/``t_exit``) and attributes ``dtwatch.op``, ``dtwatch.group``, ``dtwatch.seq``,
``dtwatch.bytes`` (numel x itemsize), ``dtwatch.dtype``, ``dtwatch.rank``, ``dtwatch.step``,
``code.filepath``, ``code.lineno``, ``code.function``; status ERROR if it raised. Its parent is the
*step span* of its rank: a record carries the step counter at entry, so the collectives with
``step == k`` happen between step marker ``k`` (written when step ``k`` completed) and marker ``k+1``.
Step span ``k`` (name ``step``, attribute ``dtwatch.step = k``) therefore runs from marker ``k`` (for
``k = 0`` or a marker not seen: its first collective's entry) to marker ``k+1``, and ends when that
marker arrives. With ``job_wide_traces`` (default) the trace id of step ``k`` is derived from (job id,
restart count, k), so every rank's step ``k`` - on every node - lands in one trace, side by side.
Each local rank has its own TracerProvider whose resource says ``service.name`` (``dtwatch`` unless
``OTEL_SERVICE_NAME``), ``service.instance.id`` (``<job>/rank-<r>``), ``dtwatch.job_id``,
``host.name``, ``dtwatch.node``, ``dtwatch.rank``, ``dtwatch.local_rank``, ``dtwatch.world_size``.

Which collectives become spans is :mod:`.sampling`'s decision; this module builds them.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode

from dtwatch.export.otel.resource import SCOPE, dtwatch_version
from dtwatch.export.otel.sampling import SpanSampling, StepStride, TokenBucket, select_calls
from dtwatch.ring import DTYPES, FLAG_ASYNC, FLAG_MARKER, OPS, RECORD_DTYPE, STATUS_ERROR, RankSnapshot, Record

if TYPE_CHECKING:
    from dtwatch.diagnose.rank_state import RankState
    from dtwatch.export.view import NodeView

MAX_OPEN_STEPS = 16  # step spans remembered per rank (open, or closed but parent of late children)
MAX_IN_FLIGHT_SPANS = 16  # in-flight calls reported per rank per stall


def step_trace_id(job_id: str, restart_count: int, step: int) -> int:
    """The trace id every rank (on every node) uses for step ``step`` of the job."""
    digest = hashlib.sha256(f"dtwatch/{job_id}/{restart_count}/{step}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1


class StepIds(IdGenerator):
    """Random ids, except the trace id of a step span when one is requested (job-wide traces)."""

    def __init__(self) -> None:
        self.random = RandomIdGenerator()
        self.next_trace_id = 0

    def generate_span_id(self) -> int:
        return self.random.generate_span_id()

    def generate_trace_id(self) -> int:
        if self.next_trace_id:
            return self.next_trace_id
        return self.random.generate_trace_id()


@dataclass
class Step:
    """What one rank's spans know about one of its steps."""

    number: int
    kept: bool  # chosen by the stride when first seen
    start: float | None = None  # time of marker `number` (None: not seen)
    first_enter: float = math.inf
    end: float | None = None  # time of marker `number + 1` once seen
    span: Span | None = None  # open step span
    context: SpanContext | None = None  # the step span's context (kept after it ended)
    seen: int = 0
    emitted: int = 0


def _ns(t: float) -> int:
    return int(round(t * 1e9))


class RankSpans:
    """Spans of one local rank: its TracerProvider, step spans and sampling state.

    ``processor`` carries the rank's spans to the exporter (a batch processor over a guarded OTLP
    exporter); ``update`` once per view, ``close_steps`` at the end.
    """

    def __init__(
        self, *, rank: int, job_id: str, restart_count: int, resource: Resource, sampling: SpanSampling,
        processor: SpanProcessor,
    ) -> None:
        self.rank = rank
        self.job_id = job_id
        self.sampling = sampling
        self.ids = StepIds()
        self.provider = TracerProvider(resource=resource, id_generator=self.ids, shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(SCOPE, dtwatch_version())
        cap = sampling.max_spans_per_second
        self.routine = TokenBucket(cap, cap * sampling.burst_seconds)
        self.priority = TokenBucket(cap, cap * sampling.burst_seconds)
        self.rate = StepStride(sampling)
        self.incarnation: tuple[int, float] | None = None
        self.restart_count = restart_count
        self.steps: OrderedDict[int, Step] = OrderedDict()
        self.marker_times: OrderedDict[int, float] = OrderedDict()
        self.reported: set[tuple[str, int]] = set()
        self.open: set[int] = set()  # steps whose span is open
        self.forgotten = -1  # steps up to this number were dropped from `steps` (late records: no parent)
        self.spans = 0  # spans started (collectives and steps)
        self.sampled_out = 0  # collectives not turned into spans

    # -- per view ------------------------------------------------------------------------------------
    def update(self, view: NodeView, state: RankState, recs: np.ndarray | None, snap: RankSnapshot | None) -> None:
        incarnation = (state.pid, state.start_time)
        if incarnation != self.incarnation:
            if self.incarnation is not None:
                self.close_steps(incomplete=True)
                self.steps.clear()
                self.open.clear()
                self.forgotten = -1
                self.marker_times.clear()
                self.reported.clear()
            self.incarnation, self.restart_count = incarnation, state.restart_count
        self.routine.refill(view.now)
        self.priority.refill(view.now)
        in_stall = view.incident_open and (state.rank in view.stalled_ranks or state.rank in view.culprit_ranks)
        if in_stall and snap is not None:
            self._in_flight(view, snap)  # first: the call a rank is stuck in matters most
        elif not view.incident_open:
            self.reported.clear()
        if recs is not None and len(recs) and recs.dtype == RECORD_DTYPE:
            self._records(view, recs, snap, in_stall)
        else:
            self.rate.observe(0, view.now)
        while len(self.steps) > MAX_OPEN_STEPS:
            _, old = self.steps.popitem(last=False)
            self.forgotten = max(self.forgotten, old.number)
            if old.span is not None:
                self._finish(old, old.end or old.first_enter, incomplete=old.end is None)

    def stride(self) -> int:
        return self.rate.stride()

    def _step(self, number: int, stride: int) -> Step | None:
        """The state of step ``number``, created on first sight; None for a step forgotten already."""
        st = self.steps.get(number)
        if st is None and number > self.forgotten:
            st = self.steps[number] = Step(number, kept=number % stride == 0, start=self.marker_times.get(number))
        return st

    def _records(self, view: NodeView, recs: np.ndarray, snap: RankSnapshot | None, in_stall: bool) -> None:
        marker = (recs["flags"] & FLAG_MARKER) != 0
        calls = np.flatnonzero(~marker & (recs["t_exit"] != 0.0))
        first_span = 0.0
        if self.rate.first and len(calls):  # the first view measures the rate over its records' own span
            done = recs[calls]
            first_span = float(done["t_exit"].max() - done["t_enter"].min())
        self.rate.observe(len(calls), view.now, first_span)
        stride = self.stride()
        selected = np.empty(0, dtype=np.int64)
        if len(calls):
            steps = recs["step"][calls].astype(np.int64)
            enters = recs["t_enter"][calls]
            order = np.argsort(steps, kind="stable")
            uniq, starts, counts = np.unique(steps[order], return_index=True, return_counts=True)
            first_enters = np.minimum.reduceat(enters[order], starts)
            kept = np.zeros(len(uniq), dtype=bool)
            per_step = zip(uniq.tolist(), counts.tolist(), first_enters.tolist(), strict=True)
            for i, (number, n, t0) in enumerate(per_step):
                st = self._step(number, stride)
                if st is not None:
                    st.seen += n
                    st.first_enter = min(st.first_enter, t0)
                    kept[i] = st.kept
            in_kept_step = kept[np.searchsorted(uniq, steps)]
            durations = recs["t_exit"][calls] - enters
            urgent = (durations >= self.sampling.slow_threshold) | (recs["status"][calls] == STATUS_ERROR)
            if in_stall:
                urgent[:] = True
            selected = select_calls(calls, in_kept_step, urgent, self.routine, self.priority)
            self.sampled_out += len(calls) - len(selected)
        events = np.sort(np.concatenate((selected, np.flatnonzero(marker))))
        for i in events.tolist():
            row = recs[i]
            if marker[i]:
                self._marker(int(row["step"]), float(row["t_enter"]), stride)
            else:
                self._collective(row, snap)

    def _marker(self, number: int, t: float, stride: int) -> None:
        self.marker_times[number] = t
        while len(self.marker_times) > 4 * MAX_OPEN_STEPS:
            self.marker_times.popitem(last=False)
        nxt = self.steps.get(number)
        if nxt is not None and nxt.start is None:
            nxt.start = t
        prev = self._step(number - 1, stride) if number >= 1 else None
        if prev is not None:
            prev.end = t if prev.end is None else prev.end
            if prev.span is None and prev.context is None and prev.kept and self.routine.take(1):
                self._open(prev)
            if prev.span is not None:
                self._finish(prev, t)
        for n in [n for n in self.open if n < number - 1]:  # steps whose own marker was lost (ring wrapped)
            st = self.steps[n]
            self._finish(st, st.end or t, incomplete=st.end is None)

    def _open(self, st: Step) -> None:
        start = st.start if st.start is not None else st.first_enter
        if not math.isfinite(start):
            start = st.end if st.end is not None else time.time()
        attrs = {"dtwatch.rank": self.rank, "dtwatch.step": st.number, "dtwatch.sampled": st.kept}
        st.span = self._root_span("step", st.number, attrs, start)
        st.context = st.span.get_span_context()
        self.open.add(st.number)
        self.spans += 1

    def _root_span(self, name: str, step: int, attrs: dict[str, Any], start: float) -> Span:
        """A span without parent; with job-wide traces, in the trace of ``step`` shared by all ranks."""
        if self.sampling.job_wide_traces:
            self.ids.next_trace_id = step_trace_id(self.job_id, self.restart_count, step)
        try:
            return self.tracer.start_span(
                name, context=Context(), kind=SpanKind.INTERNAL, attributes=attrs, start_time=_ns(start)
            )
        finally:
            self.ids.next_trace_id = 0

    def _finish(self, st: Step, end: float, incomplete: bool = False) -> None:
        span, st.span = st.span, None
        if span is None:
            return
        self.open.discard(st.number)
        span.set_attribute("dtwatch.collectives", st.seen)
        span.set_attribute("dtwatch.spans_dropped", max(0, st.seen - st.emitted))
        if incomplete:
            span.set_attribute("dtwatch.step_incomplete", True)
        span.end(end_time=_ns(end))

    def _parent(self, number: int) -> tuple[Step | None, Context | None]:
        """(step, context) for a child of step ``number``; (None, None) for a step forgotten long ago."""
        st = self.steps.get(number)
        if st is None:
            return None, None
        if st.context is None:
            self._open(st)
        assert st.context is not None
        return st, trace_api.set_span_in_context(NonRecordingSpan(st.context))

    def _child_span(self, rec: Record, ctx: Context | None, attrs: dict[str, Any]) -> Span:
        if ctx is None:  # a late completion of a forgotten step: a root span in that step's trace
            return self._root_span(rec.op, rec.step, attrs, rec.t_enter)
        return self.tracer.start_span(
            rec.op, context=ctx, kind=SpanKind.INTERNAL, attributes=attrs, start_time=_ns(rec.t_enter)
        )

    def _collective(self, row: np.void, snap: RankSnapshot | None) -> None:
        rec = snap.record(row) if snap is not None else unnamed_record(row)
        st, ctx = self._parent(rec.step)
        span = self._child_span(rec, ctx, call_attributes(rec, self.rank))
        if rec.status == STATUS_ERROR:
            span.set_status(Status(StatusCode.ERROR, "the collective raised"))
        span.end(end_time=_ns(rec.t_exit))
        self.spans += 1
        if st is not None:
            st.emitted += 1
            if st.end is not None and st.span is not None:  # a late child of a step already over
                self._finish(st, st.end)

    def _in_flight(self, view: NodeView, snap: RankSnapshot) -> None:
        """Calls a stalled rank is still inside: one span each, ending now, status ERROR."""
        for rec in snap.open_records()[-MAX_IN_FLIGHT_SPANS:]:
            key = (rec.group, rec.seq)
            if key in self.reported or not self.priority.take(1):
                continue
            self.reported.add(key)
            st = self._step(rec.step, self.stride())
            if st is not None:
                st.first_enter = min(st.first_enter, rec.t_enter)
            _, ctx = self._parent(rec.step)
            attrs = call_attributes(rec, self.rank)
            attrs.update({"dtwatch.in_flight": True, "dtwatch.stalled": True})
            span = self._child_span(rec, ctx, attrs)
            stuck_for = view.now - rec.t_enter
            span.set_status(Status(StatusCode.ERROR, f"still in flight after {stuck_for:.1f} s during a stall"))
            span.end(end_time=_ns(max(view.now, rec.t_enter)))
            self.spans += 1

    def close_steps(self, incomplete: bool) -> None:
        """End every open step span (at its last known time)."""
        for st in self.steps.values():
            if st.span is not None:
                end = st.end if st.end is not None else time.time()
                self._finish(st, end, incomplete=incomplete and st.end is None)


def call_attributes(rec: Record, rank: int) -> dict[str, Any]:
    """The span attributes of one collective call."""
    attrs: dict[str, Any] = {
        "dtwatch.op": rec.op, "dtwatch.group": rec.group, "dtwatch.seq": rec.seq,
        "dtwatch.bytes": rec.nbytes, "dtwatch.dtype": rec.dtype,
        "dtwatch.rank": rank, "dtwatch.step": rec.step, "dtwatch.async": bool(rec.flags & FLAG_ASYNC),
    }
    if rec.seq_span > 1:
        attrs["dtwatch.seq_span"] = rec.seq_span
    if rec.peer >= 0:
        attrs["dtwatch.peer"] = rec.peer
    if rec.site is not None:
        attrs.update({"code.filepath": rec.site.file, "code.lineno": rec.site.line, "code.function": rec.site.function})
    return attrs


def unnamed_record(row: np.void) -> Record:
    """A ring row as a :class:`~dtwatch.ring.Record` when its ring's tables are not at hand (a view
    without the rank's snapshot): the group is its slot number, call sites and shape are unknown."""
    return Record(
        stamp=int(row["stamp"]), seq=int(row["seq"]), seq_span=int(row["seq_span"]),
        op=_code_name(OPS, int(row["op"])), group=str(int(row["group"])), site=None,
        t_enter=float(row["t_enter"]), t_exit=float(row["t_exit"]), status=int(row["status"]),
        flags=int(row["flags"]), dtype=_code_name(DTYPES, int(row["dtype"])), shape=(),
        numel=int(row["numel"]), ntensors=int(row["ntensors"]), peer=int(row["peer"]), step=int(row["step"]),
    )


def _code_name(table: tuple[str, ...], code: int) -> str:
    return table[code] if code < len(table) else "unknown"
