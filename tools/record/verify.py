"""The replay check of a capture folder: ``mirrorckpt replay --json`` on its captures, compared with its truth.

A capture folder (``mirrorckpt record --out``, ``tests/pcaps/nccl-real/<name>/``) holds
``rank<R>-egress.pcap`` per rank (what a switch mirrors of each rank's port; every message of the
job once), ``rank<R>-ingress.pcap`` where recorded (the same frames as another rank's egress:
not replayed), ``truth.json`` and, when replay needs options for it (a transport), those options
on one line in ``replay.args``. Every all-reduce replay reports is compared with truth's
all-reduces in order (count, dtype, sha256), the comparison the generator's tests make.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mirrorckpt.tools.generator.truth import TRUTH_FILE

REPLAY_ARGS = "replay.args"
EGRESS = "rank{rank}-egress.pcap"
INGRESS = "rank{rank}-ingress.pcap"


@dataclass
class Verdict:
    folder: Path
    checked: int = 0  # all-reduces compared
    equal: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.checked > 0 and self.equal == self.checked

    def text(self) -> str:
        head = (f"{self.folder.name}: every all-reduce equals truth ({self.equal}/{self.checked})" if self.ok else
                f"{self.folder.name}: DIFFERS from truth ({self.equal}/{self.checked} all-reduces equal)")
        return "\n".join([head] + [f"  {p}" for p in self.problems])


def egress_captures(folder: Path) -> list[Path]:
    """The folder's egress captures in rank order; an error when there are none or a rank is missing."""
    found = sorted(Path(folder).glob(EGRESS.format(rank="*")), key=lambda p: int(p.name[4:].split("-")[0]))
    ranks = [int(p.name[4:].split("-")[0]) for p in found]
    if not found or ranks != list(range(len(found))):
        raise FileNotFoundError(f"{folder}: expected {EGRESS.format(rank='0')} .. one per rank, found "
                                f"{[p.name for p in found] or 'none'}")
    return found


def replay_args(folder: Path) -> list[str]:
    path = Path(folder) / REPLAY_ARGS
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if len(lines) > 1:
        raise ValueError(f"{path}: one line of replay options expected, found {len(lines)}")
    return shlex.split(lines[0]) if lines else []


def replay_transports() -> tuple[str, ...]:
    """The transports `mirrorckpt replay` decodes (its --transport choices)."""
    from mirrorckpt.tools.cmd_replay import replay

    opt = next(p for p in replay.params if p.name == "transport")
    return tuple(opt.type.choices)


def compare(report: dict, truth: dict) -> Verdict:
    """Replay's all-reduces against truth's, in order."""
    v = Verdict(Path(report.get("captures", ["?"])[0]).parent)
    want = [c for c in truth["collectives"] if c["kind"] == "all_reduce"]
    got = report["allreduces"]
    v.checked = len(want)
    if len(got) != len(want):
        v.problems.append(f"replay found {len(got)} all-reduces, truth has {len(want)}")
    for k, (g, w) in enumerate(zip(got, want)):
        name = f"all-reduce {k} ({w['what']}, {w['count']} x {w['dtype']})"
        if g["count"] != w["count"] or g["dtype"] != w["dtype"]:
            v.problems.append(f"{name}: replay has {g['count']} x {g['dtype']}")
        elif not g["complete"]:
            v.problems.append(f"{name}: incomplete, coverage {g['coverage']}, holes {g['holes'][:4]}")
        elif g["sha256"] != w["sha256"]:
            v.problems.append(f"{name}: sha256 {g['sha256'][:16]}… differs from truth's {w['sha256'][:16]}…")
        else:
            v.equal += 1
    mismatch = report.get("placement", {}).get("mismatch", 0)
    if mismatch:
        v.problems.append(f"replay placed {mismatch} send(s) against its own plan (placement mismatch)")
    for m in report.get("mismatches", [])[:5]:
        v.problems.append(f"replay: {m}")
    return v


def check_folder(folder: str | Path, timeout: float = 600) -> Verdict:
    """Replays the folder's egress captures with its replay.args through the CLI, compares with truth.json."""
    folder = Path(folder)
    v = Verdict(folder)
    truth_path = folder / TRUTH_FILE
    if not truth_path.is_file():
        v.problems.append(f"{truth_path}: missing")
        return v
    args = replay_args(folder)
    if "--transport" in args:
        wanted = args[args.index("--transport") + 1]
        if wanted not in replay_transports():
            known = ", ".join(replay_transports())
            v.problems.append(f"replay cannot decode --transport {wanted} (it decodes {known}); the capture and "
                              "its truth are kept for the decoder to come")
            return v
    cmd = [sys.executable, "-m", "mirrorckpt.tools.cli", "replay", "--json", "--quiet", *args,
           *map(str, egress_captures(folder))]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        v.problems.append(f"replay did not finish in {timeout:.0f} s: {shlex.join(cmd)}")
        return v
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-3:]
        v.problems.append(f"replay exited {r.returncode} without a report: {' / '.join(tail)}")
        return v
    v = compare(report, json.loads(truth_path.read_text()))
    v.folder = folder
    for line in r.stderr.splitlines():
        if line.startswith("error:"):
            v.problems.append(f"replay: {line}")
    return v
