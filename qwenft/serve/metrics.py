"""The server's Prometheus metrics: vLLM's names where vLLM has one, under ``qwenft:``, and the inference monitor.

Every series carries a ``model`` label (``base`` or the tuned model's id). The registry is made per app
(:class:`ServeMetrics`), never prometheus_client's global one: two apps in one process (the tests) would collide
("Duplicated timeseries", prometheus/client_python#626). Labels of both models are created when the app starts,
so ``/metrics`` lists every series before the first request (the dashboard and the alert rules find them).

vLLM's names (``vllm/v1/metrics/loggers.py``): ``prompt_tokens_total``, ``generation_tokens_total``,
``request_success_total{finished_reason}``, ``num_requests_running``, ``num_requests_waiting``,
``time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``. The monitor
(the Qwen2.5 inference write-up's dashboard): ``token_entropy_nats`` (one observation per generated token, nats, of
the distribution it was drawn from), ``decode_tokens_per_second`` (of the last batch), ``kv_cache_usage_bytes`` /
``kv_cache_capacity_bytes``, ``peak_memory_bytes`` / ``memory_capacity_bytes``, and the alert floor
``decode_tokens_per_second_floor`` (``serve.decode_floor_tokens_per_s``, so the shipped rule needs no edit).
"""

from __future__ import annotations

from typing import Dict, Iterable, List

PREFIX = "qwenft:"
# Seconds: vLLM's request-latency buckets, cut to the range a 2-core CPU to a GPU spans.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# Nats: the write-up's thresholds (2 and 8) fall on bucket edges, so a histogram_quantile near them is exact.
ENTROPY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0)
FINISHED_REASONS = ("stop", "length", "abort")


class ServeMetrics:
    """The metric objects of one app and the helpers the batcher calls.

    Args:
        models: the model ids served (``base`` first).
        decode_floor: the alert floor in tokens/s (``serve.decode_floor_tokens_per_s``).
        kv_capacity_bytes: the KV-cache bytes the server is sized for (``max_batch`` rows of ``max_prompt_tokens +
            max_tokens`` positions, as :func:`qwenft.serve.app.create_app` computes it).
        memory_capacity_bytes: the device's memory (bytes): GPU memory on CUDA, physical RAM on a CPU.
    """

    def __init__(self, models: Iterable[str], decode_floor: float, kv_capacity_bytes: int,
                 memory_capacity_bytes: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.models: List[str] = list(models)
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens prefilled.", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", m, registry=r)
        self.request_success = Counter(f"{PREFIX}request_success", "Requests finished, by finish reason.",
                                       ["model", "finished_reason"], registry=r)
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting for a batch.", m, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "From arrival to the first token (s).", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Between two tokens of a request (s).", m,
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "From arrival to the last token (s).", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.entropy = Histogram(f"{PREFIX}token_entropy_nats", "Entropy of each token's distribution (nats).", m,
                                 buckets=ENTROPY_BUCKETS, registry=r)
        self.decode_tps = Gauge(f"{PREFIX}decode_tokens_per_second", "Decode tokens/s of the last batch.", m,
                                registry=r)
        self.decode_floor = Gauge(f"{PREFIX}decode_tokens_per_second_floor",
                                  "Alert floor for decode tokens/s (serve.decode_floor_tokens_per_s).", m, registry=r)
        self.kv_usage = Gauge(f"{PREFIX}kv_cache_usage_bytes", "KV-cache bytes held by the running batch.", m,
                              registry=r)
        self.kv_capacity = Gauge(f"{PREFIX}kv_cache_capacity_bytes", "KV-cache bytes the server is sized for.", m,
                                 registry=r)
        self.peak_memory = Gauge(f"{PREFIX}peak_memory_bytes", "Peak memory of the process (GPU allocator or RSS).",
                                 m, registry=r)
        self.memory_capacity = Gauge(f"{PREFIX}memory_capacity_bytes", "Memory of the device (bytes).", m,
                                     registry=r)
        self.batch_rows = Histogram(f"{PREFIX}batch_size", "Requests per decode batch.", m,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        for model in self.models:  # every series exists from the start
            for metric in (self.prompt_tokens, self.generation_tokens, self.running, self.waiting, self.ttft,
                           self.itl, self.e2e, self.entropy, self.decode_tps, self.kv_usage, self.peak_memory,
                           self.batch_rows):
                metric.labels(model)
            for reason in FINISHED_REASONS:
                self.request_success.labels(model, reason)
            self.decode_floor.labels(model).set(decode_floor)
            self.kv_capacity.labels(model).set(kv_capacity_bytes)
            self.memory_capacity.labels(model).set(memory_capacity_bytes)

    def set_waiting(self, counts: Dict[str, int]) -> None:
        """Waiting requests per model (models absent from ``counts``: 0)."""
        for model in self.models:
            self.waiting.labels(model).set(counts.get(model, 0))

    def set_peak(self, peak_bytes: int) -> None:
        """The process's peak memory so far (one process serves both models: the same value on both series)."""
        for model in self.models:
            self.peak_memory.labels(model).set(peak_bytes)


def exposed_names(text: str) -> List[str]:
    """The metric names in a Prometheus text exposition (sample names: ``_bucket``, ``_sum``, ``_count``,
    ``_total`` included), in order of appearance, once each."""
    from prometheus_client.parser import text_string_to_metric_families

    names: Dict[str, None] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, None)
    return list(names)
