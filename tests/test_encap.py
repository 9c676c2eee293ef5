"""Mirror encapsulations taken off in the compiled frame walk (parser.encap, parser/_walk.pxi), the
mirror health they show, and their configuration.

Every case starts from a generated job's own frames (RoCE data, ACKs, CTS posts; ARP, PTP, TCP
noise), wrapped by tools.generator.encap as a switch would: ERSPAN I/II/III, GRE/gretap, a
vendor header, VXLAN, over IPv4 and IPv6 underlays, with 0-2 VLAN tags outside and inside.
"""

from __future__ import annotations

import numpy as np
import pytest
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.config.jobfile import ConfigError, parse_job
from mirrorckpt.parser import _inner, encap, roce
from mirrorckpt.parser.gloo import tcp
from mirrorckpt.parser.headers import ETH, GRE, GRE_PROTO_ERSPAN, IPV4, VLAN
from mirrorckpt.parser.roce import split
from mirrorckpt.tools.generator.encap import EncapOptions, Encapsulator
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.generator.noise import NoiseOptions

KINDS = ("erspan1", "erspan2", "erspan3", "gre", "gretap", "vxlan", "vendor:0x8949:22")
TAGS = ((), (0,), (5, 7))  # none, a priority-only tag, QinQ
FIELDS = ("frame", "src", "dst", "sport", "opcode", "pad", "dqp", "psn", "ackreq", "va", "rkey", "dlen",
          "has_reth", "has_imm", "imm_raw", "syndrome", "msn", "pay_len", "icrc_ok")


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> FrameBatch:
    d = tmp_path_factory.mktemp("encap")
    generate(GenConfig(ranks=2, model="linear:3000", steps=2, seed=4, mirrors="0:both",
                       noise=NoiseOptions(frozenset({"arp", "ptp", "tcp", "probes"}), rate_hz=20000.0)), d)
    return read_all(d / "rank0_both.pcapng")


def wrap(b: FrameBatch, kind: str, **kw) -> FrameBatch:
    return Encapsulator(EncapOptions(kind=kind, **kw)).wrap_batch(b)


def tagged(b: FrameBatch, inner: tuple[int, ...]) -> FrameBatch:
    """The frames with VLAN tags put in (a mirror port of tagged traffic), not encapsulated."""
    return wrap(b, "none", inner_vlan=inner) if inner else b


def payloads(b: FrameBatch, pk: roce.RocePackets) -> list[bytes]:
    return [b.data[o:o + n].tobytes() for o, n in zip(pk.pay_off.tolist(), pk.pay_len.tolist())]


def same_decode(got: tuple, want: tuple) -> None:
    (gb, gp, gc), (wb, wp, wc) = got, want
    assert len(gp) == len(wp) > 100
    for f in FIELDS:
        assert np.array_equal(getattr(gp, f), getattr(wp, f)), f
    assert payloads(gb, gp) == payloads(wb, wp)
    assert gc.classes == wc.classes and gc.icrc == wc.icrc and gc.malformed == wc.malformed


def decoded(b: FrameBatch, spec: EncapSpec | None = None) -> tuple:
    pk, c = roce.decode(b, encapsulation=spec)
    return b, pk, c


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("underlay", ["ipv4", "ipv6"])
def test_every_variant_decodes_as_the_bare_frames(bare, kind, underlay):
    """Every encapsulation, 0/1/2 tags outside x 0/1/2 inside: the same packets, payloads, ICRC
    verdicts and classes (ARP, PTP, TCP noise too) as the bare frames with the inner tags; the flow
    ports the split reads are the bare frames' too."""
    for inner in TAGS:
        want = decoded(tagged(bare, inner))
        ports = split.flow_ports(want[0])
        for outer in TAGS:
            b = wrap(bare, kind, ipv6=underlay == "ipv6", outer_vlan=outer, inner_vlan=inner, platform=bool(outer))
            got = decoded(b)
            same_decode(got, want)
            name = "gretap" if kind == "gre" else "gre_vendor" if kind.startswith("vendor") else kind
            assert got[2].mirror.encapsulated == {name: len(bare)}
            assert got[2].mirror.lost == 0 and got[2].mirror.truncated == 0
            assert np.array_equal(split.flow_ports(b), ports)


