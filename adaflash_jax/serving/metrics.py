"""GET /metrics: the server's state and latencies in Prometheus text (prometheus-client).

Each server has its own registry (several servers in one process, as in tests and
the load benchmark, never mix their counts). Gauges of the scheduler's state
(queue depth, slots running and free, per-engine drafted-step fraction and mean
τ) are read when scraped; counters and histograms are fed as requests finish and
as the decode thread routes tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: TTFT spans a prefill behind a queue; inter-token spans one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _SchedulerCollector:
    """Reads the scheduler's state at scrape time (no bookkeeping in the decode loop)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        s = self.scheduler
        queue = GaugeMetricFamily("adaflash_queue_depth", "Requests waiting for a decode slot")
        queue.add_metric([], s.waiting)
        yield queue
        running = GaugeMetricFamily("adaflash_slots_running", "Decode slots holding a request", labels=["engine"])
        free = GaugeMetricFamily("adaflash_slots_free", "Decode slots free", labels=["engine"])
        drafted = GaugeMetricFamily("adaflash_drafted_step_fraction",
                                    "Fraction of decode steps that ran the drafter", labels=["engine"])
        tau = GaugeMetricFamily("adaflash_mean_tau",
                                "Mean tokens committed per request per decode step (tau)", labels=["engine"])
        for mode, stats in s.pool_stats().items():
            running.add_metric([mode], stats["running"])
            free.add_metric([mode], stats["free"])
            drafted.add_metric([mode], stats["drafted_step_fraction"])
            tau.add_metric([mode], stats["mean_tau"])
        yield from (running, free, drafted, tau)


class ServerMetrics:
    """The counters and histograms one server feeds, in their own registry."""

    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.requests = Counter("adaflash_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("adaflash_time_to_first_token_seconds", "Submission to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("adaflash_inter_token_latency_seconds",
                             "Time per token after the first (a step's gap shared by the tokens it committed)",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.tokens = Counter("adaflash_generated_tokens", "Tokens generated", registry=self.registry)
        self.registry.register(_SchedulerCollector(scheduler))

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(int(status))).inc()

    def emitted(self, count: int, since_submit: float, since_last: float | None) -> None:
        """`count` tokens arrived: the request's first chunk `since_submit` s after submission
        (since_last None: TTFT), a later one `since_last` s after the previous chunk (each of its
        tokens took since_last / count)."""
        if count <= 0:
            return
        self.tokens.inc(count)
        if since_last is None:
            self.ttft.observe(since_submit)
            return
        for _ in range(count):
            self.itl.observe(since_last / count)

    def text(self) -> bytes:
        return generate_latest(self.registry)
