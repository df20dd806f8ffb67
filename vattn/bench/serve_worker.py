"""One system of `vattn bench e2e` in a process of its own, so that each
system's resident memory is its own and no system warms another's caches.

    python -m vattn.bench.serve_worker SYSTEM SETTINGS.json

The protocol, spoken by `vllm_serve.py` too: once the model is loaded, one
JSON line on stdout, `{"ready": settings it runs with}`; then for each JSON
line on stdin, a round (`requests`: prompt token ids, `max_tokens`, arrival
offset in seconds; `ignore_eos`; `out`: a path), the requests are served,
each one added once its arrival offset has passed, and `{"done": out}`
answers when `out` holds each request's tokens and times (seconds from the
round's start).  Anything else the libraries print goes to stderr.

Systems: `vattn` (the engine on the virtual cache; `vattn_compiled` with
`compile=True`), `paged_<block size>`
(the same engine on `PagedKVCache`), `hf_continuous_batching` and
`hf_static` (transformers' own serving paths, `hf_serving.py`).  Every one
runs with the options in SETTINGS (`options`: the KV memory budget among
them, see `e2e.settings`) over its `model` (a directory) in its `dtype`.
"""
import json
import os
import sys
import time
from functools import partial
from pathlib import Path


def main(system: str, settings_path: str) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    settings = json.loads(Path(settings_path).read_text())
    import torch

    from vattn import allocator
    from vattn.models import load_model

    model, tokenizer = load_model(settings["model"], settings["dtype"])
    serve = SYSTEMS["paged" if system.startswith("paged_") else system]
    ran = settings | {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                      "allocator": allocator.name(), "dtype": str(model.dtype).removeprefix("torch.")}
    print(json.dumps({"ready": ran}), file=protocol)
    for line in sys.stdin:
        round_ = json.loads(line)
        results, committed = serve(model, tokenizer, round_["requests"], round_["ignore_eos"], settings["options"])
        with open(round_["out"], "w") as f:
            json.dump({"requests": results, "kv_bytes_committed": committed}, f)
        print(json.dumps({"done": round_["out"]}), file=protocol)


def _params(requests, ignore_eos):
    from vattn import SamplingParams

    return [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=ignore_eos) for r in requests]


def serve_engine(model, tokenizer, requests, ignore_eos, options) -> tuple[list[dict], int]:
    """A fresh engine a round (so no prefix survives from the last one)."""
    from vattn.engine import LLMEngine

    engine = LLMEngine(model, tokenizer, **options)
    try:
        params = _params(requests, ignore_eos)
        order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
        done, start, added = {}, time.perf_counter(), 0
        while len(done) < len(requests):
            now = time.perf_counter() - start
            while added < len(order) and requests[order[added]]["arrival"] <= now:
                i = order[added]
                engine.add_request(requests[i]["prompt"], params[i], request_id=str(i))
                added += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, requests[order[added]]["arrival"] - now))
                continue
            done |= {int(o.request_id): o for o in engine.step() if o.finished}
        committed = engine.stats.peak_pages * engine.kv.config.page_bytes
    finally:
        engine.close()
    return [_record(done[i], start, r["arrival"]) for i, r in enumerate(requests)], committed


def serve_hf(model, tokenizer, requests, ignore_eos, options, system: str) -> tuple[list[dict], int]:
    """transformers' own serving path `system`."""
    from vattn.bench import hf_serving

    serve = {"hf_continuous_batching": hf_serving.serve_continuous_batching,
             "hf_static": hf_serving.serve_static}[system]
    outputs, figures = serve(model, [r["prompt"] for r in requests], _params(requests, ignore_eos),
                             arrivals=[r["arrival"] for r in requests], progress=False, **options)
    start = outputs[0].metrics.arrival_time - requests[0]["arrival"]
    return [_record(o, start, r["arrival"]) for o, r in zip(outputs, requests)], figures["kv_bytes_committed"]


def _record(output, start: float, arrival: float) -> dict:
    """A request's tokens and times in seconds from `start`; its arrival is when it was due."""
    m = output.metrics
    return {"token_ids": output.outputs[0].token_ids, "arrival": arrival,
            "token_times": [t - start for t in m.token_times], "finish": m.finish_time - start}


SYSTEMS = {"vattn": serve_engine, "vattn_compiled": serve_engine, "paged": serve_engine,
           "hf_continuous_batching": partial(serve_hf, system="hf_continuous_batching"),
           "hf_static": partial(serve_hf, system="hf_static")}

if __name__ == "__main__":
    main(*sys.argv[1:])
