"""Incremental detokenization and stop-string matching for streaming output.

Why not `tokenizer.decode(all_ids)` every step: that is O(n) per token, O(n^2) per request.
`IncrementalDetokenizer` decodes only a small window of recent tokens per step (vLLM's
prefix_offset / read_offset algorithm) and holds back text that still ends in an incomplete
UTF-8 sequence, so a byte-level tokenizer that splits a character across tokens never streams
U+FFFD. Invariant (tested): the deltas of `update()` plus `flush()` concatenate to
`tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level BPE tokenizers.

`FastIncrementalDetokenizer` is the same algorithm in Rust (`tokenizers.decoders.DecodeStream`,
as vLLM's fast detokenizer uses it), ~5x less CPU per token; `make_detokenizer` picks it for any
tokenizer backed by a `tokenizers.Tokenizer` and keeps the Python one for the rest.

`StopStringMatcher` sits after the detokenizer: it holds back the shortest tail of text that
could still grow into a stop string, so a stop string is never streamed to the client.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

try:  # tokenizers >= 0.22: a stream primed with context ids
    from tokenizers.decoders import DecodeStream

    DecodeStream(ids=[], skip_special_tokens=False)
except (ImportError, TypeError):
    DecodeStream = None

if TYPE_CHECKING:  # the gateway uses this module and imports no transformers
    from transformers import PreTrainedTokenizerBase

# How many prompt tokens give the first output token its context (vLLM uses 5). Context matters
# for tokenizers whose decoding of a token depends on its neighbours (SentencePiece spaces).
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# DecodeStream's error when a decode's text does not extend the text before it (vLLM #17448).
_INVALID_PREFIX = "Invalid prefix encountered"

logger = logging.getLogger(__name__)


def make_detokenizer(
    tokenizer: PreTrainedTokenizerBase,
    prompt_token_ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> IncrementalDetokenizer | FastIncrementalDetokenizer:
    """The Rust stream for tokenizers backed by `tokenizers` (LightTokenizer, transformers'
    fast tokenizers), the Python algorithm for the rest; both keep the invariant above."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is not None and isinstance(backend, Tokenizer):
        return FastIncrementalDetokenizer(backend, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(
        tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
    )


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of text deltas.

    `tokens[prefix_offset:read_offset]` is already-emitted context; `tokens[read_offset:]` is
    not yet emitted. Each step decodes `tokens[prefix_offset:]` and emits what lies beyond the
    decoded context, unless it ends in U+FFFD (an incomplete character: wait for more bytes).

    `spaces_between_special_tokens` only affects slow tokenizers; fast tokenizers' `decode`
    ignores it, and so do we (the invariant above is stated against `decode`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.output_token_ids: list[int] = []
        self.output_text = ""
        context_ids = prompt_token_ids[-_NUM_CONTEXT_TOKENS:]
        self.tokens: list[str] = self._to_tokens(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        # Context text that ends mid-character would make `decoded[len(context):]` misaligned;
        # such a prompt (token ids, not text) gets no context at all.
        if self._to_text(self.tokens).endswith(_REPLACEMENT_CHAR):
            self.tokens = []
            self.read_offset = 0

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(
            token_ids, skip_special_tokens=self.skip_special_tokens
        )
        # Ids beyond the tokenizer's vocabulary (models often pad the embedding) decode to None.
        return [t for t in tokens if t is not None]

    def _to_text(self, tokens: list[str]) -> str:
        return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def update(self, new_token_ids: list[int]) -> str:
        """Add output tokens; return the text that became final (may be "")."""
        self.output_token_ids.extend(new_token_ids)
        self.tokens.extend(self._to_tokens(new_token_ids))
        context_text = self._to_text(self.tokens[self.prefix_offset : self.read_offset])
        text = self._to_text(self.tokens[self.prefix_offset :])
        if len(text) <= len(context_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = text[len(context_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Emit held-back text (it ends in U+FFFD) when the request ends; returns the delta."""
        context_text = self._to_text(self.tokens[self.prefix_offset : self.read_offset])
        text = self._to_text(self.tokens[self.prefix_offset :])
        delta = text[len(context_text) :]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.output_text += delta
        return delta


class FastIncrementalDetokenizer:
    """`IncrementalDetokenizer`'s interface on `tokenizers`' Rust `DecodeStream`.

    The stream holds back text ending in an incomplete character (U+FFFD) like the Python
    algorithm; `flush` emits it when the request ends. Fast tokenizers' `decode` ignores
    `spaces_between_special_tokens`, so this class takes none.
    """

    def __init__(
        self, backend: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._num_held = 0  # trailing output ids whose text the stream holds back
        context_ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        # As in IncrementalDetokenizer: context ending mid-character gives no context.
        context = backend.decode(context_ids, skip_special_tokens=skip_special_tokens)
        if context.endswith(_REPLACEMENT_CHAR):
            context_ids = []
        self._stream = DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        """Add output tokens; return the text that became final (may be "")."""
        if not new_token_ids:
            return ""
        self.output_token_ids.extend(new_token_ids)
        try:
            delta = self._stream.step(self.backend, list(new_token_ids))
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # A tokenizer whose text for more ids does not extend its text for fewer breaks the
            # stream's state; vLLM restarts it without context, and so do we (logged).
            logger.warning("%s; restarting the request's decode stream without context", e)
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            delta = self._stream.step(self.backend, list(new_token_ids))
        if delta is None:
            self._num_held += len(new_token_ids)
            return ""
        self._num_held = 0
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Emit held-back text (it ends in U+FFFD) when the request ends; returns the delta."""
        if not self._num_held:
            return ""
        decode = self.backend.decode
        text = decode(self.output_token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.startswith(self.output_text):
            delta = text[len(self.output_text) :]
        else:  # SentencePiece spaces, or byte fallback's all-or-nothing runs: held ids alone
            held = self.output_token_ids[-self._num_held :]
            delta = decode(held, skip_special_tokens=self.skip_special_tokens)
        self._num_held = 0
        self._stream = DecodeStream(ids=[], skip_special_tokens=self.skip_special_tokens)
        self.output_text += delta
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text without ever streaming (part of) one.

    Feed text deltas in order. Among stop strings in the text, the first to *complete* wins
    (earliest end; on a tie the longer one, which starts earlier), so the result does not
    depend on how the text was cut into deltas. vLLM semantics: the output ends just before the
    stop string, or just after it with `include_stop_str_in_output`.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = list(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held_text = ""
        self.stop_str: str | None = None  # the stop string that ended the text, once found

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        assert not self.is_stopped, "feed() after a stop string was hit"
        text = self.held_text + delta
        hit = self._first_completed_stop(text)
        if hit is not None:
            start, stop_str = hit
            self.stop_str = stop_str
            self.held_text = ""
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            return text[:end], True
        num_held = self._num_chars_to_hold(text)
        self.held_text = text[len(text) - num_held :]
        return text[: len(text) - num_held], False

    def flush(self) -> str:
        """The held-back text, for a request that ends for another reason (EOS, length)."""
        text, self.held_text = self.held_text, ""
        return text

    def _first_completed_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop string)
        for s in self.stop:
            start = text.find(s)
            if start >= 0:
                key = (start + len(s), -len(s), s)
                best = key if best is None or key < best else best
        return None if best is None else (best[0] + best[1], best[2])

    def _num_chars_to_hold(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string.

        Everything before it can never become part of a stop string, whatever comes next.
        """
        max_len = min(len(text), max((len(s) for s in self.stop), default=1) - 1)
        for n in range(max_len, 0, -1):
            suffix = text[len(text) - n :]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0
