"""Logit bias, minimum length, penalties and logprobs with vLLM's meanings,
on cases computed by hand; the settings' checks; the server's byte sizes."""
import argparse
import math

import pytest
import torch

from vattn.engine.sampler import logprobs, processed, sample
from vattn.sampling_params import SamplingParams
from vattn.serve.sizes import byte_size

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
TOKENS, PROMPT_LEN = [0, 3, 3, 1], 1  # prompt [0], output [3, 3, 1]


def shaped(**kw):
    return processed(LOGITS.clone(), SamplingParams(max_tokens=8, **kw), TOKENS, PROMPT_LEN, {2}).tolist()


def test_penalties_as_vllm_applies_them():
    # repetition 2 on tokens of the prompt and the output (0, 1, 3): positive / 2, negative * 2;
    # then frequency 0.5 × count and presence 0.25 on the output's tokens (3 twice, 1 once)
    assert shaped(repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, 0.0]
    assert shaped(frequency_penalty=0.5, presence_penalty=0.25) == [2.0, -1.75, 0.5, 1.75, 0.0]
    assert shaped(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25) == [1.0, -2.75, 0.5, 0.25, 0.0]


def test_logit_bias_is_clamped_and_min_tokens_holds_the_stop_tokens():
    assert shaped(logit_bias={4: 150.0, 1: -0.5, 99: 1.0}) == [2.0, -1.5, 0.5, 3.0, 100.0]
    held = shaped(min_tokens=4, stop_token_ids=[4])
    assert held[2] == held[4] == -math.inf and held[:2] + [held[3]] == [2.0, -1.0, 3.0]
    assert shaped(min_tokens=3, stop_token_ids=[4]) == LOGITS.tolist()  # three tokens out: no longer held


def test_shaped_logits_decide_the_greedy_token_and_the_forward_s_row_is_untouched():
    row = LOGITS.clone()
    assert sample(row, SamplingParams(temperature=0, logit_bias={4: 5.0}), None, TOKENS, PROMPT_LEN, ()) == 4
    assert sample(row, SamplingParams(temperature=0, repetition_penalty=8.0), None, TOKENS, PROMPT_LEN, ()) == 2
    assert torch.equal(row, LOGITS)


def test_logprobs_put_the_sampled_token_first_then_the_top_k():
    lp = LOGITS.log_softmax(-1)
    got = logprobs(LOGITS, 2, 2)
    assert list(got) == [2, 3, 0] and got[2] == pytest.approx(float(lp[2]))
    assert list(logprobs(LOGITS, 3, 2)) == [3, 0] and list(logprobs(LOGITS, 1, 0)) == [1]


@pytest.mark.parametrize("field, value", [("min_tokens", 20), ("min_tokens", -1), ("presence_penalty", 3.0),
                                          ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
                                          ("logit_bias", {"a": 1.0}), ("logit_bias", {1: "x"}), ("logprobs", 21),
                                          ("logprobs", -1)])
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(max_tokens=16, **{field: value})


def test_byte_sizes():
    assert [byte_size(s) for s in ("1024", "512MiB", "2GiB", "1.5GB", "4k")] == [1024, 512 << 20, 2 << 30,
                                                                                   1_500_000_000, 4096]
    for bad in ("", "12 parsecs", "-1", "GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)
