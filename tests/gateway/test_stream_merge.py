"""A stream whose chunks arrive faster than the gateway relays them sends what waits as one delta
(gateway/dispatch.py, as vLLM's RequestOutputCollector merges the outputs its consumer has not
taken yet): the same text, tokens and logprobs as one delta per chunk, a stop string in the
middle ends it at the same token, and what follows the tokens (the final) stays its own delta."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.output_processor import OutputProcessor
from engine.sampling_params import SamplingParams
from gateway.dispatch import ChildStream
from gateway.preprocess import ChildJob
from gateway.registry import Instance
from gateway.router import Route
from protos import common_pb2, decode_pb2

TEXT = "The quick brown fox jumps over the lazy dog. Then it naps, and dreams of hens."


class UnaryCall:
    """A call that cannot tell what has arrived (as grpc's unary call): one chunk per read."""

    def __init__(self, messages: list[decode_pb2.GenerateResponse]):
        self.messages = list(messages)
        self.is_cancelled = False

    async def read(self):
        return self.messages.pop(0) if self.messages else grpc.aio.EOF

    def cancel(self) -> bool:
        self.is_cancelled = True
        return True


class BehindCall(UnaryCall):
    """Every message has arrived before the reader looks (a gateway that fell behind)."""

    def poll(self):
        if self.messages and self.messages[0].WhichOneof("kind") != "error":
            return self.messages.pop(0)
        return None


class Clients:
    def __init__(self):
        self.aborted: list[str] = []

    def abort_soon(self, instance: Instance, request_id: str) -> None:
        self.aborted.append(request_id)


class Router:
    def observe(self, *args) -> None:
        pass


def messages(token_ids: list[int], per_chunk: int = 1) -> list[decode_pb2.GenerateResponse]:
    """`per_chunk` tokens per chunk (several: speculative decoding accepted them in one step)
    with their logprobs (top-1), then the final."""
    out = []
    for start in range(0, len(token_ids), per_chunk):
        ids = token_ids[start : start + per_chunk]
        lps = [
            common_pb2.TokenLogprobs(token_ids=[token], logprobs=[-0.5 - start - i])
            for i, token in enumerate(ids)
        ]
        chunk = decode_pb2.TokenChunk(token_ids=ids, logprobs=lps)
        out.append(decode_pb2.GenerateResponse(tokens=chunk))
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=len(token_ids))
    final = decode_pb2.Final(finish_reason="length", usage=usage)
    return [*out, decode_pb2.GenerateResponse(final=final)]


async def stream(call_type, model_info, token_ids, params, per_chunk=1):
    tokenizer = model_info.tokenizer
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    state = processor.add_request("r1", prompt, params)
    call = call_type(messages(token_ids, per_chunk))
    first = await call.read()
    clients = Clients()
    route = Route(decode=Instance("127.0.0.1:1", "d1"), prefills=())
    job = ChildJob(0, prompt, params)
    child = ChildStream(job, state, call, first, route, clients, Router(), 0.01)
    deltas = [d async for d in child.deltas()]
    return deltas, call, clients


def run(call_type, model_info, token_ids, params, per_chunk=1):
    return asyncio.run(stream(call_type, model_info, token_ids, params, per_chunk))


def joined(deltas):
    return (
        "".join(d.text for d in deltas),
        [t for d in deltas for t in d.token_ids],
        [list(lp.logprobs) for d in deltas for lp in d.logprobs],
        deltas[-1].finish_reason,
    )


def test_what_waits_goes_out_as_one_delta_with_the_same_text_tokens_and_logprobs(model_info):
    token_ids = model_info.tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(token_ids), logprobs=0)
    one_by_one, _, _ = run(UnaryCall, model_info, token_ids, params)
    merged, _, _ = run(BehindCall, model_info, token_ids, params)
    assert len(one_by_one) == len(token_ids) + 1  # a delta per chunk, then the final's
    assert [len(d.token_ids) for d in merged] == [len(token_ids), 0]  # all waiting; the final
    assert joined(merged) == joined(one_by_one)
    text, ids, logprobs, finish = joined(merged)
    assert text == model_info.tokenizer.decode(token_ids) and finish == "length"
    assert ids == token_ids and logprobs == [[-0.5 - i] for i in range(len(token_ids))]


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_inside_what_waits_ends_it_at_the_same_token(model_info, include_stop):
    token_ids = model_info.tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=len(token_ids), stop=["lazy"], include_stop_str_in_output=include_stop
    )
    one_by_one, _, _ = run(UnaryCall, model_info, token_ids, params)
    merged, call, clients = run(BehindCall, model_info, token_ids, params)
    assert joined(merged) == joined(one_by_one)
    text, ids, _, finish = joined(merged)
    assert finish == "stop" and merged[-1].stop_reason == "lazy"
    assert text == TEXT[: TEXT.index("lazy") + (4 if include_stop else 0)]
    assert len(ids) < len(token_ids)  # the tokens after the stop string count for nothing
    assert call.is_cancelled and clients.aborted == ["r1"]


def test_a_stop_string_inside_a_chunk_of_several_tokens_ends_at_the_same_token(model_info):
    """A chunk of several tokens (speculation accepts several per step): with a stop string
    watched, the gateway still ends at the token that completed it (ids, logprobs and text as
    one by one)."""
    token_ids = model_info.tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(token_ids), stop=["lazy"], logprobs=0)
    one_by_one, _, _ = run(UnaryCall, model_info, token_ids, params)
    for per_chunk in (5, len(token_ids)):
        merged, call, clients = run(UnaryCall, model_info, token_ids, params, per_chunk)
        assert joined(merged) == joined(one_by_one)
        text, ids, logprobs_out, finish = joined(merged)
        assert finish == "stop" and text == TEXT[: TEXT.index("lazy")]
        assert len(ids) < len(token_ids) and len(logprobs_out) == len(ids)
        assert call.is_cancelled and clients.aborted == ["r1"]
    # Without stop strings a chunk goes through whole: the same output.
    params = SamplingParams(max_tokens=len(token_ids), logprobs=0)
    assert joined(run(UnaryCall, model_info, token_ids, params, 7)[0]) == joined(
        run(UnaryCall, model_info, token_ids, params)[0]
    )
