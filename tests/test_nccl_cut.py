"""Messages cut over the QPs of a connection (NCCL <= 2.19, NCCL_IB_QPS_PER_CONNECTION > 1): pieces are
joined only when their PSNs prove them one message (issue 13).

The decoder is fed synthetic pieces of one 2-QP connection: Simple protocol (no flag to check a join),
8192-byte messages cut into two 4096-byte pieces (4 packets each at PMTU 1024), receive slots repeating
every 8 messages as NCCL's do, so message k and message k + 8 have the same size and the same slot.
Each message's bytes are distinct, so a piece joined into the wrong message is visible in the bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from mirrorckpt.parser.roce import nccl_versions
from mirrorckpt.parser.roce.nccl import NcclDecoder
from mirrorckpt.parser.roce.reassembly import QpKey, RdmaMessage

V = "2.18"
SRC, DST = bytes(15) + b"\x01", bytes(15) + b"\x02"
SIZE, PIECE, PKTS, SLOT, NMSG = 8192, 4096, 4, 0x2000, 12
RKEY = 0x1234


def message(k: int) -> np.ndarray:
    return np.random.default_rng(k).integers(0, 256, SIZE, dtype=np.uint8)


def piece(k: int, i: int, ts: int, nqp: int = 2) -> RdmaMessage:
    """QP i's piece of message k (every piece 4 PSNs, so message k starts at PSN 4k on every QP)."""
    chunk = nccl_versions.qp_piece_bytes(SIZE, nqp)
    data = message(k)[i * chunk:(i + 1) * chunk].copy()
    return RdmaMessage(qp=QpKey(SRC, DST, 0x10 + i), sport=50000 + i, psn=k * PKTS, npkts=PKTS, data=data,
                       holes=[], va=0x100000 + (k % 8) * SLOT + i * chunk, rkey=RKEY, dlen=len(data),
                       imm_raw=nccl_versions.encode_imm(SIZE, V), with_imm=True, ts_ns=ts)


def sends_of(batches: list[list[RdmaMessage]]):
    dec = NcclDecoder(V)
    out = []
    for b in batches:
        out += dec.feed(b)
    return dec, out + dec.flush()


