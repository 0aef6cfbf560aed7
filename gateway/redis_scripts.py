"""Running the gateway's Lua scripts in Redis: a lean pipelined connection, or redis-py where
it cannot go.

Every request runs two quota scripts (acquire, then settle; gateway/quota_redis.py) and, with a
Redis block index, one lookup script (gateway/redis_index.py). Through redis-py each call costs
the gateway 75-140 us of CPU (connection pool and its locks, retry wrapper, observability hooks,
and `SCRIPT EXISTS` before every pipeline holding a script): a tenth of a request's CPU for tiny
calls. `LeanScripts` sends EVALSHA on one connection, pipelined (each call writes at once and
its reply is matched in order), for 25-30 us a call, and a busy gateway's calls share round
trips. It speaks RESP2 over plain TCP with optional AUTH and SELECT; a client configured for
anything else (TLS, unix sockets, credential providers) keeps redis-py (`RedisPyScripts`).

Failure semantics are redis-py's, which the callers rely on: a call that takes longer than
`socket_timeout` raises `redis.exceptions.TimeoutError` and closes the connection (its other
calls fail the same way: each may still run when a hung Redis resumes, which the quota scripts'
idempotence and tombstones make harmless); a connection that breaks raises `ConnectionError`,
and a call is retried once on a fresh connection (safe: every script here is idempotent); an
unreachable Redis fails at once; NOSCRIPT (a restarted Redis) loads the script and retries.
"""

from __future__ import annotations

import asyncio
import hashlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Call = tuple[str, Sequence[str], Sequence[Any]]  # (script source, keys, args)
_LEAN_KWARGS = {"host", "port", "db", "username", "password", "socket_timeout"}
_LEAN_KWARGS |= {"socket_connect_timeout"}
# redis-py's own machinery, and its retry policy (ours: once on a fresh connection, as the quota
# service configures it).
_IGNORED_KWARGS = {"retry", "himport_registry", "maint_notifications_pool_handler"}
_IGNORED_KWARGS |= {"maint_notifications_config", "orig_host_address"}
_IGNORED_KWARGS |= {"orig_socket_timeout", "orig_socket_connect_timeout"}


class ScriptRunner(ABC):
    """Runs Lua scripts by their source (EVALSHA, loading them when Redis lacks them)."""

    @abstractmethod
    async def run(self, calls: Sequence[Call], within_s: float = 0.0) -> list[Any]:
        """Every call's reply, in one round trip; raises the first error after all replied.
        `within_s`: the calls may wait up to that long to share a later call's round trip."""

    async def close(self) -> None:
        return None


def script_runner(client: aioredis.Redis) -> ScriptRunner:
    """`LeanScripts` with `client`'s address, timeouts and credentials when it can reproduce
    them, else `RedisPyScripts` on `client` itself."""
    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k not in _IGNORED_KWARGS}
    if pool.connection_class is not Connection or not set(kwargs) <= _LEAN_KWARGS:
        return RedisPyScripts(client)
    return LeanScripts(**kwargs)


class RedisPyScripts(ScriptRunner):
    def __init__(self, client: aioredis.Redis):
        self.client = client

    async def run(self, calls: Sequence[Call], within_s: float = 0.0) -> list[Any]:
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for source, keys, args in calls:
                pipe.evalsha(_sha(source), len(keys), *keys, *args)
            try:
                return await pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                for source in {source for source, _, _ in calls}:
                    await self.client.script_load(source)
        raise AssertionError("unreachable")


