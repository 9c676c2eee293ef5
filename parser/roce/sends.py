"""What an NCCL send is, for the decoder (nccl.py), its run lane (nccl_runs.py) and every reader of sends.

``ConnKey`` names a connection (sender, receiver, the UDP source port of its QP); ``NcclSend`` is one
send's bytes and what is known of it; ``LazySend`` one whose bytes still lie in the capture batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.roce.nccl_versions import LL, SIMPLE
from mirrorckpt.parser.roce.reassembly import Key, QpKey


class ConnKey(Key, NamedTuple("ConnKeyFields", [("sender", bytes), ("receiver", bytes), ("sport", int)])):
    """sender, receiver: 16-byte addresses; sport: the UDP source port of the connection's QP."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{address_text(self.sender)}->{address_text(self.receiver)}:{self.sport}"


@dataclass
class Cts:
    idx: int
    addr: int
    size: int
    rkey: int
    nreqs: int
    tag: int  # the data sender's rank


@dataclass
class NcclSend:
    connection: ConnKey
    qp: QpKey
    protocol: str | None  # "LL", "LL128", "Simple"; None for an empty step on an unknown connection
    data: np.ndarray  # user bytes (LL/LL128 flags removed)
    holes: list[tuple[int, int]]  # missing user-byte ranges
    wire_bytes: int
    size: int | None  # immediate (bytes sent), None when the closing packet was lost
    va: int | None
    form: str  # "normal", "split" (adaptive-routing form), "empty" (0-byte step)
    flag: int | None = None  # LL/LL128: connection step + 1
    seq: int | None = None  # 1-based send number on the connection (from its CTS)
    cts: Cts | None = None
    ts_ns: int = 0
    length_known: bool = True
    stream: int = 0  # which mirror stream (capture source) carried it
    psn: int | None = None  # first PSN (unwrapped) of its WRITEs on ``qp``; None when unknown
    npkts: int = 0  # PSNs its WRITEs cover on ``qp``
    pmtu: int = 0  # path MTU of ``qp`` as seen so far (0: not yet known)
    qp_index: int = 0  # which of the connection's QPs ``qp`` is (by QP number)
    nqps: int = 1  # QPs of the connection seen so far
    cut: bool = False  # joined from pieces cut over the QPs (``qp``, ``psn``: the first piece's)
    pieces: tuple = ()  # cut: (QpKey, first PSN, PSNs) of every piece it holds, one per QP
    lone_piece: bool = False  # cut: one QP's piece sent on alone (its message number not proven)

    @property
    def complete(self) -> bool:
        return not self.holes and self.length_known

    @property
    def step(self) -> int | None:
        """Connection step counter of this send (flag - 1, or CTS idx - 1)."""
        if self.flag is not None:
            return self.flag - 1
        return self.seq - 1 if self.seq is not None else None

    @property
    def nbytes(self) -> int:
        """Length of ``data``, which it does not read."""
        return len(self.data)

    def place_agreeing(self, dst, covered, start: int, n: int, es: int) -> int | None:
        """Its first ``n`` elements placed into a collective's buffer from where its bytes lie, as
        ``_merge.place_agreeing`` places ``data``; None: place ``data`` (already in a buffer)."""
        return None

    def sha256(self) -> str | None:
        return hashlib.sha256(self.data.tobytes()).hexdigest() if self.complete else None

    def copy_into(self, dst: np.ndarray) -> None:
        """Its bytes into ``dst`` (``nbytes`` of uint8), from where they lie."""
        dst[:] = np.ravel(self.data).view(np.uint8)

    def keep(self) -> NcclSend:
        """Itself, for keeping past the batch it came in (held for its channel, a fill candidate):
        bytes that are a view of a larger buffer (a run's, a worker's shared-memory ring) are
        copied into their own, so the send pins no more than it needs."""
        d = self.data
        if isinstance(d, np.ndarray) and d.base is not None:
            self.data = d.copy()
        return self

    def carrying(self, data) -> NcclSend:
        """A plain send with these fields and ``data`` in place of its bytes: what goes to another
        process (a LazySend's batch and run stay behind)."""
        out = NcclSend.__new__(NcclSend)
        out.__dict__.update(self.__dict__)
        out.__dict__.pop("_source", None)
        out.__dict__.pop("_data", None)
        out.data = data
        return out


