"""What the engine measures as it runs, and the latency figures `vllm bench` prints."""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vattn.engine.request import RequestOutput

RECORDS = 100_000  # the most recent steps kept one by one; a server runs for weeks

if TYPE_CHECKING:
    from vattn.engine.map_worker import MapWorker
    from vattn.engine.scheduler import Scheduler
    from vattn.executor.runner import ModelRunner
    from vattn.kv.manager import KVCacheManager


def _records() -> deque:
    return deque(maxlen=RECORDS)


@dataclass(slots=True)
class EngineStats:
    """The last `RECORDS` steps one by one, running totals over every step,
    and the counters the scheduler, the cache and the mapping worker keep."""

    scheduler: Scheduler  # only their counters are read
    kv: KVCacheManager
    worker: MapWorker | None
    runner: ModelRunner
    step_seconds: deque[float] = field(default_factory=_records)
    tokens: deque[int] = field(default_factory=_records)  # tokens computed per step
    decode_only: deque[bool] = field(default_factory=_records)  # the step had no prefill chunk
    steps: int = 0
    total_seconds: float = 0.0
    total_map_seconds: float = 0.0  # mapping on the steps' critical path
    peak_pages: int = 0  # pages mapped at the busiest step (each `page_bytes` of memory)
    broadcast_seconds: float = 0.0  # sending steps to the other tensor-parallel ranks
    _utilization_seconds: float = 0.0  # live / mapped by running requests, times the step's duration

    def record(self, seconds: float, map_seconds: float, tokens: int, utilization: float, pages: int,
               decode_only: bool) -> None:
        self.step_seconds.append(seconds)
        self.decode_only.append(decode_only)
        self.tokens.append(tokens)
        self.steps += 1
        self.total_seconds += seconds
        self.total_map_seconds += map_seconds
        self._utilization_seconds += utilization * seconds
        self.peak_pages = max(self.peak_pages, pages)

    @property
    def decode_step_seconds(self) -> list[float]:
        return [t for t, decode in zip(self.step_seconds, self.decode_only) if decode]

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def map_limit_hits(self) -> int:
        """Mappings refused at vm.max_map_count (handled like memory being short)."""
        return self.kv.map_limit_hits

    @property
    def per_request_decodes(self) -> int:
        """Layers of steps whose decode tokens took one attention call per
        request instead of one for all (SDPA over a range it may not read whole)."""
        return self.runner.per_request_decodes

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens served from the prefix cache / tokens of the prompts that were given slots."""
        s = self.scheduler
        return s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0

    @property
    def background_map_seconds(self) -> float:
        return self.worker.busy_seconds if self.worker else 0.0

    @property
    def kv_utilization(self) -> float:
        """Live bytes / mapped bytes, averaged over time (each step weighted by its duration)."""
        return self._utilization_seconds / self.total_seconds if self.total_seconds else 0.0


def summary(values: list[float]) -> dict[str, float]:
    """{mean, median, p99} of `values` (zeros if there are none)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def latency_report(outputs: list[RequestOutput], seconds: float) -> dict:
    """vllm-bench figures for finished requests served in `seconds` (times in ms)."""
    ms = 1e3
    ttft, tpot, itl, e2el, out_tokens = [], [], [], [], 0
    for o in outputs:
        m = o.metrics
        out_tokens += sum(len(c.token_ids) for c in o.outputs)
        ttft.append((m.first_token_time - m.arrival_time) * ms)
        e2el.append((m.finish_time - m.arrival_time) * ms)
        gaps = [(b - a) * ms for a, b in zip(m.token_times, m.token_times[1:])]
        itl += gaps
        if gaps:
            tpot.append(sum(gaps) / len(gaps))
    return {
        "requests": len(outputs),
        "output_tokens": out_tokens,
        "seconds": seconds,
        "req_per_s": len(outputs) / seconds if seconds else 0.0,
        "output_tok_per_s": out_tokens / seconds if seconds else 0.0,
        "ttft_ms": summary(ttft), "tpot_ms": summary(tpot), "itl_ms": summary(itl), "e2el_ms": summary(e2el),
    }
