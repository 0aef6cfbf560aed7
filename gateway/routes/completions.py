"""`POST /v1/completions`: text or token-id prompts (one or many) → text_completion shapes;
`echo`, `logprobs` and `prompt_logprobs` as vLLM returns them (what lm-eval's loglikelihood
tasks read)."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.accounting import metered, reserve_estimate
from gateway.deps import GatewayDep, PrincipalDep
from gateway.dispatch import PromptLogprobs, RequestOptions, TokenDelta
from gateway.extra_params import shared_extra
from gateway.logprobs import TokenTexts, completion_logprobs
from gateway.model_info import ModelInfo
from gateway.offload import openapi_body, parse_body
from gateway.preprocess import (
    check_caps,
    check_model,
    check_stop,
    check_supported,
    estimate_num_tokens,
    make_jobs,
    resolve_cache_salt,
    tokenize_completion,
    utf8_len,
)
from gateway.protocol import CompletionRequest
from gateway.serving import Choice, ResponseBuilder, respond
from gateway.structured import structured_extra

router = APIRouter()


class CompletionBuilder(ResponseBuilder):
    """`echo` as vLLM does it: each choice's text starts with its prompt's text, and with
    `logprobs` its prompt's tokens come first (the first with null logprobs); streamed, the
    prompt goes out with the choice's first chunk. With `max_tokens=0` (`echo_only`) the one
    token the engine ran is left out of text and logprobs (usage still counts it, as vLLM)."""

    chunk_object = "text_completion"

    def __init__(
        self,
        *args: Any,
        num_logprobs: int | None,
        texts: TokenTexts,
        echo: list[tuple[str, list[int]]] | None = None,
        echo_only: bool = False,
    ):
        super().__init__(*args)
        self.num_logprobs, self.texts = num_logprobs, texts
        self.echo, self.echo_only = echo, echo_only  # echo: (text, token ids) per prompt
        self._has_echoed: set[int] = set()

    def _output(
        self, choice: Choice, text: str, logprobs: list, prompt_logprobs: PromptLogprobs | None
    ) -> tuple[str, list, int | None]:
        """(text, logprobs, first token without logprobs) with the prompt echoed in front."""
        if self.echo_only:
            text, logprobs = "", []
        if self.echo is None or choice.index in self._has_echoed:
            return text, logprobs, None
        prompt_text, prompt_ids = self.echo[choice.index // self.n]
        if self.num_logprobs is None:
            return prompt_text + text, logprobs, None
        assert prompt_logprobs is not None, "echo with logprobs asks for prompt logprobs"
        return prompt_text + text, [*prompt_logprobs.logprobs, *logprobs], prompt_ids[0]

    def chunk_choice(self, d: TokenDelta, choice: Choice) -> dict[str, Any] | None:
        text, token_logprobs, first_id = self._output(choice, d.text, d.logprobs, d.prompt_logprobs)
        self._has_echoed.add(choice.index)
        has_logprobs = self.num_logprobs is not None and (
            bool(token_logprobs) or first_id is not None
        )
        if not text and d.finish_reason is None and not has_logprobs:
            return None
        logprobs = None
        if has_logprobs:
            logprobs, choice.text_offset = completion_logprobs(
                self.texts, token_logprobs, choice.text_offset, self.num_logprobs, first_id
            )
        return {
            "index": d.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }

    def final_body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text, token_logprobs, first_id = self._output(c, c.text, c.logprobs, c.prompt_logprobs)
            logprobs = None
            if self.num_logprobs is not None:
                logprobs, _ = completion_logprobs(
                    self.texts, token_logprobs, 0, self.num_logprobs, first_id
                )
            choices.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "prompt_logprobs": self.prompt_logprobs(self.texts, c.index),
                }
            )
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }


def echo_texts(info: ModelInfo, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text as echoed: as sent, or decoded from token ids (as vLLM does)."""
    return [
        p if isinstance(p, str) else info.tokenizer.decode(ids)
        for p, ids in zip(req.prompts(), prompts)
    ]


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def create_completion(request: Request, gw: GatewayDep, principal: PrincipalDep) -> Response:
    # The body is parsed by us (in the preprocessing pool unless small), not by FastAPI.
    settings, pre = gw.settings, gw.preprocessor
    raw = await request.body()
    body = await pre.run(
        parse_body, CompletionRequest, raw, settings.max_messages, num_bytes=len(raw)
    )
    check_model(gw.model, body.model)
    check_supported(body)
    prompts_in = body.prompts()
    check_caps(principal.limits, body, num_prompts=len(prompts_in))
    check_stop(body, settings.max_stop_strings)
    cache_salt = resolve_cache_salt(principal, body)
    opts = RequestOptions(
        f"cmpl-{os.urandom(16).hex()}", cache_salt, body.priority, settings.retry_after_s
    )
    num_logprobs = body.num_logprobs()

    async def prepare() -> tuple[list[list[int]], list]:
        prompts = await pre.run(tokenize_completion, gw.model, body, num_bytes=len(raw))
        jobs = make_jobs(
            gw.model,
            body,
            prompts,
            num_logprobs,
            settings.max_logprobs,
            max_tokens_cap=principal.limits.max_tokens,
            extra={**shared_extra(gw.model, body, settings.max_logprobs), **structured_extra(body)},
        )
        return prompts, jobs

    # Token-id prompts are counted exactly (4 bytes per id makes bytes / 4 their length).
    num_bytes = [utf8_len(p) if isinstance(p, str) else 4 * len(p) for p in prompts_in]
    estimate = estimate_num_tokens(gw.model, body, num_bytes, principal.limits)
    ticket, (prompts, jobs) = await reserve_estimate(
        gw.edge, principal, opts.request_id, estimate, prepare
    )
    echo = None
    if body.echo:
        texts = await pre.run(echo_texts, gw.model, body, prompts)
        echo = list(zip(texts, prompts))
    builder = CompletionBuilder(
        opts.request_id,
        body.model or gw.model.name,
        [len(p) for p in prompts],
        body.n,
        num_logprobs=num_logprobs,
        texts=gw.token_texts,
        echo=echo,
        echo_only=body.is_echo_only,
    )
    return await metered(
        gw.edge,
        request,
        ticket,
        builder,
        lambda: respond(
            request,
            gw.dispatcher,
            jobs,
            opts,
            builder,
            stream=body.stream,
            include_usage=body.include_usage,
        ),
    )
