"""From an OpenAI request to engine work: tokenize, validate, resolve sampling parameters.

Order follows vLLM: the model check, then the prompt, then the length check with the numbers,
then `SamplingParams` validation (its ValueError text is the 400 message). The result is one
`ChildJob` per engine request: a request with n samples of p prompts is p * n children, each
an n=1 request with `SamplingParams.child_params(i)`, so every child is routed independently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template
from gateway.auth import Principal, TenantLimits
from gateway.errors import APIError, bad_request, model_not_found
from gateway.model_info import ModelInfo
from gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(frozen=True)
class ChildJob:
    index: int  # the choice index in the response
    prompt_token_ids: list[int]
    params: SamplingParams  # n=1, max_tokens resolved


def check_model(info: ModelInfo, model: str | None) -> None:
    if not info.is_served(model):
        raise model_not_found(model)


def check_supported(req: SamplingFields, allowed: frozenset[str] = frozenset()) -> None:
    """Refuse a parameter the gateway would otherwise ignore (see `protocol.Unsupported`)."""
    unsupported = req.unsupported_field(allowed)
    if unsupported is not None:
        name, message = unsupported
        raise bad_request(message, name)


def check_caps(limits: TenantLimits, req: SamplingFields, num_prompts: int = 1) -> None:
    """The key's caps, before any work: `max_n` bounds the choices of one response (n times
    the prompts, as each choice is an engine request), `max_tokens` the requested length."""
    if req.n * num_prompts > limits.max_n:
        what = f"n ({req.n})" if num_prompts == 1 else f"n * prompts ({req.n} * {num_prompts})"
        raise bad_request(f"{what} is above this key's limit of {limits.max_n} choices.", "n")
    requested = req.requested_max_tokens()
    if limits.max_tokens and requested is not None and requested > limits.max_tokens:
        raise bad_request(
            f"'max_tokens' is {requested}, above this key's limit of {limits.max_tokens}.",
            "max_tokens",
        )


def resolve_cache_salt(principal: Principal, req: SamplingFields) -> str:
    """The prefix-cache salt: the tenant's (or its trust group's), never the client's choice.

    With auth off there are no tenants, and a client's `cache_salt` keeps vLLM's meaning.
    With auth on, a client value is refused rather than silently dropped: a client that
    relies on it for isolation between its own users must learn that it does not get it.
    """
    if principal.is_anonymous:
        return req.cache_salt or ""
    if req.cache_salt is not None:
        raise bad_request(
            "cache_salt is set by the gateway for each tenant and cannot be chosen by clients.",
            "cache_salt",
        )
    return principal.cache_salt


def check_stop(req: SamplingFields, max_stop_strings: int) -> None:
    """Each stop string is matched against every new piece of text: the list is bounded."""
    if isinstance(req.stop, list) and len(req.stop) > max_stop_strings:
        raise bad_request(
            f"'stop' has {len(req.stop)} strings; this gateway accepts at most "
            f"{max_stop_strings} stop strings.",
            "stop",
        )


def request_chat_template(req: ChatCompletionRequest, is_trusted: bool) -> str | None:
    """The request's own template (field or chat_template_kwargs), only with vLLM's
    --trust-request-chat-template: a template is a Jinja program the gateway would run."""
    from_kwargs = (req.chat_template_kwargs or {}).get("chat_template")
    if from_kwargs is not None and not is_trusted:
        raise bad_request(
            "chat_template_kwargs may not set 'chat_template': the gateway runs without "
            "--trust-request-chat-template; remove it from chat_template_kwargs.",
            "chat_template_kwargs",
        )
    template = req.chat_template if req.chat_template is not None else from_kwargs
    if template is not None and not isinstance(template, str):
        raise bad_request("chat_template must be a string.", "chat_template")
    return template


def estimate_num_tokens(
    info: ModelInfo, req: SamplingFields, prompt_num_bytes: Sequence[int], limits: TenantLimits
) -> int:
    """The quota reservation before tokenizing: bytes / 4 per prompt (bounded by the context),
    plus n times the requested (else the largest possible) max_tokens. `metered` settles on
    the exact count."""
    max_len = info.max_model_len
    total = 0
    for num_bytes in prompt_num_bytes:
        prompt_est = min(max_len, -(-num_bytes // 4))
        max_tokens = req.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(0, max_len - prompt_est)
        if limits.max_tokens:
            max_tokens = min(max_tokens, limits.max_tokens)
        total += prompt_est + req.n * max_tokens
    return total


def _max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes one token covers (cached on the tokenizer)."""
    cached = getattr(tokenizer, "_tandem_max_token_bytes", None)
    if cached is None:
        cached = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)
        tokenizer._tandem_max_token_bytes = cached
    return cached


def utf8_len(text: str) -> int:
    """`len(text.encode())` without the copy when the text is ASCII (CPython knows that of
    every string: O(1)); a 7.5 MB prompt's encode holds the GIL ~1.5 ms."""
    return len(text) if text.isascii() else len(text.encode())


def _too_long(max_len: int, what: str) -> APIError:
    return bad_request(
        f"This model's maximum context length is {max_len} tokens. However, your request has "
        f"{what} input tokens. Please reduce the length of the input messages.",
        "messages",
    )


