"""CURVE keys and authentication: `ravq keygen`, key files, and the ZAP handler every server uses.

Each node and the broker own one CURVE key pair.  The public halves are listed in the topology; the
secret half stays in ``KEY_DIR/NAME.key_secret`` (mode 0600).  With ``security.curve`` on, every
server socket (pipeline and ring ROUTERs, the broker's ROUTER and PUB) is a CURVE server that asks
ZeroMQ's ZAP handler about each connecting key, and this module's handler accepts only listed keys.
Every client socket pins the public key of the peer it connects to.

Refused connections are counted in ``ravq_auth_failures_total{socket,reason}``:
``unknown_key`` (a CURVE client whose key is not listed; counted by the ZAP handler) and
``handshake_failed`` (plaintext, garbage or otherwise broken handshakes, and connections that end
before their handshake completes; seen by a monitor on the server).  Without CURVE the same monitor
(``ConnectionMonitor``) counts such connections in ``ravq_connections_dropped_total``, and with or
without CURVE it counts established connections that close: a peer that went away, or one ZeroMQ
dropped for announcing a frame over ``limits.max_message_bytes``.

Key files are plain Z85 text; nothing here unpickles or evaluates anything.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils import z85

from ravq.metrics import Metrics
from ravq.net.connections import MAX_WARNED, ConnectionMonitor

if TYPE_CHECKING:
    from ravq.config import Topology
    from ravq.net.options import SocketOptions

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
BROKER = "broker"
"""The name under which the broker's key is listed and looked up."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq looks for the ZAP handler of a context (RFC 27)."""

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_KEY_FILE_BYTES = 4096


class KeyFileError(ValueError):
    """A key file that is missing, malformed or too open; ``str()`` is one line naming the path."""


class KeyExistsError(FileExistsError):
    """``ravq keygen`` refuses to overwrite a key."""


# --------------------------------------------------------------------------- key files


