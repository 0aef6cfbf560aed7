"""Prompt logprobs from a remote prefill: the decode forwards P's list in the first output, and a
prefill that does not send them (an older version) costs a local prefill, never a response
without them. P is faked; its reply and notification arrive as a real P's would."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_svc.receiver import KVReceiver
from decode_svc.remote_prefill import RemotePrefill
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import Request
from engine.serving import logprobs_to_proto
from kv_transfer import Agent
from protos import common_pb2, decode_pb2, prefill_pb2

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
PROMPT = list(range(100, 140))


class FakePrefill:
    """Replies with the first token (and `num_prompt_logprobs` entries) once it has sent the
    transfer's notification, as `prefill_svc` does."""

    def __init__(self, receiver: KVReceiver, num_prompt_logprobs: int):
        self.receiver, self.num = receiver, num_prompt_logprobs

    async def Prefill(self, msg, timeout):  # noqa: N802 - the gRPC method's name
        _, arrived = self.receiver.arrived.pop(msg.transfer_id)  # as `KVReceiver.poll` does
        del self.receiver.expected[msg.transfer_id]
        arrived.set_result(time.monotonic())
        entries = [logprobs_to_proto({t: -1.0 - i}) for i, t in enumerate(PROMPT[1:])]
        return prefill_pb2.PrefillResponse(first_token_id=5, prompt_logprobs=entries[: self.num])


@pytest.mark.parametrize("num_sent", [len(PROMPT) - 1, 0])
def test_prompt_logprobs_from_the_prefill_or_a_local_prefill(tiny_qwen3_path, num_sent):
    core = LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=33).engine
    idle_free = core.kv.num_free_blocks
    engine = AsyncEngine(core)
    agent = Agent("d-test", "inproc")
    receiver = KVReceiver(agent)
    engine.hooks.append(receiver.poll)
    counters = {"num_remote_prefills": 0, "kv_transfer_bytes": 0}
    remote = RemotePrefill(engine, agent, receiver, 5.0, 1.0, counters)
    remote._stub = lambda address: FakePrefill(receiver, num_sent)
    target = decode_pb2.PrefillTarget(address="127.0.0.1:1")

    async def run():
        req = Request("r1", PROMPT, PARAMS, set())
        request = decode_pb2.GenerateRequest(request_id="r1", transfer_id="t1", prefill=[target])
        stream = await remote.run(req, request, common_pb2.Timings())
        first = None
        if stream is not None:
            first = await anext(stream)
            await stream.aclose()  # aborts the request
        state = await engine.call(lambda: (core.kv.num_free_blocks, dict(core.reserved)))
        return first, state

    try:
        first, (free, reserved) = asyncio.run(run())
    finally:
        engine.shutdown()
        agent.close()
    assert (free, reserved) == (idle_free, {})  # the blocks went back either way
    if num_sent:
        assert first.new_token_ids == [5]
        assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(PROMPT)
        assert first.prompt_logprobs[1] == {PROMPT[1]: pytest.approx(-1.0)}
    else:
        assert first is None  # RemotePrefill.run says "prefill locally"
