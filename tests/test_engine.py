"""The serving engine: outputs equal HF generate(), under pressure too;
sharing, prefix caching, abort, failures and bad input leave the pool whole."""
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import SMALL, TINY, tiny_model
from transformers import GenerationConfig

from vattn import PagedKVCache, SamplingParams
from vattn.bench.soak import failures, pool_is_whole, soak
from vattn import _native
from vattn.engine import LLMEngine
from vattn.engine.request import Status

PROMPT_LENS = (3, 17, 40, 9, 70, 33)
EOS = SMALL["eos_token_id"]


def prompts(lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, EOS, (n,), generator=g).tolist() for n in lens]


def hf_greedy(model, prompt, max_tokens, ignore_eos=False):
    """HF generate()'s greedy tokens for one prompt, ending at EOS as the engine does (or
    not: an EOS id no token has)."""
    eos = model.config.vocab_size if ignore_eos else model.generation_config.eos_token_id
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=eos)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=config)
    return out[0, len(prompt):].tolist()


def engine_for(model, **settings):
    settings = dict(page_size=4096, max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160) | settings
    return LLMEngine(model, **settings)


def run(engine, reqs) -> list[list[list[int]]]:
    """Token ids of every sample of every request, in the order given."""
    ids = [engine.add_request(p, params) for p, params in reqs]
    done = {o.request_id: o for o in engine.stream() if o.finished}
    assert pool_is_whole(engine)
    return [[c.token_ids for c in done[i].outputs] for i in ids]


def greedy(max_tokens=40, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# a page group of the SMALL models: per_head, 8 buffers of 64 tokens (16 fp32 dims, 4 KiB pages);
# per_layer, 4 buffers of 32 tokens
GROUP = 8 * 4096
PER_LAYER_GROUP = 4 * 4096


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request):
    model = tiny_model(request.param, "sdpa")
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    return model, reference


@pytest.mark.parametrize("layout", ["per_head", "per_layer", "interleaved"])
def test_mixed_batch_equals_hf_generate(tiny, layout):
    model, reference = tiny
    engine = engine_for(model, layout=layout)
    assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
    assert engine.stats.preemptions == 0 and max(engine.stats.tokens) > 1  # prefill and decode mixed


def test_step_records_are_bounded_and_the_totals_count_every_step(tiny, monkeypatch):
    from vattn.engine import metrics

    monkeypatch.setattr(metrics, "RECORDS", 5)
    model, _ = tiny
    engine = engine_for(model)
    for p in prompts():
        engine.add_request(p, greedy())
    steps, seconds, computed = 0, [], []
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        seconds.append(engine.stats.step_seconds[-1])
        computed.append(engine.stats.tokens[-1])
    st = engine.stats
    assert steps > 5 and st.steps == steps
    assert list(st.step_seconds) == seconds[-5:] and list(st.tokens) == computed[-5:] and len(st.decode_only) == 5
    assert st.total_seconds == pytest.approx(sum(seconds)) and st.total_map_seconds >= 0
    assert 0 < st.kv_utilization <= 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(tiny, mode):
    model, reference = tiny
    engine = engine_for(model, layout="per_layer", memory_budget=4 * PER_LAYER_GROUP, preemption_mode=mode)
    assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
    assert engine.stats.preemptions > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_baseline_equals_hf_generate(tiny, block_size):
    model, reference = tiny
    engine = engine_for(model, kv_cache="paged", block_size=block_size)
    assert isinstance(engine.kv.cache, PagedKVCache) and engine.kv.cache.block_size == block_size
    assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
    assert engine.kv.cache.map_calls > 0  # block-table updates, counted as the virtual cache counts its maps


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_paged_baseline_under_preemption(tiny, mode):
    model, reference = tiny
    engine = engine_for(model, kv_cache="paged", memory_budget=4 * PER_LAYER_GROUP, preemption_mode=mode)
    assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
    assert engine.stats.preemptions > 0


def test_map_ahead_and_prefix_caching_change_no_output(tiny):
    model, reference = tiny
    for settings in (dict(map_ahead=False), dict(enable_prefix_caching=False), dict(max_num_batched_tokens=7)):
        assert run(engine_for(model, **settings), [(p, greedy()) for p in prompts()]) == [[r] for r in reference]


