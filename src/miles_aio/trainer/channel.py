"""The controller ↔ trainer-rank channel: asyncio streams on the controller, blocking sockets on ranks.

Controller side (no threads): `ChannelListener.serve()` accepts TCP connections in its own TaskGroup;
each one must complete the HMAC handshake of `protocol` within `handshake_timeout_s` or is closed
(and counted in `rejected`) without a single frame being read. Authenticated connections are handed to
`deliver` as an `AsyncChannel` (`send`/`recv` of frames, `protocol.Message`; `send_message` of a typed
`protocol.Wire` message). `serve` runs until cancelled.

Rank side (plain blocking code, no asyncio): `connect()` dials the controller, proves the secret and
checks the controller's proof, then returns a `BlockingChannel`. A rank blocks in `recv()` between
commands; EOF (the controller went away) raises `ConnectionError`, on which a rank exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

import structlog
import torch

from miles_aio.trainer import protocol
from miles_aio.trainer.protocol import Message

__all__ = ["AsyncChannel", "BlockingChannel", "ChannelListener", "connect"]

log = structlog.get_logger("miles_aio.trainer.channel")

_SMALL: Final = 64 * 1024
"""Chunks below this size are coalesced into one send: fewer syscalls for headers and small tensors."""


class AsyncChannel:
    """Controller end of one authenticated rank connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, rank: int) -> None:
        self.rank = rank
        self._reader = reader
        self._writer = writer

    async def send(
        self, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        self._writer.writelines(protocol.encode_frame(header, tensors))
        await self._writer.drain()

    async def send_message(self, msg: protocol.Wire) -> None:
        await self.send(*protocol.to_wire(msg))

    async def recv(self) -> Message:
        """The next message; `ConnectionError` at EOF (the rank closed or died)."""
        try:
            prefix = await self._reader.readexactly(protocol.FRAME_PREFIX.size)
            head_len, blob_len = protocol.parse_frame_prefix(prefix)
            head = await self._reader.readexactly(head_len)
            blob = bytearray(await self._reader.readexactly(blob_len)) if blob_len else bytearray()
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError(f"rank {self.rank} closed the channel") from exc
        return protocol.decode_frame(head, blob)

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


class ChannelListener:
    """A listening socket for trainer ranks (127.0.0.1 unless told otherwise)."""

    def __init__(
        self,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the channel secret must hold at least 16 bytes")
        self._secret = secret
        self._timeout = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except BaseException:  # a taken port, a bad address: no socket left open
            self._sock.close()
            raise
        self.rejected = 0
        """Connections dropped because the handshake failed (wrong secret, garbage, timeout)."""

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    async def serve(self, deliver: Callable[[AsyncChannel], None]) -> None:
        """Accept and authenticate connections until cancelled; the handshakes are child tasks."""
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            while True:
                conn, peer = await loop.sock_accept(self._sock)
                tg.create_task(self._handshake(conn, peer, deliver), name=f"handshake-{peer}")

    async def _handshake(
        self, conn: socket.socket, peer: Any, deliver: Callable[[AsyncChannel], None]
    ) -> None:
        """Authenticate one connection. A stranger on the port (wrong secret, garbage, silence, any
        error) is logged and dropped: it must never take the listener, or the run, down. Whatever
        happens, including cancellation (re-raised), a connection that is not delivered is closed."""
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=2**20)
        except BaseException as exc:
            conn.close()
            if not isinstance(exc, Exception):
                raise
            self._reject(peer, exc)
            return
        try:
            async with asyncio.timeout(self._timeout):
                nonce, hello = protocol.hello()
                writer.write(hello)
                await writer.drain()
                response = await reader.readexactly(protocol.RESPONSE_LEN)
                rank, client_nonce = protocol.check_response(self._secret, nonce, response)
                writer.write(protocol.controller_proof(self._secret, nonce, client_nonce))
                await writer.drain()
        except BaseException as exc:
            writer.close()
            if not isinstance(exc, Exception):
                raise  # cancelled (the listener is shutting down): closed, and not swallowed
            self._reject(peer, exc)
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return
        deliver(AsyncChannel(reader, writer, rank=rank))

    def _reject(self, peer: Any, exc: Exception) -> None:
        self.rejected += 1
        log.warning("trainer channel: rejected a connection", peer=str(peer), reason=repr(exc))

    def close(self) -> None:
        self._sock.close()


class BlockingChannel:
    """Rank end of the channel (blocking socket I/O): one thread receives; sends may come from two (the
    command loop and the heartbeat thread), so a frame is sent whole under a lock."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()

    def send(self, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        with self._send_lock:
            self._send(header, tensors)

    def send_message(self, msg: protocol.Wire) -> None:
        self.send(*protocol.to_wire(msg))

    def _send(self, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None) -> None:
        pending = bytearray()
        for chunk in protocol.encode_frame(header, tensors):
            if len(chunk) < _SMALL:
                pending += chunk
                continue
            if pending:
                self._sock.sendall(pending)
                pending = bytearray()
            self._sock.sendall(chunk)
        if pending:
            self._sock.sendall(pending)

    def recv(self) -> Message:
        head_len, blob_len = protocol.parse_frame_prefix(
            bytes(self._recv_exactly(protocol.FRAME_PREFIX.size))
        )
        head = bytes(self._recv_exactly(head_len))
        return protocol.decode_frame(head, self._recv_exactly(blob_len))

    def _recv_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("the controller closed the channel")
            got += k
        return buf

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def connect(host: str, port: int, *, secret: bytes, rank: int, timeout_s: float = 60.0) -> BlockingChannel:
    """Dial the controller and run the handshake; raises ProtocolError if the controller cannot prove
    the secret, ConnectionError if it drops us (we could not prove ours)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        chan = BlockingChannel(sock)
        hello = bytes(chan._recv_exactly(protocol.HELLO_LEN))
        client_nonce, response = protocol.rank_response(secret, hello, rank)
        sock.sendall(response)
        protocol.check_proof(secret, hello, client_nonce, bytes(chan._recv_exactly(protocol.PROOF_LEN)))
        sock.settimeout(None)  # commands may be minutes apart; liveness comes from EOF, not timeouts
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return chan
    except BaseException:
        sock.close()
        raise
