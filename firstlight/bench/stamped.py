"""TCP transports that time every read with the kernel's receive timestamp.

A streamed chunk's arrival time is what every latency metric rests on. Read in user space, it also
carries the wait for the process to be scheduled and for the event loop to reach the socket among
the others that became ready together (tens of streams emit in the same millisecond at high
concurrency). Linux stamps each received segment in the kernel (`SO_TIMESTAMPING` with software
RX stamps, returned by `recvmsg` as `SCM_TIMESTAMPING`; CLOCK_REALTIME): these transports read
that stamp and hand `(data, t)` to the protocol, `t` on the `time.perf_counter` clock. Where no
stamp comes (another OS) `t` is read in the read callback, before any parsing.

asyncio's own transports hide `recvmsg`'s ancillary data, so `StampedTransport` reads the
non-blocking socket itself from a selector callback; it implements the part of a transport the
bench client and the reference server use (write, close, abort). Protocols provide
`connection_made(transport)`, `feed(data, t)` and `connection_lost(exc)`.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

_SO_TIMESTAMPING = getattr(socket, "SO_TIMESTAMPING", 37)
_SOF_RX_SOFTWARE_AND_REPORT = (1 << 3) | (1 << 4)  # SOF_TIMESTAMPING_RX_SOFTWARE | _SOFTWARE
_CMSG_SPACE = socket.CMSG_SPACE(48) if hasattr(socket, "CMSG_SPACE") else 0  # three timespecs
_READ_SIZE = 1 << 16


class StampedProtocol(Protocol):
    def connection_made(self, transport: Any) -> None: ...
    def feed(self, data: bytes, t: float) -> None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...


def kernel_time(ancillary: list[tuple[int, int, bytes]], now: float) -> float:
    """The receive stamp in `ancillary`, on the perf_counter clock; `now` when there is none."""
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPING and len(raw) >= 16:
            sec, nsec = struct.unpack_from("qq", raw)
            if sec:  # offset between the clocks read now, so clock slewing cannot accumulate
                return min(now, sec + nsec * 1e-9 - (time.time() - time.perf_counter()))
    return now


class StampedTransport:
    """Drives `proto` from one connected non-blocking socket; see the module doc."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, proto: StampedProtocol) -> None:
        self.loop, self.sock, self.proto = loop, sock, proto
        self.fd = sock.fileno()
        self.out = b""
        self.closing = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPING, _SOF_RX_SOFTWARE_AND_REPORT)
            self.stamped = _CMSG_SPACE > 0
        except OSError:
            self.stamped = False
        proto.connection_made(self)
        loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        while not self.closing:
            try:
                if self.stamped:
                    data, anc, _, _ = self.sock.recvmsg(_READ_SIZE, _CMSG_SPACE)
                else:
                    data, anc = self.sock.recv(_READ_SIZE), []
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(e)
                return
            if not data:
                self._lost(None)
                return
            self.proto.feed(data, kernel_time(anc, time.perf_counter()))

    def _writable(self) -> None:
        try:
            n = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(e)
            return
        self.out = self.out[n:]
        if not self.out:
            self.loop.remove_writer(self.fd)
            if self.closing:
                self._shut(None)

    def write(self, data: bytes) -> None:
        if self.closing:
            return
        if not self.out:
            try:
                n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.loop.call_soon(self._lost, e)
                return
            data = data[n:]
            if not data:
                return
            self.loop.add_writer(self.fd, self._writable)
        self.out += data

    def _lost(self, exc: Exception | None) -> None:
        self._shut(exc)

    def close(self) -> None:
        """Stop reading; close once the bytes already written are sent."""
        if self.closing:
            return
        self.closing = True
        self.loop.remove_reader(self.fd)
        if not self.out:
            self._shut(None)

    def abort(self) -> None:
        """Close now, dropping unsent bytes."""
        self._shut(None)

    def _shut(self, exc: Exception | None) -> None:
        """Release the socket; the protocol hears `connection_lost` once, as from asyncio."""
        self.closing = True
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
            self.sock.close()
            self.loop.call_soon(self.proto.connection_lost, exc)


async def open_stamped(loop: asyncio.AbstractEventLoop, host: str, port: int, proto: StampedProtocol) -> StampedTransport:
    """Connect to host:port and drive `proto` with a StampedTransport."""
    err: OSError | None = None
    for family, kind, proto_num, _, addr in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto_num)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, addr)
        except OSError as e:
            sock.close()
            err = e
            continue
        return StampedTransport(loop, sock, proto)
    raise err or OSError(f"cannot resolve {host}:{port}")


def serve_stamped(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                  factory: Callable[[], StampedProtocol]) -> Callable[[], None]:
    """Accept on the listening `sock`, one `factory()` protocol per connection; returns a stopper."""
    sock.setblocking(False)
    fd = sock.fileno()

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of file descriptors: retry on the next readiness
                return
            conn.setblocking(False)
            StampedTransport(loop, conn, factory())

    loop.add_reader(fd, accept)
    return lambda: loop.remove_reader(fd)
