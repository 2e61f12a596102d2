"""ravq.net.transport, pubsub and socket_io over real ZeroMQ sockets on 127.0.0.1: delivery, per-hop
metrics, malformed input dropped and counted, request/reply with timeouts, PUB/SUB, and ZMQ_MAXMSGSIZE.

Each test runs its scenario with ``asyncio.Runner`` on uvloop (as nodes do) inside a hard timeout,
on a ``zmq_ctx`` that fails the test if a socket is left open or the context will not terminate.
Timeouts are measured on a virtual clock (``tests.virtual_time``), where no message is in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import orjson
import pytest
import torch
import uvloop
import zmq
import zmq.asyncio

from ravq.metrics import Metrics
from ravq.net import socket_io
from ravq.net.options import SocketOptions, endpoint
from ravq.net.pubsub import Publisher, Subscriber
from ravq.net.transport import Inbox, Outlink, request
from ravq.net.wire import DecodeLimits, Message, MsgType, encode
from tests.conftest import free_port
from tests.test_wire import assert_same
from tests.virtual_time import now, run_virtual

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
SCENARIO_TIMEOUT_S = 15.0
LIMITS = DecodeLimits()
OPTS = SocketOptions(linger_ms=200)
ANY_PORT = "tcp://127.0.0.1:*"


def run(scenario: Awaitable[T]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(SCENARIO_TIMEOUT_S):
            return await scenario

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(bounded())


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """A metric's value, 0 if the labelled series was never touched."""
    return metrics.registry.get_sample_value(name, labels) or 0.0


def bound_endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def forward(seq: int, n: int = 1000, sender: str = "stage-0") -> Message:
    return Message(type=MsgType.FORWARD, sender=sender, micro_batch=(0, seq), version=seq,
                   sent_at=time.time(), tensors={"activations": torch.randn(n)})


def wire_bytes(msg: Message) -> int:
    return sum(len(memoryview(f)) for f in encode(msg))  # deterministic: sent_at is set


# ------------------------------------------------------------------------- pipeline links


def test_outlink_to_inbox_delivers_and_counts_per_socket_peer_and_type(zmq_ctx: zmq.asyncio.Context) -> None:
    sender_metrics, receiver_metrics = Metrics("stage-0"), Metrics("stage-1")
    sent = [forward(0), forward(1, n=4096), forward(2, n=0),
            Message(type=MsgType.BACKWARD, sender="stage-0", micro_batch=(0, 0), sent_at=time.time(),
                    tensors={"grad": torch.randn(3, 7).to(torch.bfloat16)})]

    async def scenario() -> list[tuple[bytes, Message]]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", receiver_metrics, LIMITS, OPTS)
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "downstream", "stage-1", sender_metrics,
                               LIMITS, OPTS, identity="stage-0")
        try:
            for msg in sent:
                await link.send(msg)
            return [await inbox.recv() for _ in sent]
        finally:
            link.close()
            inbox.close()

    received = run(scenario())
    for (identity, got), want in zip(received, sent):
        assert identity == b"stage-0"
        assert_same(got, want)
    fwd_bytes = sum(wire_bytes(m) for m in sent[:3])
    hop_out = {"socket": "downstream", "peer": "stage-1"}
    hop_in = {"socket": "pipeline", "peer": "stage-0"}
    assert sample(sender_metrics, "ravq_messages_sent_total", **hop_out, type="fwd") == 3
    assert sample(sender_metrics, "ravq_messages_sent_total", **hop_out, type="bwd") == 1
    assert sample(sender_metrics, "ravq_bytes_sent_total", **hop_out, type="fwd") == fwd_bytes
    assert sample(sender_metrics, "ravq_bytes_sent_total", **hop_out, type="bwd") == wire_bytes(sent[3])
    assert sample(sender_metrics, "ravq_send_seconds_count", **hop_out, type="fwd") == 3
    assert sample(receiver_metrics, "ravq_messages_received_total", **hop_in, type="fwd") == 3
    assert sample(receiver_metrics, "ravq_messages_received_total", **hop_in, type="bwd") == 1
    assert sample(receiver_metrics, "ravq_bytes_received_total", **hop_in, type="fwd") == fwd_bytes
    assert sample(receiver_metrics, "ravq_receive_seconds_count", **hop_in, type="fwd") == 3
    # Each side counts only its own direction.
    assert sample(receiver_metrics, "ravq_messages_sent_total", **hop_in, type="fwd") == 0
    assert sample(sender_metrics, "ravq_messages_received_total", **hop_out, type="fwd") == 0


