"""``/metrics``: the server's counters in Prometheus' text format, named as vLLM names its own
(``vllm:...`` there, ``lm_eval_safe:...`` here), with SAFE's own beside them: ensemble
operations, drafted and accepted tokens, and E/T (ensembled per generated token).

A registry of its own, so two servers in one process (tests) never share counters.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from lm_eval_safe.decoder.stats import GenerationStats

PREFIX = "lm_eval_safe:"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Metrics:
    """Everything ``/metrics`` reports; the scheduler calls the ``on_*`` hooks."""

    def __init__(self, model_name: str, counts: Any):
        disable_created_metrics()  # no *_created series beside each counter (as vLLM)
        self.registry = CollectorRegistry()
        registry, labels = self.registry, ["model_name"]

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, text, [*labels, *extra], registry=registry)

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(PREFIX + name, text, labels, buckets=LATENCY_BUCKETS, registry=registry)

        self.model = model_name
        self.requests = counter(
            "request_success", "Requests finished, by reason (stop, length, abort, error)", ("finished_reason",)
        )
        self.http = counter("http_requests", "HTTP requests answered, by route and status", ("route", "status"))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens (the drafter's) of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (the drafter's)")
        self.ensemble_ops = counter("ensemble_ops", "SAFE ensemble operations")
        self.drafted_tokens = counter("drafted_tokens", "Tokens the drafter drafted")
        self.accepted_tokens = counter("accepted_tokens", "Drafted tokens accepted without ensembling")
        self.e2e = histogram("e2e_request_latency_seconds", "From arrival to the last token")
        self.queue = histogram("request_queue_time_seconds", "From arrival to joining the batch")
        self.first_token = histogram("time_to_first_token_seconds", "From arrival to the first text sent")
        self.batch_rows = Histogram(
            PREFIX + "batch_rows",
            "Requests decoded together, at each cycle's end",
            labels,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        running = Gauge(PREFIX + "num_requests_running", "Requests in the decoding batch", labels, registry=registry)
        waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for a row", labels, registry=registry)
        running.labels(model_name).set_function(lambda: counts()[0])
        waiting.labels(model_name).set_function(lambda: counts()[1])
        rate = Gauge(
            PREFIX + "ensemble_rate_percent",
            "E/T: ensemble operations per generated token, in percent, since the server started",
            labels,
            registry=registry,
        )
        rate.labels(model_name).set_function(self._ensemble_rate)
        self._tokens = 0
        self._ops = 0

    def _ensemble_rate(self) -> float:
        return 100.0 * self._ops / self._tokens if self._tokens else 0.0

    # -- scheduler hooks ---------------------------------------------------------------------
    def on_start(self, ticket: Any) -> None:
        self.queue.labels(self.model).observe(ticket.started - ticket.submitted)

    def on_first_text(self, ticket: Any) -> None:
        self.first_token.labels(self.model).observe(ticket.first_text - ticket.submitted)

    def on_end(self, ticket: Any, reason: str, stats: GenerationStats | None) -> None:
        model = self.model
        self.requests.labels(model, reason).inc()
        if stats is None:
            return
        self.e2e.labels(model).observe(time.perf_counter() - ticket.submitted)
        self.generation_tokens.labels(model).inc(stats.generated_tokens)
        self.ensemble_ops.labels(model).inc(stats.ensemble_ops)
        self.drafted_tokens.labels(model).inc(stats.drafted_tokens)
        self.accepted_tokens.labels(model).inc(stats.accepted_tokens)
        self._tokens += stats.generated_tokens
        self._ops += stats.ensemble_ops

    def on_cycle(self, rows: int) -> None:
        self.batch_rows.labels(self.model).observe(rows)

    def on_prompt(self, tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(tokens)

    def on_http(self, route: str, status: int) -> None:
        self.http.labels(self.model, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
