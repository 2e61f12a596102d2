"""The ZeroMQ context the measurements run their sockets in, with CURVE's ZAP requests answered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import zmq.asyncio

from ravq.net.options import SocketOptions


@contextlib.asynccontextmanager
async def zmq_session(options: SocketOptions) -> AsyncIterator[tuple[zmq.asyncio.Context, asyncio.TaskGroup]]:
    """A zmq context and the process's TaskGroup, with CURVE's ZAP requests answered in it (when the
    options have a monitor); on the way out the ZAP task is cancelled, the monitor closed and the
    context destroyed."""
    ctx = zmq.asyncio.Context()
    try:
        async with asyncio.TaskGroup() as group:
            zap = group.create_task(options.monitor.serve()) if options.monitor else None
            try:
                yield ctx, group
            finally:
                if zap is not None:
                    zap.cancel()
    finally:
        if options.monitor:
            options.monitor.close()
        ctx.destroy(linger=0)
