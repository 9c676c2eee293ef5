"""One DCP checkpoint of a sharded job, written together by the appliances that follow its DP groups.

The appliances of a job form a torch.distributed gloo process group (rendezvous at a TCPStore,
``init_group``). Each holds snapshots of its replica shards at recent due steps (``offer``); a
``save_round``, which every appliance calls (the calls pair up as collectives do), then:

 1. agrees on the step: the newest step every appliance holds a snapshot of, newer than the
    last joint commit (all_gather_object of the held steps). A stale appliance holds no newer
    step, so the checkpoint waits for it; it never mixes steps;
 2. the coordinator (rank 0) merges the non-tensor values (param groups listing every FQN of
    the model, the extras; groups that disagree abort the round);
 3. ``dcp.save`` over the group into ROOT/.partial-*: each appliance writes its own slices
    (``ShardPlanner``: write items with the slice's offset in the global tensor), replicated
    values are written once (DCP's dedup), the coordinator writes ``.metadata`` with global
    shapes and chunk offsets, so ``dcp.load`` reshards into any layout;
 4. every appliance hashes its own files and slices; the coordinator writes the manifest
    (``tensors[key].chunks``: offset, sizes, sha256 of each slice) and commits as
    updater.persist does: fsyncs, rename to ROOT/step-N, atomic ``latest``, pruning.

A member lost during a round fails the collective on the others: nothing is renamed, `latest`
still names the previous joint checkpoint, the partial directory is removed (or by ``recover``
at the next start). The group is then broken (gloo cannot lose a member): ``save_round`` says so
and the appliance goes on following its rings.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from mirrorckpt.config.shards import ShardedLayout
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.dcp_keys import _is_leaf, dumps, flatten, loads, map_leaves
from mirrorckpt.updater.manifest import hash_file, tensor_sha256, write_manifest
from mirrorckpt.updater.persist import prune, recover, storage_ranges
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

log = logging.getLogger(__name__)


class JointSaveError(RuntimeError):
    """A joint round failed; nothing was committed."""


def said(e: BaseException) -> str:
    """An error in one line for a log or a verdict, without gloo's source location
    ("[.../pair.cc:553] Connection closed by peer ...")."""
    text = str(e).strip()
    first = re.sub(r"^\[[^\]\s]+:\d+\]\s*", "", text.splitlines()[0]) if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def init_group(address: str, rank: int, world: int, timeout_s: float = 60.0):
    """Join the appliances' gloo process group: rank 0 hosts the TCPStore at ``address`` (host:port)."""
    import torch.distributed as dist

    join_group(address, rank, world, timeout_s)
    return dist.group.WORLD


def join_group(address: str, rank: int, world: int, timeout_s: float = 60.0):
    """``init_group``, returning the group's TCPStore (``shard_clip.StoreNormExchange`` meets there).
    Raises RuntimeError naming the address when the group is not complete within ``timeout_s``."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    try:
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
        raise RuntimeError(f"the appliances' process group at {address} (rank {rank} of {world}) was not complete "
                           f"within {timeout_s:g} s: {said(e)}") from None
    return store


def init_local_group():
    """A process group of this process alone: one appliance process that follows every group of
    the job (``serve`` with [[ring]] tables) writes its joint checkpoints through it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("this process is already in a process group of several appliances")
    return dist.group.WORLD


