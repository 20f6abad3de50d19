"""Prometheus metrics for `GET /metrics`, with vLLM's names under the `provider:` namespace.

Latency histograms are observed when each job ends (on the engine thread: prometheus_client is thread-safe);
everything else — running and waiting requests, token and speculation totals, model load times, the memory
budget — is read from one `NodeStatus` at scrape time, so /metrics, /health, heartbeats and
`provider status` can never disagree.

prometheus_client is imported when the node is made.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from . import __version__
from .outputs import Done
from .status import NodeStatus

NS = "provider:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, status: Callable[[], NodeStatus]):
        # Made here, not at the first job's end: importing prometheus_client on the engine thread, as a job ended,
        # lost a job's terminal event in tests/test_job_life_property.py (a race not found yet; see its notes).
        self._status = status
        self._made = threading.Lock()
        self.registry = None
        self._histograms()

    def _histograms(self) -> None:
        with self._made:
            if self.registry is not None:
                return
            from prometheus_client import CollectorRegistry, Histogram

            registry = CollectorRegistry(auto_describe=True)
            labels = ["model_name"]
            self.ttft = Histogram(NS + "time_to_first_token_seconds", "Arrival to first token.", labels,
                                  buckets=LATENCY_BUCKETS, registry=registry)
            self.itl = Histogram(NS + "inter_token_latency_seconds", "Time between tokens (a job's mean, per gap).",
                                 labels, buckets=LATENCY_BUCKETS, registry=registry)
            self.e2e = Histogram(NS + "e2e_request_latency_seconds", "Arrival to the end of the job.", labels,
                                 buckets=LATENCY_BUCKETS, registry=registry)
            registry.register(_StatusCollector(self._status, time.time()))
            self.registry = registry

    def job_ended(self, done: Done, model_id: str) -> None:
        if self.registry is None:
            self._histograms()
        t = done.telemetry
        if t.ttft_ms is not None:
            self.ttft.labels(model_id).observe(t.ttft_ms / 1000)
        gaps = done.usage.completion_tokens - 1
        if t.decode_tokens_per_s and gaps > 0:
            child = self.itl.labels(model_id)
            for _ in range(gaps):
                child.observe(1 / t.decode_tokens_per_s)
        self.e2e.labels(model_id).observe(t.total_ms / 1000)

    def ttft_buckets(self) -> list[tuple[float, float]]:
        """The time-to-first-token histogram over every model: (upper bound in seconds, cumulative count), +Inf
        last, as /metrics exposes it (the page's TTFT quantiles are computed from it as Prometheus would)."""
        sums: dict[float, float] = {}
        for family in self.ttft.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    sums[le] = sums.get(le, 0.0) + s.value
        return sorted(sums.items())

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        if self.registry is None:
            self._histograms()
        return generate_latest(self.registry)


class _StatusCollector:
    def __init__(self, status: Callable[[], NodeStatus], started: float):
        self._status = status
        self._started = started

    def describe(self):
        return []  # dynamic: families come from the status at scrape time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._status()
        c, m = st.counters, st.memory

        def gauge(name, doc, value):
            return GaugeMetricFamily(NS + name, doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(NS + name, doc, value=value)

        info = GaugeMetricFamily(NS + "node_info", "The node's version and backend (always 1).",
                                 labels=["version", "backend"])
        info.add_metric([__version__, st.platform.backend], 1)
        yield info
        yield gauge("node_start_time_seconds", "When the node started (unix time).", self._started)
        yield gauge("num_requests_running", "Jobs running now.", st.active_jobs)
        yield gauge("num_requests_waiting", "Jobs queued.", st.queued_jobs)
        yield gauge("num_requests_waiting_for_memory", "Queued jobs whose KV does not fit yet.",
                    st.queue.waiting_for_memory)
        yield counter("prompt_tokens", "Prompt tokens of finished jobs.", c.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens of finished jobs.", c.tokens_generated)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      st.queue.prefix_hit_tokens)
        yield counter("prefix_cache_disk_hit_tokens", "Of them, tokens read back from the prefix cache's disk tier.",
                      st.queue.prefix_disk_tokens)
        if st.prefix_disk is not None:
            d = st.prefix_disk
            yield gauge("prefix_cache_disk_bytes", "Bytes the prefix cache's disk tier holds.", d.bytes)
            yield counter("prefix_cache_disk_written_bytes", "Bytes written to the disk tier.", d.bytes_written)
            yield gauge("prefix_cache_disk_write_bytes_per_hour", "Disk tier writes per hour since start.",
                        d.write_bytes_per_hour)
            yield counter("prefix_cache_disk_refused_files", "Disk tier files refused (corrupt): deleted.",
                          d.refused_files)
        yield counter("request_success", "Jobs that ended with a finish reason other than cancelled.",
                      c.jobs_completed)
        yield counter("request_failure", "Jobs that ended with an error.", c.jobs_failed)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", c.spec_drafted)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", c.spec_accepted)
        yield counter("spec_decode_num_drafts", "Speculative rounds, each one target forward.", c.spec_target_forwards)
        yield counter("proofs", "Outcomes that carried a proof (docs/verification.md).", c.proofs_made)
        verdicts = CounterMetricFamily(NS + "verify_verdicts", "Verify jobs run on other nodes' claims, by verdict.",
                                       labels=["verdict"])
        verdicts.add_metric(["passed"], c.verify_passed)
        verdicts.add_metric(["failed"], c.verify_jobs - c.verify_passed)
        yield verdicts
        load = GaugeMetricFamily(NS + "model_load_seconds", "How long each resident model took to load.",
                                 labels=["model_name"])
        for model in st.models:
            if model.load_seconds is not None:
                load.add_metric([model.id], model.load_seconds)
        yield load
        resident = GaugeMetricFamily(NS + "model_resident", "1 for each model loaded now, 0 for one served on demand.",
                                     labels=["model_name"])
        booked = GaugeMetricFamily(NS + "model_memory_bytes", "Budget each loaded model holds (weights, drafter, "
                                   "activations).", labels=["model_name"])
        jobs = GaugeMetricFamily(NS + "model_requests_running", "Jobs running on each loaded model.",
                                 labels=["model_name"])
        for model in st.models:
            resident.add_metric([model.id], 1 if model.resident else 0)
            if model.state != "available":
                booked.add_metric([model.id], model.bytes)
                jobs.add_metric([model.id], model.active_jobs)
        yield resident
        yield booked
        yield jobs
        yield counter("request_cancelled", "Jobs that ended cancelled.", c.jobs_cancelled)
        yield gauge("memory_budget_bytes", "Usable memory budget.", m.usable_bytes)
        yield gauge("memory_used_bytes", "Budget held by models, jobs' KV and prefix caches.", m.reserved_bytes)
        yield gauge("memory_free_bytes", "Budget free.", m.free_bytes)
        yield gauge("memory_models_bytes", "Of it, loaded models' weights, drafters and activations.", m.models_bytes)
        yield gauge("memory_jobs_kv_bytes", "Of it, the running jobs' KV.", m.jobs_kv_bytes)
        yield gauge("memory_prefix_cache_bytes", "Of it, KV kept in memory for prefix reuse.", m.prefix_cache_bytes)
        yield gauge("memory_mlx_active_bytes", "What MLX holds now (mx.get_active_memory).", m.mlx_active_bytes)
        yield gauge("memory_unaccounted_bytes", "What MLX holds beyond the ledger; admission counts it as used.",
                    m.unaccounted_bytes)