def test_admission_keeps_the_running_tokens_within_the_limit(tiny):
    model, reference = tiny
    reqs = [(p, greedy()) for p in prompts()]

    def most_running(engine):
        """The most requests that ran at once; asserts that the prompts of
        those running together never passed the limit (one ran alone)."""
        ids, done, most = [engine.add_request(p, params) for p, params in reqs], {}, 0
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
            running = engine.scheduler.running
            assert len(running) == 1 or sum(len(r.prompt_token_ids) for r in running) <= \
                engine.config.max_running_tokens
            most = max(most, len(running))
        assert [[c.token_ids for c in done[i].outputs] for i in ids] == [[r] for r in reference]
        return most

    # 60 tokens: the 70-token prompt runs alone, the others two or three at a time
    assert most_running(engine_for(model, max_running_tokens=60)) < most_running(engine_for(model)) == 4


# ---------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    from vattn.models import load_model
    from vattn.sharegpt import chat_prompt

    model, tokenizer = load_model(dtype=torch.float32)  # exact: bfloat16 kernels round differently
    texts = ["What is the capital of France?", "Name three colours.", "Say hi.",
             "Write one sentence about the sea, the moon and the tides that link them."]
    chats = [chat_prompt(tokenizer, t) for t in texts]
    reference = [hf_greedy(model, p, 40, ignore_eos=True) for p in chats]
    return model, tokenizer, chats, reference


@pytest.mark.slow
def test_smollm2_in_bfloat16_equals_hf_generate_but_at_near_ties():
    """48 ShareGPT prompts, 32 tokens, greedy, against HF generate() (batch
    1, bfloat16, sdpa): a prompt whose tokens part from the reference's
    parts where its top two logits lie within 1.0 of each other (eight
    bfloat16 steps at logits of 16-32: rounding over 30 layers moves a logit
    that far).  Printed: how many prompts equal the reference, and how many
    equal it under transformers' own eager attention.  Measured: 31 of 48
    on an AVX2 CPU (f2abe2a); on an AVX-512 Intel Xeon without bf16
    instructions 28, eager attention 24, transformers at one thread against
    two 39; on an AVX512-BF16 EPYC 27 (dbc9635), and 24 at 1391f89, its
    prefill tiles rounding their probabilities to bfloat16 as SDPA does
    (eager 26; the widest parting 0.69, at a top logit of 9.3), the
    attention as accurate as SDPA's (`test_smollm2_s_attention_in_bfloat16_
    is_as_accurate_as_sdpa_on_every_instruction_set`)."""
    from test_forward import near_tie
    from vattn.models import load_model
    from vattn.sharegpt import chat_prompt, sample

    model, tokenizer = load_model(dtype=torch.bfloat16)
    chats = [chat_prompt(tokenizer, r.prompt) for r in sample(tokenizer, 48)]
    reference = [hf_greedy(model, p, 32, ignore_eos=True) for p in chats]
    eager = load_model(dtype=torch.bfloat16, attn_implementation="eager")[0]
    eager_equal = sum(hf_greedy(eager, p, 32, ignore_eos=True) == r for p, r in zip(chats, reference))
    engine = LLMEngine(model, tokenizer)
    assert engine.runner.decoder.elementwise
    tokens = [out[0] for out in run(engine, [(p, greedy(32, ignore_eos=True)) for p in chats])]
    engine.close()
    parted = [i for i, (t, r) in enumerate(zip(tokens, reference)) if t != r]
    print(f"SmolLM2 bfloat16: {len(chats) - len(parted)} of {len(chats)} prompts give HF generate()'s 32 tokens; "
          f"with eager attention HF gives them for {eager_equal}")
    assert all(near_tie(model, chats[i], tokens[i], reference[i], within=1.0) for i in parted)


SMOLLM2_GROUP = 180 * 8192  # 30 layers × K/V × 3 heads, 8 KiB pages of 32 fp32 tokens


@pytest.mark.parametrize("settings", [{}, dict(memory_budget=6 * SMOLLM2_GROUP, preemption_mode="recompute"),
                                      dict(memory_budget=6 * SMOLLM2_GROUP, preemption_mode="swap"),
                                      dict(kv_cache="paged"),
                                      dict(kv_cache="paged", memory_budget=6 * SMOLLM2_GROUP, preemption_mode="swap")],
                         ids=["roomy", "recompute", "swap", "paged", "paged-swap"])
def test_smollm2_equals_hf_generate(smollm2, settings):
    model, tokenizer, chats, reference = smollm2
    # prompts of 33-46 tokens take 2 page groups each; they grow into a third
    engine = LLMEngine(model, tokenizer, max_num_batched_tokens=48, **settings)
    assert run(engine, [(p, greedy(40, ignore_eos=True)) for p in chats]) == [[r] for r in reference]
    assert (engine.stats.preemptions > 0) == ("memory_budget" in settings)