def key_paths(name: str, key_dir: str | Path) -> tuple[Path, Path]:
    """(public, secret) key file paths of ``name``; rejects names that are not node names."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    key_dir = Path(key_dir)
    return key_dir / f"{name}{PUBLIC_SUFFIX}", key_dir / f"{name}{SECRET_SUFFIX}"


def keygen(name: str, key_dir: str | Path, owner: str | None = None) -> str:
    """Write a new CURVE key pair for ``name`` into ``key_dir``; return the Z85 public key.

    The secret file is created with O_EXCL at mode 0600, so it is never overwritten and never
    readable by anyone else, whatever the umask.  ``owner`` (a user name; needs root): the pair and a
    key directory made here belong to that user and its group, the user the services run as
    (``--owner ravq``): ravq reads a secret only when it is the owner's alone.
    """
    uid_gid = _user_ids(owner) if owner is not None else None
    public_path, secret_path = key_paths(name, key_dir)
    for path in (public_path, secret_path):
        if path.exists() or path.is_symlink():
            raise KeyExistsError(f"{path}: key exists; refusing to overwrite it (delete it first)")
    directory = Path(key_dir)
    made_dir = not directory.exists()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = (k.decode("ascii") for k in zmq.curve_keypair())
    _create(secret_path, f"# ravq CURVE secret key of {name}: keep it private\n{secret}\n", 0o600)
    try:
        _create(public_path, f"# ravq CURVE public key of {name}: list it in the topology\n{public}\n", 0o644)
        if uid_gid is not None:
            for path in ([directory] if made_dir else []) + [secret_path, public_path]:
                os.chown(path, *uid_gid, follow_symlinks=False)
    except BaseException:
        secret_path.unlink()  # no half-made pair: a secret without its public file confuses users
        public_path.unlink(missing_ok=True)
        raise
    return public


def _user_ids(user: str) -> tuple[int, int]:
    import pwd

    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(
            f"--owner: no user named {user!r} on this PC (create it first: "
            f"`useradd --system --home-dir /var/lib/ravq --shell /usr/sbin/nologin {user}`)"
        ) from None
    return entry.pw_uid, entry.pw_gid


def _who(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _create(path: Path, text: str, mode: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        raise KeyExistsError(f"{path}: key exists; refusing to overwrite it (delete it first)") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


def load_secret(name: str, key_dir: str | Path) -> tuple[str, str]:
    """(public, secret) Z85 keys of ``name``; refuses a secret file that group or others may access."""
    _, secret_path = key_paths(name, key_dir)
    me = os.geteuid()
    fix = (f"the key directory and {secret_path.name} must belong to the user that runs ravq ({_who(me)}): "
           f"`chown {_who(me)}: {key_dir} {secret_path}; chmod 700 {key_dir}; chmod 600 {secret_path}`")
    try:
        st = secret_path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"{secret_path}: no secret key (make one with `ravq keygen {name}`)") from None
    except PermissionError:
        raise KeyFileError(f"{secret_path}: permission denied; {fix}") from None
    if st.st_mode & 0o077:
        raise KeyFileError(f"{secret_path}: secret key is accessible by group/others "
                           f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {secret_path}`"
                           + ("" if st.st_uid == me else f" and `chown {_who(me)}: {secret_path}`"))
    if st.st_uid != me and me != 0:
        raise KeyFileError(
            f"{secret_path}: owned by {_who(st.st_uid)}, not by {_who(me)} who runs ravq; {fix}"
        )
    secret = _read_key(secret_path)
    return zmq.curve_public(secret.encode("ascii")).decode("ascii"), secret


def load_public(name: str, key_dir: str | Path) -> str:
    """The Z85 public key of ``name`` from its ``.key`` file."""
    return _read_key(key_paths(name, key_dir)[0])


def _read_key(path: Path) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
    except PermissionError:
        raise KeyFileError(f"{path}: cannot read key: permission denied for {_who(os.geteuid())} (the user "
                           "that runs ravq must own its secret key: see deploy/README.md)") from None
    except OSError as err:
        raise KeyFileError(f"{path}: cannot read key: {err.strerror}") from None
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path}: not a key file (larger than {_MAX_KEY_FILE_BYTES} bytes)")
    try:
        lines = [ln.strip() for ln in data.decode("ascii").splitlines()]
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not a key file (not ASCII text)") from None
    keys = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(keys) != 1 or not is_z85_key(keys[0]):
        raise KeyFileError(f"{path}: expected one 40-character Z85 key line")
    return keys[0]


def is_z85_key(text: str) -> bool:
    """True for a 40-character Z85 string (a 32-byte CURVE key)."""
    if len(text) != 40 or not text.isascii():
        return False
    try:
        return len(z85.decode(text.encode("ascii"))) == 32
    except (KeyError, ValueError):
        return False


def keygen_main(name: str, key_dir: str, owner: str | None = None) -> int:
    """`ravq keygen NAME`: make a key pair and print the topology line.  Returns the exit status."""
    try:
        public = keygen(name, key_dir, owner)
    except (OSError, ValueError) as err:
        print(f"ravq keygen: {err}", file=sys.stderr)
        return 2
    public_path, secret_path = key_paths(name, key_dir)
    # stdout is valid YAML: the key line to paste under this node (or the broker) in the topology.
    print(f'public_key: "{public}"')
    print(f"# public key: {public_path}")
    who = owner or _who(os.geteuid())
    print(f"# secret key: {secret_path} (mode 0600, owner {who}; keep it on this machine only)")
    return 0


# --------------------------------------------------------------------------- authentication


AUTH_FAILURES = ("unknown_key", "bad_mechanism", "handshake_failed")
"""Reasons a server socket refuses a connection (``ravq_auth_failures_total{socket,reason}``)."""


class Curve(ConnectionMonitor):
    """One process's CURVE identity and its ZAP authenticator; the ``curve`` of ``SocketOptions``.

    Lifecycle: build it (``from_topology``), put it in ``SocketOptions.curve``, run
    ``serve_zap()`` in the process's TaskGroup, and ``close()`` it after the TaskGroup has ended
    and every socket is closed, before the zmq context is terminated.
    """

    def __init__(self, *, name: str, public: str, secret: str, peers: Mapping[str, str],
                 metrics: Metrics) -> None:
        """``peers``: name -> Z85 public key of everyone allowed to connect (nodes and "broker")."""
        assert is_z85_key(public) and is_z85_key(secret)
        super().__init__(metrics)
        self.name, self.public = name, public
        self._secret = secret
        self._peers = dict(peers)
        self._allowed = {z85.decode(k.encode("ascii")): peer for peer, k in self._peers.items()}
        self._zap: dict[int, zmq.asyncio.Socket] = {}  # id(context) -> bound ZAP socket

    @classmethod
    def from_topology(cls, topo: Topology, name: str, key_dir: str | Path | None, metrics: Metrics) -> Curve:
        """The Curve of node ``name`` (or of the broker, ``name="broker"``) in topology ``topo``.

        ``key_dir`` defaults to ``topo.security.key_dir``; the secret there must belong to the public
        key the topology lists for ``name``.
        """
        key_dir = key_dir if key_dir is not None else topo.security.key_dir
        if key_dir is None:
            raise ValueError("security.key_dir: required when security.curve is true")
        if any(n.name == BROKER for n in topo.nodes):
            raise ValueError(
                f"nodes: no node may be named {BROKER!r} with security.curve (the broker's key is)"
            )
        peers = ({n.name: n.public_key for n in topo.nodes} | {BROKER: topo.broker.public_key}
                 | {r.name: r.public_key for r in getattr(topo, "relays", [])})
        missing = [p for p, k in peers.items() if k is None]
        if missing:
            raise ValueError(f"public_key: missing for {', '.join(missing)} (make keys with `ravq keygen`)")
        if name not in peers:
            raise ValueError(f"--name: {name!r} is neither a node nor a relay of the topology nor {BROKER!r}")
        public, secret = load_secret(name, key_dir)
        if public != peers[name]:
            raise KeyFileError(f"{key_paths(name, key_dir)[1]}: its public key {public} is not the key the "
                               f"topology lists for {name!r} ({peers[name]})")
        return cls(name=name, public=public, secret=secret, peers=peers, metrics=metrics)

    def make_server(self, sock: zmq.asyncio.Socket, name: str, *, count_closed: bool = True) -> None:
        """Make ``sock`` (not yet bound) a CURVE server that admits only listed keys (``count_closed``:
        see ``ConnectionMonitor.watch``)."""
        self._ensure_zap(sock.context)
        sock.curve_secretkey = self._secret.encode("ascii")
        sock.curve_publickey = self.public.encode("ascii")
        sock.curve_server = True
        sock.zap_domain = name.encode()  # ZAP requests then name the socket they come from
        self.watch(sock, name, count_closed=count_closed)

    def make_client(self, sock: zmq.Socket[Any], peer: str) -> None:
        """Make ``sock`` (not yet connected) a CURVE client that trusts only ``peer``'s listed key."""
        server_key = self._peers.get(peer)
        if server_key is None:
            raise ValueError(f"no CURVE public key for peer {peer!r} in the topology")
        sock.curve_secretkey = self._secret.encode("ascii")
        sock.curve_publickey = self.public.encode("ascii")
        sock.curve_serverkey = server_key.encode("ascii")

    async def serve_zap(self) -> None:
        """Answer ZAP requests and watch servers for failed handshakes, until cancelled."""
        await self.serve()

    def close(self) -> None:
        """Close the ZAP and monitor sockets (after serve_zap has ended)."""
        super().close()
        for sock in self._zap.values():
            sock.close(linger=0)
        self._zap.clear()

    # ----------------------------------------------------------------------- internals

    def _ensure_zap(self, ctx: zmq.Context[Any]) -> None:
        # Bound here, synchronously, before the server socket binds: libzmq admits every CURVE
        # client while no ZAP handler is bound, so there must never be such a moment.  Requests
        # that arrive before serve_zap runs wait in the socket (fail closed).
        if id(ctx) in self._zap:
            return
        assert isinstance(ctx, zmq.asyncio.Context), "CURVE sockets must come from a zmq.asyncio.Context"
        zap = ctx.socket(zmq.REP)
        zap.linger = 0
        try:
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as err:
            zap.close()
            raise RuntimeError(
                f"cannot bind the ZAP handler ({err}); use one Curve per zmq context"
            ) from None
        self._zap[id(ctx)] = zap
        self._adopt(zap, "")

    async def _serve_one(self, sock: zmq.asyncio.Socket, server: str) -> None:
        await (self._watch(sock, server) if server else self._answer(sock))

    async def _answer(self, zap: zmq.asyncio.Socket) -> None:
        while True:
            request = await zap.recv_multipart()
            await zap.send_multipart(self.authenticate(request))

    def authenticate(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one ZAP request (RFC 27): 200 for a listed CURVE key, 400 otherwise."""
        if len(request) < 6:
            self._refuse("?", "bad_zap_request", "")
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"bad request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        socket, peer_addr = domain.decode(errors="replace"), address.decode(errors="replace")
        if version != b"1.0" or mechanism != b"CURVE" or len(request) != 7:
            self._refuse(socket, "bad_mechanism", peer_addr)
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        peer = self._allowed.get(request[6])
        if peer is None:
            self._refuse(socket, "unknown_key", peer_addr)
            return [b"1.0", request_id, b"400", b"key not listed", b"", b""]
        # user_id becomes the "User-Id" property of every frame this peer sends.
        return [b"1.0", request_id, b"200", b"OK", peer.encode(), b""]

    def _handshake_failed(self, socket: str, where: str) -> None:
        self._refuse(socket, "handshake_failed", where)

    def _zero(self, socket: str) -> None:
        for reason in AUTH_FAILURES:
            self.metrics.auth_failures.labels(socket, reason)
        if socket not in self._closes_normal:
            self.metrics.connections_dropped.labels(socket, "closed")

    def _refuse(self, socket: str, reason: str, where: str) -> None:
        self.metrics.auth_failures.labels(socket, reason).inc()
        key = (socket, reason, where)
        if key in self._warned or len(self._warned) >= MAX_WARNED:
            log.debug("%s: refused a connection (%s) at %s", socket, reason, where)
            return
        self._warned.add(key)
        log.warning(
            "%s: refused a connection (%s) at %s; further ones are only counted", socket, reason, where
        )


def socket_options_for(topo: Topology, name: str, key_dir: str | Path | None,
                       metrics: Metrics) -> SocketOptions:
    """Socket options of process ``name`` (a node or "broker"): CURVE when the topology asks for it."""
    from ravq.net.options import CONTROL_FRAME_BYTES, SocketOptions  # not at import: keygen needs no sockets

    curve = Curve.from_topology(topo, name, key_dir, metrics) if topo.security.curve else None
    monitor = curve if curve is not None else ConnectionMonitor(metrics)
    return SocketOptions(max_message_bytes=topo.limits.max_message_bytes or CONTROL_FRAME_BYTES, curve=curve,
                         monitor=monitor)
