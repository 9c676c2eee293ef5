"""Verifying committed checkpoints, choosing one in a root, and loading it: into a Replica
(read_state) or into the trainer's own model and optimizer (load_into, through dcp.load).

From a root, ``select`` prefers the newest checkpoint proven equal to the trainer (manifest
`verified`), else the newest intact one, never a quarantined one; it says which it chose and
why, and lists every problem it met on the way (a torn or dangling `latest`, a damaged newer
checkpoint). A weight snapshot (manifest ``weights_only``, updater.weights) holds the parameters
alone: ``read_state`` and ``load_into`` refuse it as a training state unless asked for weights."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from mirrorckpt.config.training import TORCH_IMPLEMENTATION_KEYS
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.ckptdir import dcp_module, latest, parse_step  # noqa: F401  (latest is part of the API)
from mirrorckpt.updater.dcp_keys import FORMAT, ReplicaState, from_checkpoint, loads, required_keys, unflatten
from mirrorckpt.updater.fingerprint import fingerprint
from mirrorckpt.updater.manifest import (
    MANIFEST,
    MANIFEST_TMP,
    ManifestError,
    hash_file,
    quick_check,
    read_manifest,
    tensor_sha256,
)

log = logging.getLogger(__name__)

_BATCH_BYTES = 256 << 20  # verify reads tensors in batches of about this size


class CheckpointError(ValueError):
    """A checkpoint failed verification or cannot be loaded; the message names what failed."""


WEIGHTS_ONLY = ("a weight snapshot (weights only): the parameters as the job's all-gathers carried them, no "
                "optimizer state, not a full training state")


@dataclass
class Report:
    path: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    step: int | None = None  # iterations applied
    optimizer_step: int | None = None
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    weights_only: bool = False  # a weight snapshot (updater.weights), not a training state

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)

    @property
    def first_problem(self) -> str | None:
        return self.problems[0] if self.problems else None

    def to_dict(self) -> dict:
        return asdict(self)


def _read_flat(d: Path, keys: list[str], md) -> dict:
    """dcp.load of the given flat keys (tensors allocated from the metadata, other values filled in)."""
    dcp = dcp_module()
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    flat = {}
    for k in keys:
        m = md.state_dict_metadata[k]
        flat[k] = torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "chunks") else None
    dcp.load(flat, storage_reader=dcp.FileSystemReader(d), planner=DefaultLoadPlanner(), no_dist=True)
    return flat


def _check_files(d: Path, m: dict, r: Report, progress=None) -> None:
    present = set(os.listdir(d)) - {MANIFEST, MANIFEST_TMP}  # the temp file: a rewrite cut short, never read
    for name in sorted(present - set(m["files"])):
        r.fail(f"{d / name}: not listed in the manifest")
    for name, info in sorted(m["files"].items()):
        p = d / name
        if not p.is_file():
            r.fail(f"{p}: missing")
            continue
        items = sorted(((k, it) for k, it in m["items"].items() if it["file"] == name), key=lambda x: x[1]["offset"])
        size, sha, parts = hash_file(p, [(k, it["offset"], it["length"]) for k, it in items], progress)
        r.files += 1
        r.bytes += size
        if size == info["size"] and sha == info["sha256"]:
            continue
        what = (f"{size} bytes, manifest says {info['size']}" if size != info["size"]
                else "sha256 does not match the manifest")
        bad = [k for k, it in items if it["offset"] + it["length"] > size or parts.get(k) != it["sha256"]]
        if bad:
            where = f"; first damaged value: {bad[0]}" + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else "")
        else:
            where = "; damage outside the stored values"
        r.fail(f"{p}: {what}{where}")


def _values_match(t: torch.Tensor, entry: dict) -> bool:
    """The tensor read back against its manifest entry: one sha256, or (a joint checkpoint,
    updater.joint) one per stored slice, each at its offset."""
    if "chunks" not in entry:
        return tensor_sha256(t) == entry["sha256"]
    if sum(math.prod(c["sizes"]) for c in entry["chunks"]) != t.numel():
        return False  # slices that do not cover the tensor leave values nobody wrote
    for c in entry["chunks"]:
        view = t
        for dim, (o, n) in enumerate(zip(c["offset"], c["sizes"])):
            view = view.narrow(dim, o, n)
        if tensor_sha256(view) != c["sha256"]:
            return False
    return True


def verify(checkpoint_dir, tensors: bool = True, progress=None) -> Report:
    """Check one checkpoint directory: manifest, every file's size and sha256, DCP metadata against the
    manifest, the required keys, and (``tensors``) every tensor's values read back through dcp.load.
    ``progress(checkpoint_dir, bytes done, bytes in all)``, if given, follows the hashing and the
    read-back (a large checkpoint takes minutes)."""
    d = Path(checkpoint_dir)
    r = Report(str(d))
    if not d.is_dir():
        r.fail(f"{d}: not a directory")
        return r
    try:
        m = read_manifest(d)
    except ManifestError as e:
        r.fail(str(e))
        return r
    r.step, r.optimizer_step = m["step"], m.get("optimizer_step")
    r.weights_only = bool(m.get("weights_only"))
    tick = _progress(d, m, tensors, progress)
    _check_files(d, m, r, tick)
    if not r.ok:
        return r  # nothing in a damaged directory is unpickled
    dcp = dcp_module()
    try:
        md = dcp.FileSystemReader(d).read_metadata()
    except Exception as e:
        r.fail(f"{d}/.metadata: unreadable: {type(e).__name__}: {e}")
        return r
    stored = md.state_dict_metadata
    for k, t in m["tensors"].items():
        s = stored.get(k)
        if s is None or not hasattr(s, "chunks"):
            r.fail(f"{d}: tensor {k} is in the manifest but not stored as a tensor")
        elif list(s.size) != t["shape"] or str(s.properties.dtype).removeprefix("torch.") != t["dtype"]:
            r.fail(f"{d}: tensor {k}: stored {list(s.size)} {s.properties.dtype}, "
                   f"manifest says {t['shape']} {t['dtype']}")
    for k in sorted(k for k, s in stored.items() if hasattr(s, "chunks") and k not in m["tensors"]):
        r.fail(f"{d}: tensor {k} is stored but not in the manifest")
    missing = [k for k in required_keys(m.get("layout") or {}, m.get("training") or {}, r.weights_only)
               if k not in stored]
    if missing:
        r.fail(f"{d}: required key {missing[0]} missing" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    if not r.ok:
        return r
    extra = _read_flat(d, ["extra.format", "extra.iterations_done", "extra.step"], md)
    if extra["extra.format"] != FORMAT:
        r.fail(f"{d}: extra.format is {extra['extra.format']!r}, expected {FORMAT!r}")
    if (extra["extra.iterations_done"], extra["extra.step"]) != (m["step"], m.get("optimizer_step")):
        r.fail(f"{d}: extra.iterations_done/step {extra['extra.iterations_done']}/{extra['extra.step']} differ from "
               f"the manifest's {m['step']}/{m.get('optimizer_step')}")
    if not tensors:
        return r
    proven = (m.get("verified") or {}).get("fingerprints") or {}
    batch, size = [], 0
    keys = list(m["tensors"])
    for i, k in enumerate(keys):
        batch.append(k)
        size += stored[k].size.numel() * stored[k].properties.dtype.itemsize
        if size < _BATCH_BYTES and i < len(keys) - 1:
            continue
        values = _read_flat(d, batch, md)
        for key in batch:
            if not _values_match(values[key], m["tensors"][key]):
                r.fail(f"{d}: tensor {key}: values read back do not match the manifest sha256")
            elif key in proven and fingerprint(values[key]) != proven[key]:
                r.fail(f"{d}: tensor {key}: its fingerprint differs from the one it was verified by "
                       f"(step {m['verified'].get('step')})")
        r.tensors += len(batch)
        if tick is not None:
            tick(size)
        batch, size = [], 0
    return r


def _progress(d: Path, m: dict, tensors: bool, progress):
    """``progress`` as a per-chunk counter of one checkpoint's bytes: its files, then its tensors read back."""
    if progress is None:
        return None
    total = sum(f["size"] for f in m["files"].values())
    if tensors:
        total += sum(math.prod(t["shape"]) * getattr(getattr(torch, t["dtype"], None), "itemsize", 0)
                     for t in m["tensors"].values())  # a dtype torch does not know is verify's to report
    done = [0]

    def tick(nbytes: int) -> None:
        done[0] += nbytes
        progress(d, done[0], total)

    progress(d, 0, total)
    return tick


