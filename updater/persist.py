"""Committing replica snapshots as torch.distributed.checkpoint (DCP) directories, in the background.

Commit protocol for one checkpoint (ckptdir.py lists the names):
 0. the root must be this job's (ROOT/job.json, else the manifests there); a root without one
    gets this job's identity, fsync'd, before anything else is written;
 1. write into ROOT/.partial-step-N-*: `dcp.save` without a process group (data files and
    .metadata fsync'd by DCP's FileSystemWriter), then manifest.json (sha256 of every file, every
    stored byte range and every tensor), fsync'd, then fsync the directory;
 2. rename it to ROOT/step-N (refused if that exists: nothing committed is overwritten), fsync ROOT;
 3. replace ROOT/latest atomically (temp file, fsync, rename, fsync ROOT);
 4. retention: only now remove committed checkpoints beyond the newest K (renamed to .deleting-*
    first, so a half-removed directory never carries a final name); the newest checkpoint proven
    equal to the trainer (manifest `verified`) is kept as well.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.dcp_keys import flatten, loads, map_leaves
from mirrorckpt.updater.manifest import MANIFEST_TMP, dtype_name, hash_file, set_verified, tensor_sha256, write_manifest

log = logging.getLogger(__name__)


class CheckpointExists(FileExistsError):
    """A checkpoint for this step (or a newer one) is already committed; it is left as it is."""


def write_checkpoint(root, state_dict: dict, keep_last: int | None = None, job: str | None = None,
                     verified: dict | None = None, threads: int = 1, weights_only: bool = False) -> Path:
    """Commit one checkpoint of the nested DCP ``state_dict`` (updater.dcp_keys layout) under
    ``root`` and return its directory. Synchronous; the Persister calls it from its thread.
    A root that belongs to another job (ckptdir.check_identity) is refused before anything is
    written; a root without an identity gets this job's. ``weights_only``: the state is the
    model's parameters alone (updater.weights), and the manifest says so."""
    root = Path(root)
    extra = state_dict["extra"]
    step = int(extra["iterations_done"])
    ident = ckptdir.identity(loads(extra["layout"]), job)
    ckptdir.check_identity(root, ident)
    root.mkdir(parents=True, exist_ok=True)
    final = root / ckptdir.step_dirname(step)
    if final.exists():
        raise CheckpointExists(f"{final}: already exists; a committed checkpoint is never overwritten")
    newest = ckptdir.latest(root)
    if newest is not None and ckptdir.parse_step(newest.name) > step:
        raise CheckpointExists(f"{root}: step {step} is older than the committed {newest.name}; "
                               "a diverged history needs its own checkpoint root")
    ckptdir.record_identity(root, ident)
    tmp = root / f"{ckptdir.PARTIAL}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_partial(tmp, state_dict, job, verified, threads, weights_only)
        os.rename(tmp, final)  # fails on an existing non-empty directory: no overwrite
        ckptdir.fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ckptdir.write_pointer(root, final.name)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _write_partial(tmp: Path, state_dict: dict, job: str | None, verified: dict | None, threads: int = 1,
                   weights_only: bool = False) -> None:
    """DCP files, then the manifest. ``threads`` DCP writer threads (one data file each); the
    tensors are hashed by as many threads while DCP writes, and the files read back in parallel
    (hashlib releases the GIL)."""
    dcp = ckptdir.dcp_module()
    flat = flatten(state_dict)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="mirrorckpt-hash") as pool:
        keys = [k for k, v in flat.items() if isinstance(v, torch.Tensor)]
        sums = pool.map(tensor_sha256, [flat[k] for k in keys])  # overlaps the write below
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=max(1, threads),
                                      overwrite=False)
        md = dcp.save(state_dict, storage_writer=writer, no_dist=True)
        if getattr(md, "storage_data", None) is None:  # torch < 2.13 returns it without: read it back
            md = dcp.FileSystemReader(str(tmp)).read_metadata()
        tensors = {k: {"sha256": h, "dtype": dtype_name(flat[k]), "shape": list(flat[k].shape)}
                   for k, h in zip(keys, sums)}
        stored = {k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        if stored != set(tensors):
            raise RuntimeError(f"DCP stored tensor keys differ from ours: {sorted(stored ^ set(tensors))[:5]}")
        hashed = _hash_files(pool, tmp, md)
    _finish_partial(tmp, state_dict, job, verified, tensors, hashed, weights_only)


def storage_ranges(md) -> tuple[dict[str, list], dict[str, tuple]]:
    """Where a DCP save put each tensor (a slice: ``fqn@[offsets]``): per file its (key, offset,
    length) ranges, and per key its (file, offset, length)."""
    ranges: dict[str, list] = {}
    where: dict[str, tuple] = {}
    for idx, info in md.storage_data.items():
        key = idx.fqn if idx.offset is None or not any(idx.offset) else f"{idx.fqn}@{list(idx.offset)}"
        ranges.setdefault(info.relative_path, []).append((key, info.offset, info.length))
        where[key] = (info.relative_path, info.offset, info.length)
    return ranges, where


def _hash_files(pool, tmp: Path, md):
    ranges, where = storage_ranges(md)
    names = sorted(os.listdir(tmp))
    return names, where, list(pool.map(lambda n: hash_file(tmp / n, ranges.get(n, ())), names))


def _finish_partial(tmp: Path, state_dict: dict, job: str | None, verified: dict | None, tensors: dict,
                    hashed, weights_only: bool = False) -> None:
    names, where, results = hashed
    files, items = {}, {}
    for name, (size, sha, parts) in zip(names, results):
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
    } | ({"job": job} if job else {}) | ({"verified": verified} if verified else {})
        | ({"weights_only": True} if weights_only else {}))
    ckptdir.fsync_dir(tmp)