def _paths(sd: dict) -> dict[str, tuple]:
    """DCP flat key -> path of keys and list indices (DCP's planner_data)."""
    out: dict[str, tuple] = {}

    def walk(key: str, path: tuple, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{key}.{k}", path + (k,), x)
        elif _is_leaf(v):
            out[key] = path
        else:
            for i, x in enumerate(v):
                walk(f"{key}.{i}", path + (i,), x)

    for k, v in sd.items():
        walk(str(k), (k,), v)
    return out


def fqn_of(key: str) -> str | None:
    if key.startswith("model."):
        return key[len("model."):]
    if key.startswith("optim.state."):
        return key[len("optim.state."):key.rfind(".")]
    return None


@dataclass
class Chunk:
    key: str  # DCP flat key
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    tensor: torch.Tensor


def shard_chunks(layout: ShardedLayout, group: str, flat: dict) -> tuple[list[Chunk], dict]:
    """A group's flat state split into tensor slices placed in the global tensors, and the other values."""
    g = layout.group(group)
    chunks, objects = [], {}
    for key, v in flat.items():
        if not isinstance(v, torch.Tensor):
            objects[key] = v
            continue
        fqn = fqn_of(key)
        s = g.shard(fqn) if fqn is not None and any(x.fqn == fqn for x in g.shards) else None
        if s is not None and not s.whole and tuple(v.shape) == s.local_shape:
            flat = v.reshape(-1)
            for off, shape, a, b in s.boxes():  # a flat range: the boxes of the global tensor it covers
                piece = v if s.flat is None else flat[a:b].view(shape)
                chunks.append(Chunk(key, off, tuple(s.global_shape), piece))
        elif s is not None and not s.whole and v.dim() > 0:
            raise ValueError(f"group {group}: {key} has shape {list(v.shape)}, its slice {list(s.local_shape)}")
        else:  # whole tensors: unsharded parameters, scalar step counts, RNG states
            chunks.append(Chunk(key, (0,) * v.dim(), tuple(v.shape), v))
    return chunks, objects


def merge_objects(layout: ShardedLayout, per_group: list[dict]) -> dict:
    """The non-tensor values of the joint checkpoint from every group's: param groups list every
    FQN (model order), the parameters no step has touched are every group's together,
    extras describe the whole model; any other disagreement is an error."""
    order = {p.name: i for i, p in enumerate(layout.params)}
    out: dict = {}
    unstepped: set | None = None
    for objs in per_group:
        for k, v in objs.items():
            if k.startswith("optim.param_groups.") and k.endswith(".params"):
                out[k] = sorted(set(out.get(k, [])) | set(v), key=order.__getitem__)
            elif k == "extra.unstepped":  # each group lists its own slices' parameters
                unstepped = (unstepped or set()) | set(loads(v))
            elif k == "extra.layout":
                continue
            elif k in out and out[k] != v:
                raise JointSaveError(f"groups disagree on {k}: {str(out[k])[:80]} vs {str(v)[:80]}")
            else:
                out[k] = v
    if unstepped is not None:
        out["extra.unstepped"] = dumps(sorted(unstepped), "unstepped")
    out["extra.layout"] = dumps(layout.global_layout().to_dict(), "layout")
    out["extra.shards"] = dumps(layout.to_dict(), "shards")
    return out


class ShardPlanner(DefaultSavePlanner):
    """DCP save planner for slices of global tensors held by this process (several of one FQN
    when it follows several TP groups) and, on the coordinator, the merged non-tensor values."""

    def __init__(self, chunks: list[Chunk], objects: dict, paths: dict):
        # flatten_state_dict=True only so DCP merges every plan's planner_data (the key paths)
        # into .metadata; the state dict handed in is flat already (set_up_planner ignores it)
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.chunks = {(c.key, tuple(c.offset)): c for c in chunks}
        self.objects = objects
        self.paths = dict(paths) | {k: tuple(k.split(".")) for k in objects if k not in paths}
        self.final: list = []

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, off), c in self.chunks.items():
            whole = tuple(c.tensor.shape) == tuple(c.global_shape)
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(off)),
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=c.tensor.size()),
                    properties=TensorProperties.create_from_tensor(c.tensor),
                    size=torch.Size(c.global_shape))))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.objects]
        self.plan = SavePlan(items, planner_data=self.paths)
        return self.plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.final = list(new_plan.items)  # after DCP's dedup: what this process writes
        return super().finish_plan(new_plan)

    def lookup_object(self, index: MetadataIndex):
        if index.offset is None:
            return self.objects[index.fqn]
        return self.chunks[(index.fqn, tuple(index.offset))].tensor


@dataclass
class JointStats:
    offered: int = 0
    held: list[int] = field(default_factory=list)
    rounds: int = 0
    committed: int = 0
    waiting: int = 0  # rounds with no step every appliance holds yet
    failed: int = 0
    broken: str | None = None  # the group lost a member: no more joint rounds
    last_committed: str | None = None
    last_error: str | None = None
    last_seconds: float = 0.0