def summarize(checkpoint_dir) -> Report:
    """The cheap check a reader does before trusting a directory: manifest valid, files present
    with their sizes. No data is hashed (that is verify)."""
    d = Path(checkpoint_dir)
    r = Report(str(d))
    try:
        m = read_manifest(d)
    except ManifestError as e:
        r.fail(str(e))
        return r
    r.step, r.optimizer_step = m["step"], m.get("optimizer_step")
    r.weights_only = bool(m.get("weights_only"))
    r.files, r.tensors = len(m["files"]), len(m["tensors"])
    r.bytes = sum(f["size"] for f in m["files"].values())
    problem = quick_check(d)
    if problem:
        r.fail(problem)
    return r


@dataclass
class Selection:
    """Which checkpoint of a root ``select`` gives, why, and what it found wrong on the way."""

    root: str
    path: Path | None = None
    reason: str = ""
    problems: list[str] = field(default_factory=list)  # damage: a torn/dangling pointer, a bad directory
    notes: list[str] = field(default_factory=list)  # no damage: passed-over unverified ones, quarantine
    newest: int | None = None  # the highest step the root names (a step directory or `latest`)
    pointer_torn: bool = False  # `latest` unreadable: the newest step may be unknown
    report: Report | None = None  # the chosen checkpoint's check

    @property
    def step(self) -> int | None:
        return parse_step(self.path.name) if self.path is not None else None

    @property
    def short(self) -> bool:
        """A newer checkpoint than the one given exists or was named, and is damaged or missing."""
        return self.path is None or self.pointer_torn or \
            (self.newest is not None and self.step < self.newest and bool(self.problems))


