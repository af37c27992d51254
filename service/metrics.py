"""Prometheus metrics of the serving host (text exposition via `prometheus_client`).

Request counts and latencies are recorded as they happen; lane state (restarts, strikes,
quarantines) and queue depth are read from the module and scheduler at scrape time, so a
scrape never talks to a worker and can never disagree with `/health`.

Compile-cache hits, misses and bytes come from the Core ML lanes' cached PONG (`cache_hits`,
`cache_misses`: counted by each worker since it started, summed over lanes; `cache_bytes`:
the cache's size after a worker's last admission, the largest reported). PONG rather than
SHAPE_ADMITTED because LOAD admits its shapes without one; rather than the host opening the
cache index, because a scrape must stay cheap and the hit/miss events happen in the workers.
A replaced worker starts counting from 0 again, which Prometheus reads as a counter reset.
Restarts and quarantines are counted per lane id across loads: what a lane counted before it
was unloaded (by the memory budget, keep_alive or an operator) is added to its next load's.

Each `Metrics` owns its registry: two servers in one process (tests) never share counters.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from host.module import Module
from service.scheduler import BatchStats, Scheduler

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    120.0,
)
_ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


# The response header naming the lane that computed an answer (embeddings, rerank).
LANE_HEADER = "x-synapse-lane"


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        module: Callable[[], Module | None],
        scheduler: Callable[[], Scheduler | None],
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "synapse_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "synapse_http_request_duration_seconds",
            "HTTP request latency",
            ["endpoint", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "synapse_http_requests_in_flight",
            "HTTP requests received and not yet answered",
            registry=r,
        )
        self.errors = Counter(
            "synapse_errors", "Typed errors answered, by code", ["code"], registry=r
        )
        self.batch_items = Histogram(
            "synapse_batch_items",
            "Inputs per coalesced embedding batch",
            ["model"],
            buckets=_ITEM_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "synapse_batch_tokens",
            "Tokens per coalesced embedding batch",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "synapse_batch_requests",
            "HTTP requests coalesced into one batch",
            ["model"],
            buckets=_ITEM_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "synapse_batch_duration_seconds",
            "Time a batch spends in the worker",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Per lane: a model served by two lanes routes each request to one of them.
        self.lane_requests = Counter(
            "synapse_lane_requests",
            "Embedding and rerank requests answered, by model and the lane that computed them",
            ["model", "lane"],
            registry=r,
        )
        self.lane_items = Counter(
            "synapse_lane_items",
            "Inputs (texts, documents) answered, by model and the lane that computed them",
            ["model", "lane"],
            registry=r,
        )
        # Failed authentications by reason ("missing" | "invalid"): never key material.
        self.auth_failures = Counter(
            "synapse_auth_failures",
            "Requests refused with 401, by reason",
            ["reason"],
            registry=r,
        )
        r.register(_StateCollector(module, scheduler))
        # Label children, looked up once: `labels()` takes a lock and builds a key on every
        # call, on the path of every request and batch. Endpoints are a fixed set, statuses
        # and models a few, so these stay small.
        self._request_children: dict[tuple[str, int], tuple] = {}
        self._batch_children: dict[str, tuple] = {}  # model -> its batch histograms

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        children = self._request_children.get((endpoint, status))
        if children is None:
            code = str(status)
            children = self._request_children[(endpoint, status)] = (
                self.requests.labels(endpoint, code),
                self.latency.labels(endpoint, code),
            )
        children[0].inc()
        children[1].observe(seconds)

    def observe_lane(self, model: str, lane: str, items: int) -> None:
        if lane:
            self.lane_requests.labels(model, lane).inc()
            self.lane_items.labels(model, lane).inc(items)

    def observe_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def observe_auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def observe_batch(self, stats: BatchStats) -> None:
        children = self._batch_children.get(stats.model)
        if children is None:
            children = self._batch_children[stats.model] = tuple(
                h.labels(stats.model)
                for h in (self.batch_items, self.batch_tokens, self.batch_requests,
                          self.batch_seconds)
            )  # fmt: skip
        items, tokens, requests, seconds = children
        items.observe(stats.items)
        tokens.observe(stats.tokens)
        requests.observe(stats.requests)
        seconds.observe(stats.seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Lane and queue state, read at scrape time from cached values only."""

    def __init__(
        self,
        module: Callable[[], Module | None],
        scheduler: Callable[[], Scheduler | None],
    ) -> None:
        self._module = module
        self._scheduler = scheduler

    def collect(self) -> Iterator:
        restarts = CounterMetricFamily(
            "synapse_worker_restarts", "Worker processes replaced after a fault", labels=["lane"]
        )
        quarantines = CounterMetricFamily(
            "synapse_lane_quarantines", "Times a lane entered quarantine", labels=["lane"]
        )
        strikes = GaugeMetricFamily(
            "synapse_lane_strikes", "Consecutive faults of the lane", labels=["lane"]
        )
        quarantined = GaugeMetricFamily(
            "synapse_lane_quarantined", "1 while the lane is quarantined", labels=["lane"]
        )
        up = GaugeMetricFamily(
            "synapse_lane_up", "1 while the lane's worker is ready or busy", labels=["lane"]
        )
        depth = GaugeMetricFamily(
            "synapse_queue_depth", "Embedding inputs queued, not yet batched", labels=["model"]
        )
        inflight = GaugeMetricFamily(
            "synapse_inflight_tokens", "Tokens admitted and not yet answered"
        )
        rejected = CounterMetricFamily(
            "synapse_overload_rejections", "Requests refused with 429 by a budget or queue bound"
        )
        cache_hits = CounterMetricFamily(
            "synapse_compile_cache_hits", "Compiled shapes found in the compile cache"
        )
        cache_misses = CounterMetricFamily(
            "synapse_compile_cache_misses", "Shapes compiled because the cache missed"
        )
        cache_bytes = GaugeMetricFamily(
            "synapse_compile_cache_bytes", "Compile-cache size after the last admission"
        )
        module, scheduler = self._module(), self._scheduler()
        n_rejected = 0
        hits = misses = size = 0
        if module is not None:
            # Counters add what the lane's earlier loads counted before they were unloaded, so
            # they never go back (or vanish) when the memory budget or keep_alive unloads one.
            n_restarts = collections.Counter(module.retired_restarts)
            n_quarantines = collections.Counter(module.retired_quarantines)
            for served in module.served_lanes():
                state = served.supervisor.state()
                pong = state.health.last_pong or {}
                hits += pong.get("cache_hits") or 0
                misses += pong.get("cache_misses") or 0
                size = max(size, pong.get("cache_bytes") or 0)
                lid = [state.lane_id]
                n_restarts[state.lane_id] += state.restarts
                n_quarantines[state.lane_id] += getattr(served.supervisor, "quarantines", 0)
                strikes.add_metric(lid, state.strikes)
                quarantined.add_metric(lid, int(state.quarantined))
                up.add_metric(lid, int(state.health.status in ("ready", "busy")))
            for lane_id in sorted(n_restarts.keys() | n_quarantines.keys()):
                restarts.add_metric([lane_id], n_restarts[lane_id])
                quarantines.add_metric([lane_id], n_quarantines[lane_id])
            inflight.add_metric([], module.admission.inflight_tokens)
            n_rejected += module.admission.rejected
        if scheduler is not None:
            for model, n in scheduler.queue_depth().items():
                depth.add_metric([model], n)
            n_rejected += scheduler.rejected
        rejected.add_metric([], n_rejected)
        cache_hits.add_metric([], hits)
        cache_misses.add_metric([], misses)
        cache_bytes.add_metric([], size)
        yield from (
            restarts,
            quarantines,
            strikes,
            quarantined,
            up,
            depth,
            inflight,
            rejected,
            cache_hits,
            cache_misses,
            cache_bytes,
        )