def test_malformed_frames_are_dropped_counted_and_the_next_message_arrives(
        zmq_ctx: zmq.asyncio.Context) -> None:
    metrics = Metrics("stage-1")
    valid = forward(7)
    header, payload = (bytes(f) for f in encode(valid))
    bad_dtype = orjson.loads(header)
    bad_dtype["tensors"][0]["dtype"] = "complex64"
    malformed = {
        "bad_json": [b"\x80not json"],
        "frame_count": [header],
        "frame_size": [header, payload[:-4]],
        "bad_dtype": [orjson.dumps(bad_dtype), payload],
        "bad_version": [header.replace(b'"v":1', b'"v":2'), payload],
    }

    async def scenario() -> tuple[bytes, Message]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", metrics, LIMITS, OPTS)
        raw = _raw_dealer(zmq_ctx, b"intruder", inbox)
        try:
            for frames in malformed.values():
                await raw.send_multipart(frames)
            await raw.send_multipart([header, payload])
            return await inbox.recv()  # ZeroMQ keeps order: everything before it was dropped
        finally:
            raw.close()
            inbox.close()

    identity, got = run(scenario())
    assert identity == b"intruder"
    assert_same(got, valid)
    for reason in malformed:
        assert sample(metrics, "ravq_bad_messages_total", socket="pipeline", reason=reason) == 1, reason
    hop = {"socket": "pipeline", "peer": "stage-0", "type": "fwd"}
    assert sample(metrics, "ravq_messages_received_total", **hop) == 1
    assert sample(metrics, "ravq_bytes_received_total", **hop) == len(header) + len(payload)


def _raw_dealer(zmq_ctx: zmq.asyncio.Context, identity: bytes, inbox: Inbox) -> zmq.asyncio.Socket:
    """A bare DEALER named ``identity`` connected to ``inbox``: it sends whatever frames a test gives it."""
    raw = zmq_ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, identity)
    raw.connect(bound_endpoint(inbox.sock))
    return raw


def test_recv_queued_drains_what_is_queued_dropping_the_malformed_and_returns_none_when_empty(
        zmq_ctx: zmq.asyncio.Context) -> None:
    """The broker handles a burst of heartbeats with ``recv_queued``: the same checks as ``recv``, in order."""
    metrics = Metrics("broker")
    msgs = [forward(i, n=4) for i in range(4)]

    async def scenario() -> tuple[list[tuple[bytes, Message]], tuple[bytes, Message] | None]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", metrics, LIMITS, OPTS)
        raw = _raw_dealer(zmq_ctx, b"peer", inbox)
        try:
            for i, msg in enumerate(msgs):
                await raw.send_multipart(encode(msg))
                if i == 1:
                    await raw.send_multipart([b"\x80not json"])
            got = [await inbox.recv()]
            while len(got) < len(msgs):  # the rest may still be on its way: wait a little when none is
                if (one := inbox.recv_queued()) is None:
                    await asyncio.sleep(0.01)
                else:
                    got.append(one)
            return got, inbox.recv_queued()
        finally:
            raw.close()
            inbox.close()

    got, after = run(scenario())
    assert [identity for identity, _ in got] == [b"peer"] * 4 and after is None
    for (_, m), sent in zip(got, msgs, strict=True):
        assert_same(m, sent)
    assert sample(metrics, "ravq_bad_messages_total", socket="pipeline", reason="bad_json") == 1
    hop = {"socket": "pipeline", "peer": "stage-0", "type": "fwd"}
    assert sample(metrics, "ravq_messages_received_total", **hop) == 4


def test_inbox_applies_its_decode_limits(zmq_ctx: zmq.asyncio.Context) -> None:
    metrics = Metrics()

    async def scenario() -> Message:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "ring", metrics, DecodeLimits(max_tensor_bytes=4096), OPTS)
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "ring-out", "n2", Metrics(), LIMITS, OPTS)
        try:
            await link.send(forward(0, n=1025))  # 4100 bytes: over the limit
            await link.send(forward(1, n=1024))  # exactly the limit
            return (await inbox.recv())[1]
        finally:
            link.close()
            inbox.close()

    assert run(scenario()).micro_batch == (0, 1)
    assert sample(metrics, "ravq_bad_messages_total", socket="ring", reason="tensor_too_large") == 1


