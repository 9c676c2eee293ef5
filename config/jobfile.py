"""The job configuration file (TOML): the ring, the DDP layout, training, persistence, mirrors.

Every key is checked against a schema; an error names the file, the table and the key
("job.toml: [ring] nranks: expected an integer >= 2, got 'two'"). ``config/example.toml`` is the
documented example. ``dump_job`` writes the same format (the generator writes one per run).

A sharded-optimizer job (config.shard_rules) names its layout in ``[job] shards`` (a
``config.shards.ShardedLayout`` as JSON) and lists one ``[[ring]]`` per followed ring instead of
``[ring]`` and ``[[mirror]]``: each is a ring as ``[ring]`` is, plus ``group`` (the layout's
group whose replica shard it keeps) or ``weights_only = true`` (an FSDP2 shard group whose
all-gathers carry the parameters), with its own ``[[ring.mirror]]`` sources. With ``[joint]``
the file is one appliance's of several (``appliance``, the layout's name for it, and the address of
the appliances' process group): its ``[[ring]]`` tables are exactly that appliance's groups.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mirrorckpt.config.encap import ENCAPSULATIONS, EncapSpec
from mirrorckpt.config.layout import (
    AUTO,
    DTYPES,
    PROTOCOLS,
    BucketSpec,
    JobLayout,
    MirrorSpec,
    ParamSpec,
    RingSpec,
    live_source,
)
from mirrorckpt.config.shards import ShardedLayout


class ConfigError(Exception):
    """A configuration that cannot be used; the message locates the problem."""


# key -> (type description, validator returning the value or raising ValueError, required)
def _int(lo=None):
    def f(v):
        if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
            raise ValueError(f"expected an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
        return v
    return f


def _num(lo=None):
    def f(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or (lo is not None and v < lo):
            raise ValueError(f"expected a number{f' >= {lo}' if lo is not None else ''}, got {v!r}")
        return v
    return f


def _str(choices=None):
    def f(v):
        if not isinstance(v, str) or (choices and v not in choices):
            want = f"one of {', '.join(choices)}" if choices else "a string"
            raise ValueError(f"expected {want}, got {v!r}")
        return v
    return f


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _int_list(v):
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f"expected a list of integers, got {v!r}")
    return v


def _int_lists(v):
    if not isinstance(v, list) or not all(isinstance(x, list) for x in v):
        raise ValueError(f"expected a list of integer lists, got {v!r}")
    return [_int_list(x) for x in v]


def _addr(v):
    try:
        return str(ipaddress.ip_address(v))
    except (ValueError, TypeError):
        raise ValueError(f"expected an IPv4 or IPv6 address, got {v!r}") from None


def _addr_list(v):
    if not isinstance(v, list):
        raise ValueError(f"expected a list of addresses, got {v!r}")
    return [_addr(x) for x in v]


def _listen(v):
    host, colon, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    if not colon or not port.isdigit() or int(port) > 65535 or " " in host:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9100; port 0 picks a free one), got {v!r}")
    return v


def _table(v):
    if not isinstance(v, dict):
        raise ValueError(f"expected a table, got {v!r}")
    return v


RING = {
    "nranks": (_int(2), True), "nchannels": (_int(1), False), "protocol": (_str(PROTOCOLS + (AUTO,)), False),
    "nccl_version": (_str(), False), "nthreads": (_int(32), False), "orders": (_int_lists, False),
    "addresses": (_addr_list, False),
}
SCHEMA = {
    "ring": RING,
    # one ring of a sharded job ([job] shards): [ring]'s keys, whose replica shard, and its mirrors
    "rings": dict(RING, group=(_str(), False), weights_only=(_bool, False), replica=(_int(0), False),
                  listen=(_str(), False), mirror=(list, False)),
    "job": {
        "name": (_str(), False), "kind": (_str(("ddp", "allreduce")), False), "startup": (_bool, False),
        "p2p_fill": (_bool, False),
        "grad_dtype": (_str(tuple(DTYPES)), False), "counts": (_int_list, False),
        "params": (list, False), "buckets": (_table, False), "shards": (_str(), False), "initial": (_str(), False),
    },
    "job.params": {"name": (_str(), True), "shape": (_int_list, True), "dtype": (_str(tuple(DTYPES)), False)},
    "job.buckets": {"first": (_int_lists, False), "after_rebuild": (_int_lists, True)},
    "mirror": {"rank": (_int(0), True), "direction": (_str(("egress", "ingress", "both")), False),
               "source": (_str(), False), "workers": (_int(1), False)},
    "persist": {"directory": (_str(), True), "every_iterations": (_int(1), False),
                "every_seconds": (_num(0), False), "keep_last": (_int(1), False),
                "memory_budget_bytes": (_int(0), False), "writer_threads": (_int(1), False)},
    "control": {"listen": (_listen, False), "secret_file": (_str(), False), "fallback_parts": (_int(1), False),
                "fingerprint_every": (_int(1), False), "tls_cert": (_str(), False), "tls_key": (_str(), False),
                "tls_ca": (_str(), False)},
    "metrics": {"listen": (_listen, False)},
    # one appliance of several following a sharded job: its name in the layout, the appliances' group
    "joint": {"appliance": (_str(), True), "address": (_listen, True), "rank": (_int(0), False),
              "world": (_int(1), False), "timeout_seconds": (_num(1), False)},
    # control.protection.Limits: when the job counts as protected, and degraded mode's fallbacks
    "protection": {"max_lag_steps": (_int(1), False), "silent_seconds": (_num(0), False),
                   "fallback_interval": (_num(0), False), "fallback_every": (_int(1), False)},
    "updater": {"pipelined": (_bool, False), "threads": (_int(1), False)},
    "capture": {"backend": (_str(("file", "afpacket", "dpdk")), False), "batch_frames": (_int(1), False),
                "queue_bytes": (_int(1), False), "window": (_int(1), False), "transfer_bytes": (_int(0), False),
                "file_split": (_str(("connection", "port")), False),
                "encapsulation": (_str(ENCAPSULATIONS), False), "vxlan_port": (_int(1), False),
                "gre_protocol": (_int(0), False), "gre_header_bytes": (_int(0), False)},
}
TOP = {"ring": _table, "job": _table, "training": _table, "persist": _table, "mirror": list, "control": _table,
       "metrics": _table, "joint": _table, "capture": _table, "updater": _table, "protection": _table}


@dataclass
class RingConfig:
    """One ``[[ring]]`` of a sharded job: the ring, its mirrors, and what it keeps."""

    ring: RingSpec
    mirrors: list[MirrorSpec] = field(default_factory=list)
    group: str | None = None  # the layout's group whose replica shard this ring's all-reduces give
    weights_only: bool = False  # an FSDP2 shard group followed for its parameter all-gathers
    replica: int = 0  # weights_only: which shard group (mesh row) of an HSDP job; pure FSDP has one
    listen: str | None = None  # with [control]: the address of this ring's group's control plane

    @property
    def name(self) -> str:
        return self.group if self.group is not None else f"weights-{self.replica}"


def _check(where: str, section: str, d: dict) -> dict:
    schema = SCHEMA[section]
    for k in d:
        if k not in schema:
            raise ConfigError(f"{where}: unknown key {k!r} (known: {', '.join(schema)})")
    out = {}
    for k, (check, required) in schema.items():
        if k not in d:
            if required:
                raise ConfigError(f"{where}: missing key {k!r}")
            continue
        try:
            out[k] = check(d[k]) if check not in (list, dict) else d[k]
        except ValueError as e:
            raise ConfigError(f"{where} {k}: {e}") from None
        if check is list and not isinstance(d[k], list):
            raise ConfigError(f"{where} {k}: expected an array of tables, got {d[k]!r}")
    return out


@dataclass
class JobConfig:
    ring: RingSpec
    kind: str = "ddp"
    startup: bool = True
    layout: JobLayout | None = None
    counts: list[int] | None = None  # plain all-reduce jobs
    grad_dtype: str = "float32"
    training: dict = field(default_factory=dict)
    persist: dict = field(default_factory=dict)
    mirrors: list[MirrorSpec] = field(default_factory=list)
    control: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    protection: dict = field(default_factory=dict)  # [protection]: control.protection.Limits
    capture: dict = field(default_factory=dict)
    # [updater] pipelined: step each bucket as soon as it is final (updater.appliance.Appliance)
    updater: dict = field(default_factory=dict)
    path: str = ""
    # (kind, count, dtype) -> protocol, as the traffic showed it when [ring] protocol is "auto"
    protocols: dict = field(default_factory=dict)
    name: str | None = None  # [job] name: recorded in the checkpoint root; another job's root is refused
    # [job] p2p_fill: the workload sends an all-reduce's values its mirrors lack point to point (parser.concat)
    p2p_fill: bool = False
    # a sharded job (kind "sharded"): [job] shards (its path as written, and the layout), [job]
    # initial (a seed checkpoint: the replicas' step 0 where no start-up broadcast carries it), the
    # [[ring]]s; ``ring`` is then the first one's
    shards: ShardedLayout | None = None
    shards_path: str = ""
    initial: str | None = None
    rings: list[RingConfig] = field(default_factory=list)
    # [joint]: this serve is one appliance of several (appliance, address, rank, world, timeout_seconds)
    joint: dict = field(default_factory=dict)

    @property
    def encap(self) -> EncapSpec:
        """[capture] encapsulation and its keys: how the mirror copies arrive (config.encap)."""
        return EncapSpec.from_capture(self.capture)

    @property
    def pipelined(self) -> bool:
        """[updater] pipelined (default off)."""
        return bool(self.updater.get("pipelined", False))

    def updater_threads(self, packet_path: int) -> int:
        """[updater] threads: torch's threads for the replica's step; by default the cores the packet
        path's ``packet_path`` threads and processes leave, at least one (see default_updater_threads)."""
        return self.updater.get("threads") or default_updater_threads(packet_path)


