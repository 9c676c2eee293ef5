"""The protocol of each collective, read off one connection's messages.

NCCL chooses LL, LL128 or Simple per collective; each leaves its mark on the sends (LL: two equal
flags per 16-byte line, LL128: a flag word per 128-byte line, else Simple). Walking the job's
collective sequence along one connection (channel, ring position), each collective must account
for the next messages: their number, sizes, LL/LL128 flags (the connection step, which a Simple
collective advances by two per message and rounds up to a multiple of 4: doc 4.2) and detected
protocols. The protocol that makes them fit is the collective's. Channel 0 carries every
collective, so a walk that fits a connection from the first message to the last one seen, as
channel 0, decides every shape that has a message there.
"""

from __future__ import annotations

from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import schedule
from mirrorckpt.parser.roce.collectives import NcclJobModel, shape
from mirrorckpt.parser.roce.nccl import NcclSend

_FLAG_MOD = 1 << 32


def _fits(s: NcclSend | None, st: schedule.RingStep, t: int, proto: str) -> bool:
    if s is None:  # not seen (the window's end, or lost): nothing contradicts
        return True
    if s.length_known and s.wire_bytes != st.wire_bytes:
        return False
    if len(s.data) and s.protocol != proto:
        return False
    return s.flag is None or (s.flag - 1 - t) % _FLAG_MOD == 0


def _guesses(seq: dict[int, NcclSend], m: int) -> list[str]:
    """Protocols to try for the collective starting at message ``m``: the next data send's first."""
    for k in range(m, m + 16):
        s = seq.get(k)
        if s is not None and len(s.data) and s.protocol:
            return [s.protocol] + [p for p in nv.PROTOCOLS if p != s.protocol]
    return list(nv.PROTOCOLS)


def walk(model: NcclJobModel, seq: dict[int, NcclSend], channel: int, pos: int, upto: int | None = None,
         known: dict[tuple, str] | None = None) -> tuple[dict[tuple, str], int] | None:
    """(shape -> protocol, messages walked) that fits every message of ``seq`` (message number ->
    send) on (``channel``, ``pos``), for collectives before ``upto``; None when nothing fits."""
    table = dict(known or {})
    last = max(seq) if seq else -1
    t = m = k = 0
    while m <= last and (upto is None or k < upto):
        c = model[k]
        if c is None:
            return None
        p0 = model.pinned(c) or table.get(shape(c))
        absent = None
        for p in ([p0] if p0 else _guesses(seq, m)):
            plan = model.plan_as(c, p)
            msgs = plan.messages(pos, channel) if channel in plan.channels else []
            if not msgs:
                absent = absent or p
                continue
            start = schedule.conn_step_start(t, p, c.kind)
            if all(_fits(seq.get(m + i), st, start + st.conn_step, p) for i, st in enumerate(msgs)):
                table[shape(c)] = p
                t, m = start + plan.conn_steps(channel, pos), m + len(msgs)
                break
        else:
            if absent is None:
                return None
            if p0:
                table[shape(c)] = p0
        k += 1
    return table, m
