"""`vattn bench soak`: thousands of requests on a tiny model under a memory
budget that forces preemptions, arriving a few per step, some aborted on the
way; every output that finishes must equal its unpressured reference, every
request must come back exactly once (or be aborted), and the page pool must
be whole at the end.

The requests mix prompt lengths, shared system prefixes (prefix caching),
greedy and seeded sampling, and parallel samples (n = 2).  With `chaos`, 5%
of them are poisoned: a logits processor that raises mid-generation (the
request must end in error, and no other), an abort at a random later step,
or input `add_request` must refuse."""
import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vattn.config import CacheConfig
from vattn.engine import LLMEngine
from vattn.report import print_table, write_json
from vattn.sampling_params import SamplingParams

# 256 bytes a token per buffer: 16 tokens per 4 KiB page, so a small budget is a few requests
TINY_LLAMA = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=512, eos_token_id=127, bos_token_id=1)
PAGE = 4096
POISON_RATE = 0.05
POISONS = ("processor", "abort", "invalid")
INVALID = (  # what an invalid request gets wrong: (SamplingParams settings, add_request settings)
    (dict(seed=2**64 - 1, n=2), {}), (dict(stop=5), {}), (dict(temperature=float("nan")), {}),
    (dict(logits_processors=["not callable"]), {}), ({}, dict(cache_salt=["x"])), ({}, dict(prompt=[10**6])),
)


def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()