def default_updater_threads(packet_path: int) -> int:
    """The cores this process may use less the packet path's, at least one: torch's default pool
    (a thread per core) spins on the packet path's cores between steps and costs it more than the
    step gains (serve on 2 cores, LL: one updater thread was faster than two in every A/B run)."""
    return max(1, len(os.sched_getaffinity(0)) - packet_path)


def _source(spec: str, base: Path | None) -> str:
    """A capture-file source relative to the configuration file's folder; live specs unchanged."""
    if not spec or base is None or live_source(spec):
        return spec
    path = Path(spec.removeprefix("file:"))
    return str(path if path.is_absolute() else base / path)


def load_job(path) -> JobConfig:
    p = Path(path)
    name = p.name
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{name}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not a TOML job file (byte {e.start} is not UTF-8 text)") from None
    except OSError as e:
        raise ConfigError(f"{name}: {e.strerror}") from None
    return parse_job(raw, name, p.resolve().parent)


def _ring(where: str, r: dict) -> RingSpec:
    """A checked [ring] (or [[ring]]) table's RingSpec."""
    addresses = dict(enumerate(r.get("addresses", [])))
    if addresses and len(addresses) != r["nranks"]:
        raise ConfigError(f"{where} addresses: {len(addresses)} given for {r['nranks']} ranks")
    try:
        return RingSpec(nranks=r["nranks"], nchannels=r.get("nchannels", 1), protocol=r.get("protocol", AUTO),
                        nccl_version=r.get("nccl_version"), nthreads=r.get("nthreads"),
                        ring_orders=r.get("orders"), addresses=addresses)
    except ValueError as e:
        raise ConfigError(f"{where} {e}") from None


