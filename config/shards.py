"""The layout of a sharded job: TP x PP model shards, each trained by one data-parallel group.

A job with TP x PP model shards has TP*PP DP groups; group (stage s, TP rank t) all-reduces only the
gradients of its own slices over its own ring. For each group this says where every slice sits
in the global model (parameter FQN, global shape, TP dimension and offset), which global ranks
form its ring and which appliance follows it. Slices follow DTensor's ``Shard(dim)`` placement
(``torch.chunk``: ceil-sized pieces, the last may be smaller), so a checkpoint cut this way loads
into a DTensor layout unchanged. A parameter that is not TP-sharded (``tp_dim`` None, e.g. a
row-parallel layer's bias) is held whole by every TP group of its stage.

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


@dataclass(frozen=True)
class Shard:
    """One DP group's slice of a global parameter."""

    fqn: str
    global_shape: tuple[int, ...]
    tp_dim: int | None  # None: the whole tensor (replicated across TP ranks)
    offset: tuple[int, ...]  # start of the slice in the global tensor
    shape: tuple[int, ...]  # the slice's shape (the group's parameter shape)
    dtype: str = "float32"

    @property
    def whole(self) -> bool:
        return tuple(self.shape) == tuple(self.global_shape)

    def to_dict(self) -> dict:
        return {"fqn": self.fqn, "global_shape": list(self.global_shape), "tp_dim": self.tp_dim,
                "offset": list(self.offset), "shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_dict(d: dict) -> Shard:
        return Shard(d["fqn"], tuple(d["global_shape"]), d.get("tp_dim"), tuple(d["offset"]), tuple(d["shape"]),
                     d.get("dtype", "float32"))


@dataclass
class DpGroup:
    """A DP group: the ring of one model shard."""

    name: str
    pp_stage: int
    tp_rank: int
    ranks: list[int]  # global ranks, in DP order (DP rank i is ranks[i])
    appliance: str  # which appliance follows this ring
    shards: list[Shard]  # in the group's parameter order

    def shard(self, fqn: str) -> Shard:
        for s in self.shards:
            if s.fqn == fqn:
                return s
        raise KeyError(f"group {self.name} holds no slice of {fqn}")

    def to_dict(self) -> dict:
        return {"name": self.name, "pp_stage": self.pp_stage, "tp_rank": self.tp_rank, "ranks": list(self.ranks),
                "appliance": self.appliance, "shards": [s.to_dict() for s in self.shards]}

    @staticmethod
    def from_dict(d: dict) -> DpGroup:
        return DpGroup(d["name"], int(d["pp_stage"]), int(d["tp_rank"]), [int(r) for r in d["ranks"]],
                       d["appliance"], [Shard.from_dict(s) for s in d["shards"]])


@dataclass
class ShardedLayout:
    tp: int
    pp: int
    dp: int
    params: list[ParamSpec]  # the global model, in its parameter order
    groups: list[DpGroup]
    appliances: list[str] = field(default_factory=list)  # rank in the appliances' group = index here

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"tp, pp and dp must be >= 1, got {self.tp}, {self.pp}, {self.dp}")
        if len(self.groups) != self.tp * self.pp:
            raise ValueError(f"{len(self.groups)} DP groups for TP={self.tp} x PP={self.pp}")
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
        self._check_cover()

    def _check_cover(self) -> None:
        """Every global parameter is cut into disjoint slices that cover it, once per stage."""
        by_name = {p.name: p for p in self.params}
        pieces: dict[str, list[Shard]] = {}
        for g in self.groups:
            for s in g.shards:
                p = by_name.get(s.fqn)
                if p is None:
                    raise ValueError(f"group {g.name}: {s.fqn} is not a parameter of the model")
                if tuple(s.global_shape) != tuple(p.shape):
                    raise ValueError(f"group {g.name}: {s.fqn} has global shape {list(s.global_shape)}, "
                                     f"the model {list(p.shape)}")
                if len(s.offset) != len(p.shape) or any(o + n > m for o, n, m in zip(s.offset, s.shape, p.shape)):
                    raise ValueError(f"group {g.name}: slice {list(s.offset)}+{list(s.shape)} of {s.fqn} "
                                     f"lies outside {list(p.shape)}")
                pieces.setdefault(s.fqn, []).append(s)
        for p in self.params:
            got = {(tuple(s.offset), tuple(s.shape)) for s in pieces.get(p.name, [])}
            if sum(math.prod(shape) for _, shape in got) != p.numel:
                raise ValueError(f"the groups' slices of {p.name} do not cover it exactly once: "
                                 f"{sorted(got)} of {list(p.shape)}")

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
        """The group's parameters as its ring carries them: global FQNs, slice shapes."""
        return [ParamSpec(s.fqn, tuple(s.shape), s.dtype) for s in self.group(name).shards]

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in self.params],
                "groups": [g.to_dict() for g in self.groups], "appliances": list(self.appliances)}

    @staticmethod
    def from_dict(d: dict) -> ShardedLayout:
        return ShardedLayout(int(d["tp"]), int(d["pp"]), int(d["dp"]),
                             [ParamSpec(p["name"], tuple(p["shape"]), p.get("dtype", "float32")) for p in d["params"]],
                             [DpGroup.from_dict(g) for g in d["groups"]], list(d.get("appliances") or []))

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


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
    names = [f"pp{s}-tp{t}" for s in range(pp) for t in range(tp)]
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
