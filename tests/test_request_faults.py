"""A request's failure is its own: whatever goes wrong while one request is
handled (its logits processor, sampling, admission) ends that request with an
error, frees what it held, and leaves every other request's tokens, and the
step they come out in, as they would have been; input that would break a
step is refused at `add_request`; a failing forward is raised and counted."""
import pytest
import torch
from tiny_models import tiny_model

from vattn import SamplingParams
from vattn.bench.soak import FailingProcessor, pool_is_whole
from vattn.engine import EngineConfig, LLMEngine

EOS = 95
GROUP = 4 * 4096  # a page in every buffer of the tiny models (per_layer)


def clean_requests():
    """20 requests: greedy and seeded, some with n=3, half behind a shared prefix (prefix hits)."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(2, EOS, (40,), generator=g).tolist()
    reqs = []
    for i in range(20):
        prompt = (prefix if i % 2 else []) + torch.randint(2, EOS, (3 + 5 * (i % 7),), generator=g).tolist()
        params = (SamplingParams(max_tokens=40, temperature=0) if i % 3 == 0 else
                  SamplingParams(max_tokens=40, temperature=0.9, top_k=30, seed=i, n=3 if i % 5 == 1 else 1))
        reqs.append((prompt, params))
    return reqs


def engine_for(model, **settings):
    return LLMEngine(model, **dict(page_size=4096, max_num_seqs=6, max_num_batched_tokens=48, max_seq_len=160,
                                   layout="per_layer") | settings)


def tokens(outputs) -> dict:
    return {o.request_id: [c.token_ids for c in o.outputs] for o in outputs if o.finished}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "sdpa")


@pytest.fixture(scope="module")
def reference(model):
    engine = engine_for(model)
    for i, (p, params) in enumerate(clean_requests()):
        engine.add_request(p, params, request_id=str(i))
    out = tokens(engine.stream())
    engine.close()
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_failing_request_ends_alone_and_the_others_get_their_token_in_that_step(model, reference, mode):
    engine = engine_for(model, memory_budget=16 * GROUP, max_num_seqs=8, preemption_mode=mode)
    reqs = clean_requests()
    for i, (p, params) in enumerate(reqs[:3]):
        engine.add_request(p, params, request_id=str(i))
    bad = SamplingParams(max_tokens=40, temperature=0.9, seed=7, n=3, logits_processors=[FailingProcessor(at=7)])
    engine.add_request(reqs[1][0], bad, request_id="bad")  # the shared prefix: a prefix hit, 3 samples
    for i, (p, params) in enumerate(reqs[3:], 3):
        engine.add_request(p, params, request_id=str(i))
    schedule, sampling = engine.scheduler.schedule, []  # the requests each step samples for

    def watched():
        plan = schedule()
        sampling.append({w.request.request_id for w in plan.work if w.samples})
        return plan

    engine.scheduler.schedule = watched
    done, failed_step, sampled = {}, None, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        done |= tokens(outs)
        if "bad" in {o.request_id for o in outs}:
            failed_step, sampled = outs, sampling[-1]
    bad_out = next(o for o in failed_step if o.request_id == "bad")
    assert bad_out.finished and bad_out.error.startswith("RuntimeError: poisoned logits processor")
    assert {c.finish_reason for c in bad_out.outputs} == {"error"} and len(bad_out.outputs) == 3
    got = {o.request_id for o in failed_step if any(c.new_token_ids for c in o.outputs)}
    assert sampled - {"bad"} and sampled - {"bad"} <= got  # the step in which "bad" failed
    assert {k: v for k, v in done.items() if k != "bad"} == reference
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_rate > 0
    assert pool_is_whole(engine) and "bad" not in engine.requests


def test_a_failing_admission_ends_that_request_alone(model, reference, monkeypatch):
    engine = engine_for(model)
    reqs = clean_requests()[:6]
    for i, (p, params) in enumerate(reqs):
        engine.add_request(p, params, request_id=str(i))
    engine.add_request([9, 8, 7], SamplingParams(max_tokens=5), request_id="bad")
    allocate = engine.kv.allocate

    def failing(seq, token_ids, *args):
        if token_ids[:3] == [9, 8, 7]:
            raise KeyError("prefix lookup failed")
        return allocate(seq, token_ids, *args)

    monkeypatch.setattr(engine.kv, "allocate", failing)
    outs = list(engine.stream())
    bad = [o for o in outs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].error == "KeyError: 'prefix lookup failed'"
    assert bad[0].outputs[0].token_ids == [] and bad[0].metrics.first_token_time is None
    assert {k: v for k, v in tokens(outs).items() if k != "bad"} == {str(i): reference[str(i)] for i in range(6)}
    assert pool_is_whole(engine)


def test_an_error_gives_back_the_pages_and_prefix_hashes_the_request_held(model):
    engine = engine_for(model, enable_prefix_caching=True)
    prompt = list(range(2, 70))
    engine.add_request(prompt, SamplingParams(max_tokens=8, logits_processors=[FailingProcessor(at=1)]))
    (out,) = [o for o in engine.stream() if o.finished]
    assert out.error is not None
    stats = engine.kv.cache.stats()
    assert stats.pages_mapped == 0 and stats.active_slots == 0  # nothing kept idle for a prefix hit
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    list(engine.stream())
    assert engine.stats.prefix_hit_rate == 0 and pool_is_whole(engine)


def test_a_processor_that_returns_the_wrong_thing_ends_its_request(model):
    engine = engine_for(model)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, logits_processors=[lambda ids, row: row[:3]]))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, logits_processors=[
        lambda ids, row: row.index_fill(0, torch.tensor([EOS]), float("-inf"))]), request_id="ok")
    outs = {o.request_id: o for o in engine.stream() if o.finished}
    assert "tensor of shape" in outs["0"].error and outs["ok"].error is None
    assert len(outs["ok"].outputs[0].token_ids) == 4 and EOS not in outs["ok"].outputs[0].token_ids


def test_inputs_that_broke_a_step_are_refused_or_served(model):
    engine = engine_for(model)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(n=2, seed=2**64 - 1)
    with pytest.raises(ValueError, match="SamplingParams.stop must be"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(ValueError, match="cache_salt must be a str"):
        engine.add_request([5, 6], SamplingParams(), cache_salt=["x"])
    SamplingParams(n=2, seed=2**64 - 2)  # the last seed that fits
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=1e-300), request_id="tiny-t")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0), request_id="greedy")
    outs = tokens(engine.stream())
    assert outs["tiny-t"] == outs["greedy"]  # below 1e-5 is greedy
    assert pool_is_whole(engine)


def test_max_seq_len_is_bounded_by_the_model_s_positions(model):
    assert LLMEngine(model).config.max_seq_len == 256  # min(2048, max_position_embeddings)
    with pytest.raises(ValueError, match="max_seq_len=4096 is more than the model's max_position_embeddings=256"):
        LLMEngine(model, max_seq_len=4096)
    assert LLMEngine(model, max_seq_len=512, allow_long_max_seq_len=True).config.max_seq_len == 512
    with pytest.raises(ValueError, match="EngineConfig.watermark must be in"):
        EngineConfig(watermark="0.1")
    with pytest.raises(ValueError, match="EngineConfig.gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization="high")


def test_three_failing_forwards_in_a_row_make_the_engine_unhealthy(model, monkeypatch):
    engine = engine_for(model)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    run, fails = engine.runner.run, {"left": 3}

    def flaky(*args):
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("injected forward failure")
        return run(*args)

    monkeypatch.setattr(engine.runner, "run", flaky)
    health = []
    for _ in range(3):
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        health.append(engine.is_healthy)
    assert health == [True, True, False]
    list(engine.stream())
    assert engine.is_healthy and pool_is_whole(engine)