def _mirrors(where: str, entries: list, ring: RingSpec, base: Path | None, name: str) -> list[MirrorSpec]:
    out = []
    for i, m in enumerate(entries):
        at = f"{where} #{i + 1}"
        mm = _check(at, "mirror", _table_or(name, "mirror", m))
        if mm["rank"] >= ring.nranks:
            raise ConfigError(f"{at} rank: {mm['rank']} is outside the ring (ranks 0..{ring.nranks - 1})")
        out.append(MirrorSpec(mm["rank"], mm.get("direction", "both"), _source(mm.get("source", ""), base),
                              mm.get("workers", 1)))
    return out


def parse_job(raw: dict, name: str = "config", base: Path | None = None) -> JobConfig:
    sharded = isinstance(raw.get("ring"), list)
    for k, check in TOP.items():
        if k in raw and not isinstance(raw[k], dict if check is _table else list) and not (k == "ring" and sharded):
            raise ConfigError(f"{name}: [{k}] must be a {'table' if check is _table else 'array of tables'}")
    for k in raw:
        if k not in TOP:
            raise ConfigError(f"{name}: unknown table [{k}] (known: {', '.join(TOP)})")
    if "ring" not in raw:
        raise ConfigError(f"{name}: missing table [ring] (or [[ring]] tables of a sharded job)")
    j = _check(f"{name}: [job]", "job", raw.get("job", {}))
    if sharded:
        cfg = _sharded(raw, j, name, base)
    else:
        ring = _ring(f"{name}: [ring]", _check(f"{name}: [ring]", "ring", raw["ring"]))
        for k in ("shards", "initial"):
            if k in j:
                raise ConfigError(f"{name}: [job] {k}: only a sharded job ([[ring]] tables) has one")
        if "joint" in raw:
            raise ConfigError(f"{name}: [joint]: only a sharded job ([[ring]] tables) is followed by several "
                              "appliances")
        cfg = JobConfig(ring=ring, kind=j.get("kind", "ddp"), startup=j.get("startup", True),
                        grad_dtype=j.get("grad_dtype", "float32"), path=name, name=j.get("name") or None,
                        p2p_fill=j.get("p2p_fill", False))
        if cfg.kind == "ddp":
            cfg.layout = _layout(name, j, cfg.grad_dtype)
        else:
            if "counts" not in j:
                raise ConfigError(f"{name}: [job] kind = \"allreduce\" needs counts = [elements, ...]")
            cfg.counts = j["counts"]
        cfg.mirrors = _mirrors(f"{name}: [[mirror]]", raw.get("mirror", []), ring, base, name)
    for sec in ("persist", "control", "metrics", "protection", "capture", "updater"):
        if sec in raw:
            setattr(cfg, sec, _check(f"{name}: [{sec}]", sec, raw[sec]))
    try:
        EncapSpec.from_capture(cfg.capture)
    except ValueError as e:
        raise ConfigError(f"{name}: [capture] {e}") from None
    cfg.training = dict(raw.get("training", {}))
    if cfg.training and "grad_dtype" not in cfg.training:
        cfg.training["grad_dtype"] = cfg.grad_dtype  # one dtype for the wire and the replica
    return cfg