class LazySend(NcclSend):
    """A send whose bytes are still in the capture batch: a Simple send's wire bytes
    (``MessageRun.pending``), or an LL send's words as the decode read them (``ll_pending``). Its
    run's buffer is filled for its message's range when ``data`` is first read. Most sends of a ring
    all-reduce are never read (the reduce-scatter half: the concatenator keeps final values
    only), so their copy is never made. ``_source``: (run, start, end, LL words or not, message)."""

    @property
    def data(self) -> np.ndarray:
        src = self.__dict__.get("_source")
        if src is not None:
            run, a, b, ll, k = src
            run.fill_range(k, ll)
            self._data = run.ll_user[a:b] if ll else run.buf[a:b]
            self._source = None
        return self._data

    @data.setter
    def data(self, value: np.ndarray | None) -> None:
        self._data = value

    def keep(self) -> NcclSend:
        """Its batch stays valid as long as it is kept (a file's mapping): nothing to copy."""
        return self if self.__dict__.get("_source") is not None else super().keep()

    @property
    def nbytes(self) -> int:
        src = self.__dict__.get("_source")
        return src[2] - src[1] if src is not None else len(self._data)

    def copy_into(self, dst: np.ndarray) -> None:
        """Straight from the capture (its run is not filled)."""
        src = self.__dict__.get("_source")
        if src is None:
            return super().copy_into(dst)
        src[0].copy_range(src[4], dst, src[3])

    def place_agreeing(self, dst, covered, start: int, n: int, es: int) -> int | None:
        """Straight from the capture; None once ``data`` was read."""
        src = self.__dict__.get("_source")
        return src[0].place_range(src[4], dst, covered, start, n, es, src[3]) if src is not None else None


class SendBlock:
    """Consecutive sends of one batch, in order, whose bytes are all still in the capture batch
    (what the run lane would make ``LazySend``s of), kept as columns: the ring placer places them
    from the columns (``_placerun.place_batch``), with no object per send; ``sends()`` makes the
    ``LazySend``s, the same ones the run lane makes one by one.

    Per run (lists, indexed by ``run``): the ``MessageRun``, its connection, its QP, the QP's path MTU,
    its place among the connection's QPs (0 with one) and how many there are. Per send (int64 arrays):
    ``run``, its message ``m`` in the run, ``flag`` (LL: its line flag; 0: Simple), ``seq`` (the CTS
    index it answered; -1: none; ``cts`` holds the posts by row), ``va`` (uint64), ``size`` (the
    immediate), ``wire`` (bytes on the wire), ``psn``, ``npkts``, ``ts`` and ``lo``/``hi`` (its range
    in the run: LL words where ``flag``, else wire bytes)."""

    __slots__ = ("stream", "runs", "conns", "qps", "pmtus", "qis", "nqs", "run", "m", "flag", "seq", "va",
                 "size", "wire", "psn", "npkts", "ts", "lo", "hi", "cts")

    def __init__(self, stream: int, runs: list, conns: list, qps: list, pmtus: list, qis: list, nqs: list,
                 cols: dict, cts: dict):
        self.stream = stream
        self.pmtus, self.qis, self.nqs, self.cts = list(pmtus), list(qis), list(nqs), cts
        self.runs, self.conns, self.qps = list(runs), list(conns), list(qps)
        for k in ("run", "m", "flag", "seq", "size", "wire", "psn", "npkts", "ts", "lo", "hi"):
            setattr(self, k, np.ascontiguousarray(cols[k], np.int64))
        self.va = np.ascontiguousarray(cols["va"], np.uint64)  # as the RETH carries it

    def __len__(self) -> int:
        return len(self.m)

    def send(self, i: int) -> LazySend:
        """Send ``i`` as the run lane makes it."""
        j = int(self.run[i])
        flag, seq = int(self.flag[i]), int(self.seq[i])
        s = LazySend(self.conns[j], self.qps[j], LL if flag else SIMPLE, None, [], int(self.wire[i]),
                     int(self.size[i]), int(self.va[i]), "normal", flag or None, seq if seq >= 0 else None,
                     self.cts.get(i), int(self.ts[i]), True, self.stream, int(self.psn[i]), int(self.npkts[i]),
                     self.pmtus[j], self.qis[j], self.nqs[j])
        s._source = (self.runs[j], int(self.lo[i]), int(self.hi[i]), bool(flag), int(self.m[i]))
        return s

    def sends(self) -> list[LazySend]:
        return [self.send(i) for i in range(len(self))]


def flat(sends: list) -> list:
    """``sends`` with every ``SendBlock`` in it made its sends."""
    if not any(type(s) is SendBlock for s in sends):
        return sends
    return [x for s in sends for x in (s.sends() if type(s) is SendBlock else (s,))]
