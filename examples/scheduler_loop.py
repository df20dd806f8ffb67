import torch

from vattn import CacheConfig, KVCacheManager, VirtualKVCache, attention
from vattn.attention.batch import StepBatch
from vattn.attention.registry import pick_for


def serve(model, prompts: list[list[int]], max_tokens: int, memory_budget: int | None = None) -> list[list[int]]:
    """Greedy continuous batching over vattn's cache API: admit (with prefix hits),
    grow, preempt by recompute when memory is short, free."""
    cache = VirtualKVCache(CacheConfig.from_model(model, max_num_seqs=4, max_seq_len=256, memory_budget=memory_budget))
    kv, chunk = KVCacheManager(cache), 64
    attention.register()
    model.set_attn_implementation(attention.NAME)
    tokens, computed = [list(p) for p in prompts], [0] * len(prompts)
    waiting, running = list(range(len(prompts))), []
    while waiting or running:
        while waiting and kv.num_free_slots and (hit := kv.allocate(waiting[0], tokens[waiting[0]], chunk)) is not None:
            computed[waiting[0]] = hit
            running.append(waiting.pop(0))
        want = {s: min(len(tokens[s]), computed[s] + chunk) for s in running}
        while not kv.allocate_slots(want):  # memory is short: the youngest goes back to wait
            victim = running.pop()
            kv.free(victim)
            computed[victim] = 0
            waiting.insert(0, victim)
            del want[victim]
        step = sorted(running, key=lambda s: want[s] - computed[s] != 1)  # decode tokens first
        decodes = [s for s in step if want[s] - computed[s] == 1]
        batch = StepBatch([kv.slot(s) for s in decodes], [computed[s] for s in decodes],
                          [(kv.slot(s), computed[s], want[s] - computed[s]) for s in step[len(decodes):]])
        ids = [t for s in step for t in tokens[s][computed[s]:want[s]]]
        ends = torch.tensor([want[s] - computed[s] for s in step]).cumsum(0) - 1
        with torch.inference_mode(), attention.running(attention.prepare(batch, cache.data, pick_for(cache))):
            logits = model(input_ids=torch.tensor([ids]), position_ids=batch.positions(cache.device),
                           use_cache=False).logits[0, ends]
        for s, row in zip(step, logits):
            computed[s] = want[s]
            kv.cache_tokens(s, tokens[s], computed[s])
            if computed[s] == len(tokens[s]):
                tokens[s].append(int(row.argmax()))
                if len(tokens[s]) - len(prompts[s]) == max_tokens:
                    kv.free(s)
                    running.remove(s)
    return [t[len(p):] for t, p in zip(tokens, prompts)]
