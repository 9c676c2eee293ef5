"""The checkpoint root on disk: directory names, the `latest` pointer, and which directories count.

    ROOT/step-00000123/        a committed checkpoint (DCP files + manifest.json); 123 = iterations
    ROOT/latest                text "step-00000123\\n": the newest committed checkpoint
    ROOT/.partial-step-*       being written (or torn by a crash); never read, removed on start
    ROOT/.deleting-step-*      being removed by retention; removed on start
    ROOT/.latest.tmp-*         a pointer being replaced; removed on start
    ROOT/.lock                 flock held by the one writer of this root
    ROOT/job.json              the job this root belongs to (layout digest, job name), written
                               before its first commit; another job's writer is refused
    ROOT/quarantine/step-*     checkpoints written after drift went undetected: kept, never
                               listed, served or loaded by default
    ROOT/quarantine.pending    a quarantine under way (the steps it moves); finished on start

A checkpoint is committed once its directory carries its final name: it is renamed there only
after every file and the manifest are fsync'd.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import warnings
from pathlib import Path

from mirrorckpt.updater.manifest import ManifestError, fsync_write, quick_check, read_manifest

POINTER = "latest"
LOCK = ".lock"
IDENTITY, IDENTITY_FORMAT = "job.json", "mirrorckpt-root/1"
QUARANTINE, QUARANTINE_PENDING = "quarantine", "quarantine.pending"
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
    """All final-named checkpoint directories, committed or not, by step; a quarantine under way
    already hides the ones it moves."""
    root = Path(root)
    if not root.is_dir():
        return []
    hidden = set(pending_quarantine(root).get("steps", ()))
    out = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir() and p.name not in hidden]
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
    done = committed(root)
    target = read_pointer(root)
    if target is not None and target in [p for _, p in done]:
        newer = [p for s, p in done if s > parse_step(target.name)]
        return newer[-1] if newer else target
    return done[-1][1] if done else None


def verification(path) -> dict | None:
    """The manifest's record of this checkpoint being proven equal to the trainer, or None."""
    try:
        v = read_manifest(path).get("verified")
    except ManifestError:
        return None
    return v if isinstance(v, dict) else None


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


# ---- the job a root belongs to ----------------------------------------------------------------

class ForeignRoot(ValueError):
    """The checkpoint root belongs to another job; nothing was written to it."""


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def identity(layout: dict, job: str | None = None) -> dict:
    """What makes checkpoints of one job: the parameters (names, shapes, dtypes) and the gradient
    dtype of its layout, and its name when it has one. Bucket layouts are left out: they do not
    change what a checkpoint holds."""
    params = [[p["name"], list(p["shape"]), p.get("dtype", "float32")] for p in layout["params"]]
    return {"layout_sha256": _digest({"params": params, "grad_dtype": layout.get("grad_dtype", "float32")}),
            "job": job, "params": len(params)}


def read_identity(root) -> tuple[dict | None, str]:
    """(identity, where it comes from): ROOT/job.json, else the newest committed checkpoint's
    manifest (roots written before job.json existed), else (None, "")."""
    root = Path(root)
    try:
        d = json.loads((root / IDENTITY).read_text())
        if isinstance(d, dict) and d.get("format") == IDENTITY_FORMAT and "layout_sha256" in d:
            return d, str(root / IDENTITY)
        raise ForeignRoot(f"{root / IDENTITY}: not a mirrorckpt root identity; refusing to write here")
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        if isinstance(e, ForeignRoot):
            raise
        raise ForeignRoot(f"{root / IDENTITY}: unreadable ({e}); refusing to write here") from None
    for _, path in reversed(committed(root)):
        try:
            m = read_manifest(path)
        except ManifestError:
            continue
        if isinstance(m.get("layout"), dict) and "params" in m["layout"]:
            return identity(m["layout"], m.get("job")), str(path / "manifest.json")
    return None, ""


def check_identity(root, want: dict) -> None:
    """Raise ForeignRoot when ``root`` holds (or is recorded for) another job. Reads only."""
    have, where = read_identity(root)
    if have is None:
        return
    why = None
    if have["layout_sha256"] != want["layout_sha256"]:
        why = (f"its model differs ({have.get('params')} parameters, layout {have['layout_sha256'][:12]}; "
               f"this job: {want.get('params')} parameters, layout {want['layout_sha256'][:12]})")
    elif have.get("job") and want.get("job") and have["job"] != want["job"]:
        why = f"it belongs to job {have['job']!r}, this is job {want['job']!r}"
    if why:
        raise ForeignRoot(f"{root}: checkpoint directory of another job: {why} (from {where}); "
                          "nothing was written: give this job its own checkpoint directory")


def foreign_root(root, layout, job: str | None = None) -> str | None:
    """Why ``root`` cannot take checkpoints of the job with ``layout`` (a JobLayout), or None; for
    the CLIs to say before anything starts or is touched. Reads only."""
    if layout is None:
        return None
    try:
        check_identity(root, identity(layout.to_dict(), job))
    except ForeignRoot as e:
        return str(e)
    return None


def record_identity(root, want: dict) -> None:
    """Write ROOT/job.json once (atomically); an existing one is kept."""
    root = Path(root)
    if (root / IDENTITY).exists():
        return
    tmp = root / f"{POINTER_TMP}job-{os.getpid()}"
    fsync_write(tmp, json.dumps(dict(want, format=IDENTITY_FORMAT), sort_keys=True, indent=1).encode())
    os.replace(tmp, root / IDENTITY)
    fsync_dir(root)


# ---- quarantine ----------------------------------------------------------------------------

def pending_quarantine(root) -> dict:
    try:
        d = json.loads((Path(root) / QUARANTINE_PENDING).read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def quarantined(root) -> list[tuple[int, Path]]:
    q = Path(root) / QUARANTINE
    if not q.is_dir():
        return []
    out = [(parse_step(p.name.split(".")[0]), p) for p in q.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in out if s is not None)


def quarantine(root, after: int, reason: str) -> list[str]:
    """Move every checkpoint after step ``after`` to ROOT/quarantine (kept, never read by default)
    and point `latest` at the newest one left. A journal written first makes it all-or-nothing:
    readers skip the steps it lists, and a crash is finished by ``finish_quarantine`` on start."""
    root = Path(root)
    steps = [p.name for s, p in step_dirs(root) if s > after]
    if not steps:
        return []
    fsync_write(root / f"{POINTER_TMP}q-{os.getpid()}",
                json.dumps({"after": after, "steps": steps, "reason": reason}).encode())
    os.replace(root / f"{POINTER_TMP}q-{os.getpid()}", root / QUARANTINE_PENDING)
    fsync_dir(root)
    finish_quarantine(root)
    return steps


def finish_quarantine(root) -> None:
    root = Path(root)
    todo = pending_quarantine(root)
    if not todo and not (root / QUARANTINE_PENDING).exists():
        return
    q = root / QUARANTINE
    q.mkdir(exist_ok=True)
    for name in todo.get("steps", ()):
        src = root / name
        if src.is_dir():
            dst = q / name
            n = 1
            while dst.exists():  # the same step quarantined twice (another history): keep both
                dst, n = q / f"{name}.{n}", n + 1
            os.rename(src, dst)
    if todo:
        with open(q / "log.jsonl", "a") as f:
            f.write(json.dumps(todo) + "\n")
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(q)
    os.unlink(root / QUARANTINE_PENDING)
    fsync_dir(root)
    done = committed(root)
    if done:
        write_pointer(root, done[-1][1].name)
    else:
        (root / POINTER).unlink(missing_ok=True)
        fsync_dir(root)