def _sharded(raw: dict, j: dict, name: str, base: Path | None) -> JobConfig:
    """A job of [[ring]] tables: its layout from [job] shards, each ring checked against it."""
    if "mirror" in raw:
        raise ConfigError(f"{name}: [[mirror]]: a job of [[ring]] tables lists each ring's mirrors as its "
                          "[[ring.mirror]] entries")
    for k in ("kind", "params", "buckets", "counts", "startup", "p2p_fill"):
        if k in j:
            raise ConfigError(f"{name}: [job] {k}: a job of [[ring]] tables takes its layout from [job] shards")
    control = isinstance(raw.get("control"), dict)
    if control and "listen" in raw["control"]:
        raise ConfigError(f"{name}: [control] listen: a sharded job's control planes listen one per ring "
                          "([[ring]] listen)")
    layout, spath = None, None
    if "shards" in j:
        spath = Path(j["shards"])
        spath = spath if spath.is_absolute() or base is None else base / spath
        try:
            layout = ShardedLayout.from_dict(json.loads(spath.read_text()))
        except OSError as e:
            raise ConfigError(f"{name}: [job] shards: {spath}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{name}: [job] shards: {spath}: not a sharded layout: {e}") from None
    elif not control:
        raise ConfigError(f"{name}: [job] shards: missing; [[ring]] tables follow the rings of a sharded layout "
                          "(a shards.json, as `mirrorckpt gen --sharded` writes it), or the trainer registers it "
                          "over [control]")
    rings: list[RingConfig] = []
    taken: dict[str, int] = {}
    for i, t in enumerate(raw["ring"]):
        where = f"{name}: [[ring]] #{i + 1}"
        r = _check(where, "rings", _table_or(name, "ring", t))
        ring = _ring(where, r)
        rc = RingConfig(ring, _mirrors(f"{where} [[ring.mirror]]", r.get("mirror", []), ring, base, name),
                        r.get("group"), r.get("weights_only", False), r.get("replica", 0), r.get("listen"))
        if control and rc.listen is None and not rc.weights_only:
            raise ConfigError(f"{where}: missing key 'listen' (with [control] each ring's group has its control "
                              "plane, at the address the trainer's appliances map names)")
        if rc.listen is not None and not control:
            raise ConfigError(f"{where} listen: a ring's control plane needs [control] (secret_file)")
        if layout is not None:
            _check_ring(where, rc, layout, spath.name)
        elif rc.weights_only:
            raise ConfigError(f"{where} weights_only: a weights-only ring needs the layout in [job] shards (its "
                              "all-gathers' parts are laid out by it)")
        elif rc.group is None:
            raise ConfigError(f"{where}: missing key 'group' (the layout's group whose replica shard this ring keeps)")
        if rc.name in taken:
            key = "group" if rc.group is not None else "replica"
            raise ConfigError(f"{where} {key}: {rc.name!r} is followed by [[ring]] #{taken[rc.name] + 1} already")
        taken[rc.name] = i
        rings.append(rc)
    if not rings:
        raise ConfigError(f"{name}: [[ring]]: no ring listed")
    joint = _joint(name, raw, layout, spath, rings)
    initial = j.get("initial")
    if initial is not None and base is not None and not Path(initial).is_absolute():
        initial = str(base / initial)
    return JobConfig(ring=rings[0].ring, kind="sharded", grad_dtype=j.get("grad_dtype", "float32"), path=name,
                     name=j.get("name") or None, shards=layout, shards_path=j.get("shards", ""), initial=initial,
                     rings=rings, joint=joint)