def test_small_and_large_frames_arrive_intact_copied_or_not(zmq_ctx: zmq.asyncio.Context) -> None:
    # Below SocketOptions.copy_threshold_bytes a tensor frame is copied into ZeroMQ, above it is not.
    sizes = [1, OPTS.copy_threshold_bytes // 4 - 1, OPTS.copy_threshold_bytes // 4, 1 << 18]
    sent = [forward(seq, n=n) for seq, n in enumerate(sizes)]

    async def scenario() -> list[Message]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", Metrics(), LIMITS, OPTS)
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "downstream", "stage-1", Metrics(), LIMITS, OPTS)
        try:
            for msg in sent:
                await link.send(msg)
            return [(await inbox.recv())[1] for _ in sent]
        finally:
            link.close()
            inbox.close()

    for got, want in zip(run(scenario()), sent):
        assert_same(got, want)


def test_a_reply_sent_while_a_receive_waits_does_not_swallow_its_wake_up(zmq_ctx: zmq.asyncio.Context) -> None:
    """A direct (NOBLOCK) send on a ROUTER may consume the edge of ZeroMQ's file descriptor that a
    receive waiting on the same socket needs; the transport looks at EVENTS for that wait.
    (The race is timing-dependent: this exercises the path many times rather than forcing it.)"""

    async def scenario() -> list[int]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", Metrics(), LIMITS, OPTS)
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "downstream", "stage-1", Metrics(), LIMITS,
                               OPTS, identity="stage-0")
        got: list[int] = []
        try:
            await link.send(forward(0))
            identity, _ = await inbox.recv()
            for seq in range(1, 30):
                receiving = asyncio.ensure_future(inbox.recv())
                await asyncio.sleep(0.001)  # the receive is now waiting on the socket's fd
                await inbox.reply(identity, Message(type=MsgType.REPLY, sender="stage-1"), peer="stage-0")
                await link.send(forward(seq))
                got.append((await asyncio.wait_for(receiving, 5))[1].micro_batch[1])
                await link.recv(5)
            return got
        finally:
            link.close()
            inbox.close()

    assert run(scenario()) == list(range(1, 30))


def test_readable_times_out_and_close_wakes_a_waiting_receive(zmq_ctx: zmq.asyncio.Context) -> None:
    """A wait never outlives its socket: closing the inbox makes a pending receive raise at once, and
    the loop keeps no reader for the closed socket.  On a virtual clock (nothing is sent, so every wait
    is the loop's own), so the quiet wait lasts exactly its timeout."""

    async def scenario() -> tuple[bool, float, bool]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", Metrics(), LIMITS, OPTS)
        t0 = now()
        quiet = await inbox.readable(0.05)
        waited = now() - t0
        receiving = asyncio.ensure_future(inbox.recv())
        await asyncio.sleep(0.01)
        inbox.close()
        with pytest.raises(zmq.ZMQError):
            await asyncio.wait_for(receiving, 2)
        return quiet, waited, inbox._io._loop is None

    quiet, waited, no_reader = run_virtual(scenario())
    assert not quiet and waited == pytest.approx(0.05)
    assert no_reader


