"""NCCL payload formats: LL (16-byte lines), LL128 (2048-byte groups) and Simple (raw bytes).

Whole messages are encoded and decoded at once with numpy; a damaged line is reported, never
guessed, and ``holes`` turns bad lines into byte ranges of user data. Layouts: doc section 5
(/work/shared/docs/nccl-ring-schedule.md), the LL line table ``headers.LL_LINE``; the LL128
permutation below was derived in the doc from NCCL's prims_ll128.h register logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mirrorckpt.parser.headers import (
    LL128_FLAG_OFFSET,
    LL128_GROUP_DATA,
    LL128_GROUP_WIRE,
    LL128_LINE_BYTES,
    LL_DATA_PER_LINE,
    LL_LINE,
    LL_LINE_BYTES,
)
from mirrorckpt.parser.roce import _place
from mirrorckpt.parser.roce.nccl_versions import LL, LL128, SIMPLE, protocol

_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")
# LL line words, in units of u32, read from the header table (no offsets repeated here).
_LO, _F1, _HI, _F2 = (LL_LINE[n].offset // 4 for n in ("data_lo", "flag1", "data_hi", "flag2"))
_LINES_PER_GROUP = LL128_GROUP_WIRE // LL128_LINE_BYTES  # 16
_FLAG_WORD = LL128_FLAG_OFFSET // 8  # 15


def _div_up(a, b):
    return -(-a // b)


def wire_bytes(proto: str, nbytes):
    """Wire size of a message carrying ``nbytes`` user bytes (scalar or array).

    LL ``divUp(n,8)*16``, LL128 ``divUp(n,1920)*2048``, Simple ``n`` (doc 4.1)."""
    proto = protocol(proto)
    if proto == LL:
        return _div_up(nbytes, LL_DATA_PER_LINE) * LL_LINE_BYTES
    if proto == LL128:
        return _div_up(nbytes, LL128_GROUP_DATA) * LL128_GROUP_WIRE
    return nbytes


def unit_bytes(proto: str) -> int:
    """Wire bytes of the protocol's unit (LL line, LL128 group, Simple byte)."""
    return {LL: LL_LINE_BYTES, LL128: LL128_GROUP_WIRE, SIMPLE: 1}[protocol(proto)]


def unit_data(proto: str) -> int:
    """User bytes one unit carries."""
    return {LL: LL_DATA_PER_LINE, LL128: LL128_GROUP_DATA, SIMPLE: 1}[protocol(proto)]


def data_bytes(proto: str, wire_len: int) -> int:
    """Most user bytes a message of ``wire_len`` wire bytes can carry (its exact size for Simple)."""
    proto = protocol(proto)
    unit, data = unit_bytes(proto), unit_data(proto)
    if wire_len % unit:
        raise ValueError(f"{proto} message of {wire_len} wire bytes is not a multiple of {unit}")
    return wire_len // unit * data


def bad_ranges(ok: np.ndarray) -> list[tuple[int, int]]:
    """Runs of False in a boolean mask as [(start, length)] (vectorised)."""
    bad = np.concatenate(([False], ~np.asarray(ok, dtype=bool), [False]))
    edges = np.flatnonzero(bad[1:] != bad[:-1])
    starts, ends = edges[0::2], edges[1::2]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def _as_bytes(data) -> np.ndarray:
    a = np.asarray(data)
    if a.dtype != np.uint8:
        a = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    return a.reshape(-1)


def _majority(values: np.ndarray, ok: np.ndarray):
    """Most common value among ``values[ok]`` (ties: the smallest), or None."""
    cand = values[ok]
    if cand.size == 0:
        return None
    if (cand == cand[0]).all():  # the usual case: one flag in the whole message
        return int(cand[0])
    uniq, counts = np.unique(cand, return_counts=True)
    return int(uniq[np.argmax(counts)])


# --- LL ------------------------------------------------------------------------------------------


@dataclass
class LLDecoded:
    data: np.ndarray  # uint8 user bytes (bytes of invalid lines are whatever the wire held)
    line_ok: np.ndarray  # bool per 16-byte line: both flags equal and equal to `flag`
    flag: int | None  # expected flag, or the majority flag of self-consistent lines

    @property
    def holes(self) -> list[tuple[int, int]]:
        """User byte ranges [(start, length)] carried by invalid lines."""
        if self.line_ok.all():
            return []
        byte_ok = np.repeat(self.line_ok, LL_DATA_PER_LINE)[: self.data.size]
        return bad_ranges(byte_ok)