def test_smollm2_text_stop_strings_and_streaming(smollm2):
    model, tokenizer, chats, reference = smollm2
    engine = LLMEngine(model, tokenizer)
    rid = engine.add_request(chats[0], greedy(16, stop=["Paris"]))
    streamed, outs = [], list(engine.stream())
    for o in outs:
        streamed += o.outputs[0].new_token_ids
    final = outs[-1].outputs[0]
    assert outs[-1].request_id == rid and final.token_ids == streamed
    assert final.finish_reason == "stop" and "Paris" not in final.text and final.text.strip().startswith("The capital")
    assert tokenizer.decode(reference[0], skip_special_tokens=True).startswith(final.text)
    assert pool_is_whole(engine)


def test_each_step_s_text_is_its_own_tokens_decoded_when_read(smollm2):
    """A step's text, read after later steps, is the text of the tokens it had then; only reading decodes."""
    model, tokenizer, chats, reference = smollm2
    engine = LLMEngine(model, tokenizer)
    engine.add_request(chats[3], greedy(24, ignore_eos=True))
    decodes = []
    tokenizer.decode, decode = (lambda *a, **k: decodes.append(a) or decode(*a, **k)), tokenizer.decode
    try:
        outs = [o.outputs[0] for o in engine.stream()]
        assert decodes == [] and len(outs) == 24
        assert [o.text for o in outs] == [decode(reference[3][:i], skip_special_tokens=True) for i in range(1, 25)]
        assert len(decodes) == 24
        assert outs[5].text == outs[5].text and len(decodes) == 24  # decoded once
    finally:
        del tokenizer.decode


# ---------------------------------------------------------------- sharing

@pytest.mark.parametrize("cache", [{}, dict(kv_cache="paged")], ids=["virtual", "paged"])
def test_parallel_samples_share_the_prompt_and_match_lone_runs(cache):
    model = tiny_model("llama", "sdpa")
    prompt = prompts([70])[0]
    engine = engine_for(model, max_num_batched_tokens=128, **cache)
    [samples] = run(engine, [(prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=5, n=3))])
    lone_pages = 0
    for i, sample in enumerate(samples):
        lone = engine_for(model, max_num_batched_tokens=128, **cache)
        assert run(lone, [(prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=5 + i))]) == [[sample]]
        lone_pages += lone.stats.peak_pages
    assert len({tuple(s) for s in samples}) == 3
    assert engine.stats.peak_pages < lone_pages


@pytest.mark.parametrize("cache, hit", [({}, 64), (dict(kv_cache="paged", block_size=16), 96)],
                         ids=["virtual", "paged"])
def test_prefix_cache_skips_the_shared_prompt(cache, hit):
    model = tiny_model("llama", "sdpa")
    system, a, b = prompts([100, 9, 12])
    expected = [hf_greedy(model, system + q, 12) for q in (a, b)]
    engine = engine_for(model, max_num_batched_tokens=128, **cache)
    assert run(engine, [(system + a, greedy(12))]) == [[expected[0]]]
    before = sum(engine.stats.tokens)
    rid = engine.add_request(system + b, greedy(12))
    outs = list(engine.stream())
    assert outs[-1].request_id == rid and outs[-1].outputs[0].token_ids == expected[1]
    assert outs[-1].metrics.num_cached_tokens == hit  # whole blocks: 64 tokens a page, or 16 a block
    assert sum(engine.stats.tokens) - before == len(system + b) - hit + 11  # prefill of the rest, then decode
    assert engine.scheduler.prefix_hit_tokens == hit and pool_is_whole(engine)


def test_prefix_cache_hits_a_running_request_and_respects_salts():
    model = tiny_model("llama", "sdpa")
    system, a, b, c = prompts([70, 5, 6, 7])
    expected = [hf_greedy(model, system + q, 20) for q in (a, b, c)]
    engine = engine_for(model, max_num_batched_tokens=128)
    first = engine.add_request(system + a, greedy(20), cache_salt="tenant-1")
    engine.step()  # the first request's prompt is in the cache, and it keeps running
    same = engine.add_request(system + b, greedy(20), cache_salt="tenant-1")
    other = engine.add_request(system + c, greedy(20), cache_salt="tenant-2")
    done = {o.request_id: o for o in engine.stream() if o.finished}
    assert [done[r].outputs[0].token_ids for r in (first, same, other)] == expected
    assert done[same].metrics.num_cached_tokens == 64 and done[other].metrics.num_cached_tokens == 0
    assert pool_is_whole(engine)


# ---------------------------------------------------------------- failures and bad input

