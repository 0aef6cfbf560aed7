"""`POST /v1/completions`: text or token-id prompts (one or many) → text_completion shapes."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.accounting import metered, reserve_estimate
from gateway.deps import GatewayDep, PrincipalDep
from gateway.dispatch import RequestOptions, TokenDelta
from gateway.logprobs import TokenTexts, completion_logprobs
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
)
from gateway.protocol import CompletionRequest
from gateway.serving import Choice, ResponseBuilder, respond

router = APIRouter()


class CompletionBuilder(ResponseBuilder):
    chunk_object = "text_completion"

    def __init__(self, *args: Any, num_logprobs: int | None, texts: TokenTexts):
        super().__init__(*args)
        self.num_logprobs, self.texts = num_logprobs, texts

    def chunk_choice(self, d: TokenDelta, choice: Choice) -> dict[str, Any] | None:
        has_logprobs = self.num_logprobs is not None and bool(d.logprobs)
        if not d.text and d.finish_reason is None and not has_logprobs:
            return None
        logprobs = None
        if has_logprobs:
            logprobs, choice.text_offset = completion_logprobs(
                self.texts, d.logprobs, choice.text_offset
            )
        return {
            "index": d.index,
            "text": d.text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }

    def final_body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            logprobs = None
            if self.num_logprobs is not None:
                logprobs, _ = completion_logprobs(self.texts, c.logprobs, 0)
            choices.append(
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
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


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def create_completion(request: Request, gw: GatewayDep, principal: PrincipalDep) -> Response:
    # The body is parsed in the preprocessing pool, not by FastAPI on the event loop.
    settings, pre = gw.settings, gw.preprocessor
    raw = await request.body()
    body = await pre.run(parse_body, CompletionRequest, raw, settings.max_messages)
    check_model(gw.model, body.model)
    check_supported(body)
    prompts_in = body.prompts()
    check_caps(principal.limits, body, num_prompts=len(prompts_in))
    check_stop(body, settings.max_stop_strings)
    cache_salt = resolve_cache_salt(principal, body)
    opts = RequestOptions(
        f"cmpl-{uuid.uuid4().hex}", cache_salt, body.priority, settings.retry_after_s
    )
    num_logprobs = body.num_logprobs()

    async def prepare() -> tuple[list[list[int]], list]:
        prompts = await pre.run(tokenize_completion, gw.model, body)
        jobs = make_jobs(
            gw.model,
            body,
            prompts,
            num_logprobs,
            settings.max_logprobs,
            max_tokens_cap=principal.limits.max_tokens,
        )
        return prompts, jobs

    # Token-id prompts are counted exactly (4 bytes per id makes bytes / 4 their length).
    num_bytes = [len(p.encode()) if isinstance(p, str) else 4 * len(p) for p in prompts_in]
    estimate = estimate_num_tokens(gw.model, body, num_bytes, principal.limits)
    ticket, (prompts, jobs) = await reserve_estimate(
        gw.edge, principal, opts.request_id, estimate, prepare
    )
    builder = CompletionBuilder(
        opts.request_id,
        body.model or gw.model.name,
        [len(p) for p in prompts],
        body.n,
        num_logprobs=num_logprobs,
        texts=gw.token_texts,
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
