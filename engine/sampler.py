"""Batched sampler for one decoding step, following vLLM v1's `Sampler`.

Order per step (vLLM v1):
  0. (before the sampler, in the model runner) structured outputs' grammar bitmask: tokens the
     grammar forbids get -inf, so they also get -inf logprobs;
  1. logprobs from the *raw* logits (what the model said, before any request processing);
  2. logit_bias: add each request's per-token values;
  3. min_tokens: mask EOS / stop tokens until the request has produced `min_tokens`;
  4. repetition (prompt + output), frequency and presence (output only) penalties;
  5. greedy rows: argmax of the penalized logits;
  6. random rows: temperature, min_p, top_k, top_p, then the exponential race
     `argmax(probs / Exponential(1))`, which is an exact draw from `probs`.

Seeded requests draw their noise row by row from their own `torch.Generator`, so their tokens
do not depend on which other requests share the batch or at which row they sit.
All work is done in fp32 whatever the logits dtype. Each `apply_*` function is public so it can be
checked against a reference on its own.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from engine.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class SamplingBatch:
    """One row per sequence being sampled this step, in the same order as the logits rows.

    `eos_token_ids[i]` holds the EOS ids min_tokens must suppress for row i (the request's
    `eos_token_ids`, set or frozenset); None means no EOS masking. The params'
    `stop_token_ids` are always masked under min_tokens.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_ids: list[AbstractSet[int]] | None = None
    # Speculative decoding: keep each seeded row's generator state from before its draw (a
    # verify step rewinds a generator past the draws of rejected positions).
    record_generator_states: bool = False

    def __post_init__(self) -> None:
        num_rows = len(self.params)
        assert len(self.generators) == num_rows
        assert len(self.prompt_token_ids) == num_rows
        assert len(self.output_token_ids) == num_rows
        assert self.eos_token_ids is None or len(self.eos_token_ids) == num_rows

    @property
    def num_rows(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} with the sampled token first, then the top-`params.logprobs`
    # tokens; None when the request did not ask for logprobs.
    logprobs: list[dict[int, float] | None]
    # With `record_generator_states`: per row, its generator's state before the row drew its
    # noise (None for rows that drew nothing from a generator of their own).
    generator_states: list[torch.Tensor | None] | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator a seeded request keeps for its whole life (None if unseeded)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Stateless: all per-request state (RNG, token history) arrives in the batch."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, logits.shape
        if all(is_argmax_only(p, len(out)) for p, out in zip(batch.params, batch.output_token_ids)):
            # The common serving case: one argmax kernel, no fp32 copy of the logits (a grammar
            # mask, if any, is already in the logits).
            ids = logits.argmax(dim=-1).tolist()
            states = [None] * batch.num_rows if batch.record_generator_states else None
            return SamplerOutput(ids, [None] * batch.num_rows, states)
        # Copy even when already fp32: min_tokens masks in place and the caller keeps its logits.
        logits = logits.to(torch.float32, copy=True)
        num_logprobs = [p.logprobs for p in batch.params]
        wants_logprobs = any(k is not None for k in num_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None

        logits = apply_logit_bias(logits, batch.params)
        logits = apply_min_tokens(logits, batch)
        logits = apply_penalties(logits, batch)

        states = [None] * batch.num_rows if batch.record_generator_states else None
        token_ids = _draw(logits, batch.params, batch.generators, states)
        token_id_list = token_ids.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_id_list, [None] * batch.num_rows, states)
        logprobs = _gather_logprobs(raw_logprobs, token_ids, num_logprobs)
        return SamplerOutput(token_id_list, logprobs, states)

    def draw(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list
    ) -> torch.Tensor:
        """The tokens of rows that need nothing from the host's token history (each
        `is_async_samplable`), as a device tensor, without waiting for the device: what
        `__call__` would sample for them, draw for draw (async scheduling reads it later)."""
        if all(p.temperature < SAMPLING_EPS for p in params):
            return logits.argmax(dim=-1)  # as `__call__`'s fast path: no fp32 copy
        return _draw(logits.to(torch.float32, copy=True), params, generators, None)


