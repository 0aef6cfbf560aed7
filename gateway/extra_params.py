"""SamplingParams fields resolved from request fields that chat and completions share:
`logit_bias` and `prompt_logprobs`, checked with vLLM's rules and messages. A route passes the
result to `make_jobs(extra=...)`.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import bad_request
from gateway.model_info import ModelInfo
from gateway.protocol import SamplingFields

# OpenAI's range for a bias; vLLM clamps to it rather than refusing.
_MAX_BIAS = 100.0
# Out-of-vocabulary ids a 400 lists (a body may hold thousands).
_MAX_LISTED_IDS = 20


def logit_bias(info: ModelInfo, bias: dict[str, float] | None) -> dict[int, float] | None:
    """Token-id keys as ints, values clamped to [-100, 100]; a 400 naming `logit_bias` for a
    key that is not an integer or an id outside the vocabulary."""
    if not bias:
        return None
    resolved: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids (integers, as strings); got {key[:64]!r}.",
                "logit_bias",
            ) from None
        resolved[token_id] = min(_MAX_BIAS, max(-_MAX_BIAS, value))
    bad = [t for t in resolved if not 0 <= t < info.vocab_size]
    if bad:
        listed = ", ".join(map(str, bad[:_MAX_LISTED_IDS]))
        if len(bad) > _MAX_LISTED_IDS:
            listed += ", ..."
        raise bad_request(
            f"token_id(s) [{listed}] in logit_bias contain out-of-vocab token ids. "
            f"Vocabulary size: {info.vocab_size}",
            "logit_bias",
        )
    return resolved


def prompt_logprobs(info: ModelInfo, req: SamplingFields, max_logprobs: int) -> int | None:
    """The top-k per prompt token (-1: the whole vocabulary), within `--max-logprobs`."""
    k = req.num_prompt_logprobs()
    if k is None:
        return None
    num_logprobs = req.num_logprobs()
    if num_logprobs is not None and num_logprobs > max_logprobs:
        return k  # vLLM reports the sample logprobs first (`build_params` does)
    if k == -1:
        k = info.vocab_size
    if k > max_logprobs:
        raise bad_request(
            f"Requested prompt logprobs of {k}, which is greater than max allowed: {max_logprobs}",
            "prompt_logprobs",
        )
    return k


def shared_extra(info: ModelInfo, req: SamplingFields, max_logprobs: int) -> dict[str, Any]:
    """`make_jobs(extra=...)` for the fields both routes share; only the fields that are set."""
    extra: dict[str, Any] = {}
    bias = logit_bias(info, req.logit_bias)
    if bias:
        extra["logit_bias"] = bias
    k = prompt_logprobs(info, req, max_logprobs)
    if k is not None:
        extra["prompt_logprobs"] = k
    return extra