def _pointer(root: Path, sel: Selection, have_dirs: bool) -> int | None:
    p = root / ckptdir.POINTER
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if have_dirs:
            sel.notes.append(f"{p}: missing (a crash before the first pointer update; the newest step is used)")
        return None
    except OSError as e:
        sel.problems.append(f"{p}: unreadable: {e.strerror}")
        sel.pointer_torn = True
        return None
    name = raw.decode("utf-8", "replace").strip()
    step = parse_step(name)
    if step is None:
        sel.problems.append(f"{p}: torn or not a pointer ({raw[:40]!r})")
        sel.pointer_torn = True
    elif not (root / name).is_dir():
        sel.problems.append(f"{p} names {name}, which does not exist (dangling pointer)")
    return step


def select(root, verify_data: bool = False, prefer_verified: bool = True, check_newer: bool = False,
           progress=None) -> Selection:
    """Choose the checkpoint to give from a root: the newest verified intact one (with
    ``prefer_verified``), else the newest intact one. Intact: the manifest check, and with
    ``verify_data`` the full ``verify``. ``check_newer`` also fully checks every newer checkpoint
    passed over, so damage there is reported. ``progress``: as ``verify``'s."""
    root = Path(root)
    sel = Selection(str(root))
    dirs = ckptdir.step_dirs(root)
    ptr = _pointer(root, sel, bool(dirs))
    steps = [s for s, _ in dirs] + ([ptr] if ptr is not None else [])
    sel.newest = max(steps) if steps else None
    intact = []
    for step, d in reversed(dirs):
        problem = quick_check(d)
        if problem:
            sel.problems.append(f"{d.name}: not an intact checkpoint: {problem}")
        else:
            intact.append((step, d, ckptdir.verification(d)))
    order = intact
    if prefer_verified:
        order = [x for x in intact if x[2] is not None] + [x for x in intact if x[2] is None]
    checked = set()
    for _, d, v in order:
        r = verify(d, progress=progress) if verify_data else summarize(d)
        checked.add(d)
        if not r.ok:
            sel.problems.extend(r.problems)
            continue
        sel.path, sel.report = d, r
        if v is not None:
            sel.reason = (f"the newest checkpoint proven equal to the trainer (its fingerprints at step "
                          f"{v.get('step')}, {v.get('source', 'fingerprint')})")
        elif any(x[2] is not None for x in intact):
            sel.reason = "the newest intact checkpoint: every verified one failed its check"
        else:
            sel.reason = "the newest intact checkpoint (none is verified against the trainer)"
        break
    if sel.path is not None:
        passed = [(x, d) for x, d, v in intact if x > sel.step and v is None and d not in checked]
        for _, d in passed:
            if check_newer:
                r = verify(d, progress=progress) if verify_data else summarize(d)
                if not r.ok:
                    sel.problems.extend(r.problems)
                    continue
            sel.notes.append(f"{d.name} is newer but not verified against the trainer: passed over")
    q = ckptdir.quarantined(root)
    if q:
        steps = ", ".join(str(s) for s, _ in q[:8]) + (" ..." if len(q) > 8 else "")
        sel.notes.append(f"{len(q)} quarantined checkpoint(s) in {root / ckptdir.QUARANTINE} (steps {steps}): "
                         "never given by default")
    if sel.path is None:
        sel.reason = ("no intact checkpoint" if dirs
                      else "no committed checkpoint (no step-* directory with a valid manifest)")
    return sel