class JointPersister:
    """This appliance's part of a job's joint checkpoints (``layout`` names it ``appliance``).

    ``offer(group, replica)`` after every applied iteration snapshots the replica shard when the
    step is due (every ``every`` iterations), keeping the newest ``hold`` due steps in memory.
    ``save_round()`` is collective (see the module text). ``rank``/``world`` are this process's
    place in the appliances' process group (init_group), rank 0 the coordinator, which alone
    touches the root's pointer (and holds its lock)."""

    def __init__(self, layout: ShardedLayout, appliances: list[str], root, every: int = 1, hold: int = 2,
                 keep_last: int | None = 3, job: str | None = None, training: dict | None = None):
        import torch.distributed as dist

        self.dist = dist
        self.layout, self.appliances = layout, list(appliances)
        self.groups = [g.name for name in self.appliances for g in layout.groups_of(name)]
        if not self.groups:
            raise ValueError(f"{self.appliances}: no DP group of this job is followed here")
        self.root, self.every, self.hold, self.keep_last, self.job = Path(root), every, hold, keep_last, job
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.coordinator = self.rank == 0
        self.stats = JointStats()
        self._book: dict[int, dict[str, dict]] = {}  # step -> group -> staged nested state dict
        self._lock = threading.Lock()
        self._lockfile = None
        self.last_step: int | None = None
        self.all_ending = False  # the last round said every appliance was ending
        if self.coordinator:
            ident = ckptdir.identity(layout.global_layout().to_dict(), job)
            ckptdir.check_identity(self.root, ident)
            self.root.mkdir(parents=True, exist_ok=True)
            self._lockfile = ckptdir.RootLock(self.root)
            ckptdir.record_identity(self.root, ident)
            newest = recover(self.root, keep_last)["latest"]
            self.last_step = ckptdir.parse_step(newest.name) if newest is not None else None

    # ---- snapshots ----------------------------------------------------------------------

    def offer(self, group: str, replica) -> bool:
        """Snapshot ``replica`` (the shard of DP group ``group``) if its step is due."""
        step = replica.iterations_done
        if group not in self.groups or step % self.every or not replica.committable:
            return False
        try:
            sd = replica.state_dict_for_checkpoint()
        except RuntimeError:  # between buckets of an iteration
            return False
        staged = map_leaves(sd, lambda k, v: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        with self._lock:
            self._book.setdefault(step, {})[group] = staged
            for s in sorted(self._book)[:-self.hold]:
                del self._book[s]
            self.stats.offered += 1
            self.stats.held = self.held()
        return True

    def held(self) -> list[int]:
        """Steps of which every group followed here has a snapshot."""
        return sorted(s for s, by in self._book.items() if set(by) >= set(self.groups))

    # ---- a joint round ------------------------------------------------------------------

    def save_round(self, ending: bool = False) -> Path | None:
        """One collective round: the joint checkpoint at the newest step every appliance holds, or
        None when there is none newer than the last. Raises JointSaveError when the round failed.
        ``ending``: this appliance holds no newer step to come; ``all_ending`` then says whether
        every appliance said so (the last round: the appliances stop calling together)."""
        if self.stats.broken is not None:
            raise JointSaveError(f"the appliances' group is broken ({self.stats.broken}); restart to rejoin")
        self.stats.rounds += 1
        t0 = time.perf_counter()
        partial = None
        try:
            with self._lock:
                held = self.held()
            mine = {"held": held, "last": self.last_step, "ending": ending,
                    "partial": f"{ckptdir.PARTIAL}joint-{uuid.uuid4().hex[:8]}" if self.coordinator else None}
            every = [None] * self.world
            self.dist.all_gather_object(every, mine)
            self.all_ending = all(x["ending"] for x in every)
            last = every[0]["last"]
            common = set(every[0]["held"]).intersection(*(set(x["held"]) for x in every[1:]))
            common = sorted(s for s in common if last is None or s > last)
            if not common:
                self.stats.waiting += 1
                return None
            step = common[-1]
            with self._lock:
                snaps = dict(self._book[step])
            chunks, objects, paths = [], [], {}
            for g in self.groups:
                flat = flatten(snaps[g])
                c, o = shard_chunks(self.layout, g, flat)
                chunks += c
                objects.append(o)
                paths.update(_paths(snaps[g]))
            gathered = [None] * self.world if self.coordinator else None
            self.dist.gather_object(objects, gathered, dst=0)
            verdict = [None]
            if self.coordinator:
                try:
                    merged = merge_objects(self.layout, [o for per in gathered for o in per])
                    verdict = [None]
                except JointSaveError as e:
                    verdict, merged = [str(e)], {}
            self.dist.broadcast_object_list(verdict, src=0)
            if verdict[0] is not None:
                raise JointSaveError(verdict[0])
            partial = self.root / f"{every[0]['partial']}-step-{step:08d}"
            if self.coordinator:
                partial.mkdir()
            self.dist.barrier()
            final = self._save(step, partial, chunks, merged if self.coordinator else {}, paths)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            self.stats.failed += 1
            self.stats.last_error = said(e)
            if not isinstance(e, JointSaveError):
                self.stats.broken = self.stats.last_error
            if self.coordinator and partial is not None:
                shutil.rmtree(partial, ignore_errors=True)
            log.error("joint checkpoint round failed: %s", self.stats.last_error)
            raise JointSaveError(self.stats.last_error) from e
        self.last_step = step
        with self._lock:
            for s in [s for s in self._book if s <= step]:
                del self._book[s]
            self.stats.held = self.held()
        self.stats.committed += 1
        self.stats.last_committed = str(final)
        self.stats.last_seconds = time.perf_counter() - t0
        return final

    def _save(self, step: int, partial: Path, chunks: list[Chunk], objects: dict, paths: dict) -> Path:
        dcp = ckptdir.dcp_module()
        planner = ShardPlanner(chunks, objects, paths)
        writer = dcp.FileSystemWriter(partial, single_file_per_rank=True, sync_files=True, thread_count=1,
                                      overwrite=False)
        md = dcp.save({}, storage_writer=writer, planner=planner)
        # this process's files and slices, hashed here; the coordinator writes the manifest
        ranges, where = storage_ranges(md)
        files, items = {}, {}
        for name in sorted(n for n in os.listdir(partial) if n.startswith(f"__{self.rank}_")):
            size, sha, parts = hash_file(partial / name, ranges.get(name, ()))
            files[name] = {"size": size, "sha256": sha}
            for key, h in parts.items():
                f, off, n = where[key]
                items[key] = {"file": f, "offset": off, "length": n, "sha256": h}
        written = [(it.index.fqn, list(it.index.offset)) for it in planner.final if it.index.offset is not None]
        slices = {}
        for fqn, off in written:
            t = planner.chunks[(fqn, tuple(off))].tensor
            slices.setdefault(fqn, []).append({"offset": off, "sizes": list(t.shape), "sha256": tensor_sha256(t)})
        mine = (files, items, slices)
        gathered = [None] * self.world if self.coordinator else None
        self.dist.gather_object(mine, gathered, dst=0)
        result = [None]
        if self.coordinator:
            try:
                result = [str(self._commit(step, partial, md, objects, gathered))]
            except Exception as e:
                result = [JointSaveError(f"commit of step {step}: {type(e).__name__}: {e}")]
        self.dist.broadcast_object_list(result, src=0)
        if isinstance(result[0], Exception):
            raise result[0]
        return Path(result[0])

    def _commit(self, step: int, partial: Path, md, objects: dict, gathered: list) -> Path:
        files, items, slices = {}, {}, {}
        for f, i, s in gathered:
            files.update(f)
            items.update(i)
            for k, v in s.items():
                slices.setdefault(k, []).extend(v)
        extra_files = set(os.listdir(partial)) - set(files) - {".metadata"}
        if extra_files:
            raise JointSaveError(f"{partial}: files no appliance accounts for: {sorted(extra_files)}")
        size, sha, _ = hash_file(partial / ".metadata")
        files[".metadata"] = {"size": size, "sha256": sha}
        tensors = {}
        for key, m in md.state_dict_metadata.items():
            if not hasattr(m, "chunks"):
                continue
            got = sorted(slices.get(key, []), key=lambda c: c["offset"])
            if len(got) != len(m.chunks):
                raise JointSaveError(f"{key}: {len(m.chunks)} chunks stored, {len(got)} hashed")
            t = {"dtype": str(m.properties.dtype).removeprefix("torch."), "shape": list(m.size), "chunks": got}
            if len(got) == 1 and got[0]["sizes"] == list(m.size):
                t["sha256"] = got[0]["sha256"]
            tensors[key] = t
        write_manifest(partial, {
            "step": step,
            "optimizer_step": int(objects["extra.step"]),
            "created_unix": time.time(),
            "torch_version": torch.__version__,
            "layout": loads(objects["extra.layout"]),
            "training": loads(objects["extra.training"]),
            "joint": {"appliances": self.world, "shards": self.layout.to_dict()},
            "files": files,
            "items": items,
            "tensors": tensors,
        } | ({"job": self.job} if self.job else {}))
        ckptdir.fsync_dir(partial)
        final = self.root / ckptdir.step_dirname(step)
        if final.exists():
            raise JointSaveError(f"{final}: already exists; a committed checkpoint is never overwritten")
        os.rename(partial, final)
        ckptdir.fsync_dir(self.root)
        ckptdir.write_pointer(self.root, final.name)
        if self.keep_last is not None:
            prune(self.root, self.keep_last)
        return final

    def close(self) -> None:
        if self._lockfile is not None:
            self._lockfile.release()
            self._lockfile = None