class LeanScripts(ScriptRunner):
    def __init__(
        self,
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        socket_timeout: float | None = None,
        socket_connect_timeout: float | None = None,
    ):
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.timeout_s = socket_timeout
        self.connect_timeout_s = socket_connect_timeout or socket_timeout
        self._conn: _RespProtocol | None = None
        self._connecting: asyncio.Future[_RespProtocol] | None = None

    async def run(self, calls: Sequence[Call], within_s: float = 0.0) -> list[Any]:
        for attempt in range(3):  # a dead connection and NOSCRIPT, each worth one more try
            conn = await self._connection()
            futures = [conn.send(_evalsha(s, keys, args), within_s) for s, keys, args in calls]
            replies = await self._replies(conn, futures)
            errors = [r for r in replies if isinstance(r, BaseException)]
            if not errors:
                return replies
            timeouts = [e for e in errors if isinstance(e, RedisTimeoutError)]
            retryable = (RedisConnectionError, NoScriptError)
            if timeouts or attempt == 2 or not all(isinstance(e, retryable) for e in errors):
                raise (timeouts or errors)[0]
            if any(isinstance(e, NoScriptError) for e in errors):  # a restarted (empty) Redis
                conn = await self._connection()
                sources = {source for source, _, _ in calls}
                loads = [conn.send(_command(b"SCRIPT", b"LOAD", s)) for s in sources]
                for reply in await self._replies(conn, loads):
                    if isinstance(reply, BaseException):
                        raise reply
        raise AssertionError("unreachable")

    async def _replies(self, conn: _RespProtocol, futures: list[asyncio.Future]) -> list[Any]:
        """The futures' results (or exceptions), closing the connection after `timeout_s`."""
        loop = asyncio.get_running_loop()
        timer = None
        if self.timeout_s is not None:
            timer = loop.call_later(self.timeout_s, conn.fail, RedisTimeoutError("Timeout"))
        try:
            return await asyncio.gather(*futures, return_exceptions=True)
        finally:
            if timer is not None:
                timer.cancel()

    async def _connection(self) -> _RespProtocol:
        conn = self._conn
        if conn is not None and not conn.is_closed:
            return conn
        if self._connecting is None:  # one connect for every caller that needs it now
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            conn = await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None
        return conn

    async def _connect(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_RespProtocol, self.host, self.port)
                setup = []
                if self.password is not None:
                    user = [self.username] if self.username else []
                    setup.append(conn.send(_command(b"AUTH", *user, self.password)))
                if self.db:
                    setup.append(conn.send(_command(b"SELECT", self.db)))
                for reply in await asyncio.gather(*setup, return_exceptions=True):
                    if isinstance(reply, BaseException):
                        conn.fail(RedisConnectionError(f"Redis setup failed: {reply}"))
                        raise reply
        except TimeoutError:
            raise RedisTimeoutError("Timeout connecting to Redis") from None
        except OSError as e:
            raise RedisConnectionError(f"Error connecting to Redis: {e}") from e
        self._conn = conn
        return conn

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _RespProtocol(asyncio.Protocol):
    """One connection: replies matched to commands in order. A command is written at once, or
    held (`send(..., within_s)`) until the next command written at once, at most `within_s`:
    held commands ride along in the same write and the same round trip."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._waiting: deque[asyncio.Future] = deque()
        self._buffer = bytearray()
        self._held: list[bytes] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self.is_closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def send(self, command: bytes, within_s: float = 0.0) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self.is_closed:
            future.set_exception(RedisConnectionError("Connection closed by server."))
            return future
        self._waiting.append(future)
        self._held.append(command)
        if not within_s:
            self.flush()
        elif self._flush_timer is None:
            self._flush_timer = loop.call_later(within_s, self.flush)
        return future

    def flush(self) -> None:
        """Write the held commands now."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._held and not self.is_closed:
            assert self._transport is not None
            self._transport.write(b"".join(self._held) if len(self._held) > 1 else self._held[0])
        self._held.clear()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        pos = 0
        while self._waiting:
            try:
                reply, pos = _parse(self._buffer, pos)
            except _Incomplete:
                break
            except ValueError as e:  # not RESP: nothing later on this connection can be trusted
                self.fail(RedisConnectionError(f"Protocol error from Redis: {e}"))
                return
            future = self._waiting.popleft()
            if not future.done():  # its caller may have given up (cancelled)
                if isinstance(reply, BaseException):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        del self._buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Connection closed by server: {exc}"))

    def close(self) -> None:
        """Close after writing what is held (its replies are not waited for)."""
        self.flush()
        self.is_closed = True
        if self._transport is not None:
            self._transport.close()

    def fail(self, error: BaseException) -> None:
        """Close; every call still waiting gets `error` (it may have run, or may yet)."""
        self.is_closed = True
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._held.clear()
        if self._transport is not None:
            self._transport.abort()
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)


class _Incomplete(Exception):
    pass


def _parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply at `pos` → (value, position after it); errors are returned as
    exceptions (`NoScriptError`, `ResponseError`), not raised."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    pos = end + 2
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, pos
        if len(buf) < pos + size + 2:
            raise _Incomplete
        return bytes(buf[pos : pos + size]), pos + size + 2
    if kind == b"*":
        size = int(line)
        if size < 0:
            return None, pos
        items = []
        for _ in range(size):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == b"+":
        return line.decode(), pos
    if kind == b"-":
        message = line.decode(errors="replace")
        if message.startswith("NOSCRIPT"):
            return NoScriptError(message), pos
        return ResponseError(message), pos
    raise ValueError(f"unexpected reply type {bytes(kind)!r}")


def _command(*args: Any) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


_SHAS: dict[str, str] = {}


def _sha(source: str) -> str:
    sha = _SHAS.get(source)
    if sha is None:
        sha = _SHAS[source] = hashlib.sha1(source.encode()).hexdigest()
    return sha


def _evalsha(source: str, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    return _command(b"EVALSHA", _sha(source), len(keys), *keys, *args)
