"""Encapsulated mirrors through the CLI: `mirrorckpt gen --encap ...` writes them (and the job file
keys a vendor header needs), `replay` follows them with no configuration and reports the mirror's
health (loss by sequence gaps, truncation said as an error), `inspect` shows it, `status` renders
serve's mirror metrics."""

from __future__ import annotations

import json

from click.testing import CliRunner
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.cmd_status import render
from mirrorckpt.tools.metrics import Metrics

GEN = ["--ranks", "2", "--model", "linear:3000", "--steps", "3", "--mirror", "0:egress,1:egress"]


def gen(out, *extra) -> dict:
    res = CliRunner().invoke(main, ["gen", "--out", str(out), *GEN, *extra], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads((out / "truth.json").read_text())


def captures(out, truth) -> list[str]:
    return [str(out / c["file"]) for c in truth["wire"]["captures"]]


def test_an_erspan_mirror_with_loss_replays_and_reports_the_loss(tmp_path):
    """ERSPAN II over IPv6 with an outer QinQ and a priority tag inside, 1% of frames lost after the
    switch: replayed with no configuration; what is complete is the truth's, and the loss the
    sequence numbers show per capture is exactly the frames the generator dropped."""
    truth = gen(tmp_path, "--encap", "erspan2", "--outer-vlan", "100,200", "--inner-vlan", "0", "--underlay", "ipv6",
                "--loss", "0.02", "--fault-seed", "7")
    lost = {c["file"]: sum(f["kind"] == "loss" and f["file"] == c["file"] for f in truth["wire"]["faults"])
            for c in truth["wire"]["captures"]}
    assert sum(lost.values()) > 0
    res = CliRunner().invoke(main, ["replay", "--json", "--quiet", *captures(tmp_path, truth)], catch_exceptions=False)
    report = json.loads(res.stdout)
    want = [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
    got = report["allreduces"]
    assert len(got) == len(want) and any(a["complete"] for a in got)
    assert all(a["sha256"] == w for a, w in zip(got, want) if a["complete"])
    for path, health in report["mirror"].items():
        name = path.rsplit("/", 1)[-1]
        assert health["lost_frames"] == lost[name], name
        assert health["encapsulated"]["erspan2"] > 0 and health["truncated_frames"] == 0
        assert len(health["sessions"]) == 1 and health["sessions"][0]["session"].startswith("erspan2 fd99::1>fd99::2")
        if lost[name]:
            assert f"{path}: the mirror lost {lost[name]} frames" in res.stderr
    text = CliRunner().invoke(main, ["replay", "--quiet", *captures(tmp_path, truth)], catch_exceptions=False)
    assert "mirror encapsulation: erspan2" in text.stdout and " lost on the way" in text.stdout


def test_a_vendor_header_is_written_into_the_job_file_and_followed(tmp_path):
    truth = gen(tmp_path, "--encap", "vendor:0x1234:12", "--outer-vlan", "0")
    job = load_job(tmp_path / "job.toml")
    assert (job.capture["gre_protocol"], job.capture["gre_header_bytes"]) == (0x1234, 12)
    res = CliRunner().invoke(main, ["replay", "--json", "--quiet", "--config", str(tmp_path / "job.toml")],
                             catch_exceptions=False)
    report = json.loads(res.stdout)
    assert [a["sha256"] for a in report["allreduces"]] == [c["sha256"] for c in truth["collectives"]
                                                            if c["kind"] == "all_reduce"]
    assert all(it["complete"] for it in report["iterations"])
    bare = CliRunner().invoke(main, ["replay", "--quiet", *captures(tmp_path, truth)])
    assert bare.exit_code == 1  # without the job file's keys the frames stay wrapped: nothing to follow
    assert "error: no RoCEv2 traffic (UDP port 4791) in" in bare.stderr
    assert "gre_protocol and gre_header_bytes" in bare.stderr


def test_a_truncating_mirror_is_said_loudly_before_anything_else(tmp_path):
    truth = gen(tmp_path, "--encap", "vxlan", "--mirror-mtu", "400")
    res = CliRunner().invoke(main, ["replay", "--quiet", *captures(tmp_path, truth)])
    assert res.exit_code == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert "the mirror truncates" in errors[0] and "can never be followed" in errors[0] and "mtu" in errors[0]
    assert errors[-1].startswith("error: cannot reassemble")
    ins = CliRunner().invoke(main, ["inspect", captures(tmp_path, truth)[0]])
    assert "mirror encapsulation: vxlan" in ins.stdout and "mirror truncation:" in ins.stdout
    assert "the mirror truncates" in ins.stderr
    js = CliRunner().invoke(main, ["inspect", "--json", captures(tmp_path, truth)[0]])
    health = json.loads(js.stdout)["mirror"]
    assert health["truncated_frames"] == health["mirror_truncated"] > 0 and health["erspan_truncated"] == 0


def test_status_shows_serves_mirror_metrics():
    m = Metrics()
    m.frames.labels("0").inc(10)
    m.mirror_lost_sessions("0", {"erspan2 10.99.0.1>10.99.0.2 session 1": 3})
    m.mirror_lost_sessions("0", {"erspan2 10.99.0.1>10.99.0.2 session 1": 5})  # running counts
    m.truncated.labels("0").inc(7)
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    key = (("port", "0"), ("session", "erspan2 10.99.0.1>10.99.0.2 session 1"))
    assert samples["mirrorckpt_mirror_lost_frames_total"][key] == 5
    text = render(samples)
    assert "port 0: mirror session erspan2 10.99.0.1>10.99.0.2 session 1: 5 frames lost" in text
    assert "port 0: 7 frames TRUNCATED by the mirror" in text
