"""One decoding thread for every client: requests join the running batch at a cycle's end.

The HTTP side runs on an asyncio loop; the members' forwards run here, on one thread that owns
them, through :meth:`~lm_eval_safe.decoder.loop.SafeDecoder.serve` (the batch driver lm-eval's
``generate_until`` uses, fed from a queue instead of a list). A request that arrives while
others decode waits at most one cycle before it joins them; a finished or cancelled one leaves
at the cycle's end, and its row goes to the next in the queue, so no client waits for another's
batch to finish (vLLM's continuous batching, at SAFE's cycle granularity).

Anything else that must touch the members (scoring a text for ``logprobs``) is handed to the
same thread and runs between two cycles, so a member's caches are only ever used by one thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from lm_eval_safe.decoder.loop import GenerationJob, SafeDecoder
from lm_eval_safe.decoder.stats import GenerationStats
from lm_eval_safe.serve.streaming import SettledText

logger = logging.getLogger("lm_eval_safe.serve")


@dataclass
class Update:
    """What the decoding thread tells a request's waiter: a settled piece of text (``delta``),
    the end (``done``: the final text and its statistics), or a failure (``error``)."""

    delta: str = ""
    done: bool = False
    text: str = ""
    stats: GenerationStats | None = None
    error: Exception | None = None


Sink = Callable[[Update], None]


@dataclass
class Ticket:
    """One request in the scheduler, from submission to its last update."""

    job: GenerationJob
    sink: Sink
    stream: bool
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_text: float | None = None
    settled: SettledText | None = None
    cancelled: bool = False


class SchedulerClosed(RuntimeError):
    """The server is shutting down and takes no more requests."""


class Scheduler:
    """The request queue, the decoding thread, and what each request has been sent.

    ``rows``: requests decoded together at most (the batch's rows); the rest wait in order."""

    def __init__(self, decoder: SafeDecoder, rows: int, observer: Any = None):
        self.decoder = decoder
        self.rows = max(1, rows)
        self.observer = observer  # metrics (:class:`~lm_eval_safe.serve.metrics.Metrics`)
        self._lock = threading.Condition()
        self._waiting: deque[int] = deque()
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()
        self._tickets: dict[int, Ticket] = {}
        self._running: set[int] = set()
        self._ids = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None  # what stopped the thread, if anything did

    # -- the HTTP side ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lm-eval-safe-decoder", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: GenerationJob, sink: Sink, stream: bool = False) -> int:
        """Queue one request; ``sink`` receives its updates on the decoding thread."""
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            rid = next(self._ids)
            ticket = Ticket(job, sink, stream)
            if stream:
                ticket.settled = SettledText(job.until)
            self._tickets[rid] = ticket
            self._waiting.append(rid)
            self._lock.notify_all()
        return rid

    def cancel(self, rid: int) -> None:
        """The client is gone: a waiting request is dropped at once, a running one leaves the
        batch at the cycle's end (its batch-mates' texts do not change)."""
        with self._lock:
            ticket = self._tickets.get(rid)
            if ticket is None:
                return
            ticket.cancelled = True
            if rid in self._waiting:
                self._waiting.remove(rid)
                del self._tickets[rid]
                self._end(ticket, "abort")

    def call(self, work: Callable[[], Any]) -> Future:
        """Run ``work`` on the decoding thread between two cycles; its result in a future."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down")
            self._tasks.append((work, future))
            self._lock.notify_all()
        return future

    def counts(self) -> tuple[int, int]:
        """(requests decoding, requests waiting for a row)."""
        with self._lock:
            return len(self._running), len(self._waiting)

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests; cancel what is left, let the thread finish its cycle, end."""
        with self._lock:
            self._closed = True
            for rid in list(self._waiting):
                ticket = self._tickets.pop(rid)
                self._end(ticket, "abort")
            self._waiting.clear()
            for rid in self._running:
                self._tickets[rid].cancelled = True
            for _, future in self._tasks:
                future.set_exception(SchedulerClosed("the server is shutting down"))
            self._tasks.clear()
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the decoding thread (RequestSource for the batch driver) ----------------------------
    def take(self, wait: bool) -> int | None:
        while True:
            self._run_tasks()
            with self._lock:
                if self._waiting:
                    rid = self._waiting.popleft()
                    self._running.add(rid)
                    ticket = self._tickets[rid]
                    ticket.started = time.perf_counter()
                    if self.observer is not None:
                        self.observer.on_start(ticket)
                    return rid
                if not wait or self._closed:
                    return None
                if not self._tasks:
                    self._lock.wait()

    def cancelled(self, index: int) -> bool:
        with self._lock:
            ticket = self._tickets[index]
            if not ticket.cancelled:
                return False
            self._running.discard(index)
            del self._tickets[index]
        self._end(ticket, "abort")
        return True

    def between_cycles(self) -> None:
        if self.observer is not None and self._running:
            self.observer.on_cycle(len(self._running))
        self._run_tasks()

    def _run_tasks(self) -> None:
        while True:
            with self._lock:
                if not self._tasks:
                    return
                work, future = self._tasks.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except Exception as exc:
                future.set_exception(exc)

    def _job_of(self, rid: int) -> GenerationJob:
        with self._lock:
            return self._tickets[rid].job

    def _on_text(self, rid: int, text: str) -> None:
        ticket = self._tickets[rid]
        if ticket.settled is None:
            return
        delta = ticket.settled.update(text)
        if delta:
            self._first_text(ticket)
            ticket.sink(Update(delta=delta))

    def _first_text(self, ticket: Ticket) -> None:
        if ticket.first_text is None:
            ticket.first_text = time.perf_counter()
            if self.observer is not None:
                self.observer.on_first_text(ticket)

    def _on_done(self, rid: int, result: tuple[str, GenerationStats]) -> None:
        text, stats = result
        with self._lock:
            ticket = self._tickets.pop(rid)
            self._running.discard(rid)
        try:
            delta = ticket.settled.finish(text) if ticket.settled is not None else ""
        except Exception as exc:  # a stream that cannot be completed faithfully is an error
            self._on_error_ticket(ticket, exc)
            return
        self._first_text(ticket)
        self._end(ticket, "stop" if stats.stopped_requests else "length", stats)
        ticket.sink(Update(delta=delta, done=True, text=text, stats=stats))

    def _on_error(self, rid: int, exc: Exception) -> None:
        with self._lock:
            ticket = self._tickets.pop(rid)
            self._running.discard(rid)
        self._on_error_ticket(ticket, exc)

    def _on_error_ticket(self, ticket: Ticket, exc: Exception) -> None:
        logger.error("request failed while decoding: %s: %s", type(exc).__name__, exc)
        self._end(ticket, "error")
        ticket.sink(Update(done=True, error=exc))

    def _end(self, ticket: Ticket, reason: str, stats: GenerationStats | None = None) -> None:
        """Count the request's end (before its waiter hears of it: a client that reads the
        metrics after its response finds its request in them)."""
        if self.observer is not None:
            self.observer.on_end(ticket, reason, stats)
        if reason == "abort":
            ticket.sink(Update(done=True, error=RequestCancelled()))

    def _run(self) -> None:
        """Decode until closed. A failure of the batch itself (not of one request's own steps)
        fails the requests in it, and decoding starts again on a fresh batch."""
        while True:
            try:
                self.decoder.serve(
                    self,
                    self._job_of,
                    self.rows,
                    on_done=self._on_done,
                    on_error=self._on_error,
                    on_text=self._on_text,
                )
                return
            except Exception as exc:
                logger.exception("the decoding batch failed; its requests fail, the server goes on")
                with self._lock:
                    running = [self._tickets.pop(rid) for rid in self._running]
                    self._running.clear()
                for ticket in running:
                    self._on_error_ticket(ticket, exc)
            except BaseException as exc:  # kept for /health, then re-raised
                self.failed = exc
                raise


class RequestCancelled(Exception):
    """The request left before it finished (its client disconnected, or the server stopped)."""
