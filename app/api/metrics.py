"""`GET /metrics` in Prometheus' text format (prometheus-client): what an operator graphs and alerts on.

    llama_requests_total{outcome}            replies ended: done, cancelled, failed
    llama_prompt_tokens_total                prompt tokens of those replies (and how many came from the cache)
    llama_prompt_tokens_cached_total
    llama_generated_tokens_total
    llama_time_to_first_token_seconds        histogram, per reply
    llama_decode_tokens_per_second           histogram, per reply (replies of two tokens or more)
    llama_requests_running / _waiting        now: sequences in the engine's batch, and waiting for a place
    llama_kv_cache_bytes, llama_kv_caches_kept   now: KV cache memory written, and finished replies' caches kept
    llama_places_taken                       now: places in the web side's queue taken (n for a request of n)
    llama_engine_restarts_total              engine processes started again after one stopped
    llama_stored_bytes{part}                 now: bytes on disk: history (the database), history_files, uploads
                                             (measured by app.web.uploads' sweep, every 30 s; the chat app only)

Replies are counted as the backend hands their last event to the web side (`observe`); the gauges are
read from the backend when scraped. Each Metrics has its own registry, so a process may hold several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from app.messages import Done, EngineStats, Event, Failed

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SPEED_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 250)


class Metrics:
    def __init__(self, stats=lambda: EngineStats(), backend=None, stored=dict):
        """stats: returns the backend's EngineStats now (read at each scrape); backend: its places_taken and
        restarts are read at each scrape too; stored: returns the bytes on disk by part, as last measured."""
        self.registry = CollectorRegistry()
        self._stats = stats
        self._backend = backend
        self._stored = stored
        self.requests = Counter("llama_requests", "Replies ended, by outcome", ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter("llama_prompt_tokens", "Prompt tokens of ended replies", registry=self.registry)
        self.cached_tokens = Counter("llama_prompt_tokens_cached",
                                     "Prompt tokens whose keys and values came from the prefix cache",
                                     registry=self.registry)
        self.generated_tokens = Counter("llama_generated_tokens", "Tokens generated", registry=self.registry)
        self.ttft = Histogram("llama_time_to_first_token_seconds", "From the engine receiving a request to its "
                              "first token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.speed = Histogram("llama_decode_tokens_per_second", "Decode speed of a reply",
                               buckets=SPEED_BUCKETS, registry=self.registry)
        self.registry.register(_Gauges(self))

    def observe(self, event: Event) -> None:
        """Count a reply's last event (Done or Failed); other events are ignored."""
        if isinstance(event, Failed):
            self.requests.labels("failed").inc()
        elif isinstance(event, Done):
            s = event.stats
            self.requests.labels("cancelled" if event.finish_reason == "cancelled" else "done").inc()
            self.prompt_tokens.inc(s.prompt_tokens)
            self.cached_tokens.inc(s.reused_tokens)
            self.generated_tokens.inc(s.new_tokens)
            if s.new_tokens:
                self.ttft.observe(s.time_to_first_token)
            if s.tokens_per_second:
                self.speed.observe(s.tokens_per_second)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges:
    """The engine's state, read at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics._stats()
        for name, text, value in [
            ("llama_requests_running", "Sequences in the engine's batch", stats.running),
            ("llama_requests_waiting", "Sequences waiting for a place in the batch", stats.waiting),
            ("llama_kv_cache_bytes", "KV cache memory written, running and kept", stats.kv_cache_bytes),
            ("llama_kv_caches_kept", "Finished replies' KV caches kept for reuse", stats.kept_caches),
        ]:
            yield GaugeMetricFamily(name, text, value=value)
        backend = self.metrics._backend
        if backend is not None:
            yield GaugeMetricFamily("llama_places_taken", "Places in the queue taken by requests running or waiting "
                                    "(a request for n replies takes n)", value=backend.places_taken)
            yield CounterMetricFamily("llama_engine_restarts", "Engine processes started again after one stopped",
                                      value=backend.restarts)
        if stored := self.metrics._stored():
            family = GaugeMetricFamily("llama_stored_bytes", "Bytes on disk: the history database, its files, "
                                       "uploads", labels=["part"])
            for part, size in sorted(stored.items()):
                family.add_metric([part], size)
            yield family