def ll_encode(data, flag: int) -> np.ndarray:
    """User bytes -> LL wire bytes: ``divUp(n,8)`` lines of {lo, flag, hi, flag}; tail bytes zero."""
    raw = _as_bytes(data)
    nlines = _div_up(raw.size, LL_DATA_PER_LINE)
    padded = np.zeros(nlines * LL_DATA_PER_LINE, np.uint8)
    padded[: raw.size] = raw
    words = padded.view(_U32).reshape(nlines, 2)
    lines = np.empty((nlines, LL_LINE_BYTES // 4), _U32)
    lines[:, _LO], lines[:, _HI] = words[:, 0], words[:, 1]
    lines[:, _F1] = lines[:, _F2] = flag & 0xFFFFFFFF
    return lines.view(np.uint8).reshape(-1)


def ll_decode(wire, nbytes: int | None = None, expect_flag: int | None = None) -> LLDecoded:
    """LL wire bytes -> user bytes and per-line validity (flags equal and equal the expected or
    majority flag). ``nbytes`` (default: every line's 8 bytes) trims the last line's tail."""
    raw = _as_bytes(wire)
    if raw.size % LL_LINE_BYTES:
        raise ValueError(f"LL message of {raw.size} bytes is not a whole number of {LL_LINE_BYTES}-byte lines")
    nlines = raw.size // LL_LINE_BYTES
    cap = nlines * LL_DATA_PER_LINE
    if nbytes is None:
        nbytes = cap
    if nbytes > cap:
        raise ValueError(f"LL message of {nlines} lines carries at most {cap} bytes, not {nbytes}")
    lines = np.ascontiguousarray(raw).view(_U32).reshape(nlines, LL_LINE_BYTES // 4)
    f1, f2 = lines[:, _F1], lines[:, _F2]
    ok = f1 == f2
    flag = (expect_flag & 0xFFFFFFFF) if expect_flag is not None else _majority(f1, ok)
    ok &= f1 == (flag if flag is not None else 0)
    if flag is None:
        ok[:] = False
    data = np.stack([lines[:, _LO], lines[:, _HI]], axis=1).view(np.uint8).reshape(-1)[:nbytes]
    return LLDecoded(data, ok, flag)


# --- LL128 ------------------------------------------------------------------------------------


def _ll128_layout() -> tuple[np.ndarray, np.ndarray]:
    """Wire position (in a 2048-byte group) of each of the 1920 data bytes, and its line.

    Doc 5.2: each half-group of 8 lines carries 960 data bytes; lines 0-3 hold data [128L, 128L+120)
    in words 0-14; lines 4-7 hold data [512+112q, 624+112q) in words 0-13 and the 8-byte tail
    [128q+120, 128q+128) of line q in word 14; word 15 of every line is the flag."""
    half = np.empty(LL128_GROUP_DATA // 2, np.int64)
    head = np.arange(120)
    for q in range(4):
        half[128 * q + head] = 128 * q + head  # line q, words 0-14
        half[128 * q + 120 + np.arange(8)] = 128 * (4 + q) + 112 + np.arange(8)  # line 4+q, word 14
        half[512 + 112 * q + np.arange(112)] = 128 * (4 + q) + np.arange(112)  # line 4+q, words 0-13
    pos = np.concatenate([half, half + LL128_GROUP_WIRE // 2])
    assert np.unique(pos).size == LL128_GROUP_DATA and not np.any(pos % LL128_LINE_BYTES >= LL128_FLAG_OFFSET)
    return pos, pos // LL128_LINE_BYTES


LL128_DATA_POS, LL128_DATA_LINE = _ll128_layout()


@dataclass
class LL128Decoded:
    data: np.ndarray  # uint8 user bytes
    line_ok: np.ndarray  # bool per 128-byte line (16 per group), flag equal to `flag`
    flag: int | None

    @property
    def holes(self) -> list[tuple[int, int]]:
        """User byte ranges carried by invalid lines (a line's bytes are not contiguous in data)."""
        if self.line_ok.all():
            return []
        groups = self.line_ok.reshape(-1, _LINES_PER_GROUP)
        byte_ok = groups[:, LL128_DATA_LINE].reshape(-1)[: self.data.size]
        return bad_ranges(byte_ok)


def ll128_encode(data, flag: int) -> np.ndarray:
    """User bytes -> LL128 wire bytes: ``divUp(n,1920)`` groups, flag ``t+1`` in word 15 of each line."""
    raw = _as_bytes(data)
    ngroups = _div_up(raw.size, LL128_GROUP_DATA)
    padded = np.zeros(ngroups * LL128_GROUP_DATA, np.uint8)
    padded[: raw.size] = raw
    wire = np.zeros((ngroups, LL128_GROUP_WIRE), np.uint8)
    wire[:, LL128_DATA_POS] = padded.reshape(ngroups, LL128_GROUP_DATA)
    words = wire.view(_U64).reshape(ngroups, _LINES_PER_GROUP, LL128_LINE_BYTES // 8)
    words[:, :, _FLAG_WORD] = np.uint64(flag)
    return wire.reshape(-1)


def ll128_decode(wire, nbytes: int | None = None, expect_flag: int | None = None) -> LL128Decoded:
    """LL128 wire bytes -> user bytes and per-line validity (flag equal to expected or majority)."""
    raw = _as_bytes(wire)
    if raw.size % LL128_GROUP_WIRE:
        raise ValueError(f"LL128 message of {raw.size} bytes is not a whole number of {LL128_GROUP_WIRE}-byte groups")
    ngroups = raw.size // LL128_GROUP_WIRE
    cap = ngroups * LL128_GROUP_DATA
    if nbytes is None:
        nbytes = cap
    if nbytes > cap:
        raise ValueError(f"LL128 message of {ngroups} groups carries at most {cap} bytes, not {nbytes}")
    groups = np.ascontiguousarray(raw).reshape(ngroups, LL128_GROUP_WIRE)
    flags = groups.view(_U64).reshape(ngroups * _LINES_PER_GROUP, LL128_LINE_BYTES // 8)[:, _FLAG_WORD]
    flag = expect_flag if expect_flag is not None else _majority(flags, np.ones(flags.size, bool))
    ok = flags == np.uint64(flag) if flag is not None else np.zeros(flags.size, bool)
    data = groups[:, LL128_DATA_POS].reshape(-1)[:nbytes]
    return LL128Decoded(data, ok, flag)


def _runs(pos: np.ndarray) -> np.ndarray:
    """(wire offset, data offset, length) of each run of consecutive positions in a group."""
    brk = np.flatnonzero(np.diff(pos) != 1) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [pos.size]])
    return np.ascontiguousarray(np.stack([pos[starts], starts, ends - starts], axis=1), np.int64)


LL128_RUNS = _runs(LL128_DATA_POS)  # 24 copies a group instead of 1920 gathers


LL_INTACT_ARGS = (LL_LINE_BYTES, _LO * 4, _F1 * 4, _HI * 4, _F2 * 4)  # the LL kernels' line layout


def ll_intact(wire: np.ndarray) -> tuple[np.ndarray, int] | None:
    """An LL message whose every line carries the same non-zero flag twice: (user bytes, flag),
    in one compiled pass; None otherwise (``ll_decode`` then says which lines are bad)."""
    out = np.empty(wire.size // LL_LINE_BYTES * LL_DATA_PER_LINE, np.uint8)
    f = _place.ll_intact(wire, out, *LL_INTACT_ARGS)
    return (out, f) if f else None


def ll128_intact(wire: np.ndarray) -> tuple[np.ndarray, int] | None:
    """An LL128 message whose every line carries the same flag (positive as int64): (user bytes,
    flag), in one compiled pass; None otherwise."""
    out = np.empty(wire.size // LL128_GROUP_WIRE * LL128_GROUP_DATA, np.uint8)
    f = _place.ll128_intact(wire, out, LL128_LINE_BYTES, LL128_FLAG_OFFSET, LL128_GROUP_WIRE, LL128_RUNS,
                            LL128_GROUP_DATA)
    return (out, f) if f else None




def ll128_intact_pieces(src: np.ndarray, src_off: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, int] | None:
    """``ll128_intact`` of a message still in its packets (``length[r]`` bytes at
    src[src_off[r]:], end to end), read where they lie: (user bytes, flag), or None."""
    total = int(length.sum())
    out = np.empty(total // LL128_GROUP_WIRE * LL128_GROUP_DATA, np.uint8)
    scratch = np.empty(LL128_GROUP_WIRE, np.uint8)  # a group cut by a packet's end, put together
    f = _place.gather_ll128(src, np.ascontiguousarray(src_off, np.int64), np.ascontiguousarray(length, np.int64),
                            out, scratch, LL128_LINE_BYTES, LL128_FLAG_OFFSET, LL128_GROUP_WIRE, LL128_RUNS,
                            LL128_GROUP_DATA)
    return (out, f) if f else None


def decode_intact(wire: np.ndarray, proto: str | None) -> tuple[str, np.ndarray, int | None] | None:
    """The common case of a send without lost bytes, detected (``proto`` None: LL, then LL128, else
    Simple, as ``nccl.detect``) and decoded in one pass: (protocol, user bytes, flag). None when a
    line is damaged or its flag differs: the careful path decides."""
    wire = np.ascontiguousarray(_as_bytes(wire))
    if proto == SIMPLE:
        return SIMPLE, wire, None
    if proto in (None, LL) and wire.size % LL_LINE_BYTES == 0:
        got = ll_intact(wire)
        if got is not None:
            return LL, got[0], got[1]
        if proto == LL:
            return None
    if proto in (None, LL128) and wire.size % LL128_GROUP_WIRE == 0:
        got = ll128_intact(wire)
        if got is not None:
            return LL128, got[0], got[1]
        if proto == LL128:
            return None
    # With no hole, detection calls a message LL or LL128 only when every line agrees: Simple.
    return None if proto is not None else (SIMPLE, wire, None)


# --- Simple -------------------------------------------------------------------------------------


def simple_encode(data) -> np.ndarray:
    """Simple messages are the user bytes themselves."""
    return _as_bytes(data)


def simple_decode(wire) -> np.ndarray:
    return _as_bytes(wire)


def encode(proto: str, data, flag: int = 0) -> np.ndarray:
    """Wire bytes of one message of ``proto`` (flag ignored for Simple)."""
    proto = protocol(proto)
    if proto == LL:
        return ll_encode(data, flag)
    if proto == LL128:
        return ll128_encode(data, flag)
    return simple_encode(data)
