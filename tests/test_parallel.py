"""Tensor parallelism (`vattn.distributed`): ranks in their own processes
over gloo, each with a shard of the model from transformers' own plan and a
cache of its own KV heads, kept in lockstep by rank 0's replayed cache calls.
Outputs equal the single-process engine's and HF generate()'s; every rank's
books are equal and check; failures end every rank, fast and clearly."""
import functools
import multiprocessing
import subprocess
import sys
import time

import pytest
import torch
from test_engine import hf_greedy, prompts
from tiny_models import SMALL, TINY, faulty_loader
from transformers import GPT2Config, GPT2LMHeadModel

from vattn import LLM, SamplingParams
from vattn.bench.soak import FailingProcessor
from vattn.distributed.group import RankFailed

WIDE = dict(SMALL, num_attention_heads=4, num_key_value_heads=4)  # 4 KV heads: 2 a rank at TP 2
SETTINGS = dict(page_size=4096, max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160)
PER_LAYER_GROUP = 4 * 4096  # a page in every buffer of the tiny models (per_layer: 16 tokens of 4 KV heads)


def saved(arch, tmp_path_factory):
    """A tiny model with 4 KV heads saved where every rank can load it, and HF generate()'s greedy tokens."""
    config_cls, model_cls, extra = TINY[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**WIDE, **extra)).eval()
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    return path, [hf_greedy(model, p, 24) for p in prompts()]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return saved(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return saved("llama", tmp_path_factory)


def generate(llm, reqs):
    return [[c.token_ids for c in o.outputs] for o in llm.generate([p for p, _ in reqs], [s for _, s in reqs],
                                                                    use_tqdm=False)]


def workload():
    """Every prompt greedy, then the 70-token one again with n=3 (a prefix hit, three samples sharing its pages)."""
    greedy = SamplingParams(max_tokens=24, temperature=0)
    return [(p, greedy) for p in prompts()] + [(prompts()[4], SamplingParams(n=3, max_tokens=24, temperature=0))]


def no_ranks_left():
    return not [p for p in multiprocessing.active_children() if p.name.startswith("vattn-rank")]


def served_by_two_ranks(path, reqs, **settings):
    """(one process's outputs, two ranks' outputs, the two ranks' engine
    stats), the two ranks' caches checked and their page books equal."""
    settings = SETTINGS | dict(layout="per_layer") | settings
    one = LLM(str(path), **settings)
    single = generate(one, reqs)
    one.engine.close()
    llm = LLM(str(path), tensor_parallel_size=2, **settings)
    try:
        assert llm.engine.kv.cache.config.num_kv_heads == 2  # this rank's half
        outputs = generate(llm, reqs)
        books = llm.engine.rank_books()
        stats = llm.engine.stats
    finally:
        llm.engine.close()
    assert no_ranks_left()
    assert len(books) == 2 and books[0] == books[1]
    return single, outputs, stats


def test_two_ranks_equal_one_and_hf_generate(checkpoint):
    path, reference = checkpoint
    single, outputs, stats = served_by_two_ranks(path, workload())
    assert single[:-1] == [[r] for r in reference] and single[-1] == [reference[4]] * 3
    assert outputs == single
    assert stats.prefix_hit_rate > 0 and stats.broadcast_seconds > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_two_ranks_under_preemption_equal_one(llama, mode):
    path, _ = llama
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    single, outputs, stats = served_by_two_ranks(path, [(p, params) for p in prompts()],
                                                 memory_budget=8 * PER_LAYER_GROUP, preemption_mode=mode)
    assert outputs == single and stats.preemptions > 0


def test_an_abort_and_a_failing_request_under_two_ranks_leave_every_rank_the_same(llama):
    """Steps driven one by one, a request aborted halfway and another ended by
    its failing logits processor (the shared prompt, 3 samples): the others
    finish as in one process, and every rank's books agree."""
    path, _ = llama
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    finished = []
    for size in (1, 2):
        engine = LLM(str(path), tensor_parallel_size=size, **SETTINGS).engine
        ids = [engine.add_request(p, params) for p in prompts()]
        engine.add_request(prompts()[4], SamplingParams(max_tokens=24, n=3, seed=1, ignore_eos=True,
                                                         logits_processors=[FailingProcessor(at=8)]), "bad")
        for _ in range(5):
            engine.step()
        engine.abort(ids[1])
        finished.append({o.request_id: (o.outputs[0].token_ids, o.error) for o in engine.stream() if o.finished})
        books = engine.rank_books()
        assert len(books) == size and all(b == books[0] for b in books)
        engine.close()
    assert finished[0] == finished[1] and ids[1] not in finished[1]
    assert finished[1]["bad"][1].startswith("RuntimeError: poisoned")
    assert no_ranks_left()


def test_three_ranks_serve_smollm2_as_one_does():
    from vattn.models import load_model
    from vattn.sharegpt import chat_prompt

    model, tokenizer = load_model(dtype=torch.float32)
    chats = [chat_prompt(tokenizer, t) for t in ("What is the capital of France?", "Name three colours.")]
    reference = [hf_greedy(model, p, 12, ignore_eos=True) for p in chats]
    llm = LLM(tensor_parallel_size=3, max_num_seqs=4, max_seq_len=256, dtype="float32")
    try:
        config = llm.engine.kv.cache.config
        assert (config.num_kv_heads, config.num_layers) == (1, 30)  # SmolLM2's 3 KV heads, one a rank
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(chats, params, use_tqdm=False)] == reference
        books = llm.engine.rank_books()
        assert len(books) == 3 and books[0] == books[1] == books[2]
    finally:
        llm.engine.close()
    assert no_ranks_left()


