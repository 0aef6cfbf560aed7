"""Effects of implemented request fields that no other test shows (test_request_fields.py names
one test per implemented field; these are the ones it points here for).

The tiny test model's tokenizer adds no special tokens and its chat template takes no kwargs,
and its random weights never pick a special token greedily, so the fields that act on those
are shown against a gateway whose tokenizer does (`custom_gateway`) and a decode that streams a
scripted special token (`ScriptedDecode`).
"""

from __future__ import annotations

import dataclasses
import json
from concurrent import futures

import grpc
import httpx
import pytest
from tokenizers import processors

from engine.tokenizer import load_tokenizer
from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from protos import common_pb2, decode_mux, decode_pb2, decode_pb2_grpc
from tests.fixtures.tiny_models import CHAT_TEMPLATE, ENDOFTEXT_ID, IM_START_ID
from tests.gateway.conftest import MAX_MODEL_LEN, SERVED_NAME, serve

MESSAGES = [{"role": "user", "content": "Hi"}]


def _post(url: str, path: str, **body) -> httpx.Response:
    resp = httpx.post(f"{url}{path}", json={"model": SERVED_NAME, **body}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def test_add_generation_prompt(gateway_url, fake, model_info):
    for add in (True, False):
        _post(
            gateway_url,
            "/v1/chat/completions",
            messages=MESSAGES,
            max_tokens=1,
            add_generation_prompt=add,
        )
    with_header, without = (list(r.prompt_token_ids) for r in fake.record.requests)
    assert with_header[: len(without)] == without
    assert model_info.tokenizer.decode(with_header[len(without) :]) == "<|im_start|>assistant\n"


# ---- a gateway whose tokenizer adds a BOS token and whose template reads a kwarg ----

GREETING_TEMPLATE = CHAT_TEMPLATE + "{% if greeting is defined %}{{ greeting }}{% endif %}"


@pytest.fixture(scope="module")
def custom_gateway(tiny_qwen3_path, model_info, fakes):
    tokenizer = load_tokenizer(tiny_qwen3_path)
    tokenizer.chat_template = GREETING_TEMPLATE
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", IM_START_ID)]
    )
    assert tokenizer.encode("Hi", add_special_tokens=True)[0] == IM_START_ID
    info = dataclasses.replace(model_info, tokenizer=tokenizer)
    settings = GatewaySettings(
        model=str(tiny_qwen3_path),
        served_model_name=[SERVED_NAME],
        max_model_len=MAX_MODEL_LEN,
        decode=[fakes[0][1]],
    )
    with serve(create_app(settings, build_state(settings, model=info))) as url:
        yield url, tokenizer


def test_add_special_tokens(custom_gateway, fake):
    url, tokenizer = custom_gateway
    _post(url, "/v1/completions", prompt="Hi there", max_tokens=1)
    _post(url, "/v1/completions", prompt="Hi there", max_tokens=1, add_special_tokens=False)
    with_bos, without = (list(r.prompt_token_ids) for r in fake.record.requests)
    assert without == tokenizer.encode("Hi there", add_special_tokens=False)
    assert with_bos == [IM_START_ID, *without]


def test_chat_add_special_tokens(custom_gateway, fake):
    """vLLM's chat field: off by default (the template has its special tokens), on adds the
    tokenizer's own (here a BOS) to the rendered template."""
    url, tokenizer = custom_gateway
    _post(url, "/v1/chat/completions", messages=MESSAGES, max_tokens=1)
    _post(url, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, add_special_tokens=True)
    plain, with_bos = (list(r.prompt_token_ids) for r in fake.record.requests)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert plain == tokenizer.encode(text, add_special_tokens=False)
    assert with_bos == [IM_START_ID, *plain]


def test_text_content_parts_render_as_the_joined_text(custom_gateway, fake):
    """vLLM's reading of content parts: text, input_text, output_text and an assistant's
    refusal are text, joined with newlines; an image part or a text part without a string is
    a 400, not a prompt with a hole in it."""
    url, _ = custom_gateway
    plain = [
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "I can't"},
        {"role": "user", "content": "Why"},
    ]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "input_text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}]},
        {"role": "user", "content": [{"type": "output_text", "text": "Why"}]},
    ]  # fmt: skip
    _post(url, "/v1/chat/completions", messages=plain, max_tokens=1)
    _post(url, "/v1/chat/completions", messages=parts, max_tokens=1)
    want, got = (list(r.prompt_token_ids) for r in fake.record.requests)
    assert got == want
    for bad in (
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "text", "text": 5},
        {"type": "text"},
        {"type": "refusal", "text": "no"},
    ):
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": [bad]}]}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert resp.status_code == 400, bad
    assert len(fake.record.requests) == 2


def test_chat_template_kwargs(custom_gateway, fake):
    url, tokenizer = custom_gateway
    _post(url, "/v1/chat/completions", messages=MESSAGES, max_tokens=1)
    kwargs = {"greeting": "Ahoy"}
    _post(url, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, chat_template_kwargs=kwargs)
    plain, greeted = (tokenizer.decode(r.prompt_token_ids) for r in fake.record.requests)
    assert greeted == plain + "Ahoy"


# ---- skip_special_tokens: the gateway detokenizes, so a scripted special token shows it ----


class ScriptedDecode(decode_mux.DecodeServicer):
    """Streams `token_ids` one per chunk, then a Final("length")."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def Generate(self, request, context):
        for token in self.token_ids:
            yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[token]))
        usage = common_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(self.token_ids)
        )
        yield decode_pb2.GenerateResponse(
            final=decode_pb2.Final(finish_reason="length", usage=usage)
        )

    def Abort(self, request, context):
        return common_pb2.AbortResponse(found=False)

    def GetLoad(self, request, context):
        return common_pb2.LoadResponse(instance_id="scripted", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def scripted_gateway(gateway_for, model_info):
    tokenizer = model_info.tokenizer
    ids = [*tokenizer.encode("Hello"), ENDOFTEXT_ID, *tokenizer.encode(" world")]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    decode_pb2_grpc.add_DecodeServicer_to_server(ScriptedDecode(ids), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with gateway_for(decode=[f"127.0.0.1:{port}"]) as url:
            yield url
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens(scripted_gateway, stream):
    def text(**extra) -> str:
        body = {"prompt": "x", "max_tokens": 8, "stream": stream, **extra}
        resp = _post(scripted_gateway, "/v1/completions", **body)
        if not stream:
            return resp.json()["choices"][0]["text"]
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in resp.text.splitlines()
            if line.startswith("data: {")
        ]
        return "".join(c["choices"][0]["text"] for c in chunks)

    assert text() == "Hello world"  # vLLM's default: special tokens skipped
    assert text(skip_special_tokens=True) == "Hello world"
    assert text(skip_special_tokens=False) == "Hello<|endoftext|> world"