def encode_bounded(info: ModelInfo, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode`, refusing over-long text without building its id list.

    Byte length first: a token covers at most `_max_token_bytes` bytes, and normalization
    shrinks UTF-8 by at most 4x, so `bytes / (4 * max_token_bytes)` tokens is a lower bound;
    a 7.5 MB prompt is a 400 at once. Then, for fast tokenizers, the Rust encoding's length
    before its ids: converting millions of ids to a list holds the GIL (the event loop).
    `encode_batch_fast` of one text, not `encode`: the same ids, but it releases the GIL while
    it works (`encode` holds it throughout), so the loop and other workers run meanwhile
    (tests/gateway/test_tokenize_gil.py), and skips the character offsets, which nothing here
    reads (`encode_batch` computes them: 1.25x the time, SmolLM2's tokenizer)."""
    max_len = info.max_model_len
    num_bytes = utf8_len(text)
    min_tokens = num_bytes // (4 * _max_token_bytes(info.tokenizer))
    if min_tokens >= max_len:
        raise _too_long(max_len, f"at least {min_tokens} ({num_bytes} bytes of)")
    backend = getattr(info.tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(info.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    (encoding,) = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
    if len(encoding) >= max_len:
        raise _too_long(max_len, str(len(encoding)))
    return list(encoding.ids)


def tokenize_chat(
    info: ModelInfo, req: ChatCompletionRequest, chat_template: str | None = None
) -> list[int]:
    """Runs in the preprocessing pool (gateway/offload.py)."""
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "chat_template"}
    try:
        messages = [m.to_template_dict() for m in req.messages]
        if chat_template is None and not getattr(info.tokenizer, "chat_template", None):
            # engine.tokenizer.apply_chat_template's message
            apply_chat_template(info.tokenizer, messages, req.add_generation_prompt)
        text = info.tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=req.add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except ValueError as e:
        raise bad_request(str(e), "messages") from e
    except Exception as e:  # noqa: BLE001 - jinja errors: a template that rejects the messages
        raise bad_request(f"Failed to apply the chat template: {e}", "messages") from e
    assert isinstance(text, str), type(text)
    return encode_bounded(info, text, add_special_tokens=req.add_special_tokens)


def tokenize_completion(info: ModelInfo, req: CompletionRequest) -> list[list[int]]:
    """Runs in the preprocessing pool (gateway/offload.py)."""
    result = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            ids = encode_bounded(info, prompt, req.add_special_tokens)
        else:
            ids = prompt
            bad = [t for t in ids if not 0 <= t < info.vocab_size]
            if bad:
                raise bad_request(f"Token id {bad[0]} is out of vocabulary", "prompt")
        if not ids:
            raise bad_request("The decoder prompt cannot be empty", "prompt")
        result.append(ids)
    return result


def resolve_max_tokens(info: ModelInfo, prompt_len: int, requested: int | None) -> int | None:
    """vLLM's checks, messages and default (max_model_len - prompt_len, capped by the config)."""
    max_len = info.max_model_len
    if prompt_len >= max_len:
        raise bad_request(
            f"This model's maximum context length is {max_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            "messages",
        )
    if requested is not None:
        if prompt_len + requested > max_len:
            raise bad_request(
                f"'max_tokens' is too large: {requested}. This model's maximum context length is "
                f"{max_len} tokens and your request has {prompt_len} input tokens "
                f"({requested} > {max_len} - {prompt_len}).",
                "max_tokens",
            )
        return requested
    default = max_len - prompt_len
    config_max = info.generation_config.get("max_new_tokens")
    return default if config_max is None else min(default, config_max)


def build_params(
    info: ModelInfo,
    req: SamplingFields,
    max_tokens: int | None,
    num_logprobs: int | None,
    max_logprobs: int,
    extra: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """`extra`: SamplingParams fields the route resolved itself (structured outputs, logit
    bias, prompt logprobs), passed through as given."""
    if num_logprobs is not None and num_logprobs > max_logprobs:
        raise bad_request(
            f"Requested sample logprobs of {num_logprobs}, which is greater than max allowed: "
            f"{max_logprobs}",
            "logprobs",
        )
    overrides = dict(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=num_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    # Unset (None) fields fall back to generation_config.json, then to SamplingParams' defaults.
    overrides = {k: v for k, v in overrides.items() if v is not None}
    overrides.update(extra or {})
    try:
        return SamplingParams.from_generation_config(info.generation_config, **overrides)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e)) from e


def make_jobs(
    info: ModelInfo,
    req: SamplingFields,
    prompts: Sequence[list[int]],
    num_logprobs: int | None,
    max_logprobs: int,
    max_tokens_cap: int = 0,
    extra: Mapping[str, Any] | None = None,
) -> list[ChildJob]:
    """`max_tokens_cap` (0: none) also bounds the default when the client gives no max_tokens;
    `extra` as for `build_params`."""
    jobs = []
    for p, ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(info, len(ids), req.requested_max_tokens())
        if max_tokens_cap and max_tokens is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        params = build_params(info, req, max_tokens, num_logprobs, max_logprobs, extra)
        for i in range(params.n):
            jobs.append(ChildJob(p * params.n + i, ids, params.child_params(i)))
    return jobs
