"""The daemon's logs: one JSON object per line (for a collector), or plain text (for a terminal)."""

from __future__ import annotations

import json
import logging
import threading

FORMATS = ("json", "text")
RING_SEP = ":"  # a sharded job's ring threads are named "<stage>:<ring>" (tools.daemon.rings)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any `extra` fields."""

    skip = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, r: logging.LogRecord) -> str:
        d = {"ts": round(r.created, 6), "level": r.levelname.lower(), "logger": r.name, "msg": r.getMessage()}
        d.update(extra_fields(r))
        if r.exc_info:
            d["exc"] = self.formatException(r.exc_info)
        return json.dumps(d, default=str)


class TextLogFormatter(logging.Formatter):
    """``HH:MM:SS level message key=value ...``: the same records, for a person at a terminal."""

    def format(self, r: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in extra_fields(r).items())
        line = f"{self.formatTime(r, '%H:%M:%S')} {r.levelname.lower():7} {r.getMessage()}"
        if extra:
            line += f"  {extra}"
        if r.exc_info:
            line += "\n" + self.formatException(r.exc_info)
        return line


def extra_fields(r: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(r).items() if k not in JsonLogFormatter.skip}


class RingFilter(logging.Filter):
    """Names the ring of a sharded job whose thread logged the record (``ring``)."""

    def filter(self, r: logging.LogRecord) -> bool:
        _, sep, ring = threading.current_thread().name.partition(RING_SEP)
        if sep and not hasattr(r, "ring"):
            r.ring = ring
        return True


def setup_logging(level=logging.INFO, fmt: str = "json") -> None:
    h = logging.StreamHandler()
    h.setFormatter(TextLogFormatter() if fmt == "text" else JsonLogFormatter())
    h.addFilter(RingFilter())
    root = logging.getLogger("mirrorckpt")
    root.handlers[:] = [h]
    root.setLevel(level)
    root.propagate = False