def test_a_receive_loop_keeps_its_reader_between_waits_and_drops_it_once_nobody_waits(
        zmq_ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding and removing the fd reader per wait costs event-loop work on every message a receive loop
    waits for; the reader stays while waits follow one another, and goes one loop pass after the last
    waiter left (a reader left on the fd of a closed socket would block the fd's next user)."""
    drops: list[int] = []
    drop_reader = socket_io.SocketIo._drop_reader
    monkeypatch.setattr(socket_io.SocketIo, "_drop_reader", lambda io: (drops.append(1), drop_reader(io))[1])

    async def scenario() -> tuple[list[int], list[bool], int, bool, list[int]]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", Metrics(), LIMITS, OPTS)
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "downstream", "stage-1", Metrics(), LIMITS,
                               OPTS)

        async def send_slowly() -> None:
            for seq in range(5):
                await asyncio.sleep(0.005)  # the receive below is waiting on the fd by now
                await link.send(forward(seq))

        try:
            sender = asyncio.ensure_future(send_slowly())
            got, reader_kept = [], []
            for _ in range(5):
                got.append((await inbox.recv())[1].micro_batch[1])
                reader_kept.append(inbox._io._loop is not None)
            await sender
            drops_while_receiving = len(drops)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            dropped = inbox._io._loop is None
            # A task that waits again later gets a reader again.
            receiving = asyncio.ensure_future(inbox.recv())
            await asyncio.sleep(0.005)
            await link.send(forward(5))
            got.append((await asyncio.wait_for(receiving, 5))[1].micro_batch[1])
            return got, reader_kept, drops_while_receiving, dropped, drops
        finally:
            link.close()
            inbox.close()

    got, reader_kept, drops_while_receiving, dropped, _ = run(scenario())
    assert got == list(range(6))
    assert all(reader_kept) and drops_while_receiving == 0
    assert dropped


def test_senders_blocked_by_the_high_water_mark_keep_their_order(zmq_ctx: zmq.asyncio.Context) -> None:
    opts = SocketOptions(linger_ms=200, hwm=2)

    async def scenario() -> list[tuple[str, int]]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", Metrics(), LIMITS, opts)
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "downstream", "stage-1", Metrics(), LIMITS, opts)

        async def sender(name: str) -> None:
            for seq in range(40):
                await link.send(forward(seq, n=1 << 16, sender=name))

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(sender("a"))
                tg.create_task(sender("b"))
                await asyncio.sleep(0.05)  # let the queues fill and the senders wait
                got = []
                for _ in range(80):
                    msg = (await inbox.recv())[1]
                    got.append((msg.sender, msg.micro_batch[1]))
            return got
        finally:
            link.close()
            inbox.close()

    got = run(scenario())
    for name in "ab":
        assert [seq for sender, seq in got if sender == name] == list(range(40))


# --------------------------------------------------------------------------- request / reply


async def echo_server(inbox: Inbox, requests: int) -> None:
    for _ in range(requests):
        identity, msg = await inbox.recv()
        reply = Message(type=MsgType.REPLY, sender="broker", meta={"echo": msg.meta["q"]})
        await inbox.reply(identity, reply, peer=msg.sender)


def test_request_gets_the_reply_to_its_own_request(zmq_ctx: zmq.asyncio.Context) -> None:
    server_metrics, client_metrics = Metrics("broker"), Metrics("cli")
    port = free_port()

    async def scenario() -> list[Message]:
        inbox = Inbox.bind(zmq_ctx, endpoint("127.0.0.1", port), "broker", server_metrics, LIMITS, OPTS)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(echo_server(inbox, requests=3))
                replies = [tg.create_task(request(
                    zmq_ctx, endpoint("127.0.0.1", port),
                    Message(type=MsgType.STATUS_REQ, sender=f"cli-{q}", meta={"q": q}),
                    timeout_s=5.0, metrics=client_metrics, limits=LIMITS, opts=OPTS)) for q in range(3)]
            return [r.result() for r in replies]
        finally:
            inbox.close()

    replies = run(scenario())
    # Concurrent requests on their own DEALERs: the ROUTER routes each reply back by identity.
    assert [r.meta["echo"] for r in replies] == [0, 1, 2]
    assert all(r.type is MsgType.REPLY and r.sender == "broker" for r in replies)
    hop = {"socket": "request", "peer": "broker"}
    assert sample(client_metrics, "ravq_messages_sent_total", **hop, type="status_req") == 3
    assert sample(client_metrics, "ravq_messages_received_total", **hop, type="reply") == 3
    for q in range(3):
        assert sample(server_metrics, "ravq_messages_sent_total", socket="broker", peer=f"cli-{q}",
                      type="reply") == 1
        assert sample(server_metrics, "ravq_messages_received_total", socket="broker", peer=f"cli-{q}",
                      type="status_req") == 1


def test_request_to_an_absent_server_gives_up_after_its_timeout_and_closes_its_socket(
        zmq_ctx: zmq.asyncio.Context) -> None:
    """On a virtual clock (nothing can answer, so every wait is the loop's own): exactly ``timeout_s``."""
    timeout_s = 0.3

    async def scenario() -> float:
        t0 = now()
        with pytest.raises(TimeoutError, match="no reply from broker"):
            await request(zmq_ctx, endpoint("127.0.0.1", free_port()), Message(type=MsgType.STATUS_REQ, sender="cli"),
                          timeout_s, Metrics(), LIMITS, OPTS)
        return now() - t0

    assert run_virtual(scenario()) == pytest.approx(timeout_s)
    # zmq_ctx's teardown fails the test if request() left its DEALER open.


