"""The payload pool: a large frame's buffer is reused once nothing aliases it, never before."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from kit.p2p.payload_pool import GRANULE, MAX_POOLED, MIN_POOLED, PAYLOADS, PayloadPool
from kit.p2p.websocket import OP_BINARY, FrameReader, frame_header

SIZE = 2 * 1024**2 + 100  # an all-reduce chunk of 2 MiB and its header


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone() -> None:
    pool = PayloadPool()
    first = pool.take(SIZE)
    assert len(first) == SIZE and not first.readonly
    where = address(first)
    first[:4] = b"kit!"
    # Views a consumer may keep: a slice, a tensor over a slice, an array over the tensor.
    payload = first[100:]
    tensor = torch.frombuffer(payload, dtype=torch.float32, count=1000)
    array = tensor.numpy()[10:]
    del first, payload, tensor
    second = pool.take(SIZE)
    assert address(second) != where and pool.reused == 0  # the array still reads the first
    del array
    third = pool.take(SIZE + 1)  # another size of the same class gets the freed buffer
    assert address(third) == where and pool.reused == 1 and len(third) == SIZE + 1
    assert bytes(third[:4]) == b"kit!"  # reused as it was: contents are undefined, not zeroed
    del second, third


def test_sizes_share_a_buffer_by_class_and_small_or_huge_ones_are_not_kept() -> None:
    pool = PayloadPool()
    for size in (MIN_POOLED - 1, MAX_POOLED + 1):
        buffer = pool.take(size)
        assert len(buffer) == size
        del buffer
        assert pool.free_bytes == 0
    buffer = pool.take(MIN_POOLED)
    del buffer
    assert pool.free_bytes == GRANULE
    other = pool.take(MIN_POOLED + GRANULE)  # the next class: a new buffer
    assert pool.reused == 0 and pool.free_bytes == GRANULE
    del other
    smaller = pool.take(MIN_POOLED + 1)  # fits the freed larger one (at most twice its size)
    assert pool.reused == 1 and len(smaller) == MIN_POOLED + 1
    del smaller
    large = pool.take(8 * GRANULE)
    del large
    small = pool.take(3 * GRANULE)  # more than twice as large: not taken, a new buffer
    assert pool.reused == 1
    del small


def test_free_buffers_are_kept_up_to_the_limit_then_go_back_to_the_allocator() -> None:
    pool = PayloadPool(max_free_bytes=5 * 1024**2)
    buffers = [pool.take(SIZE) for _ in range(4)]
    del buffers
    capacity = -(-SIZE // GRANULE) * GRANULE
    assert pool.free_bytes == 2 * capacity  # two fit under 5 MiB, the others were let go
    pool.clear()
    assert pool.free_bytes == 0


def test_a_size_no_round_asks_for_any_more_does_not_fill_the_pool_for_good() -> None:
    """A round of 1 MiB chunks fills the pool; the next rounds' 2 MiB chunks cannot use those
    buffers. The buffers that came back longest ago make room: from the second such round on,
    every 2 MiB chunk is reused (the newest were dropped instead, and all stayed fresh)."""
    small, large = 1024**2, 2 * 1024**2 + 1
    pool = PayloadPool(max_free_bytes=8 * small)
    first = [pool.take(small) for _ in range(8)]
    del first
    assert pool.free_bytes == 8 * small
    for round_index in range(3):
        allocated = pool.allocated
        chunks = [pool.take(large) for _ in range(3)]
        del chunks
        fresh = pool.allocated - allocated
        assert fresh == (3 if round_index == 0 else 0), (round_index, fresh)
    assert pool.free_bytes <= 8 * small


def test_a_view_dropped_on_another_thread_gives_its_buffer_back() -> None:
    pool = PayloadPool()
    held = [pool.take(SIZE) for _ in range(8)]
    where = {address(view) for view in held}

    def drop() -> None:  # the training thread drops staged averages at commit
        held.clear()

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert pool.free_bytes == 8 * (-(-SIZE // GRANULE) * GRANULE)
    again = [pool.take(SIZE) for _ in range(8)]
    assert {address(view) for view in again} == where and pool.reused == 8
    del again


def test_the_frame_reader_reads_large_payloads_into_reused_buffers() -> None:
    """Frame after frame, each dropped once read: the reader's buffers come back (no new pages
    to fault in), and every message holds its own bytes."""
    reader = FrameReader(expect_masked=False, max_size=16 * 1024**2)
    reused = PAYLOADS.reused
    addresses = set()
    for _ in range(6):
        data = os.urandom(SIZE)
        stream = frame_header(OP_BINARY, len(data), None) + data
        view = memoryview(stream)
        while view:
            target = reader.buffer()
            size = min(len(target), len(view))
            target[:size] = view[:size]
            reader.received(size)
            view = view[size:]
        message = reader.messages.popleft()
        assert bytes(message) == data
        addresses.add(address(memoryview(message)))
        del message  # (no garbage collection needed: the last reference frees it)
    assert PAYLOADS.reused - reused >= 5 and len(addresses) == 1


def test_a_view_that_dies_while_the_pool_is_locked_does_not_wait_for_the_lock() -> None:
    """A garbage collection may free a lent view inside ``take`` itself (the same thread holds the
    pool's lock then): giving the buffer back must not take that lock again."""
    pool = PayloadPool()
    held = [pool.take(SIZE)]

    def collect_inside_take() -> None:
        with pool._lock:
            held.clear()  # the view dies here, as in a collection run by an allocation in take

    thread = threading.Thread(target=collect_inside_take, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "giving a buffer back waited for the pool's lock"
    assert pool.free_bytes == -(-SIZE // GRANULE) * GRANULE
