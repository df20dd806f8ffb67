"""vLLM's CPU paged attention kernel, timed for `vattn bench kernels`.  Runs
under the peer environment's interpreter (see `peers.py`) and imports nothing
of vattn.

    python vllm_kernels.py POINTS.json OUT.json

POINTS.json: `points` (each a `phase`, `dtype`, `heads`, `kv_heads`,
`head_dim`, per-request `lengths` and `query_tokens`, the last tokens of each
request that attend), `block_sizes`, `repeats`, `threads` (torch's, whose
OpenMP pool vLLM's op runs on: the harness's own count).  For each point and
block size, one layer's KV as vLLM's CPU backend holds it: a pool
`[num_blocks, H_kv, block_size, 2·D]` viewed as `[num_blocks, H_kv,
2·block_size, D]` and chunked into K and V on dim 2, each request's blocks
drawn from a seeded random permutation of the pool (scattered, as after
churn), random K/V written with `cpu_attn_reshape_and_cache` (the kernel's
own layout within a block) and the isa vLLM's backend picks (its
`_get_attn_isa`: "vec" for blocks of a multiple of 32 tokens and head sizes
of a multiple of 32, else "vec16"; "amx" for bfloat16 where the CPU has it).
The scheduler metadata is made once a point, as vLLM makes it once a step
for every layer; `cpu_attention_with_kv_cache` (causal, the queries ending
each request, all requests in one call) is what is timed.  The block sizes
take turns within each repeat, each timed call after 64 MiB of other memory
are read; medians of `repeats` after a warm-up run (the loop of
`kernels.median_ms`, which this process cannot import), whose output
is compared with SDPA in float32 over the same K/V (`max_abs_err`; the
harness judges it).  One line `vllm_kernels: point i of N` on stdout as each
point is done.

OUT.json: `vllm` and `torch` versions, `threads`, `isa` per block size and
`results`, point by point: `[{"block_size", "ms", "max_abs_err"}]`.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import vllm
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa


class Pool:
    """One layer's blocks of `block_size` tokens and the block table of each request."""

    def __init__(self, isa: str, block_size: int, lengths: list[int], kv_heads: int, head_dim: int,
                 dtype: torch.dtype, generator: torch.Generator):
        self.isa, self.block_size = isa, block_size
        counts = [-(-length // block_size) for length in lengths]
        blocks = torch.randperm(sum(counts), generator=generator, dtype=torch.int32)
        self.table = torch.zeros(len(lengths), max(counts), dtype=torch.int32)
        first = 0
        for r, count in enumerate(counts):
            self.table[r, :count] = blocks[first:first + count]
            first += count
        kv = torch.zeros(sum(counts), kv_heads, block_size, 2 * head_dim, dtype=dtype)
        self.key, self.value = kv.view(sum(counts), kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)

    def write(self, request: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens 0.. of `request`, `[tokens, H_kv, D]`, through vLLM's slot mapping."""
        bs, pos = self.block_size, torch.arange(k.shape[0])
        slots = self.table[request].long()[pos // bs] * bs + pos % bs
        ops.cpu_attn_reshape_and_cache(k, v, self.key, self.value, slots, self.isa)


def measure(point: dict, block_sizes: list[int], repeats: int, seed: int = 0) -> list[dict]:
    H, Hkv, D, n = point["heads"], point["kv_heads"], point["head_dim"], point["query_tokens"]
    dtype, lengths = getattr(torch, point["dtype"]), point["lengths"]
    g = torch.Generator().manual_seed(seed)
    pools = [Pool(_get_attn_isa(dtype, bs, D), bs, lengths, Hkv, D, dtype, g) for bs in block_sizes]
    q = torch.randn(len(lengths) * n, H, D, generator=g).to(dtype)
    ref = torch.empty(q.shape)
    for r, length in enumerate(lengths):
        k, v = (torch.randn(length, Hkv, D, generator=g).to(dtype) for _ in "kv")
        for pool in pools:
            pool.write(r, k, v)
        mask = torch.arange(length) <= torch.arange(length - n, length)[:, None]
        ref[r * n:(r + 1) * n] = F.scaled_dot_product_attention(
            *(t.float().transpose(0, 1)[None] for t in (q[r * n:(r + 1) * n], k, v)), attn_mask=mask,
            enable_gqa=True)[0].transpose(0, 1)
    starts = torch.arange(0, len(lengths) * n + 1, n, dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    calls, outs = [], []
    for pool in pools:
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lengths), num_heads=H, num_kv_heads=Hkv, head_dim=D, seq_lens=seq_lens, dtype=dtype,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa=pool.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        out = torch.empty_like(q)
        calls.append(lambda pool=pool, out=out, metadata=metadata: ops.cpu_attention_with_kv_cache(
            query=q, key_cache=pool.key, value_cache=pool.value, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=pool.table, softcap=0.0, scheduler_metadata=metadata, s_aux=None))
        outs.append(out)
    for call in calls:
        call()
    errors = [(out.float() - ref).abs().max().item() for out in outs]
    samples = [[] for _ in calls]
    scrub = torch.ones((64 << 20) // 4)  # kernels.SCRUB_BYTES
    for _ in range(repeats):
        for call, s in zip(calls, samples):
            scrub.sum()
            t0 = time.perf_counter()
            call()
            s.append((time.perf_counter() - t0) * 1e3)
    return [{"block_size": bs, "ms": statistics.median(s), "max_abs_err": e}
            for bs, s, e in zip(block_sizes, samples, errors)]


def main(points_path: str, out_path: str) -> None:
    spec = json.loads(Path(points_path).read_text())
    torch.set_num_threads(spec["threads"])
    results = []
    with torch.inference_mode():
        for i, point in enumerate(spec["points"]):
            results.append(measure(point, spec["block_sizes"], spec["repeats"]))
            print(f"vllm_kernels: point {i + 1} of {len(spec['points'])}", flush=True)
    isa = {bs: sorted({_get_attn_isa(getattr(torch, p["dtype"]), bs, p["head_dim"]) for p in spec["points"]})
           for bs in spec["block_sizes"]}
    Path(out_path).write_text(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__,
                                          "threads": torch.get_num_threads(), "isa": isa, "results": results}))


if __name__ == "__main__":
    main(*sys.argv[1:])
