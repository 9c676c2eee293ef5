"""Packet path on the real captures: RoCE decode, ICRC, PSN reassembly, and its robustness.

The robustness cases edit a real capture frame by frame (duplicate, swap, drop, corrupt, PSN
wrap) and check that only the bytes of the packets touched change.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
from common import FLOWCHECK, flowcheck_captures
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser import roce
from mirrorckpt.parser.headers import BTH, IPV6, UDP
from mirrorckpt.parser.roce import _fast, opcodes
from mirrorckpt.parser.roce.reassembly import Reassembler

CAPTURE = FLOWCHECK / "iter_40000_p2p_iter10.pcapng"


def messages(batch: FrameBatch, icrc: bool = True):
    pk, c = roce.decode(batch, icrc=icrc)
    r = Reassembler()
    msgs = r.feed(pk, batch.data) + r.flush()
    return {(str(m.qp), m.psn): m for m in msgs}, r, c


def frames_of(batch: FrameBatch) -> list[bytes]:
    return [batch.frame(i) for i in range(len(batch))]


def rebuild(frames: list[bytes]) -> FrameBatch:
    return FrameBatch.from_frames(frames, "derived")


def reseal(frame: bytes) -> bytes:
    """Recomputes the ICRC of an IPv6 RoCE frame after an edit."""
    data = np.frombuffer(frame, np.uint8).copy()
    ulen = int.from_bytes(frame[14 + 40 + 4:14 + 40 + 6], "big")
    at = 14 + 40 + ulen - 4
    out = np.zeros(1, np.uint32)
    _fast.icrc(data, np.array([14], np.int64), np.array([40], np.int64), np.array([1], np.uint8),
               np.array([at], np.int64), out)
    data[at:at + 4] = np.frombuffer(int(out[0]).to_bytes(4, "little"), np.uint8)
    return data.tobytes()


@pytest.fixture(scope="module")
def base():
    batch = read_all(CAPTURE)
    msgs, _, _ = messages(batch)
    pk, _ = roce.decode(batch)
    return batch, msgs, pk


def data_frames(pk, op):
    return pk.frame[(pk.opcode == op) & (pk.pay_len > 0)]


@pytest.mark.parametrize("name", flowcheck_captures())
def test_counts_and_icrc_equal_truth(truth, name):
    _, c = roce.decode(read_all(FLOWCHECK / name))
    t = truth[name]
    # truth.json writes unknown opcodes in lower case ("roce:0xaa"), the decoder as "0xAA"
    low = lambda d: {k.lower(): v for k, v in d.items() if v}  # noqa: E731
    assert low(c.classes) == low(t["packet_counts"])
    assert low(c.icrc) == low(t["icrc"])
    assert c.icrc_failed == sum(v for k, v in t["icrc"].items() if k.endswith(":BAD"))


@pytest.mark.parametrize("name", flowcheck_captures())
def test_messages_equal_truth(truth, name):
    msgs, _, _ = messages(read_all(FLOWCHECK / name))
    t = truth[name]
    assert len(msgs) == t["messages"]
    assert sorted(m.missing_bytes for m in msgs.values() if not m.complete) == \
        sorted(t["incomplete_message_missing_bytes"])


def test_iter_80000_two_incomplete_and_later_intact():
    msgs, _, _ = messages(read_all(FLOWCHECK / "iter_80000.pcapng"))
    bad = [m for m in msgs.values() if not m.complete]
    assert sorted(m.missing_bytes for m in bad) == [12288, 16512]
    for m in bad:  # incomplete ones are the last data messages of their QP
        later = [o for o in msgs.values() if o.qp == m.qp and o.psn > m.psn]
        assert later == [] or all(o.complete for o in later)


def test_ack_and_probes_are_not_data(base):
    batch, msgs, pk = base
    assert not any(str(k[0]).endswith("qp0x1") for k in msgs)  # UD probes go to QP 1
    assert all(m.data.size == (m.dlen or 0) for m in msgs.values() if m.dlen is not None)


def test_duplicate_packet_changes_nothing(base):
    batch, ref, pk = base
    fr = frames_of(batch)
    i = int(data_frames(pk, opcodes.RC_RDMA_WRITE_MIDDLE)[10])
    got, r, _ = messages(rebuild(fr[: i + 3] + [fr[i]] + fr[i + 3:]))
    assert got.keys() == ref.keys()
    for k in ref:
        assert np.array_equal(got[k].data, ref[k].data) and got[k].holes == ref[k].holes
    assert sum(q.stats.duplicates for q in r.qps.values()) == 1


def test_swapped_packets_change_nothing(base):
    batch, ref, pk = base
    fr = frames_of(batch)
    for i in (int(data_frames(pk, opcodes.RC_RDMA_WRITE_MIDDLE)[5]),
              int(data_frames(pk, opcodes.RC_RDMA_WRITE_FIRST)[3])):
        fr2 = list(fr)
        fr2[i], fr2[i + 1] = fr2[i + 1], fr2[i]
        got, r, _ = messages(rebuild(fr2))
        assert got.keys() == ref.keys()
        assert all(np.array_equal(got[k].data, ref[k].data) and got[k].complete for k in ref)
        assert sum(q.stats.reordered for q in r.qps.values()) >= 1


def _owner(msgs, frame_bytes):
    """The (key, offset) of the message byte range holding this frame's payload."""
    u = 14 + 40
    psn = int.from_bytes(frame_bytes[u + UDP.size + 9:u + UDP.size + 12], "big")
    dqp = int.from_bytes(frame_bytes[u + UDP.size + 5:u + UDP.size + 8], "big")
    for k, m in msgs.items():
        if m.qp.dqp == dqp and m.psn <= psn < m.psn + m.npkts:
            return k, psn - m.psn
    raise AssertionError("no message holds that packet")


