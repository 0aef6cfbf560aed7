"""The framed GenerateMux transport (protos/mux_frames.py), driven by raw frames on a socket:
requests interleave with their own tokens, errors and cancels stay with their request, a closed
connection (or an EOF: the gateway never half-closes) cancels its requests, a drain refuses new
starts and ends the connection after its own; the hello must carry the token (and under mTLS a
certificate from the CA), and no byte sequence on the port stops the listener or another
connection."""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
from collections import defaultdict

import grpc
import pytest

from engine import internal_auth
from protos import decode_pb2, mux_frames
from tests.fixtures.pki import make_pki, tls_env
from tests.protos.echo_decode import ABORT, EchoDecode

TOKEN = "frames-token-for-tests-0123456789"
OK = grpc.StatusCode.OK.value[0]


def start(rid: int, prompt: list[int]) -> decode_pb2.MuxRequest:
    request = decode_pb2.GenerateRequest(request_id=f"r{rid}", prompt_token_ids=prompt)
    return decode_pb2.MuxRequest(id=rid, start=request)


def cancel(rid: int) -> decode_pb2.MuxRequest:
    return decode_pb2.MuxRequest(id=rid, cancel=decode_pb2.MuxCancel())


@contextlib.asynccontextmanager
async def listening(delay_s: float = 0.0):
    servicer = EchoDecode(delay_s)
    server = mux_frames.FramesServer(servicer, *internal_auth.frames_auth())
    port = await server.start("127.0.0.1", 0)
    try:
        yield servicer, server, port
    finally:
        server.close()


