"""The protection verdict (control.protection) and what the plane does with the trainer's step:
a restore never rolls a job back in silence, iterations before the registration are held, and the
verdict's reasons name what is wrong (in process, handlers called directly)."""

from __future__ import annotations

import pytest
from mirrorckpt.control import messages as m
from mirrorckpt.control.appliance_side import AppliancePlane, Refused
from mirrorckpt.control.protection import LAGGING, NOT_PROTECTED, PROTECTED, Facts, Guard, Limits, judge
from test_appliance_side import LAYOUT, SECRET, feed, iteration, meta, reference, register

LIM = Limits(max_lag_steps=10, silent_seconds=30, fallback_interval=60)


def facts(**kw) -> Facts:
    base = dict(control=True, registered=True, trainer_step=20, replica_step=15, replica_seconds=1.0)
    return Facts(**{**base, **kw})


@pytest.mark.parametrize("kw, state, words", [
    ({}, PROTECTED, "state of step 15, 5 step(s) behind the trainer's step 20"),
    ({"registered": False}, NOT_PROTECTED, "no trainer has registered the job"),
    ({"replica_step": None, "replica_stale": "replica stale since step 3"}, NOT_PROTECTED, "no consistent state"),
    ({"trainer_step": 30}, LAGGING, "the replica follows the mirror"),
    ({"trainer_step": 30, "replica_seconds": 99.0}, NOT_PROTECTED, "the replica is not advancing"),
    ({"trainer_step": 30, "wire": ["no RoCE on port 0 (afpacket:eth9) for 40 s; it sees 12 frames (arp 12)"]},
     NOT_PROTECTED, "no RoCE on port 0 (afpacket:eth9)"),
    ({"fallback_error": "fallback (x) abandoned after 3 attempt(s)"}, NOT_PROTECTED, "fallback given up"),
    ({"persist_error": "OSError: [Errno 28] No space left"}, LAGGING, "in memory only"),
    ({"wire": ["no RoCE on port 0"]}, PROTECTED, "by fallbacks; mirror: no RoCE on port 0"),
    # a committed checkpoint counts though the replica went stale
    ({"trainer_step": 25, "replica_step": None, "replica_stale": "stale", "committed_step": 18}, PROTECTED,
     "state of step 18"),
])
def test_the_verdict_and_its_reason(kw, state, words):
    v = judge(facts(**kw), LIM)
    assert v.state == state and words in v.reason, v


def test_without_a_control_plane_the_verdict_is_the_wires():
    assert judge(Facts(replica_step=4), LIM).state == PROTECTED
    v = judge(Facts(replica_step=4, wire=["no RoCE on port 1 (x) for 31 s; it sees no frames at all"]), LIM)
    assert v.state == NOT_PROTECTED and "cannot follow: no RoCE on port 1" in v.reason
    v = judge(Facts(replica_stale="replica stale since step 4"), LIM)
    assert v.state == NOT_PROTECTED and "no control plane to ask a fallback" in v.reason


def test_degraded_mode_asks_fallbacks_at_a_bounded_rate():
    asked = []
    g = Guard(Limits(max_lag_steps=10, fallback_interval=3600), lambda why: asked.append(why) or True)
    silent = facts(trainer_step=40, wire=["no RoCE on port 0 (x) for 40 s; it sees no frames at all"])
    g.check(silent)
    g.check(silent)
    assert len(asked) == 1 and asked[0].startswith("degraded mode: state of step 15") and g.degraded_fallbacks == 1
    g.check(facts(trainer_step=40, wire=silent.wire, fallback="degraded mode"))  # under way: nothing more
    assert len(asked) == 1
    # a stale replica asks its own fallback; a healthy lagging replica needs none
    Guard(LIM, asked.append).check(facts(trainer_step=40, replica_stale="stale"))
    Guard(LIM, asked.append).check(facts(trainer_step=30))
    assert len(asked) == 1


def test_control_only_asks_every_n_steps():
    asked = []
    g = Guard(Limits(max_lag_steps=10, fallback_every=4), lambda why: asked.append(why) or True)
    g.check(facts(trainer_step=18, replica_step=15))
    assert not asked
    g.check(facts(trainer_step=19, replica_step=15))
    assert asked == ["control-only: the newest state is 4 steps behind the trainer"]


@pytest.fixture
def plane():
    p = AppliancePlane(SECRET, parts=2, max_lag_steps=2)
    yield p
    p.stop()


def restore(p: AppliancePlane, **body):
    return p._on_restore(m.make(m.RESTORE_REQUEST, step=None, **body), None)


def test_a_restore_never_rolls_the_job_back_in_silence(plane):
    """The trainer reported step 6; the replica holds step 3: further behind than the limit (2)."""
    plane._on_register(register("a", 0, state=True), None)
    for i in range(3):
        feed(plane, iteration(i, i + 1, first=i == 0), i + 1)
    for step in (4, 5, 6):  # the trainer went on; the mirror did not
        plane._on_step_meta(meta(step), None)
    with pytest.raises(Refused, match=r"step 3, 3 steps behind the trainer's last reported step 6 \(protection "
                                      r"limit 2\)"):
        restore(plane)
    reply = restore(plane, allow_behind=True)  # asked for explicitly
    assert reply.body["step"] == 3 and reply.body["meta"]["trainer_step"] == 6 and reply.body["meta"]["behind"] == 3
    # the held state, for the other ranks (asking as rank 0 did): said again
    assert restore(plane, allow_behind=True).body["meta"]["behind"] == 3


def test_a_restore_within_the_limit_says_how_far_behind(plane):
    plane._on_register(register("a", 0, state=True), None)
    feed(plane, iteration(0, 1, first=True), 1)
    plane._on_step_meta(meta(2), None)
    reply = restore(plane)
    assert reply.body["step"] == 1 and reply.body["meta"]["behind"] == 1


def test_iterations_before_the_registration_are_held_not_dropped():
    """The job file has the layout but no recipe: the replica exists only once the trainer
    registers; what the wire brought before is applied then, in order."""
    p = AppliancePlane(SECRET, layout=LAYOUT, parts=2)
    try:
        p.apply(iteration(0, 1, first=True))
        assert p.app is None and p.stats.dropped_unregistered == 0
        p._on_register(register("a", 0, state=True), None)
        p._on_step_meta(meta(1), None)
        assert p.replica.iterations_done == 1 and p.replica.state_sha256() == reference(1).state_sha256()
    finally:
        p.stop()


def test_the_planes_facts_carry_the_trainers_step(plane):
    assert not plane.facts().registered
    plane._on_register(register("a", 0, state=True), None)
    feed(plane, iteration(0, 1, first=True), 1)
    plane._on_step_meta(meta(7), None)
    f = plane.facts()
    assert (f.registered, f.trainer_step, f.replica_step, f.fallback) == (True, 7, 1, None)
    assert judge(f, Limits(max_lag_steps=2)).state == LAGGING  # following: the replica just moved
