"""A one-line progress display on stderr for long commands (`replay`, `bench`, `plan`).

It redraws one line in place ("label  3/5 parts  12 s  eta 8 s  note") and only when the stream
is a terminal: logs, pipes and tests see only what ``echo`` writes, so JSON on stdout stays clean. With ``tick`` a
background thread redraws the elapsed time while a long step runs without updates.
"""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    def __init__(self, label: str, total: float | None = None, unit: str = "", *, stream=None,
                 enabled: bool | None = None, tick: float | None = None, min_interval: float = 0.1):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = enabled if enabled is not None else bool(isatty and isatty())
        self.done, self.note = 0.0, ""
        self.t0 = time.monotonic()
        self._last, self._width, self._min = 0.0, 0, min_interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.enabled and tick:
            self._thread = threading.Thread(target=self._tick, args=(tick,), daemon=True)
            self._thread.start()

    def update(self, n: float = 1, note: str | None = None) -> None:
        self.set(self.done + n, note)

    def set(self, done: float, note: str | None = None) -> None:
        self.done = done
        if note is not None:
            self.note = note
        now = time.monotonic()
        if now - self._last >= self._min or (self.total is not None and done >= self.total):
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        el = (now if now is not None else time.monotonic()) - self.t0
        parts = [self.label]
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            parts.append(f"{_n(self.done)}/{_n(self.total)}{unit}")
            if 0 < self.done < self.total:
                parts.append(f"{_t(el)}, eta {_t(el * (self.total - self.done) / self.done)}")
            else:
                parts.append(_t(el))
        else:
            parts += [f"{_n(self.done)}{unit}", _t(el)]
        if self.note:
            parts.append(self.note)
        return "  ".join(parts)

    def echo(self, msg: str) -> None:
        """A log line above the progress line (to the stream, terminal or not)."""
        with self._lock:
            if self.enabled and self._width:
                self.stream.write("\r" + " " * self._width + "\r")
                self._width = 0
            self.stream.write(msg + "\n")
            self.stream.flush()
        if self.enabled:
            self._draw(time.monotonic())

    def _draw(self, now: float) -> None:
        if not self.enabled:
            return
        with self._lock:
            s = self.line(now)
            pad = max(0, self._width - len(s))
            self.stream.write("\r" + s + " " * pad)
            self.stream.flush()
            self._width, self._last = len(s), now

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            self._draw(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.enabled and self._width:
            self._draw(time.monotonic())
            with self._lock:
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _t(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"
