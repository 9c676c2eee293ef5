"""Keep freed memory in the process instead of handing it back to the kernel, and keep the
garbage collector off the heap that start-up built.

Message buffers are allocated and freed at line rate. With glibc's defaults, large buffers are
fresh mmaps and a freed heap top above 2x the mmap threshold is trimmed, so every batch's
buffers are page-faulted (and zeroed by the kernel) again: measured here, that drops placement
from about 8 GB/s to 2 GB/s. Raising both thresholds once per process lets freed buffers be
reused; the cost is that the resident size does not shrink after a peak (an appliance runs with
a fixed memory budget anyway). One arena for every thread (M_ARENA_MAX 1): a thread's own arena
grows in heaps of at most 64 MB and serves a larger request with a fresh mmap, so on the packet
path's thread every 32 MB run buffer was new memory, faulted in again; a Simple replay's first pass
in a process (what the CLI runs) took 0.35 s where later passes took 0.19 s, 0.22 s with one arena.
The biggest buffers (a run's payload, a collective's result) no longer come from the heap at all
but from ``Buffers``, mappings of their own used again whole: in the heap their many sizes holed
it, and it grew with the length of the capture.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import sys
import threading
import weakref

import numpy as np

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_done = False


def keep_freed_memory(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Applies the glibc settings once, before the process starts its threads; False where there is
    no glibc mallopt."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and \
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 and libc.mallopt(M_ARENA_MAX, 1) == 1
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok


class Buffers:
    """Big buffers, each on an anonymous mapping of its own that is used again once the buffer is
    dropped.

    keep_freed_memory trades page faults for a heap that holds its freed memory, but the packet
    path's big buffers (a run's payload, a collective's result) come in dozens of sizes. Freed
    into the heap they left holes the next request did not fit, so the heap grew with the
    capture's length: a 2 GB capture peaked 20-30 % above 200 MB of the same job. Off the heap,
    and reused whole, they neither hole it nor fault again. A mapping is free when nothing but
    this pool refers to it (its reference count: every array on it holds one).

    Mappings come in size classes, powers of two times ``STEP``, and a request takes a free one of
    its class (or the next). Sized to each request, a run's buffer (its size set by where a batch
    was cut) rarely fitted a freed one: a Simple replay mapped 33 buffers, 239 MB, where 20 serve
    it in classes, and every new one is faulted in and zeroed by the kernel (half the packet
    path's thread time in that replay). Free mappings beyond ``spare`` bytes are unmapped: a
    batch's runs are freed together, so ``spare`` holds a batch's worth (with 16 MB, warm replays
    still mapped afresh). Thread-safe: one pool serves the process (``buffers()``)."""

    MIN = 1 << 20  # smaller requests: the heap's, where they are reused well
    STEP = 2 << 20  # the smallest class: a whole huge page

    def __init__(self, spare: int = 64 << 20):
        self.spare = spare
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # a child forked while another thread held the lock gets its own
            me = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _relock(me()))

    def empty(self, n: int) -> np.ndarray:
        """``n`` uninitialised bytes."""
        if n < self.MIN:
            return np.empty(n, np.uint8)
        with self._lock:
            return self._take(n)

    @classmethod
    def size_class(cls, n: int) -> int:
        """The mapping size for ``n`` bytes: a power of two times ``STEP``."""
        size = cls.STEP
        while size < n:
            size <<= 1
        return size

    def _take(self, n: int) -> np.ndarray:
        maps, pick, c = self._maps, -1, self.size_class(n)
        for i in range(len(maps)):
            size = len(maps[i])
            if c <= size <= 2 * c and sys.getrefcount(maps[i]) == 2 and (pick < 0 or size < len(maps[pick])):
                pick = i  # getrefcount 2: the list's reference and its own argument's
        if pick >= 0:
            return np.frombuffer(maps[pick], np.uint8, count=n)
        m = self._map(c)
        a = np.frombuffer(m, np.uint8, count=n)  # before _trim, which would take ``m`` for free
        maps.append(m)
        self._trim()
        return a

    def zeros(self, n: int) -> np.ndarray:
        a = self.empty(n)
        a.fill(0)
        return a

    @staticmethod
    def _map(size: int) -> mmap.mmap:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)  # fewer faults and TLB misses on copies through it
        return m

    def _trim(self) -> None:
        maps = self._maps
        free = [i for i in range(len(maps)) if sys.getrefcount(maps[i]) == 2]
        spare = sum(len(maps[i]) for i in free)
        for i in sorted(free, key=lambda i: len(maps[i])):  # small ones first: the big ones are costly to fault
            if spare <= self.spare:
                break
            spare -= len(maps[i])
            maps[i].close()
        self._maps = [m for m in maps if not m.closed]


def _relock(pool: Buffers | None) -> None:
    if pool is not None:
        pool._lock = threading.Lock()


_buffers = Buffers()


def buffers() -> Buffers:
    """The process's pool of big buffers."""
    return _buffers


def freeze_startup_heap() -> int:
    """Moves every object alive now (modules, torch, the job's layout) out of the collector's reach.

    The packet path makes and drops tens of thousands of objects a second (messages, sends), so
    the collector runs a full pass every second or so, and a full pass walks the whole heap: with
    torch imported that is ~170,000 objects and 70-90 ms, 8 % of an LL replay's wall. Objects made
    later are collected as before. Called once by a process's entry point after its imports (a
    start-up object that dies later is then never freed: a few KB). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
