"""The link's way to the appliance: one ControlClient and one sender thread. The training thread
hands over a builder (and, optionally, a host copy it waits on); the sender thread waits for the
copy, builds the message and queues it, so no hook ever waits on the network or a copy."""

from __future__ import annotations

import logging
import queue
import threading
import time

from mirrorckpt.control import gockpt
from mirrorckpt.control.endpoint import ControlClient

log = logging.getLogger("mirrorckpt.control.trainer")


class Both(gockpt.Copy):
    """Two copies awaited together (a part's state and its gradients)."""

    def __init__(self, first: gockpt.Copy, second: gockpt.Copy):
        super().__init__()
        self.first, self.second = first, second


def copy_result(copier, copy):
    if isinstance(copy, Both):
        return (copier.result(copy.first), copier.result(copy.second))
    return copier.result(copy)


class Transport:
    """ControlClient plus sender thread. ``copier()`` gives the link's current copy engine (a test
    may swap it); ``dropped()`` is called for each message the client could not queue."""

    def __init__(self, appliance: tuple[str, int], secret, role: str, *, handlers: dict, on_connect, copier,
                 dropped, client_options: dict | None = None):
        host, port = appliance
        self._copier, self._dropped = copier, dropped
        self._queue: queue.Queue = queue.Queue()
        self.client = ControlClient(host, port, secret, role, handlers=handlers, on_connect=on_connect,
                                    **(client_options or {}))
        self._sender = threading.Thread(target=self._send_loop, name="mirrorckpt-link", daemon=True)
        self._sender.start()
        self.client.start()

    def emit(self, build, copy: gockpt.Copy | None = None) -> None:
        """Hand a message over; ``build(tensors)`` runs on the sender thread once ``copy`` is done."""
        self._queue.put((copy, build))

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            copy, build = item
            try:
                msg = build(copy_result(self._copier(), copy) if copy is not None else None)
                if msg is not None and not self.client.send(msg):
                    self._dropped()
            except Exception as e:  # noqa: BLE001 - a lost message is logged; the appliance re-asks
                log.error("control message not sent: %s: %s", type(e).__name__, e)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every message handed over so far has been written to the appliance."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:  # built and handed to the client
            time.sleep(0.005)
        return self.client.flush(max(0.0, end - time.monotonic()))

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._sender.join(timeout)
        self.client.close(flush_timeout=timeout)
