"""Remote-prefill reservations at the decode: queue limits, per-tenant caps, cancellation.

Reviewer findings reproduced here: reserved-but-not-added remote prefills were not counted by
`max_num_queued_reqs/tokens`; one tenant could reserve every block; a task cancelled during
`RemotePrefill.run`'s reserve hop left its blocks allocated and `KVReceiver.poll` busy forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from decode_svc.receiver import KVReceiver
from decode_svc.remote_prefill import RemotePrefill
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.request import Request
from engine.scheduler import SchedulerFullError
from kv_transfer import Agent
from protos import decode_pb2

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)
BS = 16


def _llm(path, **kw) -> LLM:
    return LLM(str(path), max_model_len=256, num_gpu_blocks_override=33, block_size=BS, **kw)


def _req(rid: str, num_tokens: int, salt: str | None = None) -> Request:
    prompt = [(7 * len(rid) + i) % 1000 + 3 for i in range(num_tokens)]
    return Request(rid, prompt, PARAMS, set(), cache_salt=salt)


def test_reserved_remote_prefills_count_against_the_queue_limits(tiny_qwen3_path):
    core = _llm(tiny_qwen3_path, max_num_queued_reqs=2).engine
    assert core.allocate_for_remote_prefill(_req("a", 20)) is not None
    assert core.allocate_for_remote_prefill(_req("b", 20)) is not None
    with pytest.raises(SchedulerFullError, match="max_num_queued_reqs=2"):
        core.allocate_for_remote_prefill(_req("c", 20))
    core.release_quarantine(core.quarantine_blocks(_req("a", 20)))  # a's transfer failed
    assert core.allocate_for_remote_prefill(_req("c", 20)) is not None


def test_reserved_tokens_count_against_max_num_queued_tokens(tiny_qwen3_path):
    core = _llm(tiny_qwen3_path, max_num_queued_tokens=50).engine
    assert core.allocate_for_remote_prefill(_req("a", 30)) is not None
    with pytest.raises(SchedulerFullError, match="max_num_queued_tokens=50"):
        core.allocate_for_remote_prefill(_req("b", 30))


def test_one_salt_holds_at_most_its_share_of_blocks(tiny_qwen3_path):
    core = _llm(tiny_qwen3_path).engine  # 32 usable blocks of 16 tokens
    limit = 16
    for i in range(2):  # 7 blocks each
        assert core.allocate_for_remote_prefill(_req(f"a{i}", 100, "tenant:a"), limit)
    with pytest.raises(SchedulerFullError, match="at most 16 per tenant"):
        core.allocate_for_remote_prefill(_req("a2", 100, "tenant:a"), limit)
    # Another tenant still gets blocks.
    assert core.allocate_for_remote_prefill(_req("b0", 100, "tenant:b"), limit)


def test_cancel_during_the_reserve_hop_leaks_nothing(tiny_qwen3_path):
    core = _llm(tiny_qwen3_path).engine
    idle_free = core.kv.num_free_blocks
    engine = AsyncEngine(core)
    agent = Agent("d-test", "inproc")
    receiver = KVReceiver(agent)
    engine.hooks.append(receiver.poll)
    counters = {"num_remote_prefills": 0, "kv_transfer_bytes": 0}
    remote = RemotePrefill(engine, agent, receiver, 5.0, 1.0, counters)
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait()

    async def run():
        engine.submit(hold)  # hold the engine thread: the reserve hop queues behind it
        assert await asyncio.to_thread(entered.wait, 5)
        request = decode_pb2.GenerateRequest(
            request_id="r1", prefill=[decode_pb2.PrefillTarget(address="127.0.0.1:1")]
        )
        task = asyncio.ensure_future(remote.run(_req("r1", 40), request, SimpleNamespace()))
        deadline = time.monotonic() + 5
        while engine._cmds.qsize() < 1:  # the reserve hop is queued
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the reserve hop runs now, after its caller is gone
        return await engine.call(
            lambda: (core.kv.num_free_blocks, dict(receiver.expected), dict(core.reserved))
        )

    try:
        free, expected, reserved = asyncio.run(run())
    finally:
        gate.set()
        engine.shutdown()
        agent.close()
    assert (free, expected, reserved) == (idle_free, {}, {})
    assert receiver.poll() is False  # nothing awaited: the loop may sleep


def test_the_line_is_served_in_one_engine_pass(tiny_qwen3_path):
    """Remote prefills waiting in line for blocks get them as soon as blocks free, in one pass
    of the engine loop for as many as fit, first first. Waking one per pass (one per engine
    step) let a line formed in a burst stand behind new arrivals: on one H100 at 256 streams
    requests waited 2.9 s here with a third of the blocks free."""
    core = _llm(tiny_qwen3_path).engine  # 32 usable blocks of 16 tokens
    engine = AsyncEngine(core)
    agent = Agent("d-test", "inproc")
    counters = {"num_remote_prefills": 0, "kv_transfer_bytes": 0}
    remote = RemotePrefill(engine, agent, KVReceiver(agent), 5.0, 1.0, counters)
    engine.hooks.remove(remote._serve_line)  # the test runs the loop's passes itself
    blockers = [_req(f"block{i}", 112) for i in range(4)]  # 8 blocks each (+1 slot): all 32
    waiters = [_req(f"w{i}", 40) for i in range(5)]  # 3 blocks each

    def release(request: Request) -> None:
        core.release_quarantine(core.quarantine_blocks(request))

    async def until_in_line(n: int) -> None:
        deadline = time.monotonic() + 5
        while await engine.call(lambda: len(core.awaiting_blocks)) < n:
            assert time.monotonic() < deadline, "waiters never joined the line"
            await asyncio.sleep(0.005)

    async def run():
        for b in blockers:
            assert await engine.call(core.allocate_for_remote_prefill, b) is not None
        assert await engine.call(lambda: core.kv.num_free_blocks) == 0
        tasks = []
        for w in waiters:  # one at a time: their order in line is known
            reserve = lambda w=w: core.allocate_for_remote_prefill(w)  # noqa: E731
            tasks.append(asyncio.ensure_future(remote._reserve_in_line(w, reserve)))
            await until_in_line(len(tasks))
        # 8 blocks free: the first two fit (6), the third would need 9; one pass serves both.
        await engine.call(lambda: (release(blockers[0]), remote._serve_line()))
        await asyncio.wait_for(asyncio.gather(*tasks[:2]), 5)
        # The pass's hand-overs ran before the call's own reply: nothing else was granted.
        still_waiting = [t.done() for t in tasks[2:]]
        in_line = await engine.call(lambda: list(core.awaiting_blocks))
        # The head of what is left leaves (its client went away): the pass skips it.
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)  # it has left (its `finally`)
        await engine.call(lambda: (release(blockers[1]), remote._serve_line()))
        await asyncio.wait_for(asyncio.gather(*tasks[3:]), 5)
        reserved = await engine.call(lambda: sorted(core.reserved))
        return still_waiting, in_line, reserved

    try:
        still_waiting, in_line, reserved = asyncio.run(run())
    finally:
        engine.shutdown()
        agent.close()
    assert still_waiting == [False, False, False]
    assert in_line == ["w2", "w3", "w4"]
    assert reserved == sorted(["block2", "block3", "w0", "w1", "w3", "w4"])


def test_the_wait_for_a_prefill_covers_our_prompts_ahead_of_it(tiny_qwen3_path):
    """A burst sent to one prefill is computed one prompt after another: the bound on each
    reply counts this decode's prompt tokens P has yet to answer, its own included. Counting
    only its own timed the burst's tail out while P worked through it (on one H100, 29 of
    1,000 requests went back to be prefilled at the decode and waited 12.5 s for it)."""
    import grpc

    core = LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=128).engine
    engine = AsyncEngine(core)
    agent = Agent("d-test", "inproc")
    counters = {"num_remote_prefills": 0, "kv_transfer_bytes": 0}
    remote = RemotePrefill(engine, agent, KVReceiver(agent), 60.0, 1.0, counters)
    address, timeouts = "127.0.0.1:1", []

    class HeldPrefill:  # P holds every call until the test lets go, then refuses it
        release = asyncio.Event()

        async def Prefill(self, msg, timeout):  # noqa: N802 - the gRPC method's name
            timeouts.append(timeout)
            await self.release.wait()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), "no"
            )

    remote._stub = lambda _: HeldPrefill()

    async def run():
        HeldPrefill.release = asyncio.Event()
        request = decode_pb2.GenerateRequest(prefill=[decode_pb2.PrefillTarget(address=address)])
        calls = [remote.run(_req(f"b{i}" * (i + 1), 200), request, None) for i in range(6)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        deadline = time.monotonic() + 5
        while len(timeouts) < len(tasks):
            assert time.monotonic() < deadline, timeouts
            await asyncio.sleep(0.005)
        HeldPrefill.release.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        # Each failure's release was queued on the engine thread before this call runs.
        return outcomes, await engine.call(lambda: (core.kv.num_free_blocks, dict(core.reserved)))

    idle_free = core.kv.num_free_blocks
    try:
        outcomes, (free, reserved) = asyncio.run(run())
    finally:
        engine.shutdown()
        agent.close()
    assert (free, reserved) == (idle_free, {})  # refused transfers leak no block
    assert outcomes == [None] * 6  # refused by P: each goes back to be prefilled locally
    # 200 tokens each at the prior 1 ms per token: 1 s + 4 x (200, 400, ... 1,200 tokens' time).
    assert sorted(timeouts) == pytest.approx([2.0, 2.6, 3.4, 4.2, 5.0, 5.8])
    assert remote._tokens_at == {address: 0}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_prompts_written_by_a_prefill_start_while_a_preempted_request_waits(
    tiny_qwen3_path, policy
):
    """Reproduced hang: a request preempted itself (nothing else ran) and went to the head of
    the queue, ahead of two prompts a prefill had written into the last free blocks. The head
    needed more blocks than were free, and the two behind it, which needed none, were never
    admitted: nothing ran, nothing freed a block. Requests whose KV is in place now start
    ahead of a head that cannot."""
    core = LLM(str(tiny_qwen3_path), max_model_len=256, num_gpu_blocks_override=17,
               block_size=BS, scheduling_policy=policy).engine  # fmt: skip
    a = Request("a", [5 + i for i in range(16)], SamplingParams(max_tokens=230, ignore_eos=True),
                set())  # fmt: skip
    core.add_request(a)
    while a.num_computed_tokens < 12 * BS:  # 12 full blocks: its next token needs a 13th
        core.step()
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    remote = [Request(f"r{i}", [900 + 16 * i + j for j in range(16)], short, set())
              for i in range(2)]  # fmt: skip
    for r in remote:  # 2 blocks each (prompt + first decode slot): the last 4
        assert core.allocate_for_remote_prefill(r) is not None
    assert core.kv.num_free_blocks == 0
    for r in remote:
        core.add_remote_prefilled(r, first_token=7, logprobs=None, num_cached_tokens=0)
    num_steps = 0
    while core.has_unfinished_requests():
        core.step()
        num_steps += 1
        assert num_steps < 2000, (a.status, [r.status for r in remote], core.kv.num_free_blocks)
    assert a.num_output_tokens == 230 and a.num_preemptions >= 1
    assert all(r.num_output_tokens == 8 for r in remote)
