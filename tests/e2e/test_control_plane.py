"""End to end: a 2-process CPU DDP job (gloo) whose comm hook emits NCCL's RoCEv2 frames to the
appliance, which follows every iteration live over the frame stream and the control plane.

Injected loss makes iterations unrecoverable; each one triggers exactly one GoCkpt fallback, after
which the replica equals the trainer bit for bit and mirror mode resumes. A replica corrupted by
one ulp is caught by the fingerprint check and resynced the same way; a restarted appliance
resyncs by fallback too. The handler-level security tests at the end run in-process."""

from __future__ import annotations

import functools
import hashlib
import logging
import socket
import struct
import time

import common
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.control import auth, wire
from mirrorckpt.control import messages as m
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.channel import Channel
from mirrorckpt.parser.roce.streams import MirrorStreams
from mirrorckpt.tools.testbed import harness
from mirrorckpt.tools.testbed.follower import MirrorFollower
from mirrorckpt.updater import ckptdir, manifest, restore
from mirrorckpt.updater.fingerprint import params_sha256, state_sha256

SECRET = "e2e-secret-0123456789abcdef-xyz"
WORLD = 2


wait_for = functools.partial(common.wait_for, timeout=30.0)


class Appliance:
    """Control plane + frame stream + parser thread, recording the replica after every step."""

    def __init__(self, control_port=0, frames_port=0, corrupt_at=None, **kw):
        self.states: dict[int, dict] = {}
        self.corrupt_at = corrupt_at
        self.corrupted = None
        self.plane = AppliancePlane(SECRET, port=control_port, parts=3, fingerprint_every=2,
                                    fallback_timeout=60, on_iteration=self._record, **kw).start()
        self.frames = harness.FrameStreamServer(WORLD, port=frames_port)
        ring, topo = harness.ring_for(WORLD)
        self.follower = MirrorFollower(self.plane, MirrorStreams(self.frames.sources()), ring,
                                       channels=harness.channels_for(topo, ring), psn_window=16)
        self.follower.start()

    def _record(self, index, r) -> None:
        ps, os_ = state_sha256(r.params, r.optimizer)
        self.states[r.iterations_done] = {
            "params": ps, "optim": os_, "lr": r.optimizer.param_groups[0]["lr"], "sched": r.scheduler.last_epoch,
            "rng": hashlib.sha256(r.rng["torch"].numpy().tobytes()).hexdigest() if "torch" in r.rng else None,
            "data": r.data_position}
        if (self.corrupt_at is not None and self.corrupted is None and r.iterations_done >= self.corrupt_at
                and self.plane.fallback is None):
            p = r.params[0].view(-1)
            p[0] = torch.nextafter(p[0], torch.tensor(float("inf")))  # one ulp in one tensor
            self.corrupted = r.iterations_done

    def stop(self) -> None:
        self.frames.stop()
        self.follower.join(30)
        self.plane.stop()


def trainer_state(d: dict) -> dict:
    return {k: d[k] for k in ("params", "optim", "lr", "sched", "rng", "data")}


def test_loss_and_drift_each_trigger_one_fallback_and_mirror_mode_resumes(tmp_path):
    """Several DDP buckets (small bucket_cap_mb): the registered layout must be DDP's real one.
    Checkpoints proven equal to the trainer are marked verified; on drift, those committed after
    the last proven step are quarantined, and restore gives a verified one."""
    root = tmp_path / "ckpt"
    app = Appliance(corrupt_at=14, persist=PersistSpec(str(root), every_iterations=1, keep_last=2))
    try:
        procs = harness.spawn_ranks(WORLD, tmp_path, SECRET, control_port=app.plane.port,
                                    frames_port=app.frames.port, steps=46,
                                    extra=["--drop", "3:1,34:0", "--step-delay", "0.2", "--parts", "3",
                                           "--dims", "32,64,64,16", "--bucket-cap-mb", "0.01"])
        harness.wait_ranks(procs, tmp_path, timeout=200)
        assert wait_for(lambda: app.plane.replica is not None and app.plane.replica.iterations_done == 46)
    finally:
        app.stop()
    assert app.follower.error is None
    st, summary = app.plane.stats, app.plane.app.summary
    trainer = harness.read_digests(tmp_path)
    assert sorted(trainer) == list(range(1, 47))

    # two losses, one drift: exactly three fallbacks, all finished
    assert summary.stale_events == 2, summary
    assert st.drift_events == 1
    assert st.fallbacks_requested == 3 and st.fallbacks_done == 3 and st.fallbacks_failed == 0, st
    resyncs = [d for kind, d in st.events if kind == "resynced"]
    assert len(resyncs) == 3
    drift = [d for kind, d in st.events if kind == "drift"][0]
    assert drift["tensors"] == ["model.0.weight"]  # the one corrupted tensor

    # bit-exact after every step the replica holds, except while it was deliberately corrupted
    bad = set(range(app.corrupted + 1, resyncs[1]["step"]))
    for step, have in app.states.items():
        if step in bad:
            continue
        assert have == trainer_state(trainer[step]), f"step {step}"
    # mirror mode resumed after the last fallback: every later step was followed
    assert set(range(resyncs[-1]["step"], 47)) <= set(app.states)
    # before the first loss too
    assert {1, 2, 3} <= set(app.states)

    # the checkpoints written while the replica was corrupted are quarantined, none served
    quarantined = sorted(ckptdir.parse_step(p.name) for p in (root / "quarantine").iterdir()
                         if ckptdir.parse_step(p.name) is not None)
    # (every one after the last step proven before the drift: the corrupted one among them)
    assert app.corrupted in quarantined and all(s <= drift["step"] for s in quarantined), (quarantined, drift)
    assert all(s > drift["step"] - 2 for s in quarantined)  # fingerprint_every = 2: nothing proven is moved
    sel = restore.select(root)
    assert sel.path is not None and manifest.read_manifest(sel.path).get("verified"), sel
    step = ckptdir.parse_step(sel.path.name)
    got = restore.read_state(sel.path)
    names = [p.name for p in app.plane.layout.params]
    assert params_sha256([got.params[n] for n in names]) == trainer[step]["params"]