def test_abort_mid_generation_leaves_the_others_alone(tiny):
    model, reference = tiny
    engine = engine_for(model)
    ids = [engine.add_request(p, greedy()) for p in prompts()]
    done = {}
    for _ in range(6):
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    running, waiting = ids[2], ids[5]
    assert engine.requests[running].status is Status.RUNNING and engine.requests[waiting].status is Status.WAITING
    engine.abort(running)
    engine.abort(waiting)
    engine.kv.cache.check()
    done |= {o.request_id: o.outputs[0].token_ids for o in engine.stream() if o.finished}
    assert set(done) == set(ids) - {running, waiting}
    assert all(done[i] == r for i, r in zip(ids, reference) if i in done)
    assert pool_is_whole(engine)
    with pytest.raises(ValueError, match="no request"):
        engine.abort(running)


def test_abort_a_swapped_request():
    model = tiny_model("llama", "sdpa")
    engine = engine_for(model, layout="per_layer", memory_budget=4 * PER_LAYER_GROUP, preemption_mode="swap")
    ids = [engine.add_request(p, greedy()) for p in prompts()]
    while not engine.scheduler.swapped:
        engine.step()
    engine.abort(engine.scheduler.swapped[0].request_id)
    list(engine.stream())
    assert pool_is_whole(engine) and not engine.requests
    assert len(ids) == 6


