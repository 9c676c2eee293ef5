"""The layout of a sharded job: model shards, each trained by the ranks of one all-reduce ring.

A job with TP x PP model shards, and within each of them ``shards`` optimizer shard indices
(FSDP2 HSDP, DeepSpeed ZeRO-1/2, Megatron's distributed optimizer: ``config.shard_rules``), has
TP*PP*shards groups; a group all-reduces only the gradients of its own slices over its ring.
For each group this says where every slice sits in the global model (parameter FQN, global
shape, offset), which global ranks form its ring, which appliance follows it and, when the
framework pads or packs them, how its all-reduces lay out their flat buffers (``wire``).

A slice is a block of the global tensor cut as DTensor's ``Shard(dim)`` cuts it (``torch.chunk``:
ceil-sized pieces, the last may be smaller; TP's Shard(d), FSDP2's Shard(0)), so a checkpoint cut
this way loads into a DTensor layout unchanged; or, for optimizers that flatten parameters into
one buffer and partition that (ZeRO, Megatron), a flat range of such a block (``flat``: start and
stop in the block's row-major order), which the group holds as a 1-d tensor and a checkpoint
stores as the few boxes of the global tensor the range covers (``flat_boxes``). A parameter that
is not TP-sharded (``tp_dim`` None, e.g. a row-parallel layer's bias) is held whole by every TP
group of its stage.

Global ranks are laid out as torch's DeviceMesh(["pp", "dp", "tp"]) does: the TP rank varies
fastest, then the DP rank, then the stage. Everything round-trips through plain dicts.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec


def tp_range(size: int, tp: int, rank: int) -> tuple[int, int]:
    """(offset, length) of TP rank ``rank``'s piece of a dimension of ``size`` (torch.chunk)."""
    if not 0 <= rank < tp:
        raise ValueError(f"TP rank {rank} outside 0..{tp - 1}")
    step = math.ceil(size / tp)
    lo = min(rank * step, size)
    return lo, min(lo + step, size) - lo


def group_name(pp_stage: int, tp_rank: int, shard: int | None = None) -> str:
    """"pp<s>-tp<t>", and "-sh<k>" for optimizer shard index k of a job with several."""
    return f"pp{pp_stage}-tp{tp_rank}" + (f"-sh{shard}" if shard is not None else "")


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple, tuple, int, int]]:
    """Elements [start, stop) of a row-major tensor of ``shape`` as boxes (offset, shape, start,
    stop): at most 2*ndim-1, each contiguous in row-major order (fixed leading indices, a range on
    one dimension, the trailing dimensions whole), in order."""
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {list(shape)}")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (stop - start,) if shape else (), start, stop)]
    inner = math.prod(shape[1:])
    first, first_col = divmod(start, inner)
    last, last_col = divmod(stop, inner)
    rest = (0,) * (len(shape) - 1)

    def rows(row: int, lo: int, hi: int) -> list:
        return [((row, *o), (1, *sh), row * inner + a, row * inner + b)
                for o, sh, a, b in flat_boxes(shape[1:], lo, hi)]

    if first == last:
        return rows(first, first_col, last_col)
    out = []
    if first_col:
        out += rows(first, first_col, inner)
        first += 1
    if last > first:
        out.append(((first, *rest), (last - first, *shape[1:]), first * inner, last * inner))
    if last_col:
        out += rows(last, 0, last_col)
    return out


def boxes_disjoint(a: tuple[tuple, tuple], b: tuple[tuple, tuple]) -> bool:
    """Two boxes (offset, shape) of one tensor share no element."""
    return any(oa + na <= ob or ob + nb <= oa for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1]))