def test_appliance_restart_resyncs_by_fallback(tmp_path):
    a = Appliance()
    procs = harness.spawn_ranks(WORLD, tmp_path, SECRET, control_port=a.plane.port, frames_port=a.frames.port,
                                steps=40, extra=["--step-delay", "0.2", "--parts", "3"])
    try:
        assert wait_for(lambda: a.plane.replica is not None and a.plane.replica.iterations_done >= 5, timeout=120)
        cport, fport = a.plane.port, a.frames.port
        a.stop()  # the appliance goes away mid-run ...
        b = Appliance(control_port=cport, frames_port=fport)  # ... and comes back with no state
        try:
            harness.wait_ranks(procs, tmp_path, timeout=200)
            assert wait_for(lambda: b.plane.stats.fallbacks_done >= 1, timeout=30)
        finally:
            b.stop()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    trainer = harness.read_digests(tmp_path)
    st = b.plane.stats
    assert st.fallbacks_requested == 1 and st.fallbacks_done == 1, st
    assert st.events[0][0] == "registered" and st.events[0][1]["state"] is False
    step = [d for kind, d in st.events if kind == "resynced"][0]["step"]
    assert b.states[step] == trainer_state(trainer[step])
    for s, have in b.states.items():  # whatever it followed afterwards is exact too
        assert have == trainer_state(trainer[s]), f"step {s}"
    # the restarted appliance picked the mirror up mid-stream: mirror mode resumed after the resync
    assert max(b.states) == 40, sorted(b.states)


# ------------------------------------------------------------------------ handler-level security

LAYOUT = JobLayout([ParamSpec("w", (4, 3)), ParamSpec("b", (4,))], [BucketSpec((1, 0))])
TRAINING = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.1))


@pytest.fixture
def plane(caplog):
    caplog.set_level(logging.INFO, logger="mirrorckpt")
    p = AppliancePlane(SECRET, layout=LAYOUT, training=TRAINING, parts=2,
                       server_options={"read_timeout": 0.5, "handshake_timeout": 2.0}).start()
    yield p
    p.stop()


def peer(port, secret=SECRET, handshake=True) -> Channel:
    chan = Channel(socket.create_connection(("127.0.0.1", port), timeout=5), m.CLIENT, stall_timeout=5)
    if handshake:
        auth.client_handshake(chan, auth.normalize_secret(secret), "trainer")
    return chan


def register(**kw) -> m.Message:
    g = torch.Generator().manual_seed(0)
    tensors = kw.pop("tensors", {"p:w": torch.randn(4, 3, generator=g), "p:b": torch.randn(4, generator=g)})
    return m.make(m.REGISTER, tensors, job="t", step=0, layout=kw.pop("layout", LAYOUT.to_dict()), ring=None,
                  training=TRAINING.to_dict(), rid=kw.pop("rid", 1), **kw)


def snapshot(plane) -> tuple:
    r = plane.replica
    st = plane.stats
    return (None if r is None else state_sha256(r.params, r.optimizer), None if r is None else r.iterations_done,
            st.fallbacks_requested, plane.fallback is not None, sorted(plane._metas))


def closed(chan) -> bool:
    chan.source.idle_timeout = 10
    try:
        while True:
            chan.recv()
    except (wire.ConnectionClosed, wire.ProtocolError):
        return True
    finally:
        chan.close()


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def registered(plane):
    c = peer(plane.port)
    c.send(register())
    assert c.recv().type == m.ACK
    return c


