"""`POST /v1/chat/completions`: chat template → decodes → chat.completion(.chunk) shapes."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.accounting import metered, reserve_estimate
from gateway.chat_output import ChatOutput, request_parsers
from gateway.chat_tools import resolve_tool_mode, template_request
from gateway.deps import GatewayDep, PrincipalDep
from gateway.dispatch import RequestOptions, TokenDelta
from gateway.extra_params import shared_extra
from gateway.logprobs import TokenTexts, chat_logprobs
from gateway.offload import openapi_body, parse_body
from gateway.preprocess import (
    check_caps,
    check_model,
    check_stop,
    check_supported,
    estimate_num_tokens,
    make_jobs,
    request_chat_template,
    resolve_cache_salt,
    tokenize_chat,
)
from gateway.protocol import ChatCompletionRequest
from gateway.serving import Choice, ResponseBuilder, respond
from gateway.structured import structured_extra

router = APIRouter()


class ChatBuilder(ResponseBuilder):
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        *args: Any,
        num_logprobs: int | None,
        texts: TokenTexts,
        output: ChatOutput | None = None,
    ):
        super().__init__(*args)
        self.num_logprobs, self.texts = num_logprobs, texts
        self.output = output or ChatOutput()  # reasoning and tool calls (gateway/chat_output.py)
        self.streams = [output.stream() for _ in self.choices]

    def _logprobs(self, logprobs: list) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        return {"content": chat_logprobs(self.texts, logprobs, self.num_logprobs)}

    def opening_choices(self) -> list[dict[str, Any]]:
        return [
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in self.choices
        ]

    def chunk_choice(self, d: TokenDelta, choice: Choice) -> dict[str, Any] | None:
        has_logprobs = self.num_logprobs is not None and bool(d.logprobs)
        stream = self.streams[d.index]
        delta = stream.feed(d.text)
        if d.finish_reason is not None:
            delta = _joined(delta, stream.finish())
        if not delta and d.finish_reason is None and not has_logprobs:
            return None  # text held back (partial character, stop string or parser)
        entry = {
            "index": d.index,
            "delta": delta or {"content": ""},
            "logprobs": self._logprobs(d.logprobs) if has_logprobs else None,
            "finish_reason": d.finish_reason and stream.finish_reason(d.finish_reason),
        }
        if d.finish_reason is not None:
            entry["stop_reason"] = d.stop_reason
        return entry

    def final_body(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            message, finish_reason = self.output.message(c.text, c.finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "prompt_logprobs": self.prompt_logprobs(self.texts),
        }


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two deltas as one: strings and lists concatenate."""
    out = dict(first)
    for key, value in then.items():
        out[key] = out[key] + value if key in out else value
    return out


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def create_chat_completion(
    request: Request, gw: GatewayDep, principal: PrincipalDep
) -> Response:
    # The body is parsed by us (in the preprocessing pool unless small), not by FastAPI.
    settings, pre = gw.settings, gw.preprocessor
    raw = await request.body()
    body = await pre.run(
        parse_body, ChatCompletionRequest, raw, settings.max_messages, num_bytes=len(raw)
    )
    check_model(gw.model, body.model)
    is_trusted = settings.trust_request_chat_template
    check_supported(body, frozenset({"chat_template"}) if is_trusted else frozenset())
    chat_template = request_chat_template(body, is_trusted)
    check_caps(principal.limits, body)
    check_stop(body, settings.max_stop_strings)
    cache_salt = resolve_cache_salt(principal, body)
    opts = RequestOptions(
        f"chatcmpl-{os.urandom(16).hex()}",
        cache_salt,
        body.priority,
        settings.retry_after_s,
    )
    num_logprobs = body.num_logprobs()
    tool_parser, reasoning_parser = request_parsers(
        settings.tool_call_parser, settings.reasoning_parser, gw.model.tokenizer
    )
    tools = resolve_tool_mode(body, settings, tool_parser)
    extra = structured_extra(body, tools.schema, reasoning_parser)
    if tools.kind != "none" and tool_parser is not None:
        extra.update(tool_parser.adjust_request())
    output = ChatOutput(tools, reasoning_parser, body.include_reasoning)
    templated = template_request(body, settings)

    async def prepare() -> tuple[list[int], list]:
        # A request's own template is a program of unknown cost: always in the pool.
        size = len(raw) if chat_template is None else None
        prompt = await pre.run(tokenize_chat, gw.model, templated, chat_template, num_bytes=size)
        jobs = make_jobs(
            gw.model,
            body,
            [prompt],
            num_logprobs,
            settings.max_logprobs,
            max_tokens_cap=principal.limits.max_tokens,
            extra={**shared_extra(gw.model, body, settings.max_logprobs), **extra},
        )
        return prompt, jobs

    estimate = estimate_num_tokens(gw.model, body, [len(raw)], principal.limits)
    ticket, (prompt, jobs) = await reserve_estimate(
        gw.edge, principal, opts.request_id, estimate, prepare
    )
    builder = ChatBuilder(
        opts.request_id,
        body.model or gw.model.name,
        [len(prompt)],
        body.n,
        num_logprobs=num_logprobs,
        texts=gw.token_texts,
        output=output,
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
