"""Driving a ``zmq.asyncio`` socket on the event loop, and counting every message it carries.

``SocketIo`` sends and receives whole multipart messages without copies, waiting on ZeroMQ's fd itself;
``HopMetrics`` counts each message per socket, peer and message type; ``configure`` applies a process's
``SocketOptions`` to a new socket.  Every socket class of ravq.net (``transport``, ``pubsub``) is built on
these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import zmq
import zmq.asyncio

from ravq.metrics import HopCount, HopObservations, Metrics
from ravq.net.options import SocketOptions
from ravq.net.wire import Message

log = logging.getLogger(__name__)


def _nbytes(frames: list[Any]) -> int:
    return sum(len(memoryview(f)) for f in frames)


class HopMetrics:
    """One socket's per-(peer, type) series, looked up once.

    ``labels()`` costs more than counting itself, and every message would pay it several times; the
    series are ravq.metrics' plain-number ones, so counting a message is a few additions.
    """

    def __init__(self, metrics: Metrics, socket: str, peers_as: str | None = None) -> None:
        """``peers_as``: count every peer under this one label (a broker's thousands of nodes: a series per
        node and type would be 30,000 at 10,000 members, and a lookup more per message)."""
        self.metrics, self.socket, self.peers_as = metrics, socket, peers_as
        self._sent: dict[tuple[str, str], tuple[HopObservations, HopCount, HopCount]] = {}
        self._received: dict[tuple[str, str], tuple[HopCount, HopCount, HopObservations]] = {}
        self._payload_bytes: dict[tuple[str, str], tuple[HopCount, HopCount]] = {}

    def sent(self, peer: str, msg: Message, frames: list[Any], t0: float) -> None:
        peer = self.peers_as or peer
        key = (peer, msg.type)
        if (series := self._sent.get(key)) is None:
            m, labels = self.metrics, (self.socket, peer, msg.type)
            series = self._sent[key] = (m.send_seconds.labels(*labels), m.messages_sent.labels(*labels),
                                        m.bytes_sent.labels(*labels))
        series[0].observe(time.perf_counter() - t0)
        series[1].inc()
        nbytes = _nbytes(frames)
        series[2].inc(nbytes)
        if len(frames) > 1:
            self._payload("sent", msg, nbytes - len(memoryview(frames[0])))

    def _payload(self, direction: str, msg: Message, tensor_bytes: int) -> None:
        """Tensor bytes on the wire and the uncompressed bytes they stand for, per compression format
        (``tensor_bytes``: every frame but the header; plain tensors stand for themselves)."""
        for p in msg.packed.values():
            wire, logical = self._payload_series(direction, p.format)
            wire.inc(p.wire_bytes)
            logical.inc(p.logical_bytes)
            tensor_bytes -= p.wire_bytes
        if msg.tensors:
            wire, logical = self._payload_series(direction, "none")
            wire.inc(tensor_bytes)
            logical.inc(tensor_bytes)

    def _payload_series(self, direction: str, fmt: str) -> tuple[HopCount, HopCount]:
        key = (direction, fmt)
        if (series := self._payload_bytes.get(key)) is None:
            labels = (self.socket, direction, fmt)
            series = self._payload_bytes[key] = (self.metrics.payload_wire_bytes.labels(*labels),
                                                 self.metrics.payload_logical_bytes.labels(*labels))
        return series

    def received(self, peer: str, msg: Message, frames: list[Any], latency: bool = False) -> None:
        """Count a decoded message; with ``latency``, observe sender timestamp -> now."""
        peer = self.peers_as or peer
        key = (peer, msg.type)
        if (series := self._received.get(key)) is None:
            m, labels = self.metrics, (self.socket, peer, msg.type)
            series = self._received[key] = (m.messages_received.labels(*labels),
                                            m.bytes_received.labels(*labels),
                                            m.receive_seconds.labels(*labels))
        series[0].inc()
        nbytes = _nbytes(frames)
        series[1].inc(nbytes)
        if len(frames) > 1:
            self._payload("received", msg, nbytes - len(memoryview(frames[0])))
        if latency:
            series[2].observe(max(0.0, time.time() - msg.sent_at))


class SocketIo:
    """A ``zmq.asyncio`` socket driven through its synchronous shadow, waiting on ZeroMQ's fd itself.

    Every zmq.asyncio call makes a Future, and one that cannot finish at once registers with the loop
    and reads the socket's EVENTS several times: ~20 us per wait, a third of a 64 KiB message's time on
    loopback.  Here a NOBLOCK call on a shadow of the same socket does the work, and only when it
    would block (``zmq.Again``) does a task wait: on a reader this object adds to the loop for ZeroMQ's
    fd, which reads EVENTS once per wake-up.  Parts are received one at a time with ``Frame.more``:
    ``recv_multipart`` asks for RCVMORE with a getsockopt per part, which costs more.

    The reader stays while waits follow one another (a receive loop that waits for every message, as
    a pipeline link does from 1 MiB up) and goes one loop pass after the last waiter left: adding and
    removing it costs ~4 us of event-loop work per wait on uvloop (a poll handle made and closed, two
    epoll_ctl calls).  It never outlives a quiet socket by long, because a reader left on the fd of a
    socket closed behind this object's back would keep uvloop from watching the next file given that
    fd number.

    ZeroMQ's fd signals that the socket's state may have changed, and reading EVENTS consumes that
    signal.  Every caller looks at the state (EVENTS or a NOBLOCK call) just before it waits, so a
    signal consumed while nobody waits loses nothing; but a call made while some task waits (a reply
    sent while a receive waits, or a refused call just before a second task waits) is followed by a
    look at EVENTS on the waiters' behalf.  Nothing else may await the asyncio socket (its reader would
    replace this one); ``close`` wakes every waiter, whose call then raises.
    """

    __slots__ = ("_drop_pending", "_fd", "_loop", "_recv_waited", "_send_lock", "_send_waits", "_shadow",
                 "_waiters", "sock")

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self._shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._shadow.copy_threshold = sock.copy_threshold  # set by configure
        self._fd = cast(int, self._shadow.get(zmq.FD))
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        """(POLLIN or POLLOUT, future) of every task waiting on this socket."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the reader is added to (None while there is no reader)."""
        self._drop_pending = False  # a check whether to remove the reader is scheduled
        self._send_lock = asyncio.Lock()  # sends that had to wait go in order
        self._send_waits = 0
        self._recv_waited = False  # whether the last recv() found nothing queued

    def _check_open(self) -> None:
        if self.sock.closed:  # the shadow does not know when its owner is closed
            raise zmq.ZMQError(zmq.ENOTSOCK)

    def _on_fd(self) -> None:
        """Wake every waiter whose event the socket now has (all of them once it is closed)."""
        events = (zmq.POLLIN | zmq.POLLOUT) if self.sock.closed else cast(int, self._shadow.get(zmq.EVENTS))
        for want, future in self._waiters:
            if events & want and not future.done():
                future.set_result(None)

    async def _wait(self, want: int) -> None:
        """Until the socket may have ``want``; callers look at the state just before (EVENTS or a NOBLOCK
        call), then retry their NOBLOCK call, and wait again."""
        self._check_open()
        if self._waiters:  # the caller's look may have consumed a signal that another waiter needs
            self._on_fd()
        else:
            loop = asyncio.get_running_loop()
            if loop is not self._loop:
                if self._loop is not None:  # left on a loop that has stopped
                    self._drop_reader()
                self._loop, self._drop_pending = loop, False
                loop.add_reader(self._fd, self._on_fd)
        loop = cast(asyncio.AbstractEventLoop, self._loop)
        future = loop.create_future()
        entry = (want, future)
        self._waiters.append(entry)
        try:
            await future
        finally:
            self._waiters.remove(entry)
            if not self._waiters and not self._drop_pending and self._loop is loop:
                # The caller usually waits again at once (its next receive): keep the reader until then.
                self._drop_pending = True
                loop.call_soon(self._drop_if_idle)

    def _drop_if_idle(self) -> None:
        self._drop_pending = False
        if not self._waiters:
            self._drop_reader()

    def _drop_reader(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._fd)
            except (OSError, ValueError):  # the fd went with a socket its context destroyed
                pass
        self._loop = None

    def _after_direct_call(self) -> None:
        if self._waiters:
            self._on_fd()

    def recv_now(self) -> list[Any]:
        """The next multipart message, without copies; raises zmq.Again if none is queued."""
        self._check_open()
        frame = self._shadow.recv(zmq.NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:  # a multipart message is delivered whole: the rest is already here
            frame = self._shadow.recv(zmq.NOBLOCK, copy=False)
            frames.append(frame)
        self._after_direct_call()
        return frames

    def queued(self) -> bool:
        """Whether a message is queued (a NOBLOCK receive would return one)."""
        self._check_open()
        return bool(cast(int, self._shadow.get(zmq.EVENTS)) & zmq.POLLIN)

    async def recv(self) -> list[Any]:
        waited = False
        while True:
            # A refused NOBLOCK call costs ~3 us (pyzmq raises zmq.Again), asking for EVENTS ~1 us: when
            # the last message had to be waited for, the next one probably has to be too, so ask first.
            if not self._recv_waited or cast(int, self._shadow.get(zmq.EVENTS)) & zmq.POLLIN:
                try:
                    frames = self.recv_now()
                except zmq.Again:
                    pass
                else:
                    self._recv_waited = waited
                    return frames
            self._recv_waited = waited = True
            await self._wait(zmq.POLLIN)
            self._recv_waited = False  # woken: the message is probably there

    async def readable(self, timeout_s: float) -> bool:
        """Wait until a message is queued or ``timeout_s`` has passed; whether one is."""
        self._check_open()
        try:
            async with asyncio.timeout(timeout_s):
                while not cast(int, self._shadow.get(zmq.EVENTS)) & zmq.POLLIN:
                    await self._wait(zmq.POLLIN)
                    self._check_open()
        except TimeoutError:
            return False
        return True

    def _send_now(self, frames: list[Any]) -> bool:
        """Queue ``frames`` as one message if the socket takes it at once; whether it did."""
        self._check_open()
        shadow, last = self._shadow, len(frames) - 1
        try:  # only a message's first part is refused when the queue is full, and then nothing is sent
            shadow.send(frames[0], zmq.NOBLOCK | zmq.SNDMORE if last else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        for i in range(1, last):
            shadow.send(frames[i], zmq.NOBLOCK | zmq.SNDMORE, copy=False)
        if last:
            shadow.send(frames[last], zmq.NOBLOCK, copy=False)
        self._after_direct_call()
        return True

    def send_now(self, frames: list[Any]) -> bool:
        """``_send_now`` for a caller that waits its own way (a ROUTER sending to one peer)."""
        return self._send_now(frames)

    async def send(self, frames: list[Any]) -> None:
        """Queue ``frames`` as one message; buffers of ``copy_threshold_bytes`` or more without a copy."""
        # Behind a send that is already waiting, going direct would reorder messages.
        if self._send_waits == 0 and self._send_now(frames):
            return
        self._send_waits += 1
        try:
            async with self._send_lock:
                while not self._send_now(frames):
                    await self._wait(zmq.POLLOUT)
        finally:
            self._send_waits -= 1

    def close(self, linger: int | None = None) -> None:
        """Close the socket; every task waiting on it wakes and its call raises ZMQError(ENOTSOCK)."""
        self._drop_reader()
        self.sock.close(linger)
        for _, future in self._waiters:
            if not future.done():
                future.set_result(None)


def configure(sock: zmq.asyncio.Socket, opts: SocketOptions) -> None:
    """Apply ``opts`` to a new socket (before it binds or connects)."""
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, opts.hwm)
    sock.setsockopt(zmq.RCVHWM, opts.hwm)
    sock.copy_threshold = opts.copy_threshold_bytes


def install_uvloop() -> None:
    """Use uvloop for the process's event loop when it is available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for odd platforms
        log.warning("uvloop not available; using the default asyncio loop")
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