def test_a_vendor_header_is_taken_off_as_configured(bare):
    """A GRE protocol and header length of another ASIC: only when the job file names them."""
    b = wrap(bare, "vendor:0x1234:12", outer_vlan=(3,))
    spec = EncapSpec(gre_protocol=0x1234, gre_header_bytes=12)
    same_decode(decoded(b, spec), decoded(bare))
    _, pk, c = decoded(b)
    assert len(pk) == 0 and c.classes["gre_other"] == len(bare)
    assert EncapSpec.from_capture(parse_job({"ring": {"nranks": 2}, "capture": {
        "gre_protocol": 0x1234, "gre_header_bytes": 12}}).capture) == spec


def test_a_pinned_encapsulation_takes_off_only_that_one(bare):
    """``encapsulation = "none"`` (a local SPAN port) decodes nothing inside GRE or VXLAN and says
    what it saw; a pin to one kind leaves the others alone; VXLAN on a port of its own."""
    erspan, vxlan = wrap(bare, "erspan2"), wrap(bare, "vxlan")
    _, pk, c = decoded(erspan, EncapSpec("none"))
    assert len(pk) == 0 and c.classes["gre_other"] == len(bare) and not c.mirror.encapsulated
    _, pk, c = decoded(vxlan, EncapSpec("none"))
    assert len(pk) == 0 and c.classes["udp_other"] == len(bare)
    assert len(decoded(erspan, EncapSpec("vxlan"))[1]) == 0
    assert len(decoded(vxlan, EncapSpec("erspan"))[1]) == 0
    assert len(decoded(wrap(bare, "gretap"), EncapSpec("erspan"))[1]) == 0
    same_decode(decoded(erspan, EncapSpec("erspan")), decoded(bare))
    same_decode(decoded(wrap(bare, "gre"), EncapSpec("gre")), decoded(bare))
    moved = wrap(bare, "vxlan", vxlan_port=8472)
    assert len(decoded(moved)[1]) == 0
    same_decode(decoded(moved, EncapSpec("vxlan", vxlan_port=8472)), decoded(bare))
    # bare frames decode under every pin
    for mode in ("none", "erspan", "gre", "vxlan"):
        same_decode(decoded(bare, EncapSpec(mode)), decoded(bare))


@pytest.mark.parametrize("kind", ["erspan2", "erspan3", "gretap"])
def test_sequence_gaps_are_the_frames_lost_on_the_way(bare, kind):
    """Frames lost after the switch numbered them leave gaps: the loss is exact, per session (two
    ports' sessions interleaved), across batches; a late frame is not lost, a repeated one counted
    as such, and a session that starts numbering over is not a loss of 4 billion frames."""
    rng = np.random.default_rng(2)
    a, b = wrap(bare, kind, session=3), wrap(bare, kind, session=4)
    frames = [(t, a.frame(i)) for i, t in enumerate(a.ts_ns.tolist())] + \
             [(t + 1, b.frame(i)) for i, t in enumerate(b.ts_ns.tolist())]
    frames = [f for _, f in sorted(frames, key=lambda x: x[0])]
    lost = sorted(rng.choice(np.arange(1, len(frames) - 1), 40, replace=False).tolist())
    kept = [f for i, f in enumerate(frames) if i not in set(lost)]
    kept.insert(100, kept[100])  # a duplicate
    kept[200], kept[201] = kept[201], kept[200]  # two frames swapped (of one session or two)
    batch = FrameBatch.from_frames(kept)
    c = roce.Counters()
    for part in batch.split_at([37, 150, 151, 300]):
        roce.decode(part, into=c)
    sessions = {s["session"]: s for s in c.mirror.sessions()}
    name = {"erspan2": "erspan2 10.99.0.1>10.99.0.2 session {}", "erspan3": "erspan3 10.99.0.1>10.99.0.2 session {}",
            "gretap": "gretap 10.99.0.1>10.99.0.2 key {}"}[kind]
    assert set(sessions) == {name.format(3), name.format(4)}
    assert c.mirror.lost == 40 == sum(s["lost"] for s in sessions.values())
    assert sum(s["duplicate"] for s in sessions.values()) == 1
    assert sum(s["late"] for s in sessions.values()) <= 1
    assert sum(s["frames"] for s in sessions.values()) == len(kept)
    restart = wrap(bare, kind, session=3)  # numbered from 1 again after the first session's end
    roce.decode(restart, into=c)
    assert c.mirror.lost == 40 and sessions[name.format(3)]["restarts"] == 0
    assert {s["session"]: s["restarts"] for s in c.mirror.sessions()}[name.format(3)] == 1


