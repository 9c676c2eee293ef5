"""A capture worker's sends reach the parser process through shared memory.

Pickled through the multiprocessing queue, a send's bytes were copied four times (pickle, pipe
write, pipe read, unpickle): 0.42 GB/s for 1 MB sends measured here, a fraction of what the
packet path decodes, so `serve` ran at the queue's rate while its parser waited. Now each worker
owns a ring of shared memory. It copies a chunk of sends' bytes into the ring (a send still in its
capture batch, ``nccl.LazySend``, straight from there) and puts only their metadata on the queue
(``pack``); the parser's sends read their bytes in the ring where they lie (``unpack``), and a
chunk's space goes back once the last of them is dropped (a copy out of every chunk was a third
of the parser thread's time on Simple). A send kept past its batch takes its own copy
(``NcclSend.keep``), so it does not pin its chunk. The ring is bounded: a worker whose ring is
full waits for the parser, its queue backs up and the capture edge drops, as before; one whose
ring stays full for ``STUCK_S`` (a chunk pinned by a send kept whole somewhere) sends that chunk
pickled instead of waiting on.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
from mirrorckpt.parser.roce.nccl import LazySend

STUCK_S = 1.0  # a worker's ring full this long: the chunk goes pickled (see the module doc)


def own(s):
    """``s`` as it can be pickled whole: a send still in its capture batch (``nccl.LazySend``)
    would take its batch and run with it, so it goes with a copy of its own bytes."""
    if not isinstance(s, LazySend):
        return s
    d = np.empty(s.nbytes, np.uint8)
    s.copy_into(d)
    return s.carrying(d)


class SendRing:
    """One worker's ring: ``buf`` (shared bytes) and ``done`` (shared int64: ring bytes, counted
    from the start, the parser has given back). Created before the worker starts (spawn passes
    shared memory to a child only as a start argument)."""

    def __init__(self, ctx, nbytes: int):
        self.nbytes = int(nbytes)
        self.buf = ctx.RawArray("B", self.nbytes)
        self.done = ctx.RawArray("q", 1)
        self._view = None
        self.written = 0  # the writer's side: ring bytes handed out, counted from the start
        # the parser's side: the ring as bytes, and [end, dropped] of the chunks in use, in order
        self._bytes = memoryview(self.buf).cast("B")
        self._live: collections.deque = collections.deque()
        # a chunk's last send may be dropped on any thread, or by the collector inside this one
        self._lock = threading.RLock()

    def __getstate__(self) -> dict:
        return {"nbytes": self.nbytes, "buf": self.buf, "done": self.done, "written": 0}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _view=None)

    @property
    def view(self) -> np.ndarray:
        if self._view is None:
            self._view = np.frombuffer(self.buf, np.uint8)
        return self._view

    @property
    def chunk_bytes(self) -> int:
        """Most bytes one queue item carries in the ring: a quarter, so several are in flight."""
        return self.nbytes // 4

    # -- the worker's side ------------------------------------------------------------------

    def pack(self, sends: list, waiting=None) -> Iterator[tuple]:
        """``sends`` as queue payloads, each to be put before the next is asked for (a chunk may
        wait for the parser to copy out the ones before it): (sends without their bytes, ring
        span) per chunk; a send larger than a chunk goes whole through the queue (span None).
        ``waiting()`` is asked while the ring is full: True gives up (the worker is stopping) and
        sends the chunk pickled."""
        chunk, size = [], 0
        for s in sends:
            n = s.nbytes
            if chunk and size + n > self.chunk_bytes:
                yield self._chunk(chunk, size, waiting)
                chunk, size = [], 0
            if n > self.chunk_bytes:
                yield [own(s)], None
                continue
            chunk.append(s)
            size += n
        if chunk:
            yield self._chunk(chunk, size, waiting)

    def _chunk(self, sends: list, size: int, waiting) -> tuple:
        start = self.written
        if start % self.nbytes + size > self.nbytes:  # no wrap inside a chunk: skip the ring's tail
            start += self.nbytes - start % self.nbytes
        end = start + size
        since = time.monotonic()
        while end - self.done[0] > self.nbytes:  # the parser still reads what this would reuse
            if waiting is not None and waiting() or time.monotonic() - since > STUCK_S:
                return [own(s) for s in sends], None
            time.sleep(0.0005)
        view, pos, bare = self.view, start % self.nbytes, []
        for s in sends:
            n = s.nbytes
            s.copy_into(view[pos:pos + n])  # a send still in its capture batch: straight from there
            pos += n
            bare.append(s.carrying(n))  # the length stands in for the bytes
        self.written = end
        return bare, (start, end)

    # -- the parser's side ------------------------------------------------------------------

    def unpack(self, bare: list, span: tuple[int, int] | None) -> list:
        """The sends with their bytes, views of the chunk in the ring; its space is given back
        once every view of it is dropped (chunks in order: one still in use holds back those after)."""
        if span is None:
            return bare
        start, end = span
        pos = start % self.nbytes
        # an array of its own over the chunk: every send's bytes are a view of it, so it lives
        # exactly as long as the last of them (numpy's views keep their base array alive)
        chunk = np.frombuffer(self._bytes[pos:pos + end - start], np.uint8)
        entry = [end, False]
        with self._lock:
            self._live.append(entry)
        weakref.finalize(chunk, self._dropped, entry)
        at = 0
        for s in bare:
            n = s.data
            s.data = chunk[at:at + n]
            at += n
        return bare

    def _dropped(self, entry: list) -> None:
        with self._lock:
            entry[1] = True
            while self._live and self._live[0][1]:
                self.done[0] = self._live.popleft()[0]