@pytest.mark.parametrize("own_forward", [True, False])
def test_a_failing_forward_changes_nothing(tiny, monkeypatch, own_forward):
    model, reference = tiny
    engine = engine_for(model, own_forward=own_forward)
    ids = [engine.add_request(p, greedy()) for p in prompts()]
    down = model.model.layers[1].mlp.down_proj  # what the model's forward and the layer loop in Python call
    calls = {"n": 0}

    def flaky(call):
        def failing(*args):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected failure")
            out = call(*args)
            if calls["n"] == 9:  # after the call's work: some K/V stored, then the step fails
                raise RuntimeError("injected failure")
            return out
        return failing

    monkeypatch.setattr(down, "forward", flaky(down.forward))
    monkeypatch.setattr(_native, "decoder_layers", flaky(_native.decoder_layers))  # every layer
    done, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            failures += 1
            engine.kv.cache.check()
            continue
        done |= {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert failures == 2
    assert [done[i] for i in ids] == reference
    assert pool_is_whole(engine)


@pytest.mark.parametrize("call, message", [
    (lambda e: e.add_request([], greedy()), "empty"),
    (lambda e: e.add_request([5] * 160, greedy()), "max_seq_len"),
    (lambda e: e.add_request([5, 6], SamplingParams(n=5)), "max_num_seqs"),
    (lambda e: e.add_request([5, 500], greedy()), "token ids"),
    (lambda e: e.add_request("text", greedy()), "tokenizer"),
    (lambda e: e.add_request([5, 6], "greedy"), "SamplingParams"),
    (lambda e: e.add_request([5, 6], greedy(), request_id="0"), "already"),
    (lambda e: e.abort("nope"), "no request"),
    (lambda e: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda e: SamplingParams(max_tokens=-3), "max_tokens"),
    (lambda e: SamplingParams(top_p=0), "top_p"),
    (lambda e: SamplingParams(temperature=-1), "temperature"),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(call, message):
    model = tiny_model("llama", "sdpa")
    engine = engine_for(model)
    engine.add_request([7, 8, 9], greedy(5), request_id="0")
    engine.step()
    with pytest.raises((ValueError, TypeError), match=message):
        call(engine)
    rid = engine.add_request([10, 11], greedy(5))
    done = {o.request_id for o in engine.stream() if o.finished}
    assert done == {"0", rid} and pool_is_whole(engine)


@pytest.mark.parametrize("settings, message", [
    (dict(preemption_mode="drop"), "preemption_mode"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(watermark=1.5), "watermark"), (dict(layout="paged"), "layout"), (dict(page_size=5000), "page_size"),
    (dict(kv_cache="vector"), "kv_cache must be one of"), (dict(block_size=0), "block_size"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be in"),
    (dict(max_running_tokens=0), "max_running_tokens must be"), (dict(max_running_tokens=True), "max_running_tokens"),
])
def test_bad_engine_settings(settings, message):
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ValueError, match=message):
        engine_for(model, **settings)
    assert model.config._attn_implementation == "sdpa"  # the model is left as it was


def test_close_gives_the_model_its_attention_back():
    model = tiny_model("llama", "eager")
    engine = engine_for(model)
    assert model.config._attn_implementation == "vattn"
    engine.close()
    assert model.config._attn_implementation == "eager"


def test_close_gives_back_the_memory_idle_slots_hold():
    engine = engine_for(tiny_model("llama", "sdpa"))
    run(engine, [(p, greedy(8)) for p in prompts([40, 50])])
    assert engine.kv.cache.stats().committed_bytes > 0  # finished requests' slots keep their pages, idle
    engine.close()
    assert engine.kv.cache.stats().committed_bytes == 0


def test_the_objects_alive_at_the_start_stay_out_of_the_collector_until_close():
    """The collector's full passes while serving skip the model's and the libraries' objects; close gives
    them back (else a test's engines would hold their garbage for the rest of the run)."""
    gc.unfreeze()
    engine = engine_for(tiny_model("llama", "sdpa"))
    assert gc.get_freeze_count() > 10_000
    engine.close()
    assert gc.get_freeze_count() == 0


def test_memory_budget_too_small_for_a_request():
    engine = engine_for(tiny_model("llama", "sdpa"), memory_budget=GROUP)
    with pytest.raises(ValueError, match="memory budget"):
        engine.add_request(prompts([70])[0], greedy(40))


MAP_LIMIT_SCRIPT = """
import torch
from tiny_models import tiny_model
from vattn import SamplingParams
from vattn.backends import HostBackend
from vattn.bench.soak import pool_is_whole
from vattn.engine import LLMEngine
engine = LLMEngine(tiny_model("llama", "sdpa"), page_size=4096, max_num_seqs=4, max_num_batched_tokens=32)
prompts = [[5 + i] * (3 + 11 * i) for i in range(5)]
reference = []
for p in prompts:  # one by one
    engine.add_request(p, SamplingParams(max_tokens=30, temperature=0))
    reference += [o.outputs[0].token_ids for o in engine.stream() if o.finished]
engine.kv.cache.trim()  # no page mapped: the next requests need new mappings
ids = [engine.add_request(p, SamplingParams(max_tokens=30, temperature=0)) for p in prompts]
with open("/proc/sys/vm/max_map_count") as f:
    limit = int(f.read())
with open("/proc/self/maps") as f:
    used = sum(1 for _ in f)
b, page = HostBackend(), 4096
n = (limit - used - 4) // 2  # every other page: leaves the process 4 mapping entries
hog, pool = b.reserve(2 * n * page, zero_backed=True), b.create_pool(n, page)
b.map(hog, pool, [2 * i * page for i in range(n)], range(n))
try:
    engine.step()
except RuntimeError as e:
    print("REFUSED", e)
engine.kv.cache.check()
del hog, pool  # the entries come back
done = {o.request_id: o.outputs[0].token_ids for o in engine.stream() if o.finished}
print("EQUAL", [done[i] for i in ids] == reference, "WHOLE", pool_is_whole(engine))
"""


def test_the_mapping_limit_stops_a_step_cleanly():
    with open("/proc/sys/vm/max_map_count") as f:
        if int(f.read()) > 70000:
            pytest.skip("vm.max_map_count is above what this test exhausts")
    tests = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", MAP_LIMIT_SCRIPT], capture_output=True, text=True, timeout=300,
                         env=os.environ | {"PYTHONPATH": tests})
    assert out.returncode == 0, out.stderr
    assert "REFUSED no request could be scheduled: memory is too short (the process is at vm.max_map_count)" \
        in out.stdout
    assert "EQUAL True WHOLE True" in out.stdout


# ---------------------------------------------------------------- soak

@pytest.mark.parametrize("num_requests, chaos", [(150, True), pytest.param(2000, False, marks=pytest.mark.slow),
                                                  pytest.param(2000, True, marks=pytest.mark.slow)])
def test_soak(num_requests, chaos):
    for row in soak(num_requests, chaos=chaos):
        assert failures(row) == [], row
        assert row["finished"] + row["errors"] + row["aborted"] + row["refused"] == num_requests, row
        assert row["aborted"] > 0 and row["preemptions"] >= num_requests // 20, row
        assert (row["refused"] > 0 and row["errors"] > 0) == chaos, row


def test_soak_fails_when_an_output_never_comes_back(monkeypatch):
    step, dropped = LLMEngine.step, []

    def dropping_step(self):  # the first request to finish is never returned
        outputs = step(self)
        if not dropped:
            dropped.extend([o.request_id for o in outputs if o.finished][:1])
        return [o for o in outputs if o.request_id not in dropped]

    monkeypatch.setattr(LLMEngine, "step", dropping_step)
    rows = soak(60, modes=("recompute",))
    assert rows[0]["lost"] == 1 and failures(rows[0]) == ["1 requests neither came back nor were aborted"]
