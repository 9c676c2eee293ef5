"""The trainer's bounded send queue: the training loop hands messages over and moves on.

When the queue is full, a STEP_META (or PING) makes room by evicting the oldest queued STEP_META
(or is itself dropped when none is queued); every drop is counted. Other messages (GoCkpt parts,
fingerprints, replies) are never dropped: they evict a droppable message if one is queued, else
the caller blocks until there is room, up to a timeout, then gets ``QueueFull``.
"""

from __future__ import annotations

import collections
import threading
import time

from mirrorckpt.control import messages as m

DROPPABLE = frozenset({m.STEP_META, m.PING})


class QueueFull(Exception):
    pass


class OutboxClosed(Exception):
    pass


class Outbox:
    def __init__(self, maxsize: int = 256, block_timeout: float = 30.0):
        if maxsize < 1:
            raise ValueError("outbox size must be >= 1")
        self.maxsize = maxsize
        self.block_timeout = block_timeout
        self._q: collections.deque[m.Message] = collections.deque()
        self._cond = threading.Condition()
        self.drops: collections.Counter[str] = collections.Counter()
        self.in_flight = 0  # taken by the writer and not yet reported done
        self.closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._q)

    def _evict_droppable(self) -> bool:
        for i, old in enumerate(self._q):
            if old.type in DROPPABLE:
                del self._q[i]
                self.drops[old.type] += 1
                return True
        return False

    def put(self, msg: m.Message, timeout: float | None = None) -> bool:
        """Queue ``msg``; False if it was dropped (droppable types only). Raises QueueFull."""
        timeout = self.block_timeout if timeout is None else timeout
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.closed:
                    raise OutboxClosed("the control client is closed")
                if len(self._q) < self.maxsize or self._evict_droppable():
                    self._q.append(msg)
                    self._cond.notify_all()
                    return True
                if msg.type in DROPPABLE:
                    self.drops[msg.type] += 1
                    return False
                left = end - time.monotonic()
                if left <= 0:
                    raise QueueFull(f"send queue full ({self.maxsize} messages) for {timeout:g} s; "
                                    f"{msg.type} not queued")
                self._cond.wait(left)

    def put_back(self, msg: m.Message) -> None:
        """Return a message whose send failed to the head of the queue (may exceed maxsize by one)."""
        with self._cond:
            self._q.appendleft(msg)
            self.in_flight -= 1
            self._cond.notify_all()

    def done(self) -> None:
        """The writer finished with the message it took (sent, or given up)."""
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def get(self, timeout: float) -> m.Message | None:
        with self._cond:
            if not self._q and not self.closed:
                self._cond.wait(timeout)
            if not self._q:
                return None
            msg = self._q.popleft()
            self.in_flight += 1
            self._cond.notify_all()
            return msg

    def wait_empty(self, timeout: float) -> bool:
        """Wait until every queued message was taken and finished with by the writer."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._q or self.in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