def test_request_to_a_silent_server_gets_there_times_out_and_closes_its_socket(zmq_ctx: zmq.asyncio.Context) -> None:
    """The request reaches the server; only the reply is missing.  On the real clock: a message in
    flight between two sockets is not a wait of the loop's own, and a virtual clock would jump past it
    (the time a request waits is the previous test's)."""

    async def scenario() -> Message:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "broker", Metrics(), LIMITS, OPTS)
        try:
            with pytest.raises(TimeoutError, match="no reply from broker"):
                await request(zmq_ctx, bound_endpoint(inbox.sock), Message(type=MsgType.STATUS_REQ, sender="cli"),
                              1.0, Metrics(), LIMITS, OPTS)  # long enough to connect on a busy machine
            return (await inbox.recv())[1]
        finally:
            inbox.close()

    assert run(scenario()).type is MsgType.STATUS_REQ
    # zmq_ctx's teardown fails the test if request() left its DEALER open.


def test_request_skips_a_malformed_reply_and_counts_it(zmq_ctx: zmq.asyncio.Context) -> None:
    metrics = Metrics("cli")

    async def fake_broker(router: zmq.asyncio.Socket) -> None:
        identity, *_ = await router.recv_multipart()
        await router.send_multipart([identity, b"{]"])
        await router.send_multipart([identity, *encode(Message(type=MsgType.REPLY, sender="broker"))])

    async def scenario() -> Message:
        router = zmq_ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            router.bind(ANY_PORT)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fake_broker(router))
                reply = tg.create_task(request(zmq_ctx, bound_endpoint(router),
                                               Message(type=MsgType.STATUS_REQ, sender="cli"), 5.0, metrics,
                                               LIMITS, OPTS))
            return reply.result()
        finally:
            router.close()

    assert run(scenario()).type is MsgType.REPLY
    assert sample(metrics, "ravq_bad_messages_total", socket="request", reason="bad_json") == 1
    assert sample(metrics, "ravq_messages_received_total", socket="request", peer="broker", type="reply") == 1


# ----------------------------------------------------------------------------------- PUB/SUB


def update(seq: int) -> Message:
    return Message(type=MsgType.UPDATE, sender="broker", meta={"seq": seq, "change": "join"})


def test_publisher_to_subscriber_delivers_in_order_and_counts(zmq_ctx: zmq.asyncio.Context) -> None:
    pub_metrics, sub_metrics = Metrics("broker"), Metrics("node")
    published = 0

    async def scenario() -> list[int]:
        nonlocal published
        pub = Publisher.bind(zmq_ctx, ANY_PORT, pub_metrics, OPTS)
        sub = Subscriber.connect(zmq_ctx, bound_endpoint(pub.sock), sub_metrics, LIMITS, OPTS)
        joined = asyncio.Event()

        async def publish_until_joined() -> None:  # PUB drops everything until the subscription lands
            nonlocal published
            while not joined.is_set():
                await pub.publish(update(published))
                published += 1
                await asyncio.sleep(0.02)

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(publish_until_joined())
                first = await sub.recv()
                joined.set()
            for _ in range(3):
                await pub.publish(update(published))
                published += 1
            return [first.meta["seq"], *[(await sub.recv()).meta["seq"] for _ in range(3)]]
        finally:
            sub.close()
            pub.close()

    seqs = run(scenario())
    assert seqs == list(range(seqs[0], seqs[0] + 4))  # no gaps once joined
    assert seqs[-1] == published - 1
    assert sample(pub_metrics, "ravq_messages_sent_total", socket="pub", peer="*", type="update") == published
    assert sample(sub_metrics, "ravq_messages_received_total", socket="sub", peer="broker",
                  type="update") == 4


def test_subscriber_drops_and_counts_malformed_updates(zmq_ctx: zmq.asyncio.Context) -> None:
    metrics = Metrics("node")

    async def scenario() -> tuple[float, Message]:
        raw_pub = zmq_ctx.socket(zmq.PUB)
        raw_pub.setsockopt(zmq.LINGER, 0)
        raw_pub.bind(ANY_PORT)
        sub = Subscriber.connect(zmq_ctx, bound_endpoint(raw_pub), metrics, LIMITS, OPTS)
        try:
            while True:  # join first, so that what follows is not lost to the slow-joiner window
                await raw_pub.send_multipart([b"", *encode(update(0))])  # a topic, then the message
                try:
                    await asyncio.wait_for(sub.recv(), 0.05)
                    break
                except TimeoutError:
                    pass
            await asyncio.sleep(0.1)
            while await sub.sock.poll(0):  # drain the joins' stragglers
                await sub.sock.recv_multipart()
            before = sample(metrics, "ravq_bad_messages_total", socket="sub", reason="bad_json")
            await raw_pub.send_multipart([b"", b"garbage"])
            await raw_pub.send_multipart([b"", *encode(update(1))])
            return before, await sub.recv()
        finally:
            sub.close()
            raw_pub.close()

    before, got = run(scenario())
    assert got.meta["seq"] == 1
    assert sample(metrics, "ravq_bad_messages_total", socket="sub", reason="bad_json") == before + 1


