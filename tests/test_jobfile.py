"""The job configuration file: round trip, and errors that name the file, table and key."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from mirrorckpt.config import jobfile
from mirrorckpt.config.jobfile import ConfigError, dump_job, load_job, parse_job
from mirrorckpt.tools.cli import main

GOOD = """
[ring]
nranks = 3
nchannels = 2
protocol = "LL"
addresses = ["fe80::1", "fe80::2", "10.0.0.3"]

[job]
grad_dtype = "bfloat16"

[[job.params]]
name = "w"
shape = [4, 3]

[[job.params]]
name = "b"
shape = [4]

[job.buckets]
after_rebuild = [[1], [0]]

[[mirror]]
rank = 0
direction = "egress"
source = "afpacket:lo"
"""


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_round_trip(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.ring.nranks == 3 and job.layout.grad_dtype == "bfloat16"
    assert [b.params for b in job.layout.buckets] == [(1,), (0,)]
    assert job.ring.ranks_by_address()[bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 3])] == 2
    again = load_job(write(tmp_path, dump_job(job), "again.toml"))
    assert again.layout == job.layout and again.ring == job.ring and again.mirrors == job.mirrors


@pytest.mark.parametrize("edit, message", [
    (("nranks = 3", "nranks = 3\nnrank = 3"), "[ring]: unknown key 'nrank'"),
    (("nranks = 3", 'nranks = "three"'), "[ring] nranks: expected an integer >= 2, got 'three'"),
    (('protocol = "LL"', 'protocol = "LL64"'), "[ring] protocol: expected one of LL, LL128, Simple"),
    (("rank = 0", "rank = 5"), "[[mirror]] #1 rank: 5 is outside the ring (ranks 0..2)"),
    (('"10.0.0.3"', '"10.0.0.300"'), "[ring] addresses: expected an IPv4 or IPv6 address"),
    (("[[mirror]]", "[mirrors]\nx = 1\n[[mirror]]"), "unknown table [mirrors]"),
    (("after_rebuild = [[1], [0]]", "after_rebuild = [[1], [1]]"), "every parameter must sit in exactly one bucket"),
    (('shape = [4]', 'shape = 4'), "shape: expected a list of integers"),
    (("nranks = 3", "nranks = 3\n[ring"), "job.toml:"),
    (("[[mirror]]", "[updater]\npipelined = 1\n[[mirror]]"), "[updater] pipelined: expected true or false, got 1"),
    (("[[mirror]]", "[updater]\npipeline = true\n[[mirror]]"),
     "[updater]: unknown key 'pipeline' (known: pipelined, threads)"),
    (("[[mirror]]", "[updater]\nthreads = 0\n[[mirror]]"), "[updater] threads: expected an integer >= 1, got 0"),
    (("[ring]", "updater = 1\n[ring]"), "[updater] must be a table"),
    (("rank = 0", "rank = 0\nworkers = 0"), "workers: expected an integer >= 1, got 0"),
    (("[[mirror]]", "[capture]\ntransfer_bytes = -1\n[[mirror]]"), "transfer_bytes: expected an integer >= 0"),
])
def test_errors_are_located(tmp_path, edit, message):
    text = GOOD.replace(*edit, 1)
    with pytest.raises(ConfigError) as e:
        load_job(write(tmp_path, text))
    assert message in str(e.value) and str(e.value).startswith("job.toml")


def test_mirror_workers_are_read_and_written(tmp_path):
    job = load_job(write(tmp_path, GOOD.replace("rank = 0", "rank = 0\nworkers = 3", 1)))
    assert [m.workers for m in job.mirrors][0] == 3 and all(m.workers == 1 for m in job.mirrors[1:])
    again = load_job(write(tmp_path, dump_job(job), "again.toml"))
    assert again.mirrors == job.mirrors


def test_updater_pipelined_is_read_and_written(tmp_path):
    assert not load_job(write(tmp_path, GOOD)).pipelined  # off by default
    job = load_job(write(tmp_path, GOOD.replace("[[mirror]]", "[updater]\npipelined = true\n\n[[mirror]]", 1)))
    assert job.pipelined and job.updater == {"pipelined": True}
    assert load_job(write(tmp_path, dump_job(job), "again.toml")).pipelined


def test_updater_threads_default_to_the_cores_the_packet_path_leaves(tmp_path, monkeypatch):
    job = load_job(write(tmp_path, GOOD))
    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert job.updater_threads(3) == 13
    monkeypatch.setattr(jobfile.os, "sched_getaffinity", lambda pid: {0, 1})
    assert job.updater_threads(2) == 1 and job.updater_threads(5) == 1  # never none
    job = load_job(write(tmp_path, GOOD.replace("[[mirror]]", "[updater]\nthreads = 4\n\n[[mirror]]", 1)))
    assert job.updater_threads(2) == 4
    assert load_job(write(tmp_path, dump_job(job), "again.toml")).updater_threads(2) == 4


def test_relative_sources_follow_the_file(tmp_path):
    job = parse_job({"ring": {"nranks": 2}, "job": {"kind": "allreduce", "counts": [10]},
                     "mirror": [{"rank": 1, "source": "a.pcapng"}]}, "x.toml", tmp_path)
    assert job.mirrors[0].source == str(tmp_path / "a.pcapng")


def test_serve_refuses_a_missing_interface(tmp_path):
    p = write(tmp_path, GOOD.replace("afpacket:lo", "afpacket:mck_no_such_if0"))
    res = CliRunner().invoke(main, ["serve", "--config", str(p)])
    assert res.exit_code == 2
    assert "interface 'mck_no_such_if0' does not exist" in res.stderr


def test_documented_example_loads():
    from pathlib import Path

    from mirrorckpt.config.training import TrainingSpec

    job = load_job(Path(__file__).resolve().parents[1] / "config" / "example.toml")
    assert job.ring.nranks == 3 and len(job.mirrors) == 2 and job.control["fallback_parts"] == 7
    assert TrainingSpec.from_dict(job.training).grad_dtype == job.grad_dtype


def _without_layout(text: str) -> str:
    head, _, rest = text.partition("[[job.params]]")
    return head + rest[rest.index("[[mirror]]"):]


def test_the_layout_may_come_from_the_trainer(tmp_path):
    """No [[job.params]]: the layout is None in the job (serve takes it from REGISTER); serve
    without a [control] listen address, and replay, say what is missing."""
    text = _without_layout(GOOD)
    job = load_job(write(tmp_path, text))
    assert job.layout is None and job.kind == "ddp"
    res = CliRunner().invoke(main, ["serve", "--config", str(write(tmp_path, text, "a.toml"))])
    assert res.exit_code == 2 and "[control] listen address where the trainer registers it" in res.stderr
    res = CliRunner().invoke(main, ["replay", "--config", str(write(tmp_path, text, "b.toml")), str(p := write(
        tmp_path, "x", "x.pcap"))])
    assert res.exit_code == 2 and "replay needs the layout" in res.stderr, (res.stderr, p)
    with pytest.raises(ConfigError, match="without"):
        parse_job({"ring": {"nranks": 2}, "job": {"buckets": {"after_rebuild": [[0]]}}})
