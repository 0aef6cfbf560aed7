"""Logprobs in the two OpenAI shapes: chat (`content: [...]`) and completions (parallel lists).

Each `TokenLogprobs` from a decode holds the sampled token first, then the requested top-k
(which may include the sampled token again). Values of -inf are clamped to -9999.0 (as vLLM
does) because JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from protos import common_pb2

if TYPE_CHECKING:  # the gateway imports no transformers (ARCHITECTURE: light gateway)
    from transformers import PreTrainedTokenizerBase

_MIN_LOGPROB = -9999.0


class TokenTexts:
    """Decoded text of single tokens, cached per gateway (the vocabulary is fixed)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def _clamp(logprob: float) -> float:
    return _MIN_LOGPROB if math.isnan(logprob) else max(logprob, _MIN_LOGPROB)


def _top_k(lp: common_pb2.TokenLogprobs, k: int) -> list[tuple[int, float]]:
    unique = dict(zip(lp.token_ids, lp.logprobs))
    return sorted(unique.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(
    texts: TokenTexts, logprobs: Sequence[common_pb2.TokenLogprobs], k: int
) -> list[dict[str, Any]]:
    """Entries of `choices[i].logprobs.content`."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = texts(token_id)
        return {"token": token, "logprob": _clamp(logprob), "bytes": list(token.encode())}

    content = []
    for lp in logprobs:
        item = entry(lp.token_ids[0], lp.logprobs[0])
        item["top_logprobs"] = [entry(t, v) for t, v in _top_k(lp, k)]
        content.append(item)
    return content


def completion_logprobs(
    texts: TokenTexts,
    logprobs: Sequence[common_pb2.TokenLogprobs],
    text_offset: int,
    k: int,
    first_token_id: int | None = None,
) -> tuple[dict[str, Any], int]:
    """`choices[i].logprobs` for completions, and the text offset after these tokens.

    `top_logprobs` holds the token itself plus at most `k` others, as vLLM returns them.
    `first_token_id`: a token before `logprobs` that has none (an echoed prompt's first token):
    its `token_logprobs` and `top_logprobs` entries are None.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    if first_token_id is not None:
        token = texts(first_token_id)
        tokens.append(token)
        token_logprobs.append(None)
        tops.append(None)
        offsets.append(text_offset)
        text_offset += len(token)
    for lp in logprobs:
        token = texts(lp.token_ids[0])
        tokens.append(token)
        token_logprobs.append(_clamp(lp.logprobs[0]))
        pairs = list(zip(lp.token_ids, lp.logprobs))[: k + 1]
        tops.append({texts(t): _clamp(v) for t, v in pairs})
        offsets.append(text_offset)
        text_offset += len(token)
    body = {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }
    return body, text_offset


def prompt_logprobs_body(
    texts: TokenTexts, logprobs: Sequence[common_pb2.TokenLogprobs], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing predicts it), then
    per prompt token `{token_id: {"logprob", "rank", "decoded_token"}}`, the prompt token
    first, then the top `k`.

    Ranks: 1..k for the top k. The prompt token's own rank is known only when it is one of
    them; otherwise it is null (vLLM computes it over the whole vocabulary, which the decode
    does not send).
    """
    body: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in logprobs:
        unique = dict(zip(lp.token_ids, lp.logprobs))
        ranked = sorted(unique.items(), key=lambda item: -item[1])[:k]
        rank_of = {t: r for r, (t, _) in enumerate(ranked, start=1)}
        body.append(
            {
                str(t): {"logprob": _clamp(v), "rank": rank_of.get(t), "decoded_token": texts(t)}
                for t, v in unique.items()
            }
        )
    return body
