"""`vattn bench soak`: thousands of requests on a tiny model under a memory
budget that forces preemptions, arriving a few per step, some aborted on the
way; every output that finishes must equal its unpressured reference and the
page pool must be whole at the end.

The requests mix prompt lengths, shared system prefixes (prefix caching),
greedy and seeded sampling, and parallel samples (n = 2)."""
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vattn.report import print_table, write_json
from vattn.engine import LLMEngine
from vattn.config import CacheConfig
from vattn.sampling_params import SamplingParams

# 256 bytes a token per buffer: 16 tokens per 4 KiB page, so a small budget is a few requests
TINY_LLAMA = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=512, eos_token_id=127, bos_token_id=1)
PAGE = 4096


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


def serve(model, reqs, abort_rate: float = 0.0, seed: int = 0, **settings) -> tuple[dict, set, LLMEngine]:
    """Outputs (token ids of each sample, by request id) of `reqs` on a fresh
    engine, and the ids the soak aborted.  With `abort_rate`, requests arrive
    0-3 per step and a random unfinished one is aborted with that chance each step."""
    engine = LLMEngine(model, page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=64, max_seq_len=128, **settings)
    rng, queue, outputs, aborted = random.Random(seed), list(enumerate(reqs)), {}, set()
    while queue or engine.has_unfinished_requests():
        arrivals = rng.randrange(4) if abort_rate else len(queue)
        for i, (prompt, params) in queue[:arrivals]:
            engine.add_request(prompt, params, request_id=str(i))
        del queue[:arrivals]
        if engine.requests and rng.random() < abort_rate:
            aborted.add(victim := rng.choice(sorted(engine.requests)))
            engine.abort(victim)
        outputs |= {o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished}
    engine.close()
    return outputs, aborted, engine


def pool_is_whole(engine) -> bool:
    """Every page free or held by an idle slot, and the books consistent."""
    engine.kv.check()
    st = engine.cache.stats()
    return st.active_slots == 0 and st.pages_mapped == st.pages_idle and st.swapped_slots == 0


def soak(num_requests: int, modes=("recompute", "swap"), budget_pages: int = 16) -> list[dict]:
    model = tiny_model()
    reqs = requests(num_requests)
    reference, _, _ = serve(model, reqs)
    budget = budget_pages * CacheConfig.from_model(model, page_size=PAGE, layout="per_head").page_bytes
    rows = []
    for mode in modes:
        start = time.perf_counter()
        outputs, aborted, engine = serve(model, reqs, abort_rate=0.02, preemption_mode=mode, memory_budget=budget)
        rows.append({"mode": mode, "requests": num_requests, "seconds": time.perf_counter() - start,
                     "preemptions": engine.stats.preemptions, "prefix_hit_rate": engine.stats.prefix_hit_rate,
                     "finished": len(outputs), "aborted": len(aborted),
                     "missing": len({str(i) for i in range(num_requests)} - set(outputs) - aborted),
                     "finished_after_abort": len(aborted & set(outputs)),
                     "mismatches": sum(reference.get(k) != v for k, v in outputs.items()),
                     "pool_whole": pool_is_whole(engine)})
    return rows


def failures(row: dict) -> list[str]:
    """What went wrong in a soak row (nothing, when it passed)."""
    return [what for what, bad in (
        (f"{row['missing']} requests neither finished nor were aborted", row["missing"]),
        (f"{row['finished_after_abort']} aborted requests came back finished", row["finished_after_abort"]),
        (f"{row['mismatches']} outputs differ from their references", row["mismatches"]),
        ("pages leaked", not row["pool_whole"])) if bad]


def run(json_path: str | None, num_requests: int) -> list[dict]:
    rows = soak(num_requests)
    print_table(f"soak: {num_requests} requests per preemption mode, tiny Llama, 16-page budget",
                ["mode", "seconds", "preemptions", "prefix hit rate", "finished", "aborted", "missing",
                 "outputs differing", "pool whole"],
                [[r["mode"], r["seconds"], r["preemptions"], f"{r['prefix_hit_rate']:.1%}", r["finished"], r["aborted"],
                  r["missing"], r["mismatches"], r["pool_whole"]] for r in rows])
    write_json(json_path, {"rows": rows})
    failed = [f"{r['mode']}: {what}" for r in rows for what in failures(r)]
    if failed:
        raise SystemExit("soak failed: " + "; ".join(failed))
    return rows