def prune(root, keep_last: int) -> list[Path]:
    """Remove committed checkpoints beyond the newest ``keep_last``, never the newest verified one
    (proven equal to the trainer); returns what was removed."""
    done = ckptdir.committed(root)
    keep = {p for _, p in done[-keep_last:]} if keep_last > 0 else set()
    verified = [p for _, p in done if p not in keep and ckptdir.verification(p) is not None]
    keep.update(verified[-1:])
    removed = []
    for _, path in done:
        if path in keep:
            continue
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
    ckptdir.finish_quarantine(root)
    removed = []
    for _, d in ckptdir.step_dirs(root):  # a manifest rewrite (set_verified) cut short
        (d / MANIFEST_TMP).unlink(missing_ok=True)
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
    unstaged: int = 0  # larger than the staging budget: written from the replica while it waited
    unstaged_seconds: float = 0.0  # time the replica waited for those writes
    skipped_budget: int = 0  # due, but staging buffers were still held by earlier writes
    skipped_busy: int = 0  # due, but the replica was between buckets of an iteration
    failed: int = 0
    verified: int = 0  # checkpoints marked proven equal to the trainer
    verified_without_checkpoint: int = 0  # a proven step this persister did not commit
    quarantined: int = 0  # checkpoints moved aside after drift
    refused: str | None = None  # the root belongs to another job: nothing is written
    last_error: str | None = None
    last_committed: str | None = None
    last_commit_seconds: float = 0.0  # the newest commit's write, hashes, fsyncs and rename
    committed_step: int | None = None  # the newest committed checkpoint's step, and when (unix time)
    committed_unix: float | None = None
    verified_step: int | None = None  # the newest checkpoint proven equal to the trainer
    failed_unix: float | None = None  # when the newest write failed

    @property
    def failing(self) -> str | None:
        """Why checkpoints are not being committed: the newest write failed after the newest commit."""
        if self.refused:
            return self.refused
        if self.failed_unix is not None and (self.committed_unix is None or self.failed_unix > self.committed_unix):
            return self.last_error
        return None


