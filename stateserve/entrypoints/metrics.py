"""Prometheus metrics for GET /metrics.

Engine-side numbers (queue lengths, cache use, token counters) are read at scrape time from the snapshot
the engine thread publishes after every step, so scraping never touches the engine. Latency histograms are
observed by the server as step updates reach each request. Every server has its own registry, so several
servers in one process (tests) do not collide. With data parallelism (several engine replicas) every engine-side
metric also has one sample per replica, labelled replica="0".."N-1", beside the unlabelled total."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_PREFIX = "stateserve:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# snapshot key -> (metric name without prefix, help); gauges are current values, counters only grow
_GAUGES = {
    "running": ("num_requests_running", "Sequences in the running batch."),
    "waiting": ("num_requests_waiting", "Sequences waiting to be admitted."),
    "kv_blocks_used": ("kv_cache_blocks_used", "KV cache blocks held by sequences."),
    "kv_blocks_total": ("kv_cache_blocks_total", "KV cache blocks in the pool."),
    "state_slots_used": ("state_slots_used", "Recurrent-state slots held by sequences."),
    "state_slots_total": ("state_slots_total", "Recurrent-state slots in the pool."),
}
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted (once per sample)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "preemptions": ("num_preemptions", "Sequences preempted (recomputed later) for lack of cache."),
}
# only with speculative decoding on (the engine's stats have these keys then)
_SPEC_COUNTERS = {
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Verify steps: a sequence's drafts checked in one forward."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict[str, int]],
                 replica_snapshots: Callable[[], list[dict[str, int]]] | None = None) -> None:
        self._snapshot, self._replica_snapshots = snapshot, replica_snapshots

    def collect(self) -> Iterable[Metric]:
        if self._replica_snapshots is None:
            snap, replicas = self._snapshot(), None
        else:  # one read of each replica: the total is the sum of exactly the samples shown
            replicas = self._replica_snapshots()
            snap = {}
            for r in replicas:
                for key, value in r.items():
                    snap[key] = snap.get(key, 0) + value
        for kind, table, always in ((GaugeMetricFamily, _GAUGES, False), (CounterMetricFamily, _COUNTERS, True),
                                    (CounterMetricFamily, _SPEC_COUNTERS, False)):
            for key, (name, doc) in table.items():
                if not always and key not in snap:  # a pure-attention model has no slots, an attention-free none
                    continue  # of blocks; speculative counters exist only with speculative decoding on
                if replicas is None:
                    yield kind(_PREFIX + name, doc, value=snap.get(key, 0))
                    continue
                family = kind(_PREFIX + name, doc, labels=["replica"])
                family.add_metric([], snap.get(key, 0))
                for i, r in enumerate(replicas):
                    family.add_metric([str(i)], r.get(key, 0))
                yield family


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, snapshot: Callable[[], dict[str, int]],
                 replica_snapshots: Callable[[], list[dict[str, int]]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(snapshot, replica_snapshots))
        self.time_to_first_token = Histogram(
            _PREFIX + "time_to_first_token_seconds", "From request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            _PREFIX + "inter_token_latency_seconds", "Between consecutive tokens of one sequence.",
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram(
            _PREFIX + "e2e_request_latency_seconds", "From request arrival to its last token.",
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.requests = Counter(_PREFIX + "request_success", "Finished sequences by finish reason.",
                                labelnames=["finished_reason"], registry=self.registry)
        self.rejected = Counter(_PREFIX + "request_rejected", "Requests answered with an error, by status.",
                                labelnames=["status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds one request's token arrival times into the histograms."""

    def __init__(self, metrics: ServerMetrics | None, arrival: float) -> None:
        self.metrics, self.arrival = metrics, arrival
        self.first_seen = False
        self.last_token_time: dict[int, float] = {}  # per choice index

    def on_tokens(self, choice: int, num_tokens: int, when: float) -> None:
        if self.metrics is None or num_tokens == 0:
            return
        if not self.first_seen:
            self.first_seen = True
            self.metrics.time_to_first_token.observe(max(0.0, when - self.arrival))
        last = self.last_token_time.get(choice)
        if last is not None:
            gap = max(0.0, when - last) / num_tokens
            for _ in range(num_tokens):
                self.metrics.inter_token_latency.observe(gap)
        self.last_token_time[choice] = when

    def on_finish(self, reason: str | None, when: float) -> None:
        if self.metrics is None:
            return
        self.metrics.requests.labels(finished_reason=reason or "unknown").inc()
        self.metrics.e2e_latency.observe(max(0.0, when - self.arrival))
