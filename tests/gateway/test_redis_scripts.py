"""The quota scripts' lean Redis connection (gateway/redis_scripts.py): RESP replies, script
loading, a restarted or hung Redis, credentials, and held calls sharing a round trip. The quota
semantics through it are tests/gateway/test_quota*.py's."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_scripts import LeanScripts, RedisPyScripts, _Incomplete, _parse, script_runner
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

ECHO = "return {tonumber(ARGV[1]) + 1, ARGV[2], KEYS[1]}"


def test_parse_replies_whole_and_split():
    data = b":42\r\n$3\r\nabc\r\n$-1\r\n*2\r\n:1\r\n*1\r\n$0\r\n\r\n+OK\r\n"
    expected = [42, b"abc", None, [1, [b""]], "OK"]
    pos, got = 0, []
    while pos < len(data):
        value, pos = _parse(bytearray(data), pos)
        got.append(value)
    assert got == expected
    for cut in range(1, len(b"*2\r\n:1\r\n$3\r\nabc\r\n")):  # a reply split anywhere
        with pytest.raises(_Incomplete):
            _parse(bytearray(b"*2\r\n:1\r\n$3\r\nabc\r\n"[:cut]), 0)


def test_parse_errors_are_returned_not_raised():
    noscript, _ = _parse(bytearray(b"-NOSCRIPT No matching script.\r\n"), 0)
    other, _ = _parse(bytearray(b"-ERR boom\r\n"), 0)
    assert isinstance(noscript, NoScriptError)
    assert isinstance(other, ResponseError) and not isinstance(other, NoScriptError)
    with pytest.raises(ValueError):
        _parse(bytearray(b"?what\r\n"), 0)


def test_runner_choice_follows_the_client():
    assert isinstance(script_runner(aioredis.Redis.from_url("redis://127.0.0.1:1/3")), LeanScripts)
    for url in ("rediss://127.0.0.1:1/0", "unix:///tmp/redis.sock"):
        assert isinstance(script_runner(aioredis.Redis.from_url(url)), RedisPyScripts)


def test_scripts_run_reload_and_survive_a_restart(redis_server):  # noqa: F811
    async def scenario():
        lean = LeanScripts(port=redis_server.port, socket_timeout=1.0)
        calls = [(ECHO, ["k1"], [1, "a"]), (ECHO, ["k2"], [2, "b"])]
        assert await lean.run(calls) == [[2, b"a", b"k1"], [3, b"b", b"k2"]]  # loaded on NOSCRIPT
        redis_server.kill()
        redis_server.start()  # empty: no scripts; our connection is dead
        assert await lean.run(calls[:1]) == [[2, b"a", b"k1"]]
        with pytest.raises(ResponseError):
            await lean.run([("return redis.call('NOPE')", [], [])])
        await lean.close()

    asyncio.run(scenario())


def test_a_hung_redis_times_out_and_the_next_call_reconnects(redis_server):  # noqa: F811
    async def scenario():
        lean = LeanScripts(port=redis_server.port, socket_timeout=1.0)
        await lean.run([(ECHO, ["k"], [0, "x"])])
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(RedisTimeoutError):
                await lean.run([(ECHO, ["k"], [0, "x"])])
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert await lean.run([(ECHO, ["k"], [5, "y"])]) == [[6, b"y", b"k"]]
        await lean.close()

    asyncio.run(scenario())


def test_password_and_database(redis_server):  # noqa: F811
    async def scenario():
        admin = aioredis.Redis.from_url(redis_server.url)
        await admin.config_set("requirepass", "s3cret")
        try:
            url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/2"
            runner = script_runner(aioredis.Redis.from_url(url))
            assert isinstance(runner, LeanScripts)
            await runner.run([("return redis.call('SET', KEYS[1], ARGV[1])", ["k"], ["v"])])
            check = aioredis.Redis.from_url(url)
            assert await check.get("k") == b"v"
            assert await check.execute_command("SELECT", 0) and await check.get("k") is None
            await check.aclose()
            await runner.close()
            wrong = LeanScripts(port=redis_server.port, password="wrong")
            with pytest.raises(ResponseError):
                await wrong.run([(ECHO, ["k"], [0, "x"])])
        finally:
            fixer = aioredis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{redis_server.port}/0")
            await fixer.config_set("requirepass", "")
            await fixer.aclose()
            await admin.aclose()

    asyncio.run(scenario())


def test_held_calls_ride_with_the_next_call(redis_server):  # noqa: F811
    async def scenario():
        lean = LeanScripts(port=redis_server.port, socket_timeout=1.0)
        await lean.run([(ECHO, ["k"], [0, "warm"])])
        held = asyncio.ensure_future(lean.run([(ECHO, ["k"], [1, "held"])], within_s=60.0))
        await asyncio.sleep(0.05)
        assert not held.done()  # waiting for company, not for Redis
        assert await lean.run([(ECHO, ["k"], [2, "now"])]) == [[3, b"now", b"k"]]
        assert await held == [[2, b"held", b"k"]]
        alone = await asyncio.wait_for(lean.run([(ECHO, ["k"], [3, "a"])], within_s=0.01), 1.0)
        assert alone == [[4, b"a", b"k"]]  # nobody came: sent after within_s
        await lean.close()

    asyncio.run(scenario())


def test_calls_on_a_closed_runner_fail_as_connection_errors():
    async def scenario():
        lean = LeanScripts(port=1, socket_connect_timeout=0.5)  # nothing listens on port 1
        with pytest.raises(RedisConnectionError):
            await lean.run([(ECHO, ["k"], [0, "x"])])

    asyncio.run(scenario())
