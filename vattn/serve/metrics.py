"""The server's Prometheus metrics: vLLM's names under the prefix `vattn:`,
each labelled `model_name`, and vattn's own (pages mapped, idle, shared; map
calls; mapping time on the step's critical path; a shared KV pool's total and
free bytes and each model's share of it).  Updated on the engines' thread
after every step (`observe`), the pool's when scraped; prometheus_client is
thread-safe."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vattn.engine.llm_engine import LLMEngine
from vattn.engine.request import RequestOutput
from vattn.kv.shared import KVPool

PREFIX = "vattn:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Every model's figures (`models[name]`), and the shared KV pool's where there is one."""

    def __init__(self, model_names: list[str], pool: KVPool | None = None):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        families = {name: kind(PREFIX + name, doc, label, registry=r, **kw)
                    for name, (kind, doc, kw) in METRICS.items()}
        success = Counter(PREFIX + "request_success", "Requests finished, by finish reason",
                          ["model_name", "finished_reason"], registry=r)
        self.models = {name: ModelMetrics(name, families, success) for name in model_names}
        self.pool = pool
        if pool is not None:
            self._pool_bytes = Gauge(PREFIX + "kv_pool_bytes", "The shared KV pool's bytes, in all and free",
                                     ["kind"], registry=r)
            self._pool_bytes.labels("total").set(pool.memory_budget)
            self._model_bytes = Gauge(PREFIX + "kv_pool_model_bytes", "Each model's share of the shared KV pool: "
                                      "chunks held, pages mapped, idle pages, floor and cap", ["model_name", "kind"],
                                      registry=r)

    def observe(self, name: str, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After a step of model `name`'s engine."""
        self.models[name].observe(engine, outputs)

    def text(self) -> bytes:
        if self.pool is not None:
            self._pool_bytes.labels("free").set(self.pool.free_chunks * self.pool.chunk_size)
            for name, split in self.pool.split().items():
                for kind in ("held", "mapped", "idle", "floor", "cap"):
                    self._model_bytes.labels(name, kind).set(getattr(split, kind))
        return generate_latest(self.registry)


# name: (kind, description, options) of each model's metrics
METRICS = {
    "num_requests_running": (Gauge, "Requests running on the engine", {}),
    "num_requests_waiting": (Gauge, "Requests waiting to run (and swapped out)", {}),
    "kv_cache_usage_perc": (Gauge, "Share of the KV pages running requests hold (1 = all it could hold)", {}),
    "kv_pages_mapped": (Gauge, "KV pages mapped, by running requests or idle slots", {}),
    "kv_pages_idle": (Gauge, "KV pages held only by idle slots (reclaimable)", {}),
    "kv_pages_shared": (Gauge, "KV pages mapped into more than one slot", {}),
    "kv_map_calls": (Counter, "Batched calls that mapped pages", {}),
    "kv_map_seconds": (Counter, "Mapping time on the steps' critical path", {}),
    "prefix_cache_queries": (Counter, "Prompt tokens looked up in the prefix cache", {}),
    "prefix_cache_hits": (Counter, "Prompt tokens the prefix cache served", {}),
    "num_preemptions": (Counter, "Requests preempted", {}),
    "prompt_tokens": (Counter, "Prompt tokens of requests that started", {}),
    "generation_tokens": (Counter, "Tokens generated", {}),
    "time_to_first_token_seconds": (Histogram, "Time to first token", {"buckets": TTFT_BUCKETS}),
    "inter_token_latency_seconds": (Histogram, "Time between tokens", {"buckets": ITL_BUCKETS}),
    "e2e_request_latency_seconds": (Histogram, "Request latency", {"buckets": REQUEST_BUCKETS}),
    "request_queue_time_seconds": (Histogram, "Time waiting before first scheduled", {"buckets": REQUEST_BUCKETS}),
}


class ModelMetrics:
    """One model's children of the metric families."""

    def __init__(self, model_name: str, families: dict, success: Counter):
        m = {name: family.labels(model_name) for name, family in families.items()}
        self.running, self.waiting = m["num_requests_running"], m["num_requests_waiting"]
        self.kv_usage, self.pages_mapped = m["kv_cache_usage_perc"], m["kv_pages_mapped"]
        self.pages_idle, self.pages_shared = m["kv_pages_idle"], m["kv_pages_shared"]
        self.map_calls, self.map_seconds = m["kv_map_calls"], m["kv_map_seconds"]
        self.prefix_queries, self.prefix_hits = m["prefix_cache_queries"], m["prefix_cache_hits"]
        self.preemptions = m["num_preemptions"]
        self.prompt_tokens, self.generation_tokens = m["prompt_tokens"], m["generation_tokens"]
        self.ttft, self.itl = m["time_to_first_token_seconds"], m["inter_token_latency_seconds"]
        self.e2e, self.queue = m["e2e_request_latency_seconds"], m["request_queue_time_seconds"]
        self._success = success
        self._model_name = model_name
        self._seen: dict[str, float] = {}  # the engine's running totals at the last step

    def observe(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After a step: the engine's gauges and counters, and `outputs`' latencies."""
        s, st = engine.scheduler, engine.kv.stats()
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting) + len(s.swapped))
        self.kv_usage.set((st.pages_mapped - st.pages_idle) / engine.kv.num_pages)
        self.pages_mapped.set(st.pages_mapped)
        self.pages_idle.set(st.pages_idle)
        self.pages_shared.set(st.pages_shared)
        for counter, key, total in ((self.map_calls, "map_calls", st.map_calls),
                                    (self.prefix_queries, "queries", s.prefix_queried_tokens),
                                    (self.prefix_hits, "hits", s.prefix_hit_tokens),
                                    (self.preemptions, "preemptions", s.preemptions),
                                    (self.map_seconds, "map_seconds", engine.stats.total_map_seconds)):
            counter.inc(total - self._seen.get(key, 0))
            self._seen[key] = total
        for out in outputs:
            self._request(out)

    def _request(self, out: RequestOutput) -> None:
        m = out.metrics
        self.generation_tokens.inc(sum(len(c.new_token_ids) for c in out.outputs))
        if len(m.token_times) == 1 and m.first_token_time is not None:
            self.prompt_tokens.inc(m.num_prompt_tokens)
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.scheduled_time is not None:
                self.queue.observe(m.scheduled_time - m.arrival_time)
        elif len(m.token_times) > 1:
            self.itl.observe(m.token_times[-1] - m.token_times[-2])
        if out.finished:
            if m.finish_time is not None:
                self.e2e.observe(m.finish_time - m.arrival_time)
            for c in out.outputs:
                self._success.labels(self._model_name, c.finish_reason or "abort").inc()
