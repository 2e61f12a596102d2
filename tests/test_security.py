"""CURVE keys and authentication: `ravq keygen` files, and intruders that get nothing processed.

The socket scenarios use real ``ravq.net.transport``/``pubsub`` sockets on 127.0.0.1, one zmq context per
"process", and each checks that a listed peer still gets through on the same socket, so a refused
intruder means authentication worked, not that the server was broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from ravq.config import Topology
from ravq.metrics import Metrics
from ravq.net.options import SocketOptions
from ravq.net.pubsub import Publisher, Subscriber
from ravq.net.security import (
    Curve,
    KeyExistsError,
    KeyFileError,
    keygen,
    keygen_main,
    load_public,
    load_secret,
)
from ravq.net.transport import Inbox, Outlink
from ravq.net.wire import DecodeLimits, Message, MsgType

LIMITS = DecodeLimits()
REFUSED_WAIT_S = 1.5
DELIVERY_WAIT_S = 5.0


# --------------------------------------------------------------------------- keygen and key files


def test_keygen_writes_private_secret_and_prints_the_topology_line(tmp_path: Path, capsys) -> None:
    old_umask = os.umask(0)  # the most permissive umask must not widen the secret's mode
    try:
        assert keygen_main("n1", str(tmp_path / "keys")) == 0
    finally:
        os.umask(old_umask)
    out = capsys.readouterr().out
    public = load_public("n1", tmp_path / "keys")
    assert f'public_key: "{public}"' in out.splitlines()
    assert str(tmp_path / "keys" / "n1.key_secret") in out
    secret_path = tmp_path / "keys" / "n1.key_secret"
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    loaded_public, secret = load_secret("n1", tmp_path / "keys")
    assert loaded_public == public
    assert zmq.curve_public(secret.encode()).decode() == public
    assert secret not in out and secret not in (tmp_path / "keys" / "n1.key").read_text()


def test_keygen_refuses_to_overwrite(tmp_path: Path, capsys) -> None:
    keygen("n1", tmp_path)
    before = (tmp_path / "n1.key_secret").read_bytes(), (tmp_path / "n1.key").read_bytes()
    with pytest.raises(KeyExistsError, match="n1.key"):
        keygen("n1", tmp_path)
    assert keygen_main("n1", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "n1.key" in err
    assert ((tmp_path / "n1.key_secret").read_bytes(), (tmp_path / "n1.key").read_bytes()) == before
    # A lone public file (or secret file) is refused too, and nothing is half-written.
    (tmp_path / "n2.key").write_text("placeholder\n")
    with pytest.raises(FileExistsError):
        keygen("n2", tmp_path)
    assert not (tmp_path / "n2.key_secret").exists()


@pytest.mark.parametrize("name", ["", "../evil", "a/b", "a b", "x" * 65, "nö"])
def test_keygen_rejects_names_that_are_not_node_names(tmp_path: Path, name: str, capsys) -> None:
    with pytest.raises(ValueError, match="name"):
        keygen(name, tmp_path / "keys")
    assert keygen_main(name, str(tmp_path / "keys")) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "keys").exists() or not any((tmp_path / "keys").iterdir())
    assert not (tmp_path / "evil.key_secret").exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_load_secret_refuses_a_secret_others_can_access(tmp_path: Path, mode: int) -> None:
    keygen("n1", tmp_path)
    (tmp_path / "n1.key_secret").chmod(mode)
    with pytest.raises(KeyFileError, match=r"n1\.key_secret.*chmod 600"):
        load_secret("n1", tmp_path)


def test_load_secret_reads_only_z85_text(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "n1.key_secret"
    for content in (pickle.dumps({"secret": "x" * 40}), b"not a key\n", b"", b"\xff" * 40):
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, content)
        os.close(fd)
        with pytest.raises(KeyFileError, match=r"n1\.key_secret"):
            load_secret("n1", tmp_path)
    with pytest.raises(KeyFileError, match="ravq keygen n2"):
        load_secret("n2", tmp_path)


def _topology(keys: dict[str, str], key_dir: Path) -> Topology:
    return Topology.model_validate({
        "task": "tasks_for_tests",
        "security": {"curve": True, "key_dir": str(key_dir)},
        "broker": {"pub_port": 5500, "router_port": 5501, "public_key": keys["broker"]},
        "nodes": [{"name": n, "pipeline_port": 5510 + 2 * i, "ring_port": 5511 + 2 * i, "public_key": keys[n]}
                  for i, n in enumerate(["n1", "n2"])],
    })


def test_from_topology_checks_the_secret_against_the_listed_key(tmp_path: Path) -> None:
    keys = {n: keygen(n, tmp_path) for n in ("broker", "n1", "n2")}
    curve = Curve.from_topology(_topology(keys, tmp_path), "n1", None, Metrics("n1"))
    assert curve.public == keys["n1"]
    swapped = dict(keys, n1=keys["n2"])
    with pytest.raises(KeyFileError, match="not the key the topology lists for 'n1'"):
        Curve.from_topology(_topology(swapped, tmp_path), "n1", None, Metrics("n1"))
    with pytest.raises(ValueError, match="'n3'"):
        Curve.from_topology(_topology(keys, tmp_path), "n3", None, Metrics("n3"))


def test_zap_refuses_other_mechanisms_and_unlisted_keys(tmp_path: Path) -> None:
    keys = {n: keygen(n, tmp_path) for n in ("broker", "n1", "n2")}
    metrics = Metrics("n1")
    curve = Curve.from_topology(_topology(keys, tmp_path), "n1", None, metrics)
    from zmq.utils import z85

    listed = z85.decode(keys["n2"].encode())
    stranger = z85.decode(zmq.curve_keypair()[0])
    head = [b"1.0", b"7", b"ring", b"10.0.0.9", b""]
    assert curve.authenticate([*head, b"CURVE", listed])[2:5] == [b"200", b"OK", b"n2"]
    assert curve.authenticate([*head, b"CURVE", stranger])[2] == b"400"
    assert curve.authenticate([*head, b"NULL"])[2] == b"400"
    assert curve.authenticate([*head, b"PLAIN", b"n2", b"pw"])[2] == b"400"
    assert _failures(metrics, "ring", "unknown_key") == 1
    assert _failures(metrics, "ring", "bad_mechanism") == 2


# --------------------------------------------------------------------------- sockets


def _failures(metrics: Metrics, socket: str, reason: str) -> float:
    value = metrics.registry.get_sample_value("ravq_auth_failures_total", {"socket": socket, "reason": reason})
    return value or 0.0


def _addr(sock: zmq.Socket) -> str:
    """The endpoint a socket bound to (they bind port 0: no race for a free port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _message(sender: str, seq: int) -> Message:
    return Message(type=MsgType.FORWARD, sender=sender, micro_batch=(0, seq),
                   tensors={"activations": torch.full((4, 3), float(seq))})


class _Keys:
    """A topology's worth of keys (broker, n1, n2) and the Curve of each, one zmq context each."""

    def __init__(self, key_dir: Path) -> None:
        self.key_dir = key_dir
        self.public = {n: keygen(n, key_dir) for n in ("broker", "n1", "n2")}
        self.topology = _topology(self.public, key_dir)

    def curve(self, name: str, metrics: Metrics) -> Curve:
        return Curve.from_topology(self.topology, name, self.key_dir, metrics)


def _stranger(servers: dict[str, str]) -> Curve:
    """A fresh key pair that no topology lists, which knows the servers' real public keys."""
    public, secret = (k.decode() for k in zmq.curve_keypair())
    return Curve(name="n2", public=public, secret=secret, peers=servers, metrics=Metrics("intruder"))


async def _run_server(curve: Curve, body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` with the server's ZAP handler in a TaskGroup, as a node does."""
    async with asyncio.TaskGroup() as tg:
        zap = tg.create_task(curve.serve_zap())
        try:
            await body()
        finally:
            zap.cancel()


def _terminate(*contexts: zmq.Context) -> None:
    """Terminate contexts; fails if a socket (ours or the Curve's) was left open."""
    for ctx in contexts:
        done = threading.Thread(target=ctx.term, daemon=True)
        done.start()
        done.join(5.0)
        assert not done.is_alive(), "zmq context did not terminate: a socket was left open"


async def _expect_nothing(inbox: Inbox) -> None:
    with pytest.raises(TimeoutError):
        identity, msg = await asyncio.wait_for(inbox.recv(), REFUSED_WAIT_S)
        pytest.fail(f"processed a message from {msg.sender!r} ({identity!r})")


async def _expect_from(inbox: Inbox, sender: str, seq: int) -> None:
    _, msg = await asyncio.wait_for(inbox.recv(), DELIVERY_WAIT_S)
    assert (msg.sender, msg.micro_batch) == (sender, (0, seq))
    assert torch.equal(msg.tensors["activations"], torch.full((4, 3), float(seq)))


def _serve_against(tmp_path: Path, intruder: Callable[[_Keys, zmq.asyncio.Context, str], Outlink]) -> Metrics:
    """n1 binds a CURVE pipeline Inbox; ``intruder`` sends well-formed messages, then listed n2 does."""
    keys = _Keys(tmp_path)
    server_metrics, client_metrics = Metrics("n1"), Metrics("n2")
    server_curve = keys.curve("n1", server_metrics)
    server_ctx, client_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()

    async def scenario() -> None:
        inbox = Inbox.bind(server_ctx, "tcp://127.0.0.1:*", "pipeline", server_metrics, LIMITS,
                           SocketOptions(curve=server_curve, linger_ms=0))
        addr = _addr(inbox.sock)
        bad = intruder(keys, client_ctx, addr)
        good = Outlink.connect(client_ctx, addr, "pipeline", "n1", client_metrics, LIMITS,
                               SocketOptions(curve=keys.curve("n2", client_metrics), linger_ms=0))
        try:
            async def body() -> None:
                for seq in range(5):  # well-formed, and spoofing a listed sender
                    # Once its handshake has been refused the intruder's DEALER has no peer and a send
                    # blocks; that is one of the two ways of getting nothing through.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(bad.send(_message("n2", seq)), 0.1)
                await _expect_nothing(inbox)
                await good.send(_message("n2", 99))
                await _expect_from(inbox, "n2", 99)
            await _run_server(server_curve, body)
        finally:
            for sock in (bad, good, inbox):
                sock.close()
            server_curve.close()

    asyncio.run(scenario())
    _terminate(server_ctx, client_ctx)
    return server_metrics


def test_listed_keys_deliver_over_curve(tmp_path: Path) -> None:
    keys = _Keys(tmp_path)
    m1, m2 = Metrics("n1"), Metrics("n2")
    c1, c2 = keys.curve("n1", m1), keys.curve("n2", m2)
    ctx1, ctx2 = zmq.asyncio.Context(), zmq.asyncio.Context()

    async def scenario() -> None:
        inbox = Inbox.bind(ctx1, "tcp://127.0.0.1:*", "ring", m1, LIMITS, SocketOptions(curve=c1, linger_ms=0))
        link = Outlink.connect(ctx2, _addr(inbox.sock), "ring", "n1", m2, LIMITS,
                               SocketOptions(curve=c2, linger_ms=0), identity="n2")
        try:
            async def body() -> None:
                for seq in range(3):
                    await link.send(_message("n2", seq))
                    await _expect_from(inbox, "n2", seq)
                # and back: the ROUTER replies to the authenticated DEALER
                await inbox.reply(b"n2", _message("n1", 7), peer="n2")
                reply = await link.recv(DELIVERY_WAIT_S)
                assert (reply.sender, reply.micro_batch) == ("n1", (0, 7))
            await _run_server(c1, body)
        finally:
            link.close()
            inbox.close()
            c1.close()
            c2.close()

    asyncio.run(scenario())
    _terminate(ctx1, ctx2)
    assert sum(_failures(m1, "ring", r) for r in ("unknown_key", "handshake_failed")) == 0


def test_intruder_with_an_unlisted_key_gets_nothing_processed(tmp_path: Path) -> None:
    def intruder(keys: _Keys, ctx: zmq.asyncio.Context, addr: str) -> Outlink:
        # Worst case: it knows the server's real public key, only its own key is not listed.
        stranger = _stranger({"n1": keys.public["n1"]})
        return Outlink.connect(ctx, addr, "pipeline", "n1", Metrics("intruder"), LIMITS,
                               SocketOptions(curve=stranger, linger_ms=0), identity="n2")

    metrics = _serve_against(tmp_path, intruder)
    assert _failures(metrics, "pipeline", "unknown_key") >= 1
    assert metrics.registry.get_sample_value(
        "ravq_messages_received_total", {"socket": "pipeline", "peer": "n2", "type": "fwd"}) == 1


def test_plaintext_client_to_a_curve_server_gets_nothing_through(tmp_path: Path) -> None:
    def intruder(keys: _Keys, ctx: zmq.asyncio.Context, addr: str) -> Outlink:
        return Outlink.connect(ctx, addr, "pipeline", "n1", Metrics("intruder"), LIMITS,
                               SocketOptions(curve=None, linger_ms=0), identity="n2")

    metrics = _serve_against(tmp_path, intruder)
    assert _failures(metrics, "pipeline", "handshake_failed") >= 1
    assert metrics.registry.get_sample_value(
        "ravq_messages_received_total", {"socket": "pipeline", "peer": "n2", "type": "fwd"}) == 1


def test_broker_pub_reaches_listed_subscribers_only(tmp_path: Path) -> None:
    keys = _Keys(tmp_path)
    mb, m1 = Metrics("broker"), Metrics("n1")
    broker_curve, node_curve = keys.curve("broker", mb), keys.curve("n1", m1)
    stranger = _stranger({"broker": keys.public["broker"]})
    broker_ctx, node_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()

    async def scenario() -> None:
        pub = Publisher.bind(broker_ctx, "tcp://127.0.0.1:*", mb, SocketOptions(curve=broker_curve, linger_ms=0))
        addr = _addr(pub.sock)
        sub = Subscriber.connect(node_ctx, addr, m1, LIMITS, SocketOptions(curve=node_curve, linger_ms=0))
        spy = Subscriber.connect(node_ctx, addr, Metrics("intruder"), LIMITS,
                                 SocketOptions(curve=stranger, linger_ms=0))
        plain = Subscriber.connect(node_ctx, addr, Metrics("intruder"), LIMITS, SocketOptions(linger_ms=0))
        update = Message(type=MsgType.UPDATE, sender="broker", meta={"seq": 1})
        try:
            async def keep_publishing() -> None:  # PUB drops until a subscription has arrived
                while True:
                    await pub.publish(update)
                    await asyncio.sleep(0.05)

            async def body() -> None:
                async with asyncio.TaskGroup() as tg:
                    publishing = tg.create_task(keep_publishing())
                    assert (await asyncio.wait_for(sub.recv(), DELIVERY_WAIT_S)).meta == {"seq": 1}
                    for eavesdropper in (spy, plain):
                        with pytest.raises(TimeoutError):
                            await asyncio.wait_for(eavesdropper.recv(), 0.5)
                    publishing.cancel()
            await _run_server(broker_curve, body)
        finally:
            for sock in (sub, spy, plain, pub):
                sock.close()
            broker_curve.close()

    asyncio.run(scenario())
    _terminate(broker_ctx, node_ctx)
    assert _failures(mb, "pub", "unknown_key") >= 1
    assert _failures(mb, "pub", "handshake_failed") >= 1


def test_client_refuses_a_peer_without_a_listed_key(tmp_path: Path) -> None:
    keys = _Keys(tmp_path)
    curve = keys.curve("n1", Metrics("n1"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(ValueError, match="'n9'"):
            curve.make_client(sock, "n9")
    finally:
        sock.close(linger=0)
        ctx.term()
