"""tools.daemon.ports.PortMonitor.silent: what the verdict is told of each capturing port."""

from __future__ import annotations

from mirrorckpt.tools import cmd_status
from mirrorckpt.tools.daemon.ports import SILENT_STEPS, PortMonitor
from mirrorckpt.tools.daemon.worker import COUNTERS
from mirrorckpt.tools.metrics import Metrics
from prometheus_client import generate_latest


def monitor(nports: int) -> tuple[PortMonitor, list[list[int]]]:
    shared = [[0] * len(COUNTERS) for _ in range(nports)]
    return PortMonitor(Metrics(), [str(k) for k in range(nports)], [f"src{k}" for k in range(nports)], shared), shared


def capture(shared: list[list[int]], port: int, frames: int, roce: int) -> None:
    row = shared[port]
    row[COUNTERS.index("capturing")], row[COUNTERS.index("frames")] = 1, frames
    row[COUNTERS.index("roce")] = roce


def test_a_source_that_ended_is_not_a_silent_mirror_and_a_failed_one_is_said():
    ports, shared = monitor(3)
    for port in range(3):
        capture(shared, port, 100, 90)
    ports.sync()
    ports.sync()  # the trainer's step seen with each port's count
    assert ports.silent(3600, trainer_step=1) == []
    ports.ended(0, None)  # a capture file read to its end
    ports.ended(1, "pcap: truncated block at byte 4096")
    said = ports.silent(3600, trainer_step=1 + SILENT_STEPS)
    assert len(said) == 2, said
    assert said[0] == "capture on port 1 (src1) failed: pcap: truncated block at byte 4096"
    assert said[1].startswith(f"no RoCE on port 2 (src2) for 0 s while the trainer took {SILENT_STEPS} steps"), said


def test_foreign_frames_are_counted_by_class_and_status_names_them():
    ports, shared = monitor(1)
    capture(shared, 0, 876, 850)
    ports.sync()
    # the worker's running counts, most common first (its top few only)
    ports.seen(0, {"roce:RC_RDMA_WRITE_ONLY": 800, "ethertype_0x86dd": 20, "arp": 4})
    ports.seen(0, {"roce:RC_RDMA_WRITE_ONLY": 850, "ethertype_0x86dd": 20, "lldp": 1})
    ports.seen(0, {"roce:RC_RDMA_WRITE_ONLY": 850, "ethertype_0x86dd": 20, "arp": 6})  # arp back in the top
    m = cmd_status.parse(generate_latest(ports.metrics.registry).decode())
    assert m["mirrorckpt_other_frames_total"] == {
        (("class", "ethertype_0x86dd"), ("port", "0")): 20, (("class", "arp"), ("port", "0")): 6,
        (("class", "lldp"), ("port", "0")): 1}
    text = cmd_status.render(m)
    assert "port 0: 876 frames (850 RoCE; other: ethertype_0x86dd 20, arp 6, lldp 1)," in text, text
    assert ports.sees(0) == "876 frames (roce:RC_RDMA_WRITE_ONLY 850, ethertype_0x86dd 20, arp 6, lldp 1)"
