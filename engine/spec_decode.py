"""N-gram speculative decoding (vLLM's `"method": "ngram"`, a.k.a. prompt lookup).

A step, for a request that is decoding:
  1. the scheduler asks `NgramProposer.propose` for up to k draft tokens: those that followed
     an earlier occurrence of the request's longest matching suffix (prompt + output);
  2. the request is scheduled with 1 + k new tokens (its last sampled token, then the drafts):
     one forward pass gives logits at all 1 + k positions (the chunked-prefill path: attention
     over the cached context plus causal attention among the new tokens);
  3. the sampler draws the target token t_j at every position j as if drafts 1..j had been
     accepted (row j sees output + drafts[:j]: penalties, min_tokens and logprobs hold per
     position), with the noise a non-speculative run would draw for that token;
  4. drafts are accepted while d_j == t_j; the tokens emitted are t_0..t_a (a accepted drafts,
     then the target's own token: the correction at the first mismatch, or the bonus token
     after all k). The KV of the rejected positions is dropped by rolling
     `num_computed_tokens` back (their slots are rewritten when those positions come again),
     and a seeded request's generator is rewound to the state after a + 1 draws.

Why this is exact: t_j is a draw from the target distribution p_j, so for a one-hot draft d
the draft is accepted with probability p_j(d) and, when rejected, t_j is distributed as p_j
with d removed and renormalized: the rejection-sampling rule of speculative decoding for a
one-hot draft distribution, and the bonus token is a draw from p_k. Greedy rows are the same
rule with t_j = argmax. Since t_j is the very token a non-speculative run would produce, a
seeded request's output does not depend on speculation at all (tested token for token).

Which requests get drafts: all but structured-output ones (their grammar matcher would have
to advance through the drafts and roll back) and prefill-role ones (they stop at one token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sampler import SamplingBatch


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """vLLM's n-gram lookup: the longest suffix of `tokens` of length in [min_n, max_n] that
    also ends earlier in `tokens` (occurrences may overlap the suffix), and up to `k` tokens
    that followed its earliest such occurrence. Empty when nothing matches.

    Vectorized: the candidates are the earlier positions of the last token; each is extended
    backwards by at most max_n - 1 comparisons at once. O(len) per call, no Python loop."""
    num_tokens = tokens.shape[0]
    if k <= 0 or num_tokens <= min_n:  # a match of min_n needs min_n + 1 tokens at least
        return tokens[:0]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence could end
    if ends.size == 0:
        return tokens[:0]
    offsets = np.arange(1, min(max_n, num_tokens))
    if offsets.size:
        before = ends[:, None] - offsets  # the positions each candidate must also match
        same = (tokens[np.maximum(before, 0)] == tokens[num_tokens - 1 - offsets]) & (before >= 0)
        lengths = 1 + np.logical_and.accumulate(same, axis=1).sum(axis=1)
    else:
        lengths = np.ones_like(ends)
    best = lengths.max()
    if best < min_n:
        return tokens[:0]
    start = ends[np.argmax(lengths == best)] + 1  # argmax: the first (earliest) of the longest
    return tokens[start : start + k]


class _TokenHistory:
    """A request's token ids as a growing int64 array, appended to as tokens arrive (the list
    is never converted whole: that would cost more than the lookup)."""

    def __init__(self, request: Request):
        self.request = request
        self.buf = np.empty(max(64, 2 * request.num_tokens), dtype=np.int64)
        self.num_tokens = 0

    def sync(self) -> np.ndarray:
        r = self.request
        n = r.num_tokens
        if n > self.buf.shape[0]:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[: self.num_tokens] = self.buf[: self.num_tokens]
            self.buf = grown
        if n > self.num_tokens:
            self.buf[self.num_tokens : n] = r.token_ids(self.num_tokens, n)
            self.num_tokens = n
        return self.buf[:n]


class NgramProposer:
    """Drafts for the scheduler; keeps each request's token history until `forget`."""

    def __init__(self, config: SpeculativeConfig):
        assert config.method == "ngram", config.method
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._history: dict[str, _TokenHistory] = {}

    def propose(self, request: Request, max_num_drafts: int) -> list[int]:
        """Up to min(K, max_num_drafts) draft tokens to follow the request's last token."""
        k = min(self.num_speculative_tokens, max_num_drafts)
        if k <= 0 or not can_speculate(request):
            return []
        history = self._history.get(request.request_id)
        if history is None or history.request is not request:
            history = self._history[request.request_id] = _TokenHistory(request)
        return find_ngram_draft(history.sync(), self.min_n, self.max_n, k).tolist()

    def forget(self, request_id: str) -> None:
        self._history.pop(request_id, None)


def can_speculate(request: Request) -> bool:
    """Drafts only where the verify path reproduces the non-speculative tokens exactly."""
    return request.structured is None and not request.hold_blocks


def sampling_batch(requests: list[Request], drafts: list[list[int]]) -> SamplingBatch:
    """One sampler row per position to verify: request i gets 1 + len(drafts[i]) rows, row j
    seeing the output as it would be with drafts[i][:j] accepted. A seeded request's rows
    share its generator, so they draw its noise in order, as successive steps would."""
    params, gens, prompts, outputs, eos = [], [], [], [], []
    for r, d in zip(requests, drafts, strict=True):
        p = r.sampling_params
        stop_ids = set() if p.ignore_eos else r.eos_token_ids
        # Only penalties and min_tokens read the output; without them every row can share it.
        reads_output = (
            p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
            or r.num_output_tokens < p.min_tokens
        )
        for j in range(1 + len(d)):
            params.append(p)
            gens.append(r.generator)
            prompts.append(r.prompt_token_ids)
            outputs.append(r.output_token_ids + d[:j] if j and reads_output else r.output_token_ids)
            eos.append(stop_ids)
    return SamplingBatch(params, gens, prompts, outputs, eos, record_generator_states=True)


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """Drafts accepted: the leading ones equal to the target's token at their position."""
    assert len(targets) == len(drafts) + 1
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


@dataclass
class SpecDecodeStats:
    """vLLM's counters: `spec_decode_num_drafts` (verify rows), `_num_draft_tokens`,
    `_num_accepted_tokens`, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        assert 0 <= num_accepted_tokens <= num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted_tokens):
            self.accepted_per_pos[pos] += 1