def test_sessions_beyond_the_table_are_counted_untracked(bare):
    one = bare.select(slice(0, 3))
    parts = [wrap(one, "erspan2", session=s) for s in range(encap.MAX_SESSIONS + 5)]
    c = roce.Counters()
    for p in parts:
        roce.decode(p, into=c)
    assert len(c.mirror.sessions()) == encap.MAX_SESSIONS
    assert c.mirror.count("sessions_untracked") == 5 * 3
    assert any("not checked for loss" in line for line in c.mirror.lines())


@pytest.mark.parametrize("kind", ["erspan2", "erspan3", "vxlan", "none"])
def test_a_truncating_mirror_is_counted_named_and_never_decoded(bare, kind):
    """A session MTU below the frames: ERSPAN sets its T bit; every cut RoCE packet is a frame
    shorter than its IP header, never decoded as a packet; the advice names the switch setting."""
    b = wrap(bare, kind, mirror_mtu=300)
    _, pk, c = decoded(b)
    long_ = int((tagged(bare, ()).caplen > 300).sum())
    assert long_ > 50
    assert c.classes["mirror_truncated"] == c.mirror.cut > 0
    assert c.mirror.truncated == long_ if kind.startswith("erspan") else c.mirror.truncated == c.mirror.cut
    assert c.mirror.count("erspan_truncated") == (long_ if kind.startswith("erspan") else 0)
    assert len(pk) == len(decoded(bare)[1]) - c.mirror.cut  # every cut RoCE packet, and no other, is left out
    assert all(n <= 300 for n in pk.pay_len.tolist())
    advice = encap.truncation_advice(c.mirror)
    assert "can never be followed" in advice and "mtu" in advice
    assert encap.truncation_advice(decoded(bare)[2].mirror) is None


def test_damaged_encapsulations_are_counted_never_read_past(bare):
    """Every variant's frames cut at every length and with any header byte changed: the walk
    never fails or reads past a frame, every frame lands in one class, the TCP path and the
    split's ports walk them alike."""
    rng = np.random.default_rng(5)
    src = bare.select(np.flatnonzero(bare.caplen < 200)[:6])
    frames = []
    for kind in KINDS:
        for v6 in (False, True):
            w = wrap(src, kind, ipv6=v6, outer_vlan=(9,), inner_vlan=(0,), platform=True)
            for i in range(len(w)):
                f = w.frame(i)
                frames += [f[:n] for n in range(0, len(f), 3)]
                for _ in range(30):
                    bent = bytearray(f)
                    bent[rng.integers(0, min(len(f), 120))] = int(rng.integers(256))
                    frames.append(bytes(bent))
    b = FrameBatch.from_frames(frames)
    for ll in (False, True):
        pk, c = roce.decode(b, ll=ll)
        total = sum(c.classes.values()) + sum(c.malformed.values())
        assert total == len(b)
    assert c.malformed["bad_gre"] and c.malformed["bad_erspan_version"] and c.malformed["bad_vxlan"]
    assert c.classes["gre_other"] and c.classes["mirror_truncated"]  # a GRE protocol bent; frames cut
    # an outer packet that ends inside the GRE or ERSPAN header it announces
    f = bytearray(wrap(src.select([0]), "erspan2").frame(0))
    for ip_len, why in ((IPV4.size + 6, "short_gre"), (IPV4.size + 8 + 4, "short_erspan")):
        f[ETH.size + IPV4["total_len"].offset:ETH.size + IPV4["total_len"].offset + 2] = ip_len.to_bytes(2, "big")
        assert roce.decode(FrameBatch.from_frames([bytes(f[:ETH.size + ip_len])]))[1].malformed == {why: 1}
    ports = split.flow_ports(b)
    assert np.array_equal(ports[pk.frame], pk.sport)
    segs, tc = tcp.decode(b)
    assert tc.frames == len(b)
    # the walk stays inside each frame: the same frames at the end of a buffer that ends there
    for f in frames[::97]:
        roce.decode(FrameBatch.from_frames([f]), ll=True)
        split.flow_ports(FrameBatch.from_frames([f]))


