"""vLLM's CPU engine as a serving peer of `vattn bench e2e`.  Runs under the
peer environment's interpreter (see `peers.py`) and imports nothing of vattn.

    python vllm_serve.py SETTINGS.json

Speaks the protocol of `serve_worker.py`: one JSON line on stdout when the
engine is up (the settings it runs with), then for each JSON line on stdin
(a round: requests with arrival offsets) serves them, writes their tokens
and times to the round's `out` file and answers one line.  vLLM runs at its
own defaults (torch.compile on) except for what every system shares: the KV
memory in bytes, the model and its dtype, the context length; its prefix cache is reset
before each round.  `peers.popen` gives it every core and the allocator and
OpenMP runtime vLLM's CPU docs advise preloading.
"""
import json
import os
import sys
import time
from pathlib import Path


def main(settings_path: str) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own prints go to the log, not the protocol
    settings = json.loads(Path(settings_path).read_text())
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=settings["model"], dtype=settings["dtype"], max_model_len=settings["max_model_len"],
              kv_cache_memory_bytes=settings["kv_budget_bytes"], enforce_eager=settings.get("enforce_eager", False),
              seed=0)
    engine, config = llm.llm_engine, llm.llm_engine.vllm_config
    blocks = config.cache_config.num_gpu_blocks
    ran = {"vllm": vllm.__version__, "torch": torch.__version__, "dtype": settings["dtype"],
           "kv_cache_memory_bytes": settings["kv_budget_bytes"], "kv_blocks": blocks,
           "block_size": config.cache_config.block_size, "max_model_len": config.model_config.max_model_len,
           "max_num_seqs": config.scheduler_config.max_num_seqs,
           "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
           "enable_prefix_caching": config.cache_config.enable_prefix_caching,
           "enforce_eager": config.model_config.enforce_eager,
           "compilation_mode": str(config.compilation_config.mode),
           "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
           "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"), "ld_preload": os.environ.get("LD_PRELOAD")}
    print(json.dumps({"ready": ran}), file=protocol)
    for line in sys.stdin:
        round_ = json.loads(line)
        llm.reset_prefix_cache()
        results = serve(engine, round_["requests"], SamplingParams, TokensPrompt, round_["ignore_eos"])
        with open(round_["out"], "w") as f:
            json.dump({"requests": results, "kv_bytes_committed": settings["kv_budget_bytes"]}, f)
        print(json.dumps({"done": round_["out"]}), file=protocol)


def serve(engine, requests, SamplingParams, TokensPrompt, ignore_eos: bool) -> list[dict]:
    """Each request added once its arrival offset has passed; tokens timed as
    the engine's outputs bring them (offsets in seconds from the start)."""
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
    results = [{"token_ids": [], "arrival": r["arrival"], "token_times": [], "finish": None} for r in requests]
    start, added, left = time.perf_counter(), 0, len(requests)
    while left:
        now = time.perf_counter() - start
        while added < len(order) and requests[order[added]]["arrival"] <= now:
            i = order[added]
            params = SamplingParams(temperature=0, max_tokens=requests[i]["max_tokens"], ignore_eos=ignore_eos)
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=requests[i]["prompt"]), params)
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[order[added]]["arrival"] - now))
            continue
        for out in engine.step():
            r, now = results[int(out.request_id)], time.perf_counter() - start
            tokens = list(out.outputs[0].token_ids)
            r["token_times"] += [now] * (len(tokens) - len(r["token_ids"]))
            r["token_ids"] = tokens
            if out.finished:
                r["finish"], left = now, left - 1
    return results


if __name__ == "__main__":
    main(sys.argv[1])