def _joint(name: str, raw: dict, layout: ShardedLayout | None, spath: Path | None, rings: list[RingConfig]) -> dict:
    """[joint] checked: rank and world from the layout's appliance list (given ones must agree), and
    the [[ring]]s exactly this appliance's groups."""
    if "joint" not in raw:
        return {}
    where = f"{name}: [joint]"
    jt = _check(where, "joint", raw["joint"])
    me = jt["appliance"]
    if jt["address"].endswith(":0"):
        raise ConfigError(f"{where} address: {jt['address']!r}: every appliance meets at this port, so it cannot be "
                          "0 (any)")
    if layout is None:  # the trainer registers the layout: rank and world are checked against it then
        for k in ("rank", "world"):
            if k not in jt:
                raise ConfigError(f"{where}: missing key {k!r} (without [job] shards the layout, and this "
                                  "appliance's place in it, comes from the trainer; give rank and world)")
    else:
        if me not in layout.appliances:
            raise ConfigError(f"{where} appliance: {me!r} is not an appliance of {spath.name} (appliances: "
                              f"{', '.join(layout.appliances)})")
        for k, v in (("rank", layout.appliances.index(me)), ("world", len(layout.appliances))):
            if jt.setdefault(k, v) != v:
                raise ConfigError(f"{where} {k}: {jt[k]}, but {spath.name} makes appliance {me!r} {k} {v}")
    if jt["rank"] >= jt["world"]:
        raise ConfigError(f"{where} rank: {jt['rank']} is outside the appliances' group (ranks 0..{jt['world'] - 1})")
    for i, rc in enumerate(rings):
        at = f"{name}: [[ring]] #{i + 1}"
        if rc.weights_only:
            raise ConfigError(f"{at} weights_only: a weights-only ring is followed by one serve, not with [joint]")
        owner = layout.group(rc.group).appliance if layout is not None else me
        if owner != me:
            raise ConfigError(f"{at} group: {rc.group!r} is followed by appliance {owner!r} in {spath.name}, not by "
                              f"this serve's [joint] appliance {me!r}")
    if layout is not None:
        missing = sorted({g.name for g in layout.groups_of(me)} - {rc.group for rc in rings})
        if missing:
            raise ConfigError(f"{name}: [[ring]]: appliance {me!r} follows group(s) {', '.join(missing)} in "
                              f"{spath.name}, and no [[ring]] here follows them (no other appliance will)")
    return jt