def resolve(path) -> Path:
    """A checkpoint directory itself, or the one ``select`` chooses when ``path`` is a root."""
    return _verified(path, False)


def _is_checkpoint(path: Path) -> bool:
    return parse_step(path.name) is not None or (path / MANIFEST).exists() or (path / ".metadata").exists()


def _verified(path, check: bool) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory")
    if not _is_checkpoint(path):
        sel = select(path, verify_data=check)
        if sel.path is None:
            why = f": {'; '.join(sel.problems[:3])}" if sel.problems else ""
            raise CheckpointError(f"{path}: {sel.reason}{why}")
        if sel.problems:
            log.warning("%s: giving %s (%s); problems: %s", path, sel.path.name, sel.reason, "; ".join(sel.problems))
        return sel.path
    d = path
    if check:
        r = verify(d)
        if not r.ok:
            raise CheckpointError(f"checkpoint failed verification: {r.first_problem}")
    else:
        try:
            read_manifest(d)
        except ManifestError as e:
            raise CheckpointError(str(e)) from None
    return d


def _refuse_weights_only(d: Path, what: str) -> None:
    if read_manifest(d).get("weights_only"):
        raise CheckpointError(f"{d}: {WEIGHTS_ONLY}; {what}")


def read_state(path, verify_first: bool = True) -> ReplicaState:
    """The full replica state stored in a checkpoint directory (or a root's latest checkpoint)."""
    d = _verified(path, verify_first)
    _refuse_weights_only(d, "it cannot start a replica")
    md = dcp_module().FileSystemReader(d).read_metadata()
    flat = _read_flat(d, list(md.state_dict_metadata), md)
    return from_checkpoint(unflatten(flat, md.planner_data), where=str(d))


@dataclass
class Resumed:
    """What load_into restored, and what only the trainer itself can apply."""

    path: Path
    iterations_done: int
    step: int
    rng: dict[str, torch.Tensor]  # trainer RNG states by name, when they were sent
    data_position: object
    missing_buffers: list[str]  # model buffers the checkpoint cannot hold (not on the wire)


def keep_implementation(loaded: list[dict], own: list[dict]) -> None:
    """Param groups about to be loaded take the trainer's own implementation choice (foreach,
    fused, capturable, differentiable, unset ones included): a checkpoint records how the
    replica stepped, which says nothing about how the trainer's device should."""
    if len(loaded) != len(own):
        raise CheckpointError(f"the checkpoint has {len(loaded)} param groups, the optimizer {len(own)}")
    for group, mine in zip(loaded, own):
        for k in TORCH_IMPLEMENTATION_KEYS:
            if k in mine:
                group[k] = mine[k]
            else:
                group.pop(k, None)