# ------------------------------------------------------------------------------- MAXMSGSIZE


@pytest.mark.parametrize(("max_message_bytes", "big_arrives"), [(4096, False), (1 << 20, True)],
                         ids=["over-limit", "under-limit"])
def test_frame_larger_than_max_message_bytes_never_arrives(zmq_ctx: zmq.asyncio.Context,
                                                           max_message_bytes: int, big_arrives: bool) -> None:
    big = forward(0, n=2048)  # an 8 KiB tensor frame

    async def scenario() -> list[Message]:
        inbox = Inbox.bind(zmq_ctx, ANY_PORT, "pipeline", Metrics(), LIMITS,
                           SocketOptions(max_message_bytes=max_message_bytes, linger_ms=200))
        link = Outlink.connect(zmq_ctx, bound_endpoint(inbox.sock), "downstream", "stage-1", Metrics(), LIMITS,
                               OPTS)
        got: list[Message] = []
        try:
            await link.send(big)
            try:
                got.append((await asyncio.wait_for(inbox.recv(), 0.5))[1])
            except TimeoutError:
                pass
            # ZeroMQ dropped the connection on the oversized frame; the DEALER reconnects and small
            # messages flow again (those in flight during the reconnect may be lost, so retry).
            for seq in range(1, 100):
                await link.send(forward(seq, n=16))
                try:
                    got.append((await asyncio.wait_for(inbox.recv(), 0.1))[1])
                    return got
                except TimeoutError:
                    pass
            raise AssertionError("small messages never arrived after the oversized one")
        finally:
            link.close()
            inbox.close()

    got = run(scenario())
    assert [m.version == 0 for m in got] == ([True, False] if big_arrives else [False])  # version = seq
    assert got[-1].tensors["activations"].numel() == 16


def test_a_subscriber_counts_an_update_over_its_header_limit_and_tells_its_reader(
        zmq_ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture) -> None:
    """Such an update was counted as a bad message only: a node whose broker's state outgrew 64 KiB stopped
    hearing it without a word.  Now the first is logged and ``oversized`` tells the reader to fetch the
    state another way (``ravq.node.membership``), and a topic prefix filters what arrives."""
    metrics = Metrics("node")
    small = DecodeLimits(max_header_bytes=2048)

    async def scenario() -> tuple[int, Message]:
        raw_pub = zmq_ctx.socket(zmq.PUB)
        raw_pub.setsockopt(zmq.LINGER, 0)
        raw_pub.bind(ANY_PORT)
        sub = Subscriber.connect(zmq_ctx, bound_endpoint(raw_pub), metrics, small, OPTS, ["g.", "c1."])
        try:
            while True:  # join first, so that what follows is not lost to the slow-joiner window
                await raw_pub.send_multipart([b"g.", *encode(update(0))])
                try:
                    await asyncio.wait_for(sub.recv(), 0.05)
                    break
                except TimeoutError:
                    pass
            await asyncio.sleep(0.1)
            while await sub.sock.poll(0):
                await sub.sock.recv_multipart()
            big = Message(type=MsgType.UPDATE, sender="broker", meta={"seq": 1, "pad": "x" * 4096})
            for _ in range(2):
                await raw_pub.send_multipart([b"g.", *encode(big)])
            await raw_pub.send_multipart([b"c10.", *encode(update(2))])  # another cluster's topic
            await raw_pub.send_multipart([b"c1.", *encode(update(3))])
            got = await sub.recv()
            return sub.oversized, got
        finally:
            sub.close()
            raw_pub.close()

    oversized, got = run(scenario())
    assert oversized == 2 and got.meta["seq"] == 3
    assert sample(metrics, "ravq_bad_messages_total", socket="sub", reason="header_too_large") == 2
    assert sum("over max_header_bytes" in r.message for r in caplog.records) == 1
