"""Structured outputs (vLLM's `structured_outputs`) on xgrammar, as vLLM v1 does them.

Lifecycle of one constrained request:
1. Admission (engine thread): `StructuredOutputManager.start` looks the grammar up in a bounded
   LRU cache keyed by (kind, spec, whitespace option). On a miss it builds the `xgr.Grammar` at
   once (cheap; an invalid schema, regex or grammar raises ValueError here, which the services
   answer with INVALID_ARGUMENT) and compiles it on a worker thread: compiling precomputes token
   masks over the whole vocabulary (tens of ms to seconds with a 150k vocabulary), which must not
   stall the other requests' decoding. The request waits outside the scheduler until the
   compile is done (`EngineCore`). The first constrained request also loads the tokenizer
   for xgrammar, on that worker.
2. Ready: `StructuredRequest.activate` makes the request's `GrammarMatcher` and feeds it the
   output tokens the request already has (a decode instance resuming after a remote prefill's
   first token), so the grammar resumes where the sampler that drew them left it.
3. Every step: the model runner fills one row of a shared bitmask per constrained row, copies it
   to the device once and masks the logits before sampling (`engine/grammar_bitmask.py`).
4. Every accepted token: `StructuredRequest.advance`. After the stop token the matcher is
   terminated and the request must end (EngineCore stops it even under `ignore_eos`).

Reasoning: with `reasoning_end_token_id` set, tokens up to and including the end of the
reasoning are free and not fed to the matcher; the grammar constrains what follows.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from engine.config import ModelConfig

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (LRU); a Qwen-vocab JSON schema is ~MBs
NUM_COMPILE_WORKERS = 2  # xgrammar compiles with its own threads inside one job
# vLLM's json_object: any JSON object (xgrammar's builtin grammar would allow any JSON value).
JSON_OBJECT_SCHEMA = '{"type": "object"}'

_LABELS = {
    "json": "JSON schema",
    "json_object": "json_object constraint",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}
# xgrammar's C++ errors start with "[12:34:56] /project/cpp/file.cc:123: " and may carry a
# "Check failed: (...) is false: " prefix; neither helps a client.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def import_xgrammar():
    """xgrammar, imported on first use (0.3 s in an engine process, 1.4 s cold): most engines
    never need it."""
    import xgrammar

    return xgrammar


def grammar_key(so: StructuredOutputsParams) -> tuple[str, str, bool]:
    """What identifies a compiled grammar: kind, spec, whitespace option."""
    kind = so.kind
    spec = getattr(so, kind)
    if kind == "json" and not isinstance(spec, str):
        spec = json.dumps(spec)  # property order matters to the grammar: no sort_keys
    elif kind == "choice":
        spec = json.dumps(spec)
    elif kind == "json_object":
        spec = JSON_OBJECT_SCHEMA
    return kind, spec, so.disable_any_whitespace


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"`; JSON string escapes are valid EBNF string escapes in xgrammar."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(so: StructuredOutputsParams) -> xgrammar.Grammar:
    """The request's grammar, not yet compiled; ValueError naming what is invalid."""
    xgr = import_xgrammar()
    kind = so.kind
    any_whitespace = not so.disable_any_whitespace
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(so.json, any_whitespace=any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(so.regex)
        if kind == "choice":
            if not all(isinstance(c, str) for c in so.choice):
                raise ValueError("every choice must be a string")
            return xgr.Grammar.from_ebnf(choice_ebnf(so.choice))
        if kind == "grammar":
            # GBNF/EBNF rules use `::=`; anything else is read as Lark, as vLLM does.
            if "::=" in so.grammar:
                return xgr.Grammar.from_ebnf(so.grammar)
            return xgr.Grammar.from_lark(so.grammar)
        assert kind == "structural_tag", kind
        return _structural_tag_grammar(xgr, so.structural_tag)
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        message = _CPP_PREFIX.sub("", str(e).strip()) or type(e).__name__
        raise ValueError(f"Invalid {_LABELS[kind]} for structured outputs: {message}") from None


def _structural_tag_grammar(xgr, spec: str) -> xgrammar.Grammar:
    """vLLM accepts xgrammar's structural tag JSON, or the legacy {"structures", "triggers"}."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"])
    return xgr.Grammar.from_structural_tag(spec)


def reasoning_ended_in_prompt(prompt: list[int], start_id: int | None, end_id: int) -> bool:
    """The prompt closed its reasoning: an end id after the last start id (any end id when
    there is no start id)."""
    last_end = _rindex(prompt, end_id)
    if start_id is None:
        return last_end >= 0
    return last_end >= 0 and last_end > _rindex(prompt, start_id)


def _rindex(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


class StructuredRequest:
    """One request's grammar state: its compile (a future) and, once ready, its matcher."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future):
        self.params = params
        self.compiled = compiled
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.reasoning_ended = params.reasoning_end_token_id is None

    @property
    def is_ready(self) -> bool:
        return self.compiled.done()

    def activate(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> bool:
        """Make the matcher (the compile must be done; its error is raised here) and feed it
        the outputs so far. False: the grammar rejects one of them."""
        assert self.matcher is None, "activated twice"
        self.matcher = import_xgrammar().GrammarMatcher(self.compiled.result())
        end_id = self.params.reasoning_end_token_id
        if end_id is not None:
            start_id = self.params.reasoning_start_token_id
            self.reasoning_ended = reasoning_ended_in_prompt(prompt_token_ids, start_id, end_id)
        return all(self.advance(t) for t in output_token_ids)

    def advance(self, token_id: int) -> bool:
        """Take a sampled token; False if the grammar rejects it."""
        assert self.matcher is not None
        if not self.reasoning_ended:
            self.reasoning_ended = token_id == self.params.reasoning_end_token_id
            return True
        return self.matcher.accept_token(token_id)

    @property
    def is_constrained(self) -> bool:
        """The next token must follow the grammar."""
        m = self.matcher
        return m is not None and self.reasoning_ended and not m.is_terminated()

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: nothing more may follow."""
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles grammars off the engine thread, with a bounded cache shared by all requests.

    `start` is called on the engine thread only; compile jobs run on the workers. The
    tokenizer xgrammar needs is loaded by the first job (never when no request is constrained).
    """

    def __init__(
        self, model_config: ModelConfig, device: str = "cpu", max_cached: int = MAX_CACHED_GRAMMARS
    ):
        self.model_config = model_config
        self.device = torch.device(device)
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._init_lock = threading.Lock()
        self._init_error: str | None = None
        self.num_compiles = 0  # grammars sent to compile (cache misses)

    def start(self, params: StructuredOutputsParams) -> StructuredRequest:
        """A request's grammar state; its compile may still be running. ValueError: the
        constraint is invalid (or structured outputs cannot work on this model)."""
        if self._init_error is not None:
            raise ValueError(f"Structured outputs are unavailable: {self._init_error}")
        key = grammar_key(params)
        compiled = self._cache.get(key)
        if compiled is not None and not (compiled.done() and compiled.exception() is not None):
            self._cache.move_to_end(key)
            return StructuredRequest(params, compiled)
        grammar = build_grammar(params)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(NUM_COMPILE_WORKERS, "grammar-compile")
        compiled = self._executor.submit(self._compile, grammar)
        self.num_compiles += 1
        self._cache[key] = compiled
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)  # requests holding it keep their own reference
        return StructuredRequest(params, compiled)

    def _compile(self, grammar: xgrammar.Grammar) -> xgrammar.CompiledGrammar:
        return self._get_compiler().compile_grammar(grammar)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._init_lock:
            if self._compiler is None:
                try:
                    self._compiler = self._make_compiler()
                except Exception as e:
                    self._init_error = f"cannot load the tokenizer for xgrammar: {e}"
                    logger.exception("structured outputs: %s", self._init_error)
                    raise
            return self._compiler

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        from engine.tokenizer import get_eos_token_ids, load_tokenizer

        xgr = import_xgrammar()
        mc = self.model_config
        tokenizer = load_tokenizer(mc.tokenizer or mc.path)
        stop_ids = sorted(get_eos_token_ids(tokenizer, mc.generation_config))
        # vocab_size: the logits' width (the model may pad its vocabulary past the tokenizer's);
        # ids past the tokenizer's are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=mc.vocab_size, stop_token_ids=stop_ids or None
        )
        logger.info(
            "structured outputs: xgrammar ready (vocab %d, stop ids %s)",
            mc.vocab_size,
            stop_ids,
        )
        if self.device.type == "cuda":
            from engine.grammar_bitmask import warm_up_mask_kernel

            warm_up_mask_kernel(mc.vocab_size, self.device)
        # Our cache above is the one cache (bounded, and shared by in-flight compiles). Half
        # the cores at most: the engine loop and the RPC threads must keep running meanwhile.
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
