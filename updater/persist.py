"""Committing replica snapshots as torch.distributed.checkpoint (DCP) directories, in the background.

Commit protocol for one checkpoint (ckptdir.py lists the names):
 1. write into ROOT/.partial-step-N-*: `dcp.save` without a process group (data files and
    .metadata fsync'd by DCP's FileSystemWriter), then manifest.json (sha256 of every file, every
    stored byte range and every tensor), fsync'd, then fsync the directory;
 2. rename it to ROOT/step-N (refused if that exists: nothing committed is overwritten), fsync ROOT;
 3. replace ROOT/latest atomically (temp file, fsync, rename, fsync ROOT);
 4. retention: only now remove committed checkpoints beyond the newest K (renamed to .deleting-*
    first, so a half-removed directory never carries a final name).
A kill at any point leaves `latest` naming a complete checkpoint; the start-up `recover` removes
leftovers and moves a lagging pointer forward to the newest committed directory.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.training import PersistSpec
from . import ckptdir
from .dcp_keys import flatten, loads, map_leaves
from .manifest import dtype_name, hash_file, tensor_sha256, write_manifest

log = logging.getLogger(__name__)


class CheckpointExists(FileExistsError):
    """A checkpoint for this step (or a newer one) is already committed; it is left as it is."""


def write_checkpoint(root, state_dict: dict, keep_last: int | None = None) -> Path:
    """Commit one checkpoint of the nested DCP ``state_dict`` (updater.dcp_keys layout) under
    ``root`` and return its directory. Synchronous; the Persister calls it from its thread."""
    root = Path(root)
    extra = state_dict["extra"]
    step = int(extra["iterations_done"])
    root.mkdir(parents=True, exist_ok=True)
    final = root / ckptdir.step_dirname(step)
    if final.exists():
        raise CheckpointExists(f"{final}: already exists; a committed checkpoint is never overwritten")
    newest = ckptdir.latest(root)
    if newest is not None and ckptdir.parse_step(newest.name) > step:
        raise CheckpointExists(f"{root}: step {step} is older than the committed {newest.name}; "
                               "a diverged history needs its own checkpoint root")
    tmp = root / f"{ckptdir.PARTIAL}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_partial(tmp, state_dict)
        os.rename(tmp, final)  # fails on an existing non-empty directory: no overwrite
        ckptdir.fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckptdir.write_pointer(root, final.name)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _write_partial(tmp: Path, state_dict: dict) -> None:
    dcp = ckptdir.dcp_module()
    flat = flatten(state_dict)
    tensors = {k: {"sha256": tensor_sha256(v), "dtype": dtype_name(v), "shape": list(v.shape)}
               for k, v in flat.items() if isinstance(v, torch.Tensor)}
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
    md = dcp.save(state_dict, storage_writer=writer, no_dist=True)
    stored = {k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
    if stored != set(tensors):
        raise RuntimeError(f"DCP stored tensor keys differ from ours: {sorted(stored ^ set(tensors))[:5]}")
    ranges: dict[str, list] = {}
    where: dict[str, tuple] = {}
    for idx, info in md.storage_data.items():
        key = idx.fqn if idx.offset is None or not any(idx.offset) else f"{idx.fqn}@{list(idx.offset)}"
        ranges.setdefault(info.relative_path, []).append((key, info.offset, info.length))
        where[key] = (info.relative_path, info.offset, info.length)
    files, items = {}, {}
    for name in sorted(os.listdir(tmp)):
        size, sha, parts = hash_file(tmp / name, ranges.get(name, ()))
        files[name] = {"size": size, "sha256": sha}
        for key, h in parts.items():
            f, off, n = where[key]
            items[key] = {"file": f, "offset": off, "length": n, "sha256": h}
    extra = state_dict["extra"]
    write_manifest(tmp, {
        "step": int(extra["iterations_done"]),
        "optimizer_step": int(extra["step"]),
        "created_unix": time.time(),
        "torch_version": torch.__version__,
        "layout": loads(extra["layout"]),
        "training": loads(extra["training"]),
        "files": files,
        "items": items,
        "tensors": tensors,
    })
    ckptdir.fsync_dir(tmp)


def prune(root, keep_last: int) -> list[Path]:
    """Remove committed checkpoints beyond the newest ``keep_last``; returns what was removed."""
    done = ckptdir.committed(root)
    removed = []
    for _, path in done[:-keep_last] if keep_last > 0 else []:
        gone = Path(root) / f"{ckptdir.DELETING}{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, gone)  # atomic: a half-deleted directory never carries a final name
        ckptdir.fsync_dir(root)
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(path)
    return removed


def recover(root, keep_last: int | None = None) -> dict:
    """Start-up cleanup: drop partial/deleting directories and pointer temp files, point `latest`
    at the newest committed checkpoint, and apply retention (a crash may have come between a commit
    and its pruning). Call with the root's lock held."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    removed = []
    for p in root.iterdir():
        if p.name.startswith((ckptdir.PARTIAL, ckptdir.DELETING)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        elif p.name.startswith(ckptdir.POINTER_TMP):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    done = ckptdir.committed(root)
    uncommitted = [p.name for s, p in ckptdir.step_dirs(root) if (s, p) not in done]
    newest = done[-1][1] if done else None
    if newest is not None and ckptdir.read_pointer(root) != newest:
        ckptdir.write_pointer(root, newest.name)
    if removed:
        ckptdir.fsync_dir(root)
    if keep_last is not None:
        removed += [p.name for p in prune(root, keep_last)]
    if uncommitted:
        log.warning("%s: step directories without a valid manifest are ignored: %s", root, uncommitted)
    return {"removed": removed, "latest": newest, "uncommitted": uncommitted}


# ---- background persister --------------------------------------------------------------------

@dataclass
class PersistStats:
    submitted: int = 0  # snapshots staged and queued
    committed: int = 0
    skipped_budget: int = 0  # due, but the staging copy did not fit the memory budget
    skipped_busy: int = 0  # due, but the replica was between buckets of an iteration
    failed: int = 0
    last_error: str | None = None
    last_committed: str | None = None


class StagingPool:
    """Staging buffers for snapshots, reused across snapshots of the same shapes. The bytes
    allocated never exceed the budget; a snapshot that does not fit gets no buffer."""

    def __init__(self, budget: int):
        self.budget, self.allocated = budget, 0
        self._free: list[tuple[tuple, int, dict]] = []
        self._lock = threading.Lock()

    def acquire(self, specs: dict[str, tuple]) -> tuple | None:
        sig = tuple(sorted(specs.items()))
        need = sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in specs.values())
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf[0] == sig:
                    return self._free.pop(i)
            while self.allocated + need > self.budget and self._free:
                self.allocated -= self._free.pop(0)[1]  # shapes changed: drop an unusable buffer
            if self.allocated + need > self.budget:
                return None
            self.allocated += need
        return sig, need, {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in specs.items()}

    def release(self, buf: tuple) -> None:
        with self._lock:
            self._free.append(buf)