def _draw(logits, params, generators, states) -> torch.Tensor:
    """Greedy rows: the argmax; random rows: temperature, min_p, top_k, top_p, then the
    exponential race. `logits` fp32, already biased and penalized; changed in place."""
    is_greedy = [p.temperature < SAMPLING_EPS for p in params]
    token_ids = logits.argmax(dim=-1)
    if not all(is_greedy):
        probs = torch.softmax(apply_sampling_filters(logits, params), dim=-1)
        sampled = exponential_race(probs, generators, is_greedy, states)
        greedy_mask = _on_device(is_greedy, torch.bool, logits.device)
        token_ids = torch.where(greedy_mask, token_ids, sampled)
    return token_ids


def is_async_samplable(p: SamplingParams, num_output_tokens: int) -> bool:
    """The sampler's work for this row needs no token history and returns no logprobs: no
    penalties, logit bias or pending min_tokens (`Sampler.draw` can sample it on the device)."""
    return (
        p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and not p.logit_bias
        and num_output_tokens >= p.min_tokens
    )


def is_argmax_only(p: SamplingParams, num_output_tokens: int) -> bool:
    """The sampler's work for this row is an argmax of the logits it is given."""
    return p.temperature < SAMPLING_EPS and is_async_samplable(p, num_output_tokens)


