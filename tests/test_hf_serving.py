"""The peers of the end-to-end benchmark give each request what generate()
gives it alone, with ordered timestamps, and leave the model as they found it."""
import pytest
import torch
from tiny_models import tiny_model
from transformers import GenerationConfig

from vattn import SamplingParams
from vattn.bench.hf_serving import serve_continuous_batching, serve_static

PROMPT_LENS = (5, 17, 40, 3, 60)
MAX_TOKENS = (10, 3, 25, 1, 8)
SERVERS = {
    "continuous": lambda *a, **kw: serve_continuous_batching(*a, max_batch_tokens=32, block_size=16, progress=False,
                                                             **kw),
    "static": lambda *a, **kw: serve_static(*a, batch_size=2, progress=False, **kw),
}


def greedy(model, prompt, max_tokens):
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=model.generation_config.eos_token_id)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=config)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("server", SERVERS)
def test_outputs_match_generate_alone(server, attn):
    model = tiny_model("llama", attn)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 94, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in MAX_TOKENS]
    # The random model never says its eos: make a token the third request says early its eos instead.
    model.generation_config.eos_token_id = greedy(model, prompts[2], 3)[-1]
    expected = [greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    assert len(expected[2]) < MAX_TOKENS[2]

    outputs, figures = SERVERS[server](model, prompts, params)

    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.outputs[0].finish_reason for o in outputs].count("stop") >= 1
    assert figures["requests"] == len(prompts)
    assert figures["output_tokens"] == sum(map(len, expected))
    for o in outputs:
        m = o.metrics
        assert len(m.token_times) == len(o.outputs[0].token_ids)
        assert m.first_token_time == m.token_times[0]
        times = [m.arrival_time, *m.token_times, m.finish_time]
        assert times == sorted(times)
    assert model.config._attn_implementation == attn


def test_rejects_requests_the_peers_cannot_serve_like_the_engine():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ValueError, match="greedy"):
        serve_static(model, [[3, 4]], [SamplingParams(temperature=0.8)], progress=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        serve_continuous_batching(model, [[3, 4]], [SamplingParams(temperature=0)] * 2, progress=False)
    with pytest.raises(ValueError, match="arrivals must be one offset >= 0 per prompt"):
        serve_static(model, [[3, 4]], [SamplingParams(temperature=0)], arrivals=[-1.0], progress=False)
    with pytest.raises(ValueError, match="arrivals must be one offset >= 0 per prompt"):
        serve_continuous_batching(model, [[3, 4]], [SamplingParams(temperature=0)], arrivals=[0.0, 1.0],
                                  progress=False)
    with pytest.raises(ValueError, match="must agree on ignore_eos"):
        serve_static(model, [[3, 4], [5, 6]], [SamplingParams(temperature=0),
                                               SamplingParams(temperature=0, ignore_eos=True)], progress=False)


@pytest.mark.parametrize("server", SERVERS)
def test_ignore_eos_and_arrivals(server):
    model = tiny_model("llama", "sdpa")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 94, (n,), generator=g).tolist() for n in PROMPT_LENS]
    model.generation_config.eos_token_id = greedy(model, prompts[2], 3)[-1]  # the third request says it early
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    arrivals = [0.0, 0.3, 0.0, 0.6, 0.1]

    outputs, _ = SERVERS[server](model, prompts, params, arrivals=arrivals)

    assert [len(o.outputs[0].token_ids) for o in outputs] == list(MAX_TOKENS)
    assert outputs[2].outputs[0].token_ids[:3] == greedy(model, prompts[2], 3)
    for o, due in zip(outputs, arrivals):
        assert o.metrics.first_token_time - o.metrics.arrival_time > 0
        assert o.metrics.token_times[0] >= o.metrics.arrival_time
    starts = sorted(o.metrics.arrival_time for o in outputs)
    assert starts[-1] - starts[0] == pytest.approx(0.6, abs=1e-6)  # arrivals kept as they were due