class Persister:
    """Takes replica snapshots at the configured interval and commits them from a writer thread.

    ``submit`` copies the state into a staging buffer (only if the memory budget allows; else the
    snapshot is skipped and counted) and returns at once; it never waits for a write."""

    def __init__(self, spec: PersistSpec, on_commit: Callable[[Path], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.spec, self.root, self.clock, self.on_commit = spec, Path(spec.directory), clock, on_commit
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = ckptdir.RootLock(self.root)
        self.recovered = recover(self.root, spec.keep_last)
        newest = self.recovered["latest"]
        self._last_iterations = ckptdir.parse_step(newest.name) if newest is not None else None
        self._last_time = clock()
        self.stats = PersistStats()
        self._pool = StagingPool(spec.memory_budget_bytes)
        self._queue: queue.Queue = queue.Queue()
        self._inflight = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mirrorckpt-persist", daemon=True)
        self._thread.start()

    def due(self, iterations_done: int) -> bool:
        if self._last_iterations is not None and iterations_done <= self._last_iterations:
            return False  # nothing new since the last snapshot
        s = self.spec
        if s.every_iterations is None and s.every_seconds is None:
            return True
        since = iterations_done - (self._last_iterations or 0)
        if s.every_iterations is not None and since >= s.every_iterations:
            return True
        return s.every_seconds is not None and self.clock() - self._last_time >= s.every_seconds

    def submit(self, replica, force: bool = False) -> bool:
        """Snapshot ``replica`` if due (or ``force``); True if a snapshot was queued for writing."""
        if self._closed:
            raise RuntimeError("Persister is closed")
        it = replica.iterations_done
        if self._last_iterations is not None and it <= self._last_iterations:
            return False
        if not (force or self.due(it)):
            return False
        try:
            sd = replica.state_dict_for_checkpoint()
        except RuntimeError:
            self.stats.skipped_busy += 1
            return False
        flat = flatten(sd)
        specs = {k: (tuple(v.shape), v.dtype) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        buf = self._pool.acquire(specs)
        if buf is None:
            self.stats.skipped_budget += 1
            return False
        staging = buf[2]

        def stage(key, v):
            if isinstance(v, torch.Tensor):
                return staging[key].copy_(v)
            return copy.deepcopy(v)

        staged = map_leaves(sd, stage)
        self._last_iterations, self._last_time = it, self.clock()
        with self._cond:
            self._inflight += 1
        self.stats.submitted += 1
        self._queue.put((staged, buf))
        return True

    def _run(self):
        while True:
            job = self._queue.get()
            if job is None:
                self._lock.release()  # only once the last queued write is done
                return
            staged, buf = job
            try:
                path = write_checkpoint(self.root, staged, keep_last=self.spec.keep_last)
                self.stats.committed += 1
                self.stats.last_committed = str(path)
                if self.on_commit is not None:
                    self.on_commit(path)
            except Exception as e:  # a failed write must not stop later ones; it is counted and logged
                self.stats.failed += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                log.error("checkpoint write failed: %s", self.stats.last_error)
            finally:
                del staged
                self._pool.release(buf)
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued snapshot is written (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout)

    def close(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if wait:
            self.flush()
        self._queue.put(None)
        if wait:
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
