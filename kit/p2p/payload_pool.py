"""Large frame payloads read into memory that is already resident: buffers reused once nobody
holds them.

Every large websocket payload (an all-reduce chunk: 0.5-4 MiB) is read straight into a buffer of
its own, and a round keeps dozens of them at once (the averages are staged in the frames they
arrived in until the round commits). Fresh buffers cost a page fault for every 4 KiB the kernel
writes into them; the allocator hands the freed ones back to the system between rounds (glibc
trims a thread's arena), so every round faulted its whole vector in again: ~13,500 faults and
~13 ms of system time per peer and round for a 72 MB vector here, ~7% of a round
(``benchmarks/allreduce.py``, ``minor_faults``). Float16 encodings of outgoing chunks come from
here too (``kit.averaging.compression``), for the same reason.

A :class:`PayloadPool` lends a buffer as a view of a larger base array and takes the base back
when the view dies (``weakref.finalize``: the last tensor, memoryview or array that aliases it is
gone). Nothing is reused while anything still reads it: a consumer that keeps a frame keeps its
buffer. Lent views may die on any thread (a staged average dropped by the training thread) and at
any moment, a garbage collection inside ``take`` included, so a dying view only appends its base
to a deque (atomic); ``take`` moves those onto the free lists under its lock. Free buffers are
kept up to ``max_free_bytes``; beyond that, those given back longest ago go back to the allocator.
Not the newest: a size no round asks for any more would fill the pool for good (seen: a round of
1 MiB chunks, then rounds of 2 MiB ones, whose ~100 buffers a round were all fresh from then on,
``pool_reused_fresh``).
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

MIN_POOLED = 64 * 1024  # smaller payloads are parsed out of the stage buffer (kit.p2p.websocket)
MAX_POOLED = 8 * 1024**2 + 64 * 1024  # larger ones are rare (state downloads): not kept
GRANULE = 64 * 1024  # capacities are rounded up to this: one class for a round's chunk sizes
MAX_FREE_BYTES = 128 * 1024**2  # free buffers kept; raise it if minor_faults stay high for a
# large vector (a round stages about the whole vector in frames), lower it on a small machine


def uninitialized(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes whose pages cost memory only once written to.

    np.empty, not bytearray: nothing is zero-filled, so the pages become resident only as bytes
    arrive in them. A peer that declares a large frame and sends nothing (or an idle connection)
    costs no memory (found by tests/p2p/test_fuzz.py)."""
    return memoryview(np.empty(size, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]


class PayloadPool:
    """Writable byte buffers for large payloads, reused once every view of them is gone."""

    def __init__(self, max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        # capacity -> free bases, oldest first, each with when it came back (a counter)
        self._free: dict[int, collections.deque[tuple[int, np.ndarray]]] = {}
        self._returns = 0
        self._free_bytes = 0
        self._returned: collections.deque[np.ndarray] = collections.deque()  # not yet sorted
        self._lock = threading.Lock()  # (encodings may be made on any thread)
        self.reused = 0  # buffers lent again (for tests and benchmarks)
        self.allocated = 0  # buffers lent fresh

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._sort_returned()
            return self._free_bytes

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` bytes (its contents are undefined)."""
        if size < MIN_POOLED or size > MAX_POOLED:
            return uninitialized(size)
        capacity = -(-size // GRANULE) * GRANULE
        base = None
        with self._lock:
            self._sort_returned()
            # The smallest free buffer that fits, up to twice the size: a round's frames, its
            # encodings and its float32 temporaries differ by a header or a factor of two, and
            # classes that cannot serve each other would each keep their own free buffers.
            fits = [c for c, free in self._free.items() if free and capacity <= c <= 2 * capacity]
            if fits:
                best = min(fits)
                base = self._free[best].pop()[1]  # the newest: most likely still cached
                self._free_bytes -= best
                self.reused += 1
            else:
                self.allocated += 1
        if base is None:
            base = np.empty(capacity, dtype=np.uint8)  # resident as bytes arrive (see above)
        lent = base[:size]  # the view whose death gives ``base`` back
        weakref.finalize(lent, self._returned.append, base).atexit = False
        return memoryview(lent).cast("B")  # type: ignore[arg-type]

    def _sort_returned(self) -> None:
        """Put the bases of views that died onto the free lists; over ``max_free_bytes``, give
        the ones that came back longest ago to the allocator (the lock is held)."""
        while self._returned:
            base = self._returned.popleft()
            self._returns += 1
            self._free.setdefault(len(base), collections.deque()).append((self._returns, base))
            self._free_bytes += len(base)
            while self._free_bytes > self.max_free_bytes:
                _, oldest = min((free[0][0], c) for c, free in self._free.items() if free)
                self._free[oldest].popleft()
                self._free_bytes -= oldest

    def clear(self) -> None:
        """Give every free buffer back to the allocator."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
            self._free_bytes = 0


#: The process's pool: every connection's large payloads (they all run on kit's one loop).
PAYLOADS = PayloadPool()