class Client:
    """A raw framed connection; what arrived, per request id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.frames = mux_frames.FrameReader(64 * 1024 * 1024)
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.ends: dict[int, list[tuple[int, str]]] = defaultdict(list)
        self.is_closed = False

    @classmethod
    async def connect(cls, port: int, token: str | None = TOKEN, context=None) -> Client:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1" if context else None
        )
        client = cls(reader, writer)
        if token is not None:
            client.send(decode_pb2.MuxHello(token=token, version=mux_frames.FRAMES_VERSION))
        return client

    @classmethod
    async def welcomed(cls, port: int, context=None) -> Client:
        """Connected with the token and past the hello."""
        client = await cls.connect(port, context=context)
        await client.welcome()
        return client

    def send(self, *messages) -> None:
        for message in messages:
            self.writer.write(mux_frames.frame(message))

    async def _frames(self, timeout_s: float) -> list[bytes]:
        """The next frames; [] and `is_closed` once the server closed the connection."""
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    self.is_closed = True
                    return []
                frames = self.frames.feed(data)
                if frames:
                    return frames

    async def welcome(self) -> decode_pb2.MuxWelcome:
        frames = await self._frames(10)
        if not frames:
            raise ConnectionError("closed instead of welcomed")
        return decode_pb2.MuxWelcome.FromString(frames[0])

    async def until(self, done, timeout_s: float = 10.0) -> None:
        while not done():
            frames = await self._frames(timeout_s)
            if not frames:
                return
            for payload in frames:
                for item in decode_pb2.MuxResponse.FromString(payload).items:
                    if item.HasField("response"):
                        self.tokens[item.id] += item.response.tokens.token_ids
                    else:
                        self.ends[item.id].append((item.end.code, item.end.details))

    async def until_closed(self, timeout_s: float = 10.0) -> None:
        await self.until(lambda: self.is_closed, timeout_s)
        assert self.is_closed

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv(internal_auth.ENV_TOKEN, TOKEN)


def test_requests_interleave_and_errors_and_cancels_stay_with_their_own(token):
    async def run():
        async with listening(delay_s=0.01) as (servicer, _, port):
            client = await Client.connect(port)
            assert (await client.welcome()).version == mux_frames.FRAMES_VERSION
            prompts = {rid: [100 * rid + k for k in range(1, 6)] for rid in (1, 2, 3)}
            client.send(*(start(rid, p) for rid, p in prompts.items()))
            client.send(start(4, [ABORT, 1]), start(5, list(range(1, 200))))
            await client.until(lambda: all(client.ends.get(rid) for rid in (1, 2, 3, 4)))
            for rid, prompt in prompts.items():
                assert client.tokens[rid] == prompt
                assert client.ends[rid] == [(OK, "")]
            invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert client.ends[4] == [(invalid, "bad prompt")]
            client.send(cancel(5))
            async with asyncio.timeout(10):
                while servicer.cancelled != ["r5"]:
                    await asyncio.sleep(0.01)
            assert 5 not in client.ends
            client.close()

    asyncio.run(run())


def test_a_closed_connection_cancels_its_requests(token):
    async def run():
        async with listening(delay_s=0.05) as (servicer, server, port):
            client = await Client.welcomed(port)
            client.send(start(1, list(range(1, 200))), start(2, list(range(1, 200))))
            await client.until(lambda: client.tokens[1] and client.tokens[2])
            client.close()
            async with asyncio.timeout(10):
                while sorted(servicer.cancelled) != ["r1", "r2"]:
                    await asyncio.sleep(0.01)
                while server.connections:
                    await asyncio.sleep(0.01)

    asyncio.run(run())


def test_drain_refuses_new_starts_and_ends_the_connection_after_its_own(token):
    async def run():
        async with listening(delay_s=0.02) as (servicer, _, port):
            client = await Client.welcomed(port)
            client.send(start(1, list(range(1, 20))))
            await client.until(lambda: client.tokens[1])
            servicer.close_mux_streams()
            client.send(start(2, [1, 2]))
            await client.until_closed()
            assert client.tokens[1] == list(range(1, 20))
            assert client.ends[1] == [(OK, "")]
            unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
            assert client.ends[2] == [(unavailable, "the decode is draining")]

    asyncio.run(run())


def test_an_eof_from_the_client_cancels_its_requests(token):
    """The gateway never half-closes: an EOF is a client gone, whose requests are cancelled
    at once rather than run on for nobody."""

    async def run():
        async with listening(delay_s=0.05) as (servicer, server, port):
            client = await Client.welcomed(port)
            client.send(start(1, list(range(1, 200))))
            await client.until(lambda: client.tokens[1])
            client.writer.write_eof()
            await client.until_closed()
            assert 1 not in client.ends and len(client.tokens[1]) < 199
            async with asyncio.timeout(10):
                while servicer.cancelled != ["r1"]:
                    await asyncio.sleep(0.01)
                while server.connections:
                    await asyncio.sleep(0.01)

    asyncio.run(run())


async def _refused(port: int, data: bytes, token: str | None = None) -> None:
    """`data` as the first bytes of a connection (after a hello with `token`, if given): the
    listener closes it without a welcome."""
    client = await Client.connect(port, token=token)
    client.writer.write(data)
    await client.until_closed()


def test_no_bytes_on_the_port_stop_the_listener_or_other_connections(token):
    async def run():
        async with listening(delay_s=0.02) as (servicer, server, port):
            good = await Client.welcomed(port)
            good.send(start(1, list(range(1, 100))))
            hello = decode_pb2.MuxHello(token="a-wrong-token-0123456789")
            bad_firsts = [
                mux_frames.frame(hello),  # a wrong token
                mux_frames.frame(decode_pb2.MuxHello()),  # none
                mux_frames.HEADER.pack(mux_frames.MAX_HELLO_BYTES + 1),  # a hello too long
                mux_frames.HEADER.pack(3) + b"\xff\xff\xff",  # not a protobuf message
            ]
            for data in bad_firsts:
                await _refused(port, data)
            after_hello = [
                mux_frames.HEADER.pack(mux_frames.MAX_REQUEST_FRAME_BYTES + 1),  # too long
                mux_frames.HEADER.pack(2) + b"\x0a\xff",  # a truncated field
            ]
            for data in after_hello:
                await _refused(port, data, token=TOKEN)
            assert server.num_rejected == len(bad_firsts) + len(after_hello)
            # A rejected message after a good hello is GenerateMux's, per request.
            good.send(start(0, [1]))
            await good.until(lambda: good.tokens[1] == list(range(1, 100)) and good.ends[1])
            assert good.ends[0][0][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert servicer.cancelled == []
            fresh = await Client.welcomed(port)
            fresh.send(start(7, [7, 8]))
            await fresh.until(lambda: fresh.ends[7])
            assert fresh.tokens[7] == [7, 8]
            good.close()
            fresh.close()

    asyncio.run(run())


def test_connections_without_a_hello_are_bounded_in_number_and_time(token, monkeypatch):
    monkeypatch.setattr(mux_frames, "MAX_HANDSHAKES", 4)

    async def run():
        async with listening() as (_, server, port):
            silent = [await Client.connect(port, token=None) for _ in range(4)]
            async with asyncio.timeout(10):
                while server.num_handshakes < 4:
                    await asyncio.sleep(0.01)
            extra = await Client.connect(port)  # its hello is never read
            await extra.until_closed()
            assert server.num_rejected == 1
            for client in silent:
                client.close()
            async with asyncio.timeout(10):
                while server.num_handshakes:
                    await asyncio.sleep(0.01)
            client = await Client.welcomed(port)
            client.close()
            monkeypatch.setattr(mux_frames, "HELLO_TIMEOUT_S", 0.2)
            slow = await Client.connect(port, token=None)
            await slow.until_closed()
            assert server.num_rejected == 2 and server.num_handshakes == 0

    asyncio.run(run())


def test_under_mtls_a_certificate_from_the_ca_is_required(token, monkeypatch, tmp_path):
    pki = make_pki(tmp_path)
    for name, value in tls_env(pki).items():
        monkeypatch.setenv(name, value)

    async def run():
        async with listening() as (_, _, port):
            client = await Client.welcomed(port, context=internal_auth.ssl_context(server=False))
            client.send(start(1, [5, 6]))
            await client.until(lambda: client.ends[1])
            assert client.tokens[1] == [5, 6]
            client.close()
            bare = ssl.create_default_context(cafile=str(pki / "ca.pem"))  # no certificate
            rogue = ssl.create_default_context(cafile=str(pki / "ca.pem"))
            rogue.load_cert_chain(str(pki / "rogue.pem"), str(pki / "rogue.key"))
            for context in (bare, rogue):
                with pytest.raises((ssl.SSLError, ConnectionError)):
                    client = await Client.connect(port, context=context)
                    await client.welcome()  # TLS 1.3: the refusal may come at the first read
                    pytest.fail("welcomed without a valid client certificate")
            with pytest.raises(ConnectionError):  # nor does a plain connection get through
                client = await Client.welcomed(port)

    asyncio.run(run())


def test_the_reader_splits_frames_however_the_bytes_arrive():
    rng = random.Random(7)
    messages = [start(i, list(range(rng.randrange(0, 5000)))) for i in range(1, 40)]
    stream = b"".join(mux_frames.frame(m) for m in messages)
    for _ in range(20):
        reader, payloads, position = mux_frames.FrameReader(1 << 20), [], 0
        while position < len(stream):  # reads of 1 byte to 64 KiB: headers and frames split
            size = rng.choice([1, 3, 4, 5, rng.randrange(1, 65536)])
            payloads += reader.feed(stream[position : position + size])
            position += size
        assert [decode_pb2.MuxRequest.FromString(p) for p in payloads] == messages
    with pytest.raises(mux_frames.FrameError):
        mux_frames.FrameReader(10).feed(mux_frames.HEADER.pack(11))
