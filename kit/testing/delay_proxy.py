"""A delaying TCP proxy (pure asyncio): latency and "loss" where the kernel has no ``sch_netem``.

Holds :class:`DelayProxy`, which forwards each accepted TCP connection to one target and holds
every chunk ``delay`` seconds in each direction before passing it on, in order, and
:class:`DelaySchedule`, the pure rule deciding when a chunk may go. Run one in a network namespace
with :meth:`kit.testing.netsim.NetSim.start_delay_proxy`, or by hand::

    python -m kit.testing.delay_proxy --target 10.231.0.11:4000 --delay 0.05   # prints its port

"Loss" is modelled as what a lost segment costs a TCP connection: with probability
``stall_probability`` a chunk is held ``stall`` seconds longer (about one retransmission timeout;
Linux's minimum RTO is 200 ms, RFC 6298 §2.4). Caveat: the proxy terminates TCP, so each side's
congestion control sees a short RTT: the proxy adds latency to request/response exchanges, not the
bandwidth-delay limits of a long fat pipe. It does not shape bandwidth (``tc tbf`` does that).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from collections.abc import Sequence

from kit.errors import ConfigError
from kit.runtime import get_runtime

logger = logging.getLogger(__name__)


class DelaySchedule:
    """When each chunk of one direction may be delivered: ``delay`` after it arrived, plus a rare
    stall (a "lost" segment), never before the chunk ahead of it (TCP delivers in order)."""

    def __init__(
        self, delay: float, stall_probability: float, stall: float, rng: random.Random
    ) -> None:
        if delay < 0 or not 0 <= stall_probability <= 1 or stall < 0:
            raise ConfigError(
                "invalid delay proxy settings - help: delay >= 0, stall >= 0, "
                "0 <= stall_probability <= 1"
            )
        self.delay, self.stall_probability, self.stall = delay, stall_probability, stall
        self.rng = rng
        self.last_release = float("-inf")

    def release_time(self, now: float) -> float:
        extra = self.stall if self.rng.random() < self.stall_probability else 0.0
        self.last_release = max(now + self.delay + extra, self.last_release)
        return self.last_release


class DelayProxy:
    """A TCP proxy adding one-way ``delay`` (and rare stalls) in each direction.

    Args:
        target: (host, port) to forward each accepted connection to.
        delay: seconds every chunk is held, per direction (RTT grows by ``2 * delay``).
        stall_probability: chance that a chunk is held ``stall`` seconds longer ("loss").
        max_buffered: bytes held per direction before reading pauses; increase if throughput
            through the proxy is capped at about ``max_buffered / delay``.
        seed: for reproducible stalls.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        delay: float,
        stall_probability: float = 0.0,
        stall: float = 0.2,
        max_buffered: int = 16 * 2**20,
        seed: int = 0,
    ) -> None:
        DelaySchedule(delay, stall_probability, stall, random.Random(seed))  # validates
        self.target, self.delay, self.max_buffered = target, delay, max_buffered
        self.stall_probability, self.stall = stall_probability, stall
        self.rng = random.Random(seed)
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str = "0.0.0.0", port: int = 0) -> int:
        """Listen; returns the port."""
        self.server = await asyncio.start_server(self._accept, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=2.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)  # type: ignore[arg-type]
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), 10)
        except (OSError, asyncio.TimeoutError) as e:
            logger.info("delay proxy: cannot reach %s: %s", self.target, e)
            writer.close()
            self.tasks.discard(task)  # type: ignore[arg-type]
            return
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.wait(pumps, timeout=2.0)
            writer.close()
            up_writer.close()
            self.tasks.discard(task)  # type: ignore[arg-type]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        schedule = DelaySchedule(self.delay, self.stall_probability, self.stall, self.rng)
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        room = asyncio.Semaphore(max(1, self.max_buffered // 65536))  # chunks of <= 64 KiB

        async def deliver() -> None:
            while True:
                release, chunk = await queue.get()
                await asyncio.sleep(max(0.0, release - loop.time()))
                if not chunk:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 60)
                room.release()

        delivering = asyncio.ensure_future(deliver())
        try:
            while True:
                await room.acquire()
                chunk = await reader.read(65536)  # no timeout: idle connections are legitimate
                queue.put_nowait((schedule.release_time(loop.time()), chunk))
                if not chunk:
                    break
            await delivering
        finally:
            delivering.cancel()


async def _serve_proxy(args: argparse.Namespace) -> None:
    host, _, port = args.target.rpartition(":")
    proxy = DelayProxy(
        (host, int(port)),
        delay=args.delay,
        stall_probability=args.stall_probability,
        stall=args.stall,
    )
    print(await proxy.start("0.0.0.0", args.port), flush=True)  # the port: the product
    try:
        await asyncio.sleep(args.lifetime)  # bounded; NetSim.down() kills it long before
    finally:
        await proxy.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kit.testing.delay_proxy --target HOST:PORT --delay SECONDS [...]``."""
    proxy = argparse.ArgumentParser(
        prog="python -m kit.testing.delay_proxy", description="a delaying TCP proxy"
    )
    proxy.add_argument("--target", required=True, help="HOST:PORT to forward to")
    proxy.add_argument("--port", type=int, default=0, help="port to listen on (0 = any)")
    proxy.add_argument("--delay", type=float, default=0.02, help="one-way delay, seconds")
    proxy.add_argument("--stall-probability", type=float, default=0.0)
    proxy.add_argument("--stall", type=float, default=0.2, help="seconds a 'lost' chunk costs")
    proxy.add_argument("--lifetime", type=float, default=3600.0, help="exit after this long")
    args = proxy.parse_args(argv)
    get_runtime().call(_serve_proxy(args), timeout=args.lifetime + 10.0)  # kit's one loop
    return 0


__all__ = ["DelayProxy", "DelaySchedule", "main"]

if __name__ == "__main__":
    sys.exit(main())