def _check_ring(where: str, rc: RingConfig, layout: ShardedLayout, shards_name: str) -> None:
    """A [[ring]] against the layout: a group of it (or weights of an FSDP2 job), of its ring's size."""
    names = [g.name for g in layout.groups]
    if rc.weights_only:
        if rc.group is not None:
            raise ConfigError(f"{where} group: a weights_only ring keeps every parameter, not group {rc.group!r}")
        if layout.scheme != "fsdp2":
            raise ConfigError(f"{where} weights_only: a {layout.scheme} layout has no FSDP2 shard group to follow "
                              "for weights")
        if rc.replica >= layout.dp:
            raise ConfigError(f"{where} replica: {rc.replica} outside the layout's replicas 0..{layout.dp - 1}")
        size = layout.shards
    else:
        if rc.group is None:
            raise ConfigError(f"{where}: missing key 'group' (the group of {shards_name} whose replica shard this "
                              f"ring keeps: {', '.join(names)}), or weights_only = true")
        if rc.group not in names:
            raise ConfigError(f"{where} group: {rc.group!r} is not a group of {shards_name} (groups: "
                              f"{', '.join(names)})")
        if layout.refusal is not None:
            raise ConfigError(f"{where} group: {layout.refusal}; follow such a job with one weights_only ring")
        size = len(layout.group(rc.group).ranks)
    if rc.ring.nranks != size:
        raise ConfigError(f"{where} nranks: {rc.ring.nranks}, but the ring of {rc.name} in {shards_name} has "
                          f"{size} ranks")


def _table_or(name, sec, v):
    if not isinstance(v, dict):
        raise ConfigError(f"{name}: [[{sec}]] entries must be tables, got {v!r}")
    return v


def _layout(name: str, j: dict, grad_dtype: str) -> JobLayout | None:
    """The [[job.params]]/[job.buckets] layout; None when not written (the trainer registers it)."""
    if "params" not in j:
        if "buckets" in j:
            raise ConfigError(f"{name}: [job.buckets] without [[job.params]] (name, shape) entries")
        return None
    params = []
    for i, p in enumerate(j["params"]):
        pp = _check(f"{name}: [[job.params]] #{i + 1}", "job.params", _table_or(name, "job.params", p))
        params.append(ParamSpec(pp["name"], tuple(pp["shape"]), pp.get("dtype", "float32")))
    if "buckets" in j:
        b = _check(f"{name}: [job.buckets]", "job.buckets", j["buckets"])
        after = [BucketSpec(tuple(x)) for x in b["after_rebuild"]]
        first = [BucketSpec(tuple(x)) for x in b.get("first", [list(range(len(params)))])]
    else:  # DDP 2.13: one bucket at first; the rebuilt layout must be given for a multi-bucket model
        first = after = [BucketSpec(tuple(range(len(params))))]
    try:
        return JobLayout(params=params, buckets=after, first_buckets=first, grad_dtype=grad_dtype)
    except ValueError as e:
        raise ConfigError(f"{name}: [job.buckets] {e}") from None


