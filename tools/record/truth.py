"""The ranks' own records merged into ``truth.json``, in the generator's schema (``tools.generator.truth``).

Each rank wrote ``rank<R>.json`` (``tools.record.workload``): per collective its input's and
result's sha256. The merge checks that every rank issued the same collectives and got the same
result (a ring all-reduce ends with every rank holding the same bytes; a difference means the
record cannot be truth) and writes the generator's keys: ``config``, ``layout``,
``initial_params``, ``collectives`` (with ``inputs_sha256``, one per rank, beside the result's
``sha256``) and ``iterations`` (``losses`` per rank, the state digests of rank 0), plus
``record``: how the capture was made (release, transport, environment, machine).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, numpy_dtype
from mirrorckpt.tools.generator.truth import FORMAT, INITIAL_PARAMS_FILE, TRUTH_FILE
from mirrorckpt.tools.record.workload import RANK_FILE

_SAME = ("kind", "what", "dtype", "count")  # what every rank's record of a collective agrees on


class TruthError(RuntimeError):
    """The ranks' records are missing or disagree; the message names the rank and collective."""


def read_ranks(work: Path, world: int) -> list[dict]:
    out = []
    for r in range(world):
        path = Path(work) / RANK_FILE.format(rank=r)
        if not path.is_file():
            raise TruthError(f"{path}: rank {r} wrote no record (see its log)")
        out.append(json.loads(path.read_text()))
    return out


def check_agree(ranks: list[dict]) -> None:
    """Every rank issued the same collectives and got the same results."""
    base = ranks[0]["collectives"]
    for rec in ranks[1:]:
        mine = rec["collectives"]
        if len(mine) != len(base):
            raise TruthError(f"rank {rec['rank']} issued {len(mine)} collectives, rank 0 {len(base)}")
        for c0, c in zip(base, mine):
            if any(c0[k] != c[k] for k in _SAME):
                raise TruthError(f"collective {c['index']}: rank {rec['rank']} issued {c['what']} "
                                 f"({c['count']} x {c['dtype']}), rank 0 {c0['what']} ({c0['count']} x {c0['dtype']})")
            if c0["sha256"] != c["sha256"]:
                raise TruthError(f"collective {c['index']} ({c['what']}): rank {rec['rank']}'s result differs from "
                                 "rank 0's (the ranks do not agree on what the wire carried)")


def layout_of(rank0: dict) -> JobLayout:
    return JobLayout(params=[ParamSpec(n, tuple(s), "float32") for n, s in zip(rank0["names"], rank0["shapes"])],
                     buckets=[BucketSpec(tuple(b)) for b in rank0["buckets"]],
                     first_buckets=[BucketSpec(tuple(b)) for b in rank0["first_buckets"]],
                     grad_dtype=rank0["grad_dtype"])


def first8(raw: bytes, dtype: str) -> list[float]:
    """The first parameter's first 8 values as floats (the generator's ``initial_params.first8``)."""
    a = np.frombuffer(raw, dtype=numpy_dtype(dtype).newbyteorder("<"))[:8]
    if dtype == "bfloat16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return [float(v) for v in a]


def merge(work: Path, folder: Path, world: int, config: dict, record: dict) -> dict:
    """Writes ``folder/truth.json`` (and moves ``initial_params.bin`` there); returns the truth."""
    ranks = read_ranks(work, world)
    check_agree(ranks)
    r0 = ranks[0]
    layout = layout_of(r0)
    src = Path(work) / INITIAL_PARAMS_FILE
    if not src.is_file():
        raise TruthError(f"{src}: rank 0 wrote no initial parameters")
    raw = src.read_bytes()
    if len(raw) != layout.total_numel * np.dtype(numpy_dtype(layout.grad_dtype)).itemsize:
        raise TruthError(f"{src}: {len(raw)} bytes, the layout has {layout.total_numel} {layout.grad_dtype} values")
    collectives = []
    for k, c in enumerate(r0["collectives"]):
        collectives.append({**{key: c[key] for key in ("index", "kind", "what", "dtype", "count", "sha256")},
                            "inputs_sha256": [rec["collectives"][k]["input_sha256"] for rec in ranks]})
    iterations = []
    for k, it in enumerate(r0["iterations"]):
        iterations.append({"index": it["index"], "step": it["step"], "lr": it["lr"], "loss_scale": None,
                           "skipped": False, "losses": [rec["iterations"][k]["loss"] for rec in ranks],
                           "buckets_sha256": it["buckets_sha256"], "params_sha256": it["params_sha256"],
                           "optim_sha256": it["optim_sha256"], "grad_norm": None, "extra": {}})
    truth = {
        "format": FORMAT,
        "config": config,
        "layout": layout.to_dict(),
        "initial_params": {"file": INITIAL_PARAMS_FILE, "dtype": layout.grad_dtype, "count": layout.total_numel,
                           "sha256": hashlib.sha256(raw).hexdigest(), "first8": first8(raw, layout.grad_dtype)},
        "collectives": collectives,
        "iterations": iterations,
        "record": {**record, "library": r0["library"]},
    }
    folder = Path(folder)
    shutil.copyfile(src, folder / INITIAL_PARAMS_FILE)
    (folder / TRUTH_FILE).write_text(json.dumps(truth, sort_keys=True, indent=1) + "\n")
    return truth
