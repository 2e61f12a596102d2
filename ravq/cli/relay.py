"""`ravq relay`: run one relay of the topology (``ravq.net.relay``) on a reachable PC, until SIGTERM/SIGINT.

Two nodes behind NAT reach each other through it; the broker's PC is one by default (``broker.relay_port``,
``ravq broker`` runs it).  Listed under ``relays:`` in the topology, with its key under CURVE.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal

import zmq.asyncio

from ravq.config import ConfigError, Topology
from ravq.metrics import Metrics
from ravq.net import listen
from ravq.net.options import SocketOptions, endpoint
from ravq.net.relay import Relay
from ravq.net.security import socket_options_for

log = logging.getLogger(__name__)


def relay_options(topology: Topology, name: str, key_dir: str | None, metrics: Metrics) -> SocketOptions:
    """The relay's socket options: CURVE with its listed key, frames up to ``limits.max_message_bytes``
    (else the relay's queue bound: a larger frame could never be queued)."""
    config = next((r for r in topology.relays if r.name == name), None)
    if config is None:
        raise ConfigError(f"--name: no relay named {name!r} in the topology (relays: "
                          f"{', '.join(r.name for r in topology.relays) or 'none'})")
    try:
        opts = socket_options_for(topology, name, key_dir, metrics)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    max_message_bytes = topology.limits.max_message_bytes or config.queue_bytes
    return dataclasses.replace(opts, max_message_bytes=max_message_bytes)


async def run_relay(topology: Topology, name: str, opts: SocketOptions, metrics: Metrics) -> None:
    config = next(r for r in topology.relays if r.name == name)
    ctx = zmq.asyncio.Context()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    relay = Relay(
        ctx,
        endpoint(config.bind_host or config.host, config.port),
        [n.name for n in topology.nodes],
        metrics,
        opts,
        name=name,
        queue_bytes=config.queue_bytes,
    )
    log.info(
        "relay %s up on port %d for %d nodes (at most %d bytes queued per destination)",
        name,
        config.port,
        len(topology.nodes),
        config.queue_bytes,
    )
    try:
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(relay.serve())
            if opts.monitor is not None:
                monitor = tg.create_task(opts.monitor.serve())
            await stop.wait()
            serving.cancel()
            if opts.monitor is not None:
                monitor.cancel()
    finally:
        relay.close()
        if opts.monitor is not None:
            opts.monitor.close()
        ctx.term()
        log.info("relay %s stopped after forwarding %d bytes", name, relay.forwarded_bytes)


def relay_main(topology: Topology, name: str, key_dir: str | None) -> int:
    from ravq.net.socket_io import install_uvloop
    from ravq.tuning import tune_process

    metrics = Metrics(name)
    metrics.set_role("relay")
    opts = relay_options(topology, name, key_dir, metrics)
    config = next(r for r in topology.relays if r.name == name)
    if config.metrics_port is not None:
        listen.serve_metrics(metrics, config.metrics_port, config.bind_host or config.host)
    tune_process()
    install_uvloop()
    asyncio.run(run_relay(topology, name, opts, metrics))
    return 0