@dataclass(frozen=True)
class Shard:
    """One group's slice of a global parameter: a block, or a flat range of one."""

    fqn: str
    global_shape: tuple[int, ...]
    tp_dim: int | None  # the dimension the block is cut along (TP's or FSDP2's Shard(d)); None: whole
    offset: tuple[int, ...]  # start of the block in the global tensor
    shape: tuple[int, ...]  # the block's shape
    dtype: str = "float32"
    flat: tuple[int, int] | None = None  # (start, stop) in the block's row-major order: the group holds that range

    @property
    def whole(self) -> bool:
        return self.flat is None and tuple(self.shape) == tuple(self.global_shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape the group holds (its parameter's shape on the ring and in the replica)."""
        return tuple(self.shape) if self.flat is None else (self.flat[1] - self.flat[0],)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def boxes(self) -> list[tuple[tuple, tuple, int, int]]:
        """The slice as boxes of the global tensor: (global offset, shape, start, stop), start and
        stop counted in the slice's own (flattened) elements."""
        if self.flat is None:
            return [(tuple(self.offset), tuple(self.shape), 0, self.numel)]
        lo = self.flat[0]
        return [(tuple(o + p for o, p in zip(self.offset, off)), sh, a - lo, b - lo)
                for off, sh, a, b in flat_boxes(tuple(self.shape), *self.flat)]

    def to_dict(self) -> dict:
        d = {"fqn": self.fqn, "global_shape": list(self.global_shape), "tp_dim": self.tp_dim,
             "offset": list(self.offset), "shape": list(self.shape), "dtype": self.dtype}
        if self.flat is not None:
            d["flat"] = list(self.flat)
        return d

    @staticmethod
    def from_dict(d: dict) -> Shard:
        flat = d.get("flat")
        return Shard(d["fqn"], tuple(d["global_shape"]), d.get("tp_dim"), tuple(d["offset"]), tuple(d["shape"]),
                     d.get("dtype", "float32"), (int(flat[0]), int(flat[1])) if flat is not None else None)


PAD = -1  # a wire segment that is none of the group's slices (padding, or another group's slice)


@dataclass
class DpGroup:
    """A group: the ring of one model shard (one optimizer shard index of it)."""

    name: str
    pp_stage: int
    tp_rank: int
    ranks: list[int]  # global ranks of its all-reduce ring, in ring (DP) order
    appliance: str  # which appliance follows this ring
    shards: list[Shard]  # in the group's parameter order
    shard_index: int = 0  # the optimizer shard index (0 when the optimizer is not sharded)
    # The ring's all-reduces, in order, each its flat buffer as segments (slice index or PAD,
    # elements); None: DDP's buckets over the slices (registered by the trainer)
    wire: list[list[tuple[int, int]]] | None = None

    def __post_init__(self):
        if self.wire is None:
            return
        seen: dict[int, int] = {}
        for b, segments in enumerate(self.wire):
            for i, n in segments:
                if n <= 0 or not (i == PAD or 0 <= i < len(self.shards)):
                    raise ValueError(f"group {self.name}: all-reduce {b} has segment ({i}, {n})")
                if i != PAD:
                    if i in seen or n != self.shards[i].numel:
                        raise ValueError(f"group {self.name}: slice {self.shards[i].fqn} sits in the all-reduces "
                                         f"more than once or with {n} of its {self.shards[i].numel} elements")
                    seen[i] = n
        if len(seen) != len(self.shards):
            missing = [s.fqn for i, s in enumerate(self.shards) if i not in seen]
            raise ValueError(f"group {self.name}: slices in no all-reduce: {missing[:3]}")

    def shard(self, fqn: str) -> Shard:
        for s in self.shards:
            if s.fqn == fqn:
                return s
        raise KeyError(f"group {self.name} holds no slice of {fqn}")

    def wire_numel(self) -> list[int]:
        """Elements of each all-reduce of the ring (padding included)."""
        return [sum(n for _, n in segments) for segments in self.wire or []]

    def job_layout(self, grad_dtype: str = "float32") -> JobLayout:
        """The group's ring as the replica follows it: its slices under their global FQNs (a flat
        range as a 1-d tensor), one bucket per all-reduce of ``wire`` holding the slices it
        carries in buffer order, its padding left out (``updater.shard_sink`` takes the slices
        out of the padded buffer)."""
        if self.wire is None:
            raise ValueError(f"group {self.name}: its all-reduces are DDP's buckets, which the trainer registers")
        return JobLayout([ParamSpec(s.fqn, s.local_shape, s.dtype) for s in self.shards],
                         [BucketSpec(tuple(i for i, _ in segments if i != PAD)) for segments in self.wire],
                         grad_dtype=grad_dtype)

    def to_dict(self) -> dict:
        d = {"name": self.name, "pp_stage": self.pp_stage, "tp_rank": self.tp_rank, "ranks": list(self.ranks),
             "appliance": self.appliance, "shards": [s.to_dict() for s in self.shards]}
        if self.shard_index:
            d["shard_index"] = self.shard_index
        if self.wire is not None:
            d["wire"] = [[[i, n] for i, n in segments] for segments in self.wire]
        return d

    @staticmethod
    def from_dict(d: dict) -> DpGroup:
        wire = d.get("wire")
        return DpGroup(d["name"], int(d["pp_stage"]), int(d["tp_rank"]), [int(r) for r in d["ranks"]],
                       d["appliance"], [Shard.from_dict(s) for s in d["shards"]], int(d.get("shard_index", 0)),
                       [[(int(i), int(n)) for i, n in segments] for segments in wire] if wire is not None else None)


# how a ring all-reduce averages: x*(1/N) then SUM; x/N then SUM; NCCL's ncclAvg; SUM then x*(1/N)
AVERAGES = ("premul", "prediv", "avg", "postmul")


@dataclass
class ShardedLayout:
    tp: int
    pp: int
    dp: int  # ranks in each group's ring
    params: list[ParamSpec]  # the global model, in its parameter order
    groups: list[DpGroup]
    appliances: list[str] = field(default_factory=list)  # rank in the appliances' group = index here
    shards: int = 1  # optimizer shard indices per (stage, TP rank)
    scheme: str = "dtensor"  # who laid it out: dtensor (TP/PP), fsdp2, zero, megatron (config.shard_rules)
    average: str = "premul"  # how the ring's all-reduce averages (AVERAGES)
    # why the job's optimizer state cannot be followed exactly from its all-reduces, and the setting
    # that makes it followable; None: it can
    refusal: str | None = None
    # what the framework's per-step collective sequence needs beyond the groups (config.shard_steps:
    # ZeRO's param groups, its overflow check); None: nothing
    steps: dict | None = None

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp, self.shards) < 1:
            raise ValueError(f"tp, pp, dp and shards must be >= 1, got {self.tp}, {self.pp}, {self.dp}, {self.shards}")
        if len(self.groups) != self.tp * self.pp * self.shards:
            raise ValueError(f"{len(self.groups)} groups for TP={self.tp} x PP={self.pp} x {self.shards} optimizer "
                             "shards")
        if self.average not in AVERAGES:
            raise ValueError(f"average {self.average!r} is not one of {', '.join(AVERAGES)}")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"DP group names repeat: {names}")
        if not self.appliances:
            self.appliances = sorted({g.appliance for g in self.groups})
        for g in self.groups:
            if g.appliance not in self.appliances:
                raise ValueError(f"group {g.name} is followed by {g.appliance!r}, not one of {self.appliances}")
            if len(g.ranks) != self.dp:
                raise ValueError(f"group {g.name} lists {len(g.ranks)} ranks for DP={self.dp}")
            if not 0 <= g.shard_index < self.shards:
                raise ValueError(f"group {g.name}: optimizer shard index {g.shard_index} outside 0..{self.shards - 1}")
        self._check_cover()

    def _check_cover(self) -> None:
        """Every global parameter is cut into disjoint slices that cover it, once per stage (TP
        groups may each hold the same whole or FSDP-cut piece: those count once)."""
        by_name = {p.name: p for p in self.params}
        pieces: dict[str, set] = {}
        for g in self.groups:
            for s in g.shards:
                p = by_name.get(s.fqn)
                if p is None:
                    raise ValueError(f"group {g.name}: {s.fqn} is not a parameter of the model")
                if tuple(s.global_shape) != tuple(p.shape):
                    raise ValueError(f"group {g.name}: {s.fqn} has global shape {list(s.global_shape)}, "
                                     f"the model {list(p.shape)}")
                if len(s.offset) != len(p.shape) or len(s.shape) != len(p.shape) or \
                        any(o + n > m for o, n, m in zip(s.offset, s.shape, p.shape)):
                    raise ValueError(f"group {g.name}: slice {list(s.offset)}+{list(s.shape)} of {s.fqn} "
                                     f"lies outside {list(p.shape)}")
                if s.flat is not None and not 0 <= s.flat[0] < s.flat[1] <= math.prod(s.shape):
                    raise ValueError(f"group {g.name}: flat range {list(s.flat)} of {s.fqn}'s block {list(s.shape)}")
                pieces.setdefault(s.fqn, set()).update((g.shard_index, off, sh) for off, sh, _, _ in s.boxes())
        for p in self.params:
            held = pieces.get(p.name, set())
            got = sorted({(off, sh) for _, off, sh in held})
            overlap = next(((a, b) for i, a in enumerate(got) for b in got[i + 1:] if not boxes_disjoint(a, b)), None)
            # a box two optimizer shard indices both claim is held twice
            if overlap is not None or len(held) != len(got) or sum(math.prod(sh) for _, sh in got) != p.numel:
                raise ValueError(f"the groups' slices of {p.name} do not cover it exactly once: "
                                 f"{got[:6]} of {list(p.shape)}")

    # ---- views ---------------------------------------------------------------------------

    def group(self, name: str) -> DpGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no DP group {name!r} (groups: {', '.join(g.name for g in self.groups)})")

    def groups_of(self, appliance: str) -> list[DpGroup]:
        return [g for g in self.groups if g.appliance == appliance]

    def global_layout(self) -> JobLayout:
        """The unsharded model as a JobLayout (one bucket: what a TP=1 trainer restores)."""
        return JobLayout(params=list(self.params), buckets=[BucketSpec(tuple(range(len(self.params))))])

    def group_params(self, name: str) -> list[ParamSpec]:
        """The group's parameters as its ring carries them: global FQNs, slice shapes (1-d for a
        flat range)."""
        return [ParamSpec(s.fqn, s.local_shape, s.dtype) for s in self.group(name).shards]

    def to_dict(self) -> dict:
        d = {"tp": self.tp, "pp": self.pp, "dp": self.dp,
             "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in self.params],
             "groups": [g.to_dict() for g in self.groups], "appliances": list(self.appliances)}
        # only what differs from a TP/PP layout: such a layout keeps its dict (and digest)
        extra = {"shards": self.shards, "scheme": self.scheme, "average": self.average, "refusal": self.refusal,
                 "steps": self.steps}
        d.update({k: v for k, v in extra.items() if v != _DEFAULTS[k]})
        return d

    @staticmethod
    def from_dict(d: dict) -> ShardedLayout:
        return ShardedLayout(int(d["tp"]), int(d["pp"]), int(d["dp"]),
                             [ParamSpec(p["name"], tuple(p["shape"]), p.get("dtype", "float32")) for p in d["params"]],
                             [DpGroup.from_dict(g) for g in d["groups"]], list(d.get("appliances") or []),
                             **{k: d.get(k, v) for k, v in _DEFAULTS.items()})

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


