"""The server's Prometheus metrics: vLLM's names under the prefix `vattn:`,
each labelled `model_name`, and vattn's own (pages mapped, idle, shared; map
calls; mapping time on the step's critical path).  Updated on the engine's
thread after every step (`observe`); prometheus_client is thread-safe."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vattn.engine.llm_engine import LLMEngine
from vattn.engine.request import RequestOutput

PREFIX = "vattn:"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def make(kind, name, doc, **kw):
            return kind(PREFIX + name, doc, label, registry=r, **kw).labels(model_name)

        self.running = make(Gauge, "num_requests_running", "Requests running on the engine")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to run (and swapped out)")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Share of the KV pages running requests hold (1 = all)")
        self.pages_mapped = make(Gauge, "kv_pages_mapped", "KV pages mapped, by running requests or idle slots")
        self.pages_idle = make(Gauge, "kv_pages_idle", "KV pages held only by idle slots (reclaimable)")
        self.pages_shared = make(Gauge, "kv_pages_shared", "KV pages mapped into more than one slot")
        self.map_calls = make(Counter, "kv_map_calls", "Batched calls that mapped pages")
        self.map_seconds = make(Counter, "kv_map_seconds", "Mapping time on the steps' critical path")
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Prompt tokens the prefix cache served")
        self.preemptions = make(Counter, "num_preemptions", "Requests preempted")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that started")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Time between tokens", buckets=ITL_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Request latency", buckets=REQUEST_BUCKETS)
        self.queue = make(Histogram, "request_queue_time_seconds", "Time waiting before first scheduled",
                          buckets=REQUEST_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self._seen: dict[str, float] = {}  # the engine's running totals at the last step

    def observe(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After a step: the engine's gauges and counters, and `outputs`' latencies."""
        s, st = engine.scheduler, engine.kv.stats()
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting) + len(s.swapped))
        self.kv_usage.set((st.pages_mapped - st.pages_idle) / st.pages_total if st.pages_total else 0.0)
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

    def text(self) -> bytes:
        return generate_latest(self.registry)
