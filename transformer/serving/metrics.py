"""The Prometheus metrics of one app, in a registry of its own (two apps in one process count apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("serve_requests", "HTTP requests answered, by path and status", ["path", "status"], registry=r)  # fmt: skip
        self.sentences = Counter("serve_sentences", "Sentences translated", registry=r)
        self.batch_sentences = Histogram("serve_batch_sentences", "Sentences per decoding batch (per step under continuous batching)", buckets=BATCH_BUCKETS, registry=r)  # fmt: skip
        self.latency = Histogram("serve_request_latency_seconds", "Time from arrival to answer of translate requests", buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.errors = Counter("serve_errors", "Requests refused or failed, by kind of problem", ["kind"], registry=r)
        self.queue = Gauge("serve_queue_requests", "Requests waiting to be decoded", registry=r)

    def batch(self, sentences: int) -> None:
        """A request-level batch decoded."""
        self.batch_sentences.observe(sentences)
        self.sentences.inc(sentences)

    def step(self, sentences: int) -> None:
        """A continuous-batching step ran: its batch size."""
        self.batch_sentences.observe(sentences)

    def text(self) -> bytes:
        return generate_latest(self.registry)
