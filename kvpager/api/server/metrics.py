"""Prometheus metrics of one server, in a registry of its own (no global registry state).

Gauges and counters are read from the engine's stats snapshot at scrape time (a custom collector),
so they can never drift from the engine's own counts. Latency histograms are observed by the
server when a request finishes. Every family exists twice: `kvpager:*` and, for dashboards and
autoscalers written for vLLM, under vLLM's own name (`vllm:*`, labels `model_name` and `engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpager.core.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# (metric name, help, stats field) for values read from EngineStats at scrape time.
_GAUGES = (
    ("kvpager:num_requests_running", "Requests in the running batch.", "num_running"),
    ("kvpager:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("kvpager:kv_cache_usage_perc", "Fraction of KV blocks owned by requests (0..1).", "kv_cache_usage"),
    ("kvpager:kv_blocks_owned", "KV blocks owned by requests (zero when idle).", "num_owned_blocks"),
    ("kvpager:kv_blocks_total", "KV blocks in the pool.", "num_blocks"),
)
_COUNTERS = (
    ("kvpager:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("kvpager:prefix_cache_hits", "Prompt tokens served by the prefix cache.", "prefix_cache_hits"),
    ("kvpager:num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    ("kvpager:prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
    ("kvpager:generation_tokens", "Tokens generated.", "generation_tokens_total"),
)


# kvpager name -> vLLM's name (same meaning and unit), for the families vLLM has.
VLLM_NAMES = {
    "kvpager:num_requests_running": "vllm:num_requests_running",
    "kvpager:num_requests_waiting": "vllm:num_requests_waiting",
    "kvpager:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "kvpager:prefix_cache_queries": "vllm:prefix_cache_queries",
    "kvpager:prefix_cache_hits": "vllm:prefix_cache_hits",
    "kvpager:num_preemptions": "vllm:num_preemptions",
    "kvpager:prompt_tokens": "vllm:prompt_tokens",
    "kvpager:generation_tokens": "vllm:generation_tokens",
}
VLLM_LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # vLLM's `engine` label: kvpager runs one engine per server


class _EngineStatsCollector(Collector):
    def __init__(self, get_stats: Callable[[], Any], model_name: str) -> None:
        self._get_stats = get_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        for name, help_text, field in _GAUGES:
            for family in self._families(GaugeMetricFamily, name, help_text):
                family.add_metric(self._labels(family), float(getattr(stats, field)))
                yield family
        for name, help_text, field in _COUNTERS:
            for family in self._families(CounterMetricFamily, name, help_text):
                family.add_metric(self._labels(family), float(getattr(stats, field)))
                yield family

    def _families(self, kind: Any, name: str, help_text: str) -> list[Any]:
        families = [kind(name, help_text, labels=["model_name"])]
        if name in VLLM_NAMES:
            families.append(kind(VLLM_NAMES[name], help_text, labels=VLLM_LABELS))
        return families

    def _labels(self, family: Metric) -> list[str]:
        return [self._model_name, ENGINE_INDEX] if family.name.startswith("vllm:") else [self._model_name]


# KV tier values (flat names of `KVTierStats.as_dict()`) that go up and down; the rest only grow.
_KV_GAUGE_SUFFIXES = ("bytes_held", "num_blocks", "pinned_blocks")


class _KVCollector(Collector):
    """`kvpager:kv_<name>` for every KV tier value and disaggregation counter (see `ServerMetrics`)."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self._metrics = metrics
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        values = dict(self._metrics.kv_tiers)
        if self._metrics.get_disagg is not None:
            values.update(self._metrics.get_disagg())
        for key, value in sorted(values.items()):
            name = f"kvpager:kv_{key}"
            help_text = f"KV tiers, packs and transfer: {key.replace('_', ' ')}."
            family: GaugeMetricFamily | CounterMetricFamily
            if key.endswith(_KV_GAUGE_SUFFIXES):
                family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            else:
                family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model_name], float(value))
            yield family


class _KernelCollector(Collector):
    """`kvpager:kernel_fallbacks{op, reason}`: calls of a CPU kernel op that ran in torch because a
    precondition failed (`ServerMetrics.kernel_fallbacks`, from the ops' `kernel_stats()`)."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self._metrics = metrics
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        help_text = "Calls of a CPU kernel op that ran in torch because a precondition failed."
        family = CounterMetricFamily("kvpager:kernel_fallbacks", help_text, labels=["model_name", "op", "reason"])
        for op, reasons in sorted(self._metrics.kernel_fallbacks.items()):
            for reason, calls in sorted(reasons.items()):
                family.add_metric([self._model_name, op, reason], float(calls))
        yield family


class ServerMetrics:
    """The metrics of one app: engine gauges/counters, KV tier values, request latency histograms.

    `kv_tiers` holds the latest `engine.kv_tier_stats().as_dict()` (the /metrics route refreshes
    it on the engine thread before rendering; the engine is not thread-safe); `get_disagg`, when
    set, returns the KV-fetch counters of a disaggregated decode server.
    """

    def __init__(
        self,
        get_stats: Callable[[], Any],
        model_name: str,
        get_disagg: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.kv_tiers: dict[str, float] = {}
        # {op: {reason: calls}}: the latest ops.kernel_stats()["fallbacks"], refreshed like kv_tiers
        self.kernel_fallbacks: dict[str, dict[str, int]] = {}
        self.get_disagg = get_disagg
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(get_stats, model_name))
        self.registry.register(_KVCollector(self, model_name))
        self.registry.register(_KernelCollector(self, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(
            "kvpager:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.tpot = Histogram(
            "kvpager:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "kvpager:e2e_request_latency_seconds",
            "End-to-end request latency (arrival to finish).",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        vllm = [model_name, ENGINE_INDEX]
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            VLLM_LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*vllm)
        self.vllm_itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            VLLM_LABELS,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        ).labels(*vllm)
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency (arrival to finish).",
            VLLM_LABELS,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(*vllm)
        self.vllm_success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            [*VLLM_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._vllm_labels = vllm

    def observe_finished(self, out: RequestOutput) -> None:
        """Record the latencies of a request that finished (aborted requests are skipped)."""
        if any(o.finish_reason == "abort" for o in out.outputs):
            return
        metrics = out.metrics
        ttft = metrics.ttft
        if ttft is not None:
            self.ttft.observe(ttft)
            self.vllm_ttft.observe(ttft)
        num_tokens = max((len(o.token_ids) for o in out.outputs), default=0)
        tpot = metrics.tpot(num_tokens)
        if tpot is not None:
            self.tpot.observe(tpot)
        for gap in metrics.inter_token_latencies:
            self.vllm_itl.observe(gap)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
            self.vllm_e2e.observe(metrics.finished_time - metrics.arrival_time)
        for o in out.outputs:
            self.vllm_success.labels(*self._vllm_labels, o.finish_reason or "stop").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