def test_valid_registration_reaches_the_replica(plane, caplog):
    c = registered(plane)
    assert plane.replica is not None and plane.replica.iterations_done == 0
    c.close()


@pytest.mark.parametrize("attack, words", [
    ("wrong_secret", ["AuthError", "wrong secret"]),
    ("truncated", ["TruncatedFrame"]),
    ("oversized", ["FrameTooLarge"]),
    ("unknown_type", ["UnknownMessageType", "FORMAT_DISKS"]),
    ("replayed", ["SequenceError", "replayed"]),
])
def test_hostile_frames_leave_the_appliance_unchanged(plane, caplog, attack, words):
    good = registered(plane)
    before = snapshot(plane)
    n = plane.server.rejected
    if attack == "wrong_secret":
        with pytest.raises(wire.AuthError):
            peer(plane.port, secret="not-the-secret-0123456789abcdef")
    else:
        c = peer(plane.port)
        meta = m.make(m.STEP_META, step=1, lr=0.1, loss_scale=None)
        if attack == "truncated":
            data = c.seal_bytes(meta)
            c.send_raw(data[: len(data) // 2])
            c.sock.shutdown(socket.SHUT_WR)
        elif attack == "oversized":
            c.send_raw(struct.pack(">I", 0xFFFFFFF0) + bytes(16))
        elif attack == "unknown_type":
            h = ('{"v":1,"type":"FORMAT_DISKS","seq":' + str(c.send_seq) + ',"body":{},"tensors":[]}').encode()
            c.send_raw(wire.frame_bytes(h, b"", c.session.sign(h, [b""], 0)))
        elif attack == "replayed":
            data = c.seal_bytes(m.make(m.STEP_META, step=1, lr=0.1, loss_scale=None))
            c.send_raw(data)
            time.sleep(0.2)
            before = snapshot(plane)  # the original frame was fine
            c.send_raw(data)
        assert closed(c)
    assert wait_for(lambda: plane.server.rejected > n)
    assert snapshot(plane) == before
    rejected = [x for x in lines(caplog) if x.startswith("rejected")]
    assert rejected and all(w in rejected[-1] for w in words), rejected
    good.close()


def test_register_that_does_not_match_the_traffic_is_refused(plane, caplog):
    c = peer(plane.port)
    other = JobLayout([ParamSpec("w", (4, 3)), ParamSpec("b", (4,))], [BucketSpec((0,)), BucketSpec((1,))])
    c.send(register(layout=other.to_dict()))
    reply = c.recv()
    assert reply.type == m.ERROR and "layout does not match" in reply.body["reason"]
    c.send(register(tensors={"p:w": torch.zeros(3, 4), "p:b": torch.zeros(4)}, rid=2))
    reply = c.recv()
    assert reply.type == m.ERROR and "float32 (4, 3)" in reply.body["reason"]
    assert plane.replica is None and snapshot(plane)[2] == 0
    assert any("handler for REGISTER refused" in x for x in lines(caplog))
    c.close()


def test_gockpt_parts_with_wrong_content_are_refused(plane, caplog):
    c = registered(plane)
    plane.request_fallback("test")
    assert c.recv().type == m.FALLBACK_REQUEST  # pushed to the trainer
    before = snapshot(plane)
    g = torch.Generator().manual_seed(1)
    good = {"p:w": torch.randn(4, 3, generator=g), "g:w": torch.randn(4, 3, generator=g)}
    bad_cases = [
        ({"p:w": torch.randn(3, 4), "g:w": torch.randn(4, 3)}, dict(step=5, index=0, parts=2), "shape"),
        (good, dict(step=5, index=1, parts=2), "part 1 before part 0"),
        (good, dict(step=5, index=0, parts=65), "parts must be in"),
        (dict(good, **{"p:b": torch.zeros(4)}), dict(step=5, index=0, parts=2), "unexpected"),
    ]
    for k, (tensors, body, text) in enumerate(bad_cases):
        slices = {"params": ["w"], "hparams": [{"lr": 0.1}]}
        c.send(m.make(m.GOCKPT_PART, tensors, slices=slices, rid=10 + k, **body))
        reply = c.recv()
        assert reply.type == m.ERROR and text in reply.body["reason"], (text, reply.body)
    c.send(m.make(m.GOCKPT_DONE, step=7, parts=2, fingerprints={"model.w": 1}, rid=30))
    assert c.recv().type == m.ERROR
    assert snapshot(plane) == before and plane.fallback.rebuild is None
    assert sum("handler for GOCKPT" in x for x in lines(caplog)) == 5
    c.close()
