"""Offline inference, vLLM-shaped: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams, default_sampling_params
from engine.tokenizer import apply_chat_template, encode_prompt, get_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Takes the keyword arguments of `EngineConfig.from_args` (vLLM's names)."""

    def __init__(self, model: str, *, skip_tokenizer_init: bool = False, **kwargs: Any):
        self.config = EngineConfig.from_args(model, **kwargs)
        mc = self.config.model
        self.tokenizer = None
        if not skip_tokenizer_init:
            self.tokenizer = load_tokenizer(mc.tokenizer or mc.path)
        self.eos_token_ids = frozenset(
            get_eos_token_ids(self.tokenizer, mc.generation_config)
            if self.tokenizer is not None
            else _config_eos(mc.generation_config, mc.hf_config)
        )
        self.engine = EngineCore(self.config)
        # KV-cache events feed routers (a service's KVEventSource drains them); offline no one
        # takes them, and they would pile up for as long as the LLM lives.
        self.engine.kv.pool.enable_events = False
        self._counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.config.model.generation_config)

    # ---- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        token_prompts = [self._tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_prompts, texts, params_list, priority, cache_salt)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; do not set skip_tokenizer_init.")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            apply_chat_template(
                self.tokenizer,
                conv,
                add_generation_prompt,
                chat_template,
                **(chat_template_kwargs or {}),
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    # ---- internals -----------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer; pass token ids instead.")
            return encode_prompt(self.tokenizer, prompt)
        return list(prompt)

    def _run(self, token_prompts, texts, params_list, priority, cache_salt) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        parents: list[tuple[str, list[str]]] = []
        added: list[str] = []
        try:
            for i, (ids, params) in enumerate(zip(token_prompts, params_list)):
                parent_id = str(next(self._counter))
                children = (
                    [params] if params.n == 1 else [params.child_params(k) for k in range(params.n)]
                )
                child_ids = []
                for k, child in enumerate(children):
                    rid = parent_id if params.n == 1 else f"{k}_{parent_id}"
                    req = Request(
                        rid,
                        ids,
                        child,
                        self.eos_token_ids,
                        cache_salt=cache_salt,
                        priority=priority[i] if priority else 0,
                    )
                    self.engine.add_request(req)
                    added.append(rid)
                    processor.add_request(rid, ids, child)
                    child_ids.append(rid)
                parents.append((parent_id, child_ids))
            while self.engine.has_unfinished_requests():
                _, to_abort = processor.process(self.engine.step())
                for rid in to_abort:
                    self.engine.abort_request(rid)
        except BaseException:
            for rid in added:  # leave the engine clean for the next call
                self.engine.abort_request(rid)
            raise
        return [
            self._make_output(pid, cids, ids, text, processor)
            for (pid, cids), ids, text in zip(parents, token_prompts, texts)
        ]

    @staticmethod
    def _make_output(parent_id, child_ids, ids, text, processor) -> RequestOutput:
        states: list[RequestState] = [processor.pop(c) for c in child_ids]
        outputs = [
            CompletionOutput(
                index=k,
                text=s.text,
                token_ids=s.token_ids,
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=s.logprobs if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for k, s in enumerate(states)
        ]
        return RequestOutput(
            request_id=parent_id,
            prompt=text,
            prompt_token_ids=ids,
            outputs=outputs,
            prompt_logprobs=states[0].prompt_logprobs,
            finished=True,
            num_cached_tokens=states[0].num_cached_tokens,
        )


def _config_eos(gen_cfg: dict, hf_config) -> set[int]:
    eos = gen_cfg.get("eos_token_id", getattr(hf_config, "eos_token_id", None))
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