def load_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, root_or_dir, scheduler=None,
              scaler=None, verify_first: bool = True, weights_only: bool = False) -> Resumed:
    """Resume a trainer from the latest committed checkpoint under ``root_or_dir`` (or that checkpoint
    directory): model parameters and optimizer state through get_state_dict/dcp.load/set_state_dict,
    then the LR scheduler and a torch.amp.GradScaler when given. A weight snapshot is refused unless
    ``weights_only``: then only the model's parameters are loaded (``optimizer`` None)."""
    dcp = dcp_module()
    d = _verified(root_or_dir, verify_first)
    md = dcp.FileSystemReader(d).read_metadata()
    if weights_only:
        return _load_weights(model, d, md)
    _refuse_weights_only(d, "load it with load_into(..., weights_only=True) into the model alone, and take the "
                         "optimizer state from a full checkpoint (a GoCkpt fallback's)")
    return _load_training(model, optimizer, d, md, scheduler, scaler)


def _load_weights(model: torch.nn.Module, d: Path, md) -> Resumed:
    """The parameters of a checkpoint (a weight snapshot or a full one) into ``model``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    msd = get_model_state_dict(model)
    params = {n for n, _ in model.named_parameters()}
    sd = {"model": {k: v for k, v in msd.items() if k in params}}
    missing = [f"model.{k}" for k in sd["model"] if f"model.{k}" not in md.state_dict_metadata]
    if missing:
        raise CheckpointError(f"{d}: the checkpoint has no {missing[0]}"
                              + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                              + "; it was written for a different model")
    dcp_module().load(sd, storage_reader=dcp_module().FileSystemReader(d),
                      planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    set_model_state_dict(model, sd["model"], options=StateDictOptions(strict=False))
    ex = unflatten(_read_flat(d, ["extra.iterations_done", "extra.step"], md), md.planner_data)["extra"]
    return Resumed(path=d, iterations_done=int(ex["iterations_done"]), step=int(ex["step"]), rng={},
                   data_position=None, missing_buffers=sorted(f"model.{n}" for n, _ in model.named_buffers()))


def _load_training(model, optimizer, d: Path, md, scheduler, scaler) -> Resumed:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dcp = dcp_module()
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optim": osd}
    from mirrorckpt.updater.dcp_keys import flatten

    wanted = flatten(sd)
    absent = [k for k in wanted if k not in md.state_dict_metadata]
    buffers = {f"model.{n}" for n, _ in model.named_buffers()}
    not_buffers = [k for k in absent if k not in buffers]
    if not_buffers:
        raise CheckpointError(f"{d}: the checkpoint has no {not_buffers[0]}"
                              + (f" (+{len(not_buffers) - 1} more)" if len(not_buffers) > 1 else "")
                              + "; it was written for a different model or optimizer")
    dcp.load(sd, storage_reader=dcp.FileSystemReader(d), planner=DefaultLoadPlanner(allow_partial_load=bool(absent)),
             no_dist=True)
    keep_implementation(sd["optim"]["param_groups"], optimizer.param_groups)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    keys = [k for k in md.state_dict_metadata if k.startswith("extra.")]
    ex = unflatten(_read_flat(d, keys, md), md.planner_data)["extra"]
    base = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    named = dict(base.named_parameters())
    for n in loads(ex["unstepped"]) if "unstepped" in ex else ():
        if n in named:  # set_state_dict made a placeholder state; never stepped means none
            optimizer.state.pop(named[n], None)
    if scheduler is not None:
        if "lr_scheduler" not in ex:
            raise CheckpointError(f"{d}: no lr_scheduler state, but a scheduler was given")
        scheduler.load_state_dict(loads(ex["lr_scheduler"]))
    if scaler is not None:
        if "loss_scale" not in ex:
            raise CheckpointError(f"{d}: no loss-scale state (not an fp16 job), but a scaler was given")
        ls, spec = loads(ex["loss_scale"]), loads(ex["training"])["loss_scale"]
        scaler.load_state_dict({"scale": ls["scale"], "_growth_tracker": ls["growth_tracker"],
                                "growth_factor": spec["growth_factor"], "backoff_factor": spec["backoff_factor"],
                                "growth_interval": spec["growth_interval"]})
    return Resumed(path=d, iterations_done=int(ex["iterations_done"]), step=int(ex["step"]),
                   rng=dict(ex.get("rng") or {}),
                   data_position=loads(ex["data_position"]) if "data_position" in ex else None,
                   missing_buffers=sorted(absent))