def test_tcp_segments_are_read_through_the_encapsulation(bare):
    """The TCP path (gloo's transport) takes the mirrored frames from the same walk."""
    want, _ = tcp.decode(bare)
    for kind in ("erspan2", "vxlan", "gre"):
        b = wrap(bare, kind, outer_vlan=(1,), inner_vlan=(2,))
        health = encap.MirrorHealth()
        got, c = tcp.decode(b, mirror=health)
        assert len(got) == len(want) > 5
        for f in ("frame", "src", "dst", "sport", "dport", "seq", "ack", "flags", "pay_len"):
            assert np.array_equal(getattr(got, f), getattr(want, f)), (kind, f)
        assert sum(health.encapsulated.values()) == len(bare)
        assert len(tcp.decode(b, EncapSpec("none"))[0]) == 0


@pytest.mark.parametrize("capture, message", [
    ({"encapsulation": "geneve"}, "[capture] encapsulation: expected one of auto, none, erspan, gre, vxlan"),
    ({"vxlan_port": 70000}, "[capture] vxlan_port: expected a UDP port 1..65535"),
    ({"encapsulation": "erspan", "vxlan_port": 8472}, "[capture] vxlan_port: applies with encapsulation"),
    ({"gre_protocol": 0x8949}, "[capture] gre_protocol: needs gre_header_bytes too"),
    ({"gre_header_bytes": 22}, "[capture] gre_header_bytes: needs gre_protocol too"),
    ({"gre_protocol": 0x18949, "gre_header_bytes": 22}, "[capture] gre_protocol: expected a 16-bit"),
    ({"gre_protocol": 0x8949, "gre_header_bytes": 500}, "[capture] gre_header_bytes: expected 0..128"),
    ({"encapsulation": "vxlan", "gre_protocol": 1, "gre_header_bytes": 2}, "[capture] gre_protocol: applies"),
])
def test_the_job_files_encapsulation_keys_are_checked(capture, message):
    with pytest.raises(ConfigError) as e:
        parse_job({"ring": {"nranks": 2}, "capture": capture}, "job.toml")
    assert str(e.value).startswith(f"job.toml: {message}"), str(e.value)


def test_a_port_the_walk_owns_is_refused():
    with pytest.raises(ConfigError, match=r"\[capture\] vxlan_port: 4791 is RoCEv2's own port"):
        encap.check(EncapSpec(vxlan_port=4791))


def test_a_configured_gre_protocol_overrides_the_built_in_rule(bare):
    """A switch that sends ERSPAN's protocol with a sequence number and no ERSPAN header (what
    Wireshark calls fake ERSPAN): the built-in rule reads a bad version; the job file's protocol
    and length take it off, in the decoder and in the split's ports."""
    b = wrap(bare, "gretap", outer_vlan=(2,))
    data = b.data.copy()
    at = b.offset + ETH.size + VLAN.size + IPV4.size + GRE["proto"].offset
    for k in (0, 1):
        data[at + k] = GRE_PROTO_ERSPAN.to_bytes(2, "big")[k]
    fake = FrameBatch(data, b.offset, b.caplen, b.wirelen, b.ts_ns, b.iface)
    _, pk, c = decoded(fake)
    assert len(pk) == 0 and c.malformed["bad_erspan_version"] > 0
    spec = EncapSpec(gre_protocol=GRE_PROTO_ERSPAN, gre_header_bytes=0)  # after checksum, key, sequence
    same_decode(decoded(fake, spec), decoded(bare))
    assert np.array_equal(split.flow_ports(fake, spec), split.flow_ports(bare))


def test_the_walks_tables_fit_its_compiled_constants():
    assert len(encap.table()) == 5 and len(_inner.MIRROR) == len(encap.MirrorHealth().counts)
    assert encap.table(EncapSpec("none")).tolist() == [0, 0, -1, 0, -1]