@pytest.mark.parametrize("op", [opcodes.RC_RDMA_WRITE_MIDDLE, opcodes.RC_RDMA_WRITE_FIRST,
                                opcodes.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE])
def test_dropped_packet_is_exactly_its_own_hole(base, op):
    batch, ref, pk = base
    fr = frames_of(batch)
    i = int(data_frames(pk, op)[7])
    key, pos = _owner(ref, fr[i])
    got, _, _ = messages(rebuild(fr[:i] + fr[i + 1:]))
    assert got.keys() == ref.keys()
    for k in ref:
        if k != key:
            assert np.array_equal(got[k].data, ref[k].data) and got[k].complete
    m, want = got[key], ref[key]
    pmtu = 1024
    lo, hi = pos * pmtu, min((pos + 1) * pmtu, len(want.data))
    assert m.holes == [(lo, hi - lo)]
    keep = np.ones(len(want.data), bool)
    keep[lo:hi] = False
    assert np.array_equal(m.data[keep], want.data[keep])
    if op == opcodes.RC_RDMA_WRITE_FIRST:
        assert m.va is None and m.dlen is None  # RETH lost with its packet
    else:
        assert m.va == want.va


def test_flipped_payload_byte_fails_icrc_and_becomes_hole(base):
    batch, ref, pk = base
    fr = frames_of(batch)
    i = int(data_frames(pk, opcodes.RC_RDMA_WRITE_MIDDLE)[20])
    key, pos = _owner(ref, fr[i])
    bad = bytearray(fr[i])
    bad[100] ^= 0x40
    got, _, c = messages(rebuild(fr[:i] + [bytes(bad)] + fr[i + 1:]))
    assert c.icrc_failed == 1
    assert got[key].holes == [(pos * 1024, 1024)]
    assert all(got[k].complete for k in ref if k != key)


