"""transformers as the reference we did not write: greedy tokens and log-softmax."""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=4)
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' forward and its own KV cache, running past EOS (as
    `ignore_eos=True` does). `generate` cannot be told to ignore EOS without `min_new_tokens`,
    which masks EOS and so changes the argmax; this loop is exactly generate's greedy step."""
    model = hf_model(str(path))
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens


def hf_logprobs(path, token_ids: list[int]) -> torch.Tensor:
    """log-softmax over the vocab at every position of `token_ids`: [len, vocab]."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