# -- writing --------------------------------------------------------------------------------


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _drop_none(d):
    """TOML has no null: absent keys mean "not set"."""
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def _ring_lines(r: RingSpec) -> list[str]:
    lines = [f"nranks = {r.nranks}", f"nchannels = {r.nchannels}", f"protocol = {_toml_value(r.protocol)}"]
    if r.nccl_version:
        lines.append(f"nccl_version = {_toml_value(r.nccl_version)}")
    if r.nthreads:
        lines.append(f"nthreads = {r.nthreads}")
    if r.ring_orders:
        lines.append(f"orders = {_toml_value(r.ring_orders)}")
    if r.addresses:
        lines.append(f"addresses = {_toml_value([r.addresses[i] for i in range(r.nranks)])}")
    return lines


def _mirror_lines(m: MirrorSpec, table: str) -> list[str]:
    lines = ["", f"[[{table}]]", f"rank = {m.rank}", f"direction = {_toml_value(m.direction)}"]
    if m.source:
        lines.append(f"source = {_toml_value(m.source)}")
    if m.workers != 1:
        lines.append(f"workers = {m.workers}")
    return lines


def dump_job(cfg: JobConfig) -> str:
    if cfg.rings:
        return _dump_sharded(cfg)
    lines = ["# mirrorckpt job configuration", "[ring]"] + _ring_lines(cfg.ring)
    lines += ["", "[job]"] + ([f"name = {_toml_value(cfg.name)}"] if cfg.name else [])
    lines += [f"kind = {_toml_value(cfg.kind)}", f"startup = {_toml_value(cfg.startup)}",
              f"grad_dtype = {_toml_value(cfg.grad_dtype)}"]
    if cfg.p2p_fill:
        lines.append("p2p_fill = true")
    if cfg.kind == "allreduce":
        lines.append(f"counts = {_toml_value(cfg.counts)}")
    else:
        lay = cfg.layout
        for p in lay.params:
            lines += ["", "[[job.params]]", f"name = {_toml_value(p.name)}", f"shape = {_toml_value(list(p.shape))}"]
            if p.dtype != "float32":
                lines.append(f"dtype = {_toml_value(p.dtype)}")
        lines += ["", "[job.buckets]", f"first = {_toml_value([list(b.params) for b in lay.bucket_list(0)])}",
                  f"after_rebuild = {_toml_value([list(b.params) for b in lay.buckets])}"]
    lines += _section_lines(cfg)
    for m in cfg.mirrors:
        lines += _mirror_lines(m, "mirror")
    return "\n".join(lines) + "\n"


def _section_lines(cfg: JobConfig) -> list[str]:
    lines = []
    for sec in ("training", "persist", "control", "joint", "metrics", "protection", "capture", "updater"):
        d = _drop_none(getattr(cfg, sec))
        if d:
            lines += ["", f"[{sec}]"] + [f"{k} = {_toml_value(v)}" for k, v in d.items()]
    return lines


def _dump_sharded(cfg: JobConfig) -> str:
    lines = ["# mirrorckpt job configuration: a sharded job, one [[ring]] per followed ring", "[job]"]
    lines += [f"name = {_toml_value(cfg.name)}"] if cfg.name else []
    lines += [f"shards = {_toml_value(cfg.shards_path)}"] if cfg.shards_path else []
    lines += [f"grad_dtype = {_toml_value(cfg.grad_dtype)}"]
    if cfg.initial:
        lines.append(f"initial = {_toml_value(cfg.initial)}")
    lines += _section_lines(cfg)
    for rc in cfg.rings:
        lines += ["", "[[ring]]"]
        lines += [f"group = {_toml_value(rc.group)}"] if rc.group is not None else ["weights_only = true"]
        if rc.weights_only and rc.replica:
            lines.append(f"replica = {rc.replica}")
        if rc.listen:
            lines.append(f"listen = {_toml_value(rc.listen)}")
        lines += _ring_lines(rc.ring)
        for m in rc.mirrors:
            lines += _mirror_lines(m, "ring.mirror")
    return "\n".join(lines) + "\n"