def test_psn_wraparound(base):
    """Shift one QP's PSNs so they cross 2**24; the messages must come out the same."""
    batch, ref, pk = base
    fr = frames_of(batch)
    sel = (pk.dqp == 0x672) & pk.has_reth | (pk.dqp == 0x672)
    shift = (1 << 24) - 300
    out = list(fr)
    for i in pk.frame[sel & opcodes.IS_WRITE[pk.opcode]].tolist():
        f = bytearray(fr[i])
        at = 14 + IPV6.size + UDP.size + BTH["psn"].offset
        psn = (int.from_bytes(f[at:at + 3], "big") + shift) % (1 << 24)
        f[at:at + 3] = psn.to_bytes(3, "big")
        out[i] = reseal(bytes(f))
    got, r, c = messages(rebuild(out))
    assert c.icrc_failed == 0
    shifted = {k: m for k, m in got.items() if m.qp.dqp == 0x672}
    orig = sorted((m for m in ref.values() if m.qp.dqp == 0x672), key=lambda m: m.psn)
    new = sorted(shifted.values(), key=lambda m: m.psn)
    assert len(new) == len(orig)
    assert all(np.array_equal(a.data, b.data) and b.complete for a, b in zip(orig, new))


def test_truncated_frames_are_counted_not_decoded(base):
    batch, ref, pk = base
    fr = frames_of(batch)
    i = int(data_frames(pk, opcodes.RC_RDMA_WRITE_MIDDLE)[3])
    wl = [len(f) for f in fr]
    cut = fr[:i] + [fr[i][:200]] + fr[i + 1:]
    b = FrameBatch.from_frames(cut, "cut", wirelen=wl)
    got, _, c = messages(b)
    assert c.truncated_frames == 1
    key, pos = _owner(ref, fr[i])
    assert got[key].holes == [(pos * 1024, 1024)]


def _icrc_reference(ip: bytes, v6: bool) -> int:
    """The ICRC from the annex's text, through Python's zlib: masked IP/UDP/BTH, then the rest."""
    hl = 40 if v6 else (ip[0] & 15) * 4
    m = bytearray(ip)
    for i in ((0, 1, 2, 3, 7) if v6 else (1, 8, 10, 11)):
        m[i] = 0xFF
    if v6:
        m[0] = ip[0] | 0x0F  # keep the version nibble
    m[hl + 6] = m[hl + 7] = m[hl + 8 + 4] = 0xFF  # UDP checksum, BTH resv8a
    return zlib.crc32(b"\xff" * 8 + bytes(m))