def requests(num: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 127) for _ in range(rng.randrange(16, 40))] for _ in range(4)]
    out = []
    for i in range(num):
        prompt = [rng.randrange(2, 127) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + prompt
        kind = rng.random()
        params = dict(max_tokens=rng.randrange(1, 40))
        if kind < 0.6:
            params |= dict(temperature=0)
        elif kind < 0.9:
            params |= dict(temperature=0.8, top_k=20, seed=i)
        else:
            params |= dict(temperature=1.0, top_p=0.9, seed=i, n=2)
        out.append((prompt, SamplingParams(**params)))
    return out


def poisons(num: int, seed: int = 1) -> dict[str, str]:
    """Which requests are poisoned, and how (request id -> one of `POISONS`)."""
    rng = random.Random(seed)
    return {str(i): rng.choice(POISONS) for i in range(num) if rng.random() < POISON_RATE}


class FailingProcessor:
    """A logits processor that raises at its `at`-th call: a request's own code failing mid-generation."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.at:
            raise RuntimeError(f"poisoned logits processor, call {self.calls}")
        return logits


@dataclass
class Served:
    """What came back from the engine, by request id."""

    outputs: dict[str, list[list[int]]] = field(default_factory=dict)  # each sample's token ids
    returns: Counter = field(default_factory=Counter)  # finished outputs seen per request
    errors: set[str] = field(default_factory=set)  # ended in error
    aborted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)  # add_request raised ValueError
    accepted_invalid: set[str] = field(default_factory=set)


def serve(model, reqs, abort_rate: float = 0.0, seed: int = 0, poisoned: dict[str, str] | None = None,
          **settings) -> tuple[Served, LLMEngine]:
    """`reqs` on a fresh engine.  With `abort_rate`, requests arrive 0-3 per
    step and a random unfinished one is aborted with that chance each step;
    `poisoned` requests are spoiled as `POISONS` says."""
    engine = LLMEngine(model, page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=64, max_seq_len=128, **settings)
    rng, queue, served = random.Random(seed), list(enumerate(reqs)), Served()
    poisoned, abort_at, step = poisoned or {}, {}, 0
    while queue or engine.has_unfinished_requests():
        arrivals = rng.randrange(4) if abort_rate else len(queue)
        for i, (prompt, params) in queue[:arrivals]:
            rid = str(i)
            poison = poisoned.get(rid)
            if poison == "invalid":
                _add_invalid(engine, prompt, rid, served)
                continue
            if poison == "processor":  # ignore_eos: the processor is called `at` times before the request ends
                at = rng.randrange(1, params.max_tokens + 1)
                params = dataclasses.replace(params, ignore_eos=True, logits_processors=[FailingProcessor(at)])
            engine.add_request(prompt, params, request_id=rid)
            if poison == "abort":
                abort_at[rid] = step + rng.randrange(1, 20)
        del queue[:arrivals]
        due = [rid for rid, at in abort_at.items() if at <= step and rid in engine.requests]
        if engine.requests and rng.random() < abort_rate:
            due.append(rng.choice(sorted(engine.requests)))
        for rid in dict.fromkeys(due):
            served.aborted.add(rid)
            engine.abort(rid)
        for o in engine.step():
            if o.finished:
                served.returns[o.request_id] += 1
                served.outputs[o.request_id] = [c.token_ids for c in o.outputs]
                if o.error is not None:
                    served.errors.add(o.request_id)
        step += 1
    engine.close()
    return served, engine


def _add_invalid(engine: LLMEngine, prompt: list[int], rid: str, served: Served) -> None:
    params, settings = INVALID[int(rid) % len(INVALID)]
    try:
        engine.add_request(settings.get("prompt", prompt), SamplingParams(max_tokens=4, **params), request_id=rid,
                           cache_salt=settings.get("cache_salt"))
    except ValueError:
        served.refused.add(rid)
    else:
        served.accepted_invalid.add(rid)


def pool_is_whole(engine) -> bool:
    """Every page free or held by an idle slot, and the books consistent."""
    engine.kv.check()
    st = engine.kv.stats()
    return st.active_slots == 0 and st.pages_mapped == st.pages_idle and st.swapped_slots == 0


def soak(num_requests: int, modes=("recompute", "swap"), budget_pages: int = 16, chaos: bool = False) -> list[dict]:
    model = tiny_model()
    reqs = requests(num_requests)
    reference, _ = serve(model, reqs)
    poisoned = poisons(num_requests) if chaos else {}
    failing = {rid for rid, kind in poisoned.items() if kind == "processor"}
    admitted = {str(i) for i in range(num_requests)} - {rid for rid, kind in poisoned.items() if kind == "invalid"}
    budget = budget_pages * CacheConfig.from_model(model, page_size=PAGE, layout="per_head").page_bytes
    rows = []
    for mode in modes:
        start = time.perf_counter()
        served, engine = serve(model, reqs, abort_rate=0.02, poisoned=poisoned, preemption_mode=mode,
                               memory_budget=budget)
        back = set(served.returns)
        rows.append({"mode": mode, "requests": num_requests, "seconds": time.perf_counter() - start,
                     "preemptions": engine.stats.preemptions, "prefix_hit_rate": engine.stats.prefix_hit_rate,
                     "poisoned": len(poisoned), "refused": len(served.refused), "errors": len(served.errors),
                     "finished": len(back - served.errors), "aborted": len(served.aborted),
                     "lost": len(admitted - back - served.aborted),
                     "returned_twice": sum(n > 1 for n in served.returns.values()),
                     "finished_after_abort": len(served.aborted & back),
                     "mismatches": sum(reference.outputs.get(rid) != served.outputs[rid] for rid in back - failing),
                     "poisoned_not_ended": len(failing - served.errors - served.aborted),
                     "clean_errors": len(served.errors - failing),
                     "accepted_invalid": len(served.accepted_invalid),
                     "pool_whole": pool_is_whole(engine)})
    return rows


def failures(row: dict) -> list[str]:
    """What went wrong in a soak row (nothing, when it passed)."""
    return [what for what, bad in (
        (f"{row['lost']} requests neither came back nor were aborted", row["lost"]),
        (f"{row['returned_twice']} requests came back more than once", row["returned_twice"]),
        (f"{row['finished_after_abort']} aborted requests came back", row["finished_after_abort"]),
        (f"{row['mismatches']} clean outputs differ from their references", row["mismatches"]),
        (f"{row['poisoned_not_ended']} requests whose logits processor failed did not end in error",
         row["poisoned_not_ended"]),
        (f"{row['clean_errors']} clean requests ended in error", row["clean_errors"]),
        (f"{row['accepted_invalid']} invalid requests were accepted", row["accepted_invalid"]),
        ("pages leaked", not row["pool_whole"])) if bad]


def run(json_path: str | None, num_requests: int, chaos: bool = False) -> list[dict]:
    rows = soak(num_requests, chaos=chaos)
    title = f"soak{' --chaos' * chaos}: {num_requests} requests per preemption mode, tiny Llama, 16-page budget"
    print_table(title, ["mode", "seconds", "preemptions", "prefix hit rate", "poisoned", "refused", "errors",
                        "finished", "aborted", "lost", "clean outputs differing", "pool whole"],
                [[r["mode"], r["seconds"], r["preemptions"], f"{r['prefix_hit_rate']:.1%}", r["poisoned"],
                  r["refused"], r["errors"], r["finished"], r["aborted"], r["lost"], r["mismatches"],
                  r["pool_whole"]] for r in rows])
    write_json(json_path, {"chaos": chaos, "rows": rows})
    failed = [f"{r['mode']}: {what}" for r in rows for what in failures(r)]
    if failed:
        raise SystemExit("soak failed: " + "; ".join(failed))
    return rows