_DEFAULTS = {"shards": 1, "scheme": "dtensor", "average": "premul", "refusal": None, "steps": None}


def global_rank(pp_stage: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """Rank in DeviceMesh(["pp", "dp", "tp"]) order."""
    return (pp_stage * dp + dp_rank) * tp + tp_rank


def build(params: list[ParamSpec], plan: dict[str, tuple[int | None, int]], tp: int, pp: int, dp: int,
          appliances: list[str] | None = None) -> ShardedLayout:
    """The layout of a job from its global parameters and ``plan``: FQN -> (TP dimension or None,
    PP stage). Groups are named "pp{s}-tp{t}" and handed to ``appliances`` round-robin (default:
    one appliance per group)."""
    missing = [p.name for p in params if p.name not in plan]
    if missing:
        raise ValueError(f"no TP/PP placement for {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1
                                                                   else ""))
    names = [group_name(s, t) for s in range(pp) for t in range(tp)]
    appliances = list(appliances) if appliances else [f"appliance-{i}" for i in range(len(names))]
    groups = []
    for k, name in enumerate(names):
        s, t = divmod(k, tp)
        shards = []
        for p in params:
            dim, stage = plan[p.name]
            if not 0 <= stage < pp:
                raise ValueError(f"{p.name}: stage {stage} outside 0..{pp - 1}")
            if stage != s:
                continue
            offset, shape = [0] * len(p.shape), list(p.shape)
            if dim is not None:
                if not 0 <= dim < len(p.shape):
                    raise ValueError(f"{p.name}: TP dimension {dim} of a {len(p.shape)}-d tensor")
                offset[dim], shape[dim] = tp_range(p.shape[dim], tp, t)
                if shape[dim] == 0:
                    raise ValueError(f"{p.name}: dimension {dim} of size {p.shape[dim]} leaves TP rank {t} empty")
            shards.append(Shard(p.name, tuple(p.shape), dim, tuple(offset), tuple(shape), p.dtype))
        if not shards:
            raise ValueError(f"stage {s} holds no parameter")
        groups.append(DpGroup(name, s, t, [global_rank(s, d, t, dp, tp) for d in range(dp)],
                              appliances[k % len(appliances)], shards))
    return ShardedLayout(tp, pp, dp, list(params), groups, sorted(set(appliances[:len(names)]),
                                                                   key=appliances.index))