TORCHRUN_SCRIPT = """
import sys
from vattn import LLM, SamplingParams
from vattn.bench.soak import FailingProcessor
llm = LLM(sys.argv[1], tensor_parallel_size=2, page_size=4096, max_num_seqs=4, max_seq_len=160)
out = llm.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
print("tokens", out[0].outputs[0].token_ids, flush=True)
llm.engine.close()
"""


def test_under_torchrun_every_process_runs_the_same_script_and_rank_0_serves(llama, tmp_path):
    path, _ = llama
    script = tmp_path / "serve.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                           str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    one = LLM(str(path), page_size=4096, max_num_seqs=4, max_seq_len=160)
    expected = one.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    one.engine.close()
    assert done.stdout.count("tokens") == 1  # only rank 0 returned from LLM(...)
    assert f"tokens {expected[0].outputs[0].token_ids}" in done.stdout


@pytest.mark.parametrize("fault", ["raise", "die"])
def test_a_failing_rank_ends_every_rank_with_a_clear_error(llama, fault):
    path, _ = llama
    llm = LLM(functools.partial(faulty_loader, str(path), fault), tensor_parallel_size=2, **SETTINGS)
    start = time.monotonic()
    why = "injected fault in rank 1's forward" if fault == "raise" else "rank 1: exited with status -9"
    with pytest.raises(RankFailed, match=why):
        generate(llm, workload())
    assert time.monotonic() - start < 60
    assert no_ranks_left()
    with pytest.raises(RankFailed, match="shut down"):  # and the engine says so from then on
        generate(llm, workload())
    llm.engine.close()


def test_bad_settings_are_refused_before_any_process_starts(llama, tmp_path):
    path, _ = llama
    for size, why in ((3, "must divide the model's 4 attention heads and 4 KV heads"),
                      (8, "must divide"), (0, "must be a positive int")):
        with pytest.raises(ValueError, match=why):
            LLM(str(path), tensor_parallel_size=size, **SETTINGS)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=96)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2 has none"):
        LLM(str(tmp_path), tensor_parallel_size=2, **SETTINGS)
    with pytest.raises(ValueError, match="not a loaded model"):
        LLM(GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=96)), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="compile does not run under tensor parallelism"):
        LLM(str(path), tensor_parallel_size=2, compile=True, **SETTINGS)
    assert no_ranks_left()
