"""The checkpoint root on disk: directory names, the `latest` pointer, and which directories count.

    ROOT/step-00000123/        a committed checkpoint (DCP files + manifest.json); 123 = iterations
    ROOT/latest                text "step-00000123\\n": the newest committed checkpoint
    ROOT/.partial-step-*       being written (or torn by a crash); never read, removed on start
    ROOT/.deleting-step-*      being removed by retention; removed on start
    ROOT/.latest.tmp-*         a pointer being replaced; removed on start
    ROOT/.lock                 flock held by the one writer of this root

A checkpoint is committed once its directory carries its final name: it is renamed there only
after every file and the manifest are fsync'd.
"""

from __future__ import annotations

import fcntl
import os
import re
import warnings
from pathlib import Path

from .manifest import fsync_write, quick_check

POINTER = "latest"
LOCK = ".lock"
PARTIAL, DELETING, POINTER_TMP = ".partial-", ".deleting-", ".latest.tmp-"
_STEP = re.compile(r"^step-(\d{8,})$")


def dcp_module():
    """torch.distributed.checkpoint, imported on use (it costs ~2 s). The appliance writes and reads
    without a process group on purpose, so DCP's warning about exactly that is silenced."""
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)
    return dcp


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dirs(root) -> list[tuple[int, Path]]:
    """All final-named checkpoint directories, committed or not, by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in out if s is not None)


def committed(root) -> list[tuple[int, Path]]:
    """Checkpoint directories that pass the cheap commit check, oldest first."""
    return [(s, p) for s, p in step_dirs(root) if quick_check(p) is None]


def read_pointer(root) -> Path | None:
    try:
        name = (Path(root) / POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Path(root) / name if parse_step(name) is not None else None


def write_pointer(root, name: str) -> None:
    """Atomically point `latest` at ``name``: temp file, fsync, rename, fsync the directory."""
    root = Path(root)
    tmp = root / f"{POINTER_TMP}{os.getpid()}"
    fsync_write(tmp, (name + "\n").encode())
    os.replace(tmp, root / POINTER)
    fsync_dir(root)


def latest(root) -> Path | None:
    """The newest committed checkpoint under ``root``: the pointer's target when it passes the commit
    check, else the highest committed step (the pointer may lag a commit by one crash)."""
    target = read_pointer(root)
    if target is not None and target.is_dir() and quick_check(target) is None:
        newer = [p for s, p in committed(root) if s > parse_step(target.name)]
        return newer[-1] if newer else target
    done = committed(root)
    return done[-1][1] if done else None


def resolve(path) -> Path:
    """A checkpoint directory itself, or the latest committed one when ``path`` is a root."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory")
    if parse_step(path.name) is not None or (path / "manifest.json").exists() or (path / ".metadata").exists():
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no committed checkpoint (no step-* directory with a valid manifest)")
    return found


class RootLock:
    """Exclusive flock on ROOT/.lock: one writer per root. The kernel drops it if the writer dies."""

    def __init__(self, root):
        self.path = Path(root) / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RuntimeError(f"{self.path}: another writer holds this checkpoint root") from None

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