def number(s) -> int:
    """The message a send claims to be, from its pieces' PSNs (each message takes 4 PSNs per QP)."""
    ks = {psn // PKTS for _, psn, _ in getattr(s, "pieces", None) or [(s.qp, s.psn, s.npkts)]}
    assert len(ks) == 1, f"one send joined from pieces of messages {sorted(ks)}"
    return ks.pop()


def check(sends) -> dict[int, list]:
    """Every byte a send does not mark as a hole is its message's byte; a send without holes is its whole
    message. Returns the sends by message number."""
    by = {}
    for s in sends:
        assert s.cut and s.size == SIZE and len(s.data) == SIZE and s.wire_bytes == SIZE
        k = number(s)
        ok = np.ones(SIZE, bool)
        for a, n in s.holes:
            ok[a:a + n] = False
        assert (s.data[ok] == message(k)[ok]).all(), f"message {k}: bytes of another message"
        by.setdefault(k, []).append(s)
    return by


def test_clean_pieces_join_into_every_message_once():
    dec, sends = sends_of([[piece(k, i, 10 * k + i) for k in range(NMSG) for i in range(2)]])
    by = check(sends)
    assert sorted(by) == list(range(NMSG)) and all(len(v) == 1 and v[0].complete for v in by.values())
    assert dec.cut_pieces == 2 * NMSG and dec.lone_pieces == dec.lost_pieces == 0


def test_a_lost_piece_never_borrows_the_same_slot_of_another_message():
    """QP 1 loses its piece of message 0 and delivers the rest before QP 0 does (a QP held behind a
    loss). Message 8 has message 0's size and slot: joined by (size, slot), message 0 came out complete
    with message 8's second half (the old decoder). Its PSNs prove QP 1's pieces only once message 0's
    size is known, so they become holes or join their own messages; message 0's second half is a hole."""
    first = [piece(k, 1, 100 + k) for k in range(1, 9)]
    then = [piece(k, 0, 200 + k) for k in range(NMSG)] + [piece(k, 1, 300 + k) for k in range(9, NMSG)]
    dec, sends = sends_of([first + then])  # one batch: both QPs known from the start, in time order
    by = check(sends)
    assert not any(s.complete for s in by[0]), "message 0 lost a piece: it cannot be complete"
    assert by[0][0].holes == [(PIECE, PIECE)]
    # QP 1's later pieces are proven by the PSN gap once the sizes before them are known
    assert all(by[k][-1].complete for k in range(9, NMSG))


@pytest.mark.parametrize("lost", [0, 3, 8])
def test_a_whole_lost_piece_is_a_hole_and_the_next_ones_still_join(lost):
    """QP 1's piece of one message is lost whole, in time order otherwise: the PSN gap is exactly that
    piece (message ``lost``'s size is known from QP 0), so every later message is joined whole."""
    msgs = [piece(k, i, 10 * k + i) for k in range(NMSG) for i in range(2) if (k, i) != (lost, 1)]
    dec, sends = sends_of([msgs])
    by = check(sends)
    assert sorted(by) == list(range(NMSG))
    assert [k for k in by if not any(s.complete for s in by[k])] == [lost]
    assert by[lost][0].holes == [(PIECE, PIECE)]


def test_a_whole_lost_message_leaves_later_pieces_unjoined_not_guessed():
    """Both pieces of message 2 are lost: its size is unknown, so neither QP's PSN gap proves which
    message its next pieces belong to; they are never joined by guess, but sent on alone, each its own
    bytes only (the state machine places them by the plan's sizes). Nothing wrong comes out, and the
    messages before the loss are whole."""
    msgs = [piece(k, i, 10 * k + i) for k in range(NMSG) for i in range(2) if k != 2]
    dec, sends = sends_of([msgs])
    by = check(sends)
    assert all(by[k][0].complete for k in (0, 1))
    assert 2 not in by
    lone = [s for k in by if k > 2 for s in by[k]]
    assert len(lone) == 2 * (NMSG - 3) and all(s.lone_piece and not s.complete for s in lone)


def test_a_piece_seen_before_its_connections_other_qps_is_never_a_whole_send():
    """The first batch holds QP 1's pieces only (QP 0's are late): a WRITE shorter than its immediate is a
    piece, never an 8192-byte send of 4096 bytes (the old decoder sent it on as a complete send, whose
    length then contradicted the plan and got the whole connection rejected)."""
    dec, sends = sends_of([[piece(k, 1, 100 + k) for k in range(4)],
                           [piece(k, 0, 200 + k) for k in range(NMSG)] +
                           [piece(k, 1, 300 + k) for k in range(4, NMSG)]])
    by = check(sends)
    assert sorted(by) == list(range(NMSG))
    assert all(by[k][0].complete for k in range(NMSG))


def test_under_the_2_29_rotation_pieces_after_a_whole_lost_message_are_dropped_not_guessed():
    """NCCL 2.29 with NCCL_IB_SPLIT_DATA_ON_QPS=1 puts piece i of message k on QP (k + i) mod nqps. Once
    message 2 is lost whole, a later piece's message number is unproven, and with it which piece of its
    message it is: it cannot even go on alone with its place known, so it is dropped (counted), never
    joined or placed by guess. (The loss sweep's random trials no longer reach this since reassembly
    gives a lost message up within 4 messages: the PSN gaps prove the pieces there.)"""
    v = "2.29"

    def rotated(k: int, i: int, ts: int) -> RdmaMessage:
        p = piece(k, i, ts)
        q = (k + i) % 2
        return RdmaMessage(qp=QpKey(SRC, DST, 0x10 + q), sport=50000 + q, psn=p.psn, npkts=p.npkts, data=p.data,
                           holes=[], va=p.va, rkey=RKEY, dlen=p.dlen, imm_raw=nccl_versions.encode_imm(SIZE, v),
                           with_imm=True, ts_ns=ts)

    whole = NcclDecoder(v)
    sends = whole.feed([rotated(k, i, 10 * k + i) for k in range(NMSG) for i in range(2)]) + whole.flush()
    assert sorted(check(sends)) == list(range(NMSG)) and all(s.complete for s in sends)
    dec = NcclDecoder(v)
    sends = dec.feed([rotated(k, i, 10 * k + i) for k in range(NMSG) for i in range(2) if k != 2]) + dec.flush()
    by = check(sends)
    assert sorted(by) == [0, 1] and all(s.complete for s in sends)
    assert dec.lost_pieces == 2 * (NMSG - 3) and dec.lone_pieces == 0