def test_icrc_equals_an_independent_crc32():
    """Whatever CRC-32 the build links (roce.ICRC_BACKEND), it is the annex's ICRC: random IPv4 (with
    and without options) and IPv6 packets, payloads of 0 to 9000 bytes, every length mod 16."""
    rng = np.random.default_rng(16)
    lens = np.concatenate([np.arange(0, 64), rng.integers(64, 9001, 200)])
    bufs, ip_off, ip_hlen, v6s, icrc_off, want = [], [], [], [], [], []
    at = 0
    for k, n in enumerate(lens.tolist()):
        v6 = k % 3 == 0
        hl = 40 if v6 else 4 * int(rng.integers(5, 16))
        ip = bytearray(rng.integers(0, 256, hl + 8 + 12 + n, dtype=np.uint8).tobytes())
        if not v6:
            ip[0] = 0x40 | (hl // 4)
        pre = int(rng.integers(0, 20))  # unaligned starts
        bufs.append(bytes(pre) + bytes(ip) + bytes(4))
        ip_off.append(at + pre)
        ip_hlen.append(hl)
        v6s.append(v6)
        icrc_off.append(at + pre + len(ip))
        want.append(_icrc_reference(bytes(ip), v6))
        at += len(bufs[-1])
    data = np.frombuffer(b"".join(bufs), np.uint8).copy()
    got = np.zeros(len(lens), np.uint32)
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    _fast.icrc(data, i64(ip_off), i64(ip_hlen), np.array(v6s, np.uint8), i64(icrc_off), got)
    assert got.tolist() == want
    for k, w in enumerate(want):  # the check reads the stored ICRC little-endian
        data[icrc_off[k]:icrc_off[k] + 4] = np.frombuffer(w.to_bytes(4, "little"), np.uint8)
    data[icrc_off[5] - 1] ^= 1
    ok = np.zeros(len(lens), np.uint8)
    _fast.icrc_check(data, i64(ip_off), i64(ip_hlen), np.array(v6s, np.uint8), i64(icrc_off), ok)
    assert ok.tolist() == [k != 5 for k in range(len(lens))]


def test_icrc_uses_isal_where_it_is_installed():
    """setup.py links ISA-L when libisal-dev is there (tools/install-system-deps.sh installs it); a
    build that missed it must be rebuilt, not pass silently at a fraction of the speed."""
    import os

    installed = Path("/usr/include/isa-l/crc.h").is_file() and os.environ.get("MIRRORCKPT_ICRC") != "zlib"
    assert roce.ICRC_BACKEND == ("isa-l" if installed else "zlib")
    assert (roce.SLOW_ICRC is None) == (roce.ICRC_BACKEND == "isa-l")


def test_replay_and_serve_say_when_the_icrc_is_slow(monkeypatch, tmp_path):
    """A build on zlib's crc32 is told at start-up: replay (unless --no-icrc) and serve."""
    import logging

    from click.testing import CliRunner
    from mirrorckpt.tools import cmd_replay
    from mirrorckpt.tools.cli import main

    monkeypatch.setattr(cmd_replay, "SLOW_ICRC", "the ICRC is slow here")
    for extra, warned in (([], True), (["--no-icrc"], False)):
        res = CliRunner().invoke(main, ["replay", "--json", str(CAPTURE), *extra])
        assert res.exit_code == 0 and ("warning: the ICRC is slow here" in res.stderr) == warned
    monkeypatch.setattr(roce, "SLOW_ICRC", "the ICRC is slow here")
    bad = tmp_path / "job.toml"
    bad.write_text("[ring]\n")  # the warning comes before the configuration is read
    log = logging.getLogger("mirrorckpt")
    monkeypatch.setattr(log, "handlers", list(log.handlers))  # serve sets up its own; undone after
    monkeypatch.setattr(log, "propagate", log.propagate)
    res = CliRunner().invoke(main, ["serve", "--config", str(bad)])
    assert res.exit_code == 2 and '"the ICRC is slow here"' in res.stderr


@pytest.mark.parametrize("name", ["demo", "ll_r2_noise_faults", "simple_r3_both", "ll128_bf16_v229"])
def test_ll_read_by_the_decode_is_the_ll_kernels_reading(name):
    """decode(ll=True) reads every WRITE payload of whole LL lines as protocols.ll_intact reads it:
    its flag (0: not intact LL) and its data words at llu[pay_off // 2]; any other packet's flag is
    0, and every other column is what decode gives without it."""
    from common import PCAPS
    from mirrorckpt.parser.roce import protocols

    read = 0
    for path in sorted((PCAPS / name).glob("*.pcap*")):
        b = read_all(path)
        pk, plain = roce.decode(b, ll=True)[0], roce.decode(b)[0]
        for k in plain.__dataclass_fields__:
            if k not in ("llf", "llu"):
                assert np.array_equal(getattr(pk, k), getattr(plain, k)), k
        assert plain.llf is None and len(pk.llf) == len(pk)
        for r in range(len(pk)):
            po, pl = int(pk.pay_off[r]), int(pk.pay_len[r])
            want = None
            if opcodes.IS_WRITE[pk.opcode[r]] and pl and pl % 16 == 0:
                want = protocols.ll_intact(b.data[po:po + pl])
            assert int(pk.llf[r]) == (want[1] if want else 0)
            if want:
                assert np.array_equal(pk.llu[po // 2:po // 2 + pl // 2], want[0])
                read += 1
    assert (read > 100) == name.startswith(("demo", "ll_"))
