"""`POST /v1/completions`: text or token-id prompts (one or many) → text_completion shapes."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.accounting import metered
from gateway.deps import GatewayDep, PrincipalDep
from gateway.dispatch import RequestOptions, TokenDelta
from gateway.logprobs import TokenTexts, completion_logprobs
from gateway.preprocess import (
    check_caps,
    check_model,
    check_supported,
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


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, gw: GatewayDep, principal: PrincipalDep
) -> Response:
    check_model(gw.model, body.model)
    check_supported(body)
    check_caps(principal.limits, body, num_prompts=len(body.prompts()))
    cache_salt = resolve_cache_salt(principal, body)
    prompts = tokenize_completion(gw.model, body)
    num_logprobs = body.num_logprobs()
    jobs = make_jobs(
        gw.model,
        body,
        prompts,
        num_logprobs,
        gw.settings.max_logprobs,
        max_tokens_cap=principal.limits.max_tokens,
    )
    opts = RequestOptions(
        f"cmpl-{uuid.uuid4().hex}", cache_salt, body.priority, gw.settings.retry_after_s
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
        principal,
        jobs,
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