class StagingPool:
    """Staging buffers for snapshots, reused across snapshots of the same shapes. The bytes
    allocated never exceed the budget; a snapshot that does not fit gets no buffer."""

    def __init__(self, budget: int):
        self.budget, self.allocated = budget, 0
        self._free: list[tuple[tuple, int, dict]] = []
        self._lock = threading.Lock()

    @staticmethod
    def size(specs: dict[str, tuple]) -> int:
        return sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in specs.values())

    def acquire(self, specs: dict[str, tuple]) -> tuple | None:
        sig = tuple(sorted(specs.items()))
        need = self.size(specs)
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

    ``submit`` copies the state into a staging buffer and returns at once; it never waits for a
    write. A snapshot larger than the whole staging budget cannot be staged: it is written from
    the replica itself, tensor by tensor, while the caller waits (logged once, counted in
    ``stats.unstaged``); nothing due is ever skipped for its size.

    The root is claimed for one job (ckptdir.check_identity) before anything in it is touched:
    at construction when ``identity`` is given, else at the first snapshot, from the replica's
    layout. A foreign root is refused (``stats.refused``) and nothing is written to it.

    The control plane reports what it proved: ``mark_verified(step, fingerprints)`` records in the
    manifest of the checkpoint this persister took at that step that it equals the trainer's
    state (pruning keeps the newest such); ``quarantine_after(step)`` moves the checkpoints after
    the last proven step aside when drift is found. Both run in the writer thread, in order with
    the commits queued before them."""

    def __init__(self, spec: PersistSpec, on_commit: Callable[[Path], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, identity: dict | None = None):
        self.spec, self.root, self.clock, self.on_commit = spec, Path(spec.directory), clock, on_commit
        self.job = getattr(spec, "job_name", None)
        if identity is not None:
            ckptdir.check_identity(self.root, identity)  # before the lock file: a foreign root is not touched
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = ckptdir.RootLock(self.root)
        self.identity: dict | None = None
        self.recovered: dict | None = None
        self._last_iterations: int | None = None
        self.last_verified_step: int | None = None
        self._last_time = clock()
        self.stats = PersistStats()
        self._pool = StagingPool(spec.memory_budget_bytes)
        self._queue: queue.Queue = queue.Queue()
        self._inflight = 0
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()  # one write to the root at a time (writer thread or unstaged)
        self._seq = 0
        self._taken: dict[int, int] = {}  # step -> sequence number of the latest snapshot taken at it
        self._landed: set[int] = set()  # sequence numbers committed
        self._closed = False
        if identity is not None:
            self._claim(identity)
        self._thread = threading.Thread(target=self._run, name="mirrorckpt-persist", daemon=True)
        self._thread.start()

    def _claim(self, identity: dict) -> None:
        """Check the root is this job's, then recover it (leftovers, pointer, retention)."""
        ckptdir.check_identity(self.root, identity)
        self.identity = identity
        self.recovered = recover(self.root, self.spec.keep_last)
        newest = self.recovered["latest"]
        self._last_iterations = ckptdir.parse_step(newest.name) if newest is not None else None
        proven = [s for s, p in ckptdir.committed(self.root) if ckptdir.verification(p) is not None]
        self.last_verified_step = proven[-1] if proven else None

    def claim_for(self, layout: dict) -> bool:
        """Claim the root for the job of ``layout`` (a JobLayout dict) if not claimed yet; False
        (and ``stats.refused`` set, logged) when it belongs to another job."""
        if self.identity is not None:
            return True
        if self.stats.refused is not None:
            return False
        try:
            self._claim(ckptdir.identity(layout, self.job))
        except ckptdir.ForeignRoot as e:
            self.stats.refused = self.stats.last_error = str(e)
            self.stats.failed += 1
            log.error("%s", e)
            return False
        return True

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
        """Snapshot ``replica`` if due (or ``force``); True if a snapshot was queued or written."""
        if self._closed:
            raise RuntimeError("Persister is closed")
        if not self.claim_for(replica.layout.to_dict()):
            return False
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
        if StagingPool.size(specs) > self._pool.budget:
            return self._write_unstaged(sd, it, StagingPool.size(specs))
        buf = self._pool.acquire(specs)
        if buf is None:  # earlier snapshots still hold the buffers: the next due one goes
            self.stats.skipped_budget += 1
            return False
        staging = buf[2]

        def stage(key, v):
            if isinstance(v, torch.Tensor):
                return staging[key].copy_(v)
            return copy.deepcopy(v)

        staged = map_leaves(sd, stage)
        self._put(("commit", self._take(it), staged, buf))
        self.stats.submitted += 1
        return True

    def _take(self, step: int) -> int:
        self._seq += 1
        self._taken[step] = self._seq
        while len(self._taken) > 1024:
            self._taken.pop(next(iter(self._taken)))
        self._last_iterations, self._last_time = step, self.clock()
        return self._seq

    def _write_unstaged(self, sd: dict, step: int, nbytes: int) -> bool:
        if not self.stats.unstaged:
            log.warning("snapshot of %d bytes exceeds persist memory_budget_bytes (%d): written from the "
                        "replica tensor by tensor while it waits (raise the budget to write in the background)",
                        nbytes, self._pool.budget)
        self.flush()  # earlier snapshots first, in order
        t0 = time.monotonic()
        seq = self._take(step)
        with self._write_lock:
            self._commit(seq, sd)
        self.stats.unstaged += 1
        self.stats.unstaged_seconds += time.monotonic() - t0
        return True

    def mark_verified(self, step: int, fingerprints: dict, source: str = "fingerprint",
                      numeric: dict | None = None) -> None:
        """The replica's state at ``step`` was proven equal to the trainer's (per-tensor
        ``fingerprints`` as updater.fingerprint, keyed by DCP flat key), bit for bit or, with
        ``numeric`` (updater.numeric.Verdict.record: match, distance, tolerance...), within the
        tolerance of a trainer whose arithmetic differs. The checkpoint this persister took at
        that step, if any, records it in its manifest."""
        info = {"step": int(step), "source": source, "unix": time.time(),
                "fingerprints": {str(k): int(v) for k, v in fingerprints.items()},
                "match": "exact", "distance": 0.0}
        info.update(numeric or {})
        self.last_verified_step = max(step, self.last_verified_step if self.last_verified_step is not None else step)
        self._put(("verify", self._taken.get(step), info))

    def quarantine_after(self, step: int | None = None, reason: str = "drift") -> None:
        """Drift was found: checkpoints after ``step`` (default: the last proven step; with none,
        every checkpoint) are moved to ROOT/quarantine once the writes queued before are done."""
        if step is None:
            step = self.last_verified_step if self.last_verified_step is not None else -1
        if self._last_iterations is not None:
            self._last_iterations = min(self._last_iterations, step) if step >= 0 else None
        self._put(("quarantine", int(step), reason))

    def _put(self, job) -> None:
        with self._cond:
            self._inflight += 1
        self._queue.put(job)

    def _commit(self, seq: int, sd: dict) -> None:
        """One write (writer thread, or the caller for an unstaged snapshot); failures are counted
        and logged, never raised: later snapshots must still be written."""
        try:
            t = time.perf_counter()
            path = write_checkpoint(self.root, sd, keep_last=self.spec.keep_last, job=self.job,
                                    threads=self.spec.writer_threads)
            self.stats.last_commit_seconds = time.perf_counter() - t
            self._landed.add(seq)
            self.stats.committed += 1
            self.stats.last_committed = str(path)
            self.stats.committed_step = ckptdir.parse_step(path.name)
            self.stats.committed_unix = time.time()
            if self.on_commit is not None:
                self.on_commit(path)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.stats.failed += 1
            self.stats.failed_unix = time.time()
            self.stats.last_error = f"{type(e).__name__}: {_first_line(e)}{_free_space(self.root)}"
            log.error("checkpoint write failed: %s", self.stats.last_error)

    def _verify(self, seq: int | None, info: dict) -> None:
        path = self.root / ckptdir.step_dirname(info["step"])
        if seq is None or seq not in self._landed or not path.is_dir():
            self.stats.verified_without_checkpoint += 1
            return
        try:
            set_verified(path, info)
            self.stats.verified += 1
            self.stats.verified_step = max(info["step"], self.stats.verified_step or 0)
        except Exception as e:
            self.stats.failed += 1
            self.stats.last_error = f"marking {path.name} verified: {type(e).__name__}: {e}"
            log.error("%s", self.stats.last_error)

    def _quarantine(self, after: int, reason: str) -> None:
        try:
            moved = ckptdir.quarantine(self.root, after, reason)
        except Exception as e:
            self.stats.failed += 1
            self.stats.last_error = f"quarantine after step {after}: {type(e).__name__}: {e}"
            log.error("%s", self.stats.last_error)
            return
        self.stats.quarantined += len(moved)
        if moved:
            log.warning("%s: %d checkpoint(s) after step %d quarantined (%s): %s", self.root, len(moved), after,
                        reason, ", ".join(moved))

    def _run(self):
        while True:
            job = self._queue.get()
            if job is None:
                self._lock.release()  # only once the last queued write is done
                return
            try:
                with self._write_lock:
                    if job[0] == "commit":
                        self._commit(job[1], job[2])
                    elif job[0] == "verify":
                        self._verify(job[1], job[2])
                    else:
                        self._quarantine(job[1], job[2])
            finally:
                if job[0] == "commit":
                    self._pool.release(job[3])
                del job
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


def _first_line(e: BaseException) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return lines[-1] if len(lines) > 1 and "Traceback" in str(e) else (lines[0] if lines else "")


def _free_space(root: Path) -> str:
    """The filesystem's free space, when low: DCP reports a full disk as a torn zip record."""
    try:
        st = os.statvfs(root)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f" ({free} bytes free on the filesystem: full?)" if free < (64 << 20) else ""