def is_plain_greedy(p: SamplingParams, num_output_tokens: int) -> bool:
    """An argmax of the raw logits: what the decode graphs compute on the device (async
    scheduling); a grammar needs its mask from the host first."""
    return p.structured_outputs is None and is_argmax_only(p, num_output_tokens)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add `logit_bias[token]` to each row's logits, in place (token ids validated at
    admission; values as given: the gateway clamps them to [-100, 100] as vLLM does)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long, device=logits.device)
        bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_((index[0], index[1]), bias, accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Forbid every token that would end the request before it has `min_tokens` outputs.

    Like vLLM, EOS is masked even with ignore_eos (harmless: EOS cannot stop such a request).
    """
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(batch.params):
        if len(batch.output_token_ids[i]) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids)
        if batch.eos_token_ids is not None:
            stop_ids |= batch.eos_token_ids[i]
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    if rows:
        logits[rows, cols] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF style, prompt + output), frequency and presence (OpenAI, output only)."""
    params = batch.params
    has_rep = any(p.repetition_penalty != 1.0 for p in params)
    has_freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
    if not (has_rep or has_freq_pres):
        return logits
    num_rows, vocab_size = logits.shape
    output_counts = _token_counts(batch.output_token_ids, num_rows, vocab_size, logits.device)
    if has_rep:
        prompt_counts = _token_counts(batch.prompt_token_ids, num_rows, vocab_size, logits.device)
        seen = (prompt_counts > 0) | (output_counts > 0)
        rep = _row_tensor([p.repetition_penalty for p in params], logits).expand_as(logits)
        # Dividing a negative logit would *raise* its probability, hence the sign split.
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if has_freq_pres:
        freq = _row_tensor([p.frequency_penalty for p in params], logits)
        pres = _row_tensor([p.presence_penalty for p in params], logits)
        logits = logits - freq * output_counts - pres * (output_counts > 0).to(logits.dtype)
    return logits


def apply_sampling_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p for the random rows (greedy rows pass temperature 1)."""
    temperatures = [p.temperature if p.temperature >= SAMPLING_EPS else 1.0 for p in params]
    logits = apply_temperature(logits, _row_tensor(temperatures, logits))
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, _row_tensor([p.min_p for p in params], logits))
    vocab_size = logits.shape[-1]
    use_top_k = any(0 < p.top_k < vocab_size for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        logits = apply_top_k_top_p(
            logits,
            _on_device(top_k, torch.int64, logits.device) if use_top_k else None,
            _row_tensor([p.top_p for p in params], logits).squeeze(1) if use_top_p else None,
        )
    return logits


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`temperatures` is [num_rows, 1]; must be positive."""
    return logits / temperatures


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p * max_prob` (`min_p` is [num_rows, 1])."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p with one ascending sort, as vLLM and HF do. Ties at the k-th value stay.

    `top_k` is [num_rows] ints in [1, vocab]; `top_p` is [num_rows] floats in (0, 1].
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_index = (logits_sort.shape[-1] - top_k).unsqueeze(1)
        kth_value = logits_sort.gather(1, kth_index)
        logits_sort.masked_fill_(logits_sort < kth_value, float("-inf"))
    if top_p is not None:
        cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum_probs <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(-1, logits_idx, logits_sort)


def exponential_race(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    skip_rows: list[bool],
    states: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Sample one token per row: `argmax(probs / E)` with E ~ Exponential(1) i.i.d.

    This is an exact categorical draw and needs no cumsum. Rows with a generator take all of
    their noise from it (the same vocab-sized draw whatever the batch), in row order (rows
    sharing a generator draw one after the other); rows in `skip_rows` (greedy) consume
    nothing from their generator. `states`, if given, gets each drawing row's generator state
    from before its draw.
    """
    noise = torch.empty_like(probs)
    if any(g is None and not skip for g, skip in zip(generators, skip_rows, strict=True)):
        noise.exponential_()
    for i, generator in enumerate(generators):
        if generator is not None and not skip_rows[i]:
            if states is not None:
                states[i] = generator.get_state()
            if generator.device == noise.device:
                noise[i].exponential_(generator=generator)
            else:  # CPU generator, GPU logits: same stream as on CPU, then one copy
                row = torch.empty(noise.shape[1], dtype=noise.dtype).exponential_(
                    generator=generator
                )
                noise[i].copy_(row, non_blocking=True)
    return (probs / noise).argmax(dim=-1)


def skip_sampler_step(generator: torch.Generator, vocab_size: int) -> None:
    """Consume exactly what one random sampling step draws from a row's generator.

    Used when a step was sampled elsewhere (the first token of a disaggregated request comes
    from the prefill instance): the decode side continues the same random stream.
    """
    torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=generator)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], k: int
) -> list[dict[int, float]]:
    """Prompt logprobs: row i of `logits` predicts `next_token_ids[i]`.

    Returns, per position, that actual token's logprob plus the top-`k` (vLLM's prompt_logprobs).
    """
    assert logits.dim() == 2 and logits.shape[0] == len(next_token_ids), logits.shape
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_ids = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    return _gather_logprobs(logprobs, token_ids, [k] * len(next_token_ids))


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[dict[int, float] | None]:
    """One `.tolist()` per tensor instead of per-element syncs (matters on GPU)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = min(max((k or 0) for k in num_logprobs), logprobs.shape[-1]) if num_logprobs else 0
    top_vals: list[list[float]] = [[] for _ in num_logprobs]
    top_ids: list[list[int]] = [[] for _ in num_logprobs]
    if max_k > 0:
        vals, ids = logprobs.topk(max_k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    token_id_list = token_ids.tolist()
    out: list[dict[int, float] | None] = []
    for i, k in enumerate(num_logprobs):
        if k is None:
            out.append(None)
            continue
        row = {token_id_list[i]: chosen[i]}
        row.update(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
        out.append(row)
    return out


def _token_counts(
    token_ids: list[list[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab] occurrence counts, built with one scatter over a padded id matrix.

    Pads with `vocab_size` into an extra column that is dropped, so ragged rows need no loop.
    """
    max_len = max((len(ids) for ids in token_ids), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = torch.full((num_rows, max_len), vocab_size, dtype=torch.long)
    for i, ids in enumerate(token_ids):
        padded[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    # Ids past the logits' vocab (padded embeddings) cannot be sampled; HF drops them likewise.
    padded = padded.clamp_(max=vocab_size).to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _row_tensor(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A per-row scalar as a [num_rows, 1] column that broadcasts over the vocab."""
    return _on_device(values, like.dtype, like.device).unsqueeze(1)


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` on `device` without waiting for it: a plain `torch.tensor(..., device=cuda)`
    synchronizes the stream (the forward of a step launched ahead); a pinned copy does not
    (the caching host allocator keeps the buffer until the copy is done)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
