"""Model execution: a step's forward over the KV cache (`ModelRunner`), the
engine's own decoder forward, its packed linears and GEMM, and model loading."""
