"""vLLM's `POST /tokenize` and `POST /detokenize`, on the served model's tokenizer.

Off unless `enable_tokenizer_endpoints` (`--enable-tokenizer-endpoints`): `create_app` only
includes this router then, and the allowlist (`Edge.routes`) only lets the paths through then.
They are never public: with keys configured they need one, like the completion routes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.tokenizer import apply_chat_template
from gateway.deps import GatewayDep
from gateway.errors import bad_request, model_not_found
from gateway.model_info import ModelInfo
from gateway.protocol import ChatMessage

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vLLM: True for a prompt, False for messages (the template writes the special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Either `prompt` or `messages` must be given, not both.")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


def _check_model(info: ModelInfo, model: str | None) -> None:
    if not info.is_served(model):
        raise model_not_found(model)


def _token_ids(info: ModelInfo, req: TokenizeRequest) -> list[int]:
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return list(info.tokenizer.encode(req.prompt, add_special_tokens=add_special))
    try:
        messages = [m.to_template_dict() for m in req.messages or []]
        ids = apply_chat_template(info.tokenizer, messages, req.add_generation_prompt)
    except ValueError as e:
        raise bad_request(str(e), "messages") from e
    except Exception as e:  # noqa: BLE001 - jinja errors: a template that rejects the messages
        raise bad_request(f"Failed to apply the chat template: {e}", "messages") from e
    if req.add_special_tokens:  # the rendered text again, with the tokenizer's own specials
        ids = info.tokenizer.build_inputs_with_special_tokens(ids)
    return list(ids)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, gw: GatewayDep) -> dict[str, Any]:
    _check_model(gw.model, req.model)
    ids = _token_ids(gw.model, req)
    strs = gw.model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": gw.model.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, gw: GatewayDep) -> dict[str, str]:
    _check_model(gw.model, req.model)
    bad = [t for t in req.tokens if not 0 <= t < gw.model.vocab_size]
    if bad:
        raise bad_request(f"Token id {bad[0]} is out of vocabulary", "tokens")
    return {"prompt": gw.model.tokenizer.decode(req.tokens)}
