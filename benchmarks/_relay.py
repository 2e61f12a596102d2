"""One-way latency in user space: a TCP relay that holds each chunk for a fixed delay, then forwards it.

The ``netem`` qdisc is not available on the kernels this runs on, so an emulated PC (benchmarks/_emulate.py)
gets its latency here instead.  In every PC's network namespace one relay process listens on the PC's
address at each port the PC serves (pipeline, ring, probe, broker ports) and forwards to the same port on
127.0.0.1, where the real process is bound (``bind_host: 127.0.0.1`` in the topology).  A connection
from peer ``a`` (known by its source address) gets ``delay[a -> me]`` on the bytes it sends and
``delay[me -> a]`` on the bytes coming back, so a round trip over any connection costs
``delay[a -> me] + delay[me -> a]``.

The relay never lowers bandwidth: a reader thread takes bytes off the socket as fast as they arrive
(the shaped veth upstream sets the rate) and stamps them; a writer thread releases each chunk when its
time has come.  Buffered bytes are at most rate x delay.  Threads, not asyncio: the copies are
``recv``/``sendall`` system calls that release the GIL, and a sleeping writer wakes within ~0.1 ms.

    python benchmarks/_relay.py serve CONFIG.json   # prints "ready" once every port listens
    python benchmarks/_relay.py ping PORT N HOST...  # N round trips to each host's echo port; JSON seconds

CONFIG: {"address": "10.14.3.2", "ports": [5560, ...], "echo_port": 5999,
         "delays_s": {"10.14.3.3": [in_s, out_s], ...}, "default_s": [in_s, out_s]}
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

CHUNK_BYTES = 256 << 10
_EOF = b""


class DelayedPipe:
    """Bytes read from ``src`` written to ``dst`` ``delay_s`` after they arrived."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float, on_close: Any) -> None:
        self.src, self.dst, self.delay_s, self.on_close = src, dst, delay_s, on_close
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.src.recv(CHUNK_BYTES)
            except OSError:
                data = _EOF
            with self._cond:
                self._queue.append((time.monotonic() + self.delay_s, data))
                self._cond.notify()
            if not data:
                return

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                due, data = self._queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                try:
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.on_close()
                return
            try:
                self.dst.sendall(data)
            except OSError:
                self.on_close()
                return


class Connection:
    """Both directions of one relayed connection; the sockets close when both directions ended."""

    def __init__(self, client: socket.socket, upstream: socket.socket, in_s: float, out_s: float) -> None:
        self._ended = 0
        self._lock = threading.Lock()
        self.sockets = (client, upstream)
        for s in self.sockets:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        DelayedPipe(client, upstream, in_s, self._end)
        DelayedPipe(upstream, client, out_s, self._end)

    def _end(self) -> None:
        with self._lock:
            self._ended += 1
            if self._ended < 2:
                return
        for s in self.sockets:
            s.close()


def listen(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(128)
    return sock


def accept_forever(listener: socket.socket, port: int, delays: dict[str, list[float]], default: list[float]) -> None:
    while True:
        client, (peer, _) = listener.accept()
        in_s, out_s = delays.get(peer, default)
        try:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
            upstream.settimeout(None)
        except OSError:  # nothing listens behind this port (yet): refuse as the real port would
            client.close()
            continue
        Connection(client, upstream, in_s, out_s)


def echo_forever(listener: socket.socket) -> None:
    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(CHUNK_BYTES):
                conn.sendall(data)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _raise_priority() -> None:
    """A network does not slow down when the PCs compute: the relay goes before them on the CPU."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:  # not root: run at the normal priority
        pass


def serve(config: dict[str, Any]) -> None:
    _raise_priority()
    address, delays, default = config["address"], config["delays_s"], config.get("default_s", [0.0, 0.0])
    ports = list(config["ports"])
    if config.get("echo_port"):
        echo = listen("127.0.0.1", config["echo_port"])
        threading.Thread(target=echo_forever, args=(echo,), daemon=True).start()
        ports.append(config["echo_port"])
    for port in ports:
        listener = listen(address, port)
        threading.Thread(target=accept_forever, args=(listener, port, delays, default), daemon=True).start()
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def ping(host: str, port: int, count: int) -> list[float]:
    """Round-trip times of ``count`` 64-byte messages through the relay at host:port."""
    _raise_priority()
    rtts = []
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            t0 = time.perf_counter()
            sock.sendall(b"x" * 64)
            got = 0
            while got < 64:
                data = sock.recv(64 - got)
                if not data:
                    raise ConnectionError(f"{host}:{port} closed during a ping")
                got += len(data)
            rtts.append(time.perf_counter() - t0)
    return rtts


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 2:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # threads inherit the mask
        with open(argv[1]) as f:
            serve(json.load(f))
        return 0
    if argv[:1] == ["ping"] and len(argv) >= 4:
        port, count = int(argv[1]), int(argv[2])
        print(json.dumps({host: ping(host, port, count) for host in argv[3:]}))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
