"""The generator's truth record: what the trainer did, for tests of the parser and the replica.

``truth.json`` holds the run configuration, the job layout, every collective in issue order
(kind, what, dtype, count per rank, sha256 of the result bytes), per iteration the sha256 of each
reduced bucket, the step, lr, loss scale, skipped flag and the state digests after the step, and
the initial parameters' digest. The initial parameters themselves (as broadcast, in the model's
dtype, layout order) are written next to it as raw little-endian bytes, ``initial_params.bin``,
whose sha256 is the recorded one. Keys are sorted, so equal runs give equal files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from mirrorckpt.config.layout import JobLayout, numpy_dtype
from mirrorckpt.updater.fingerprint import tensor_bytes

FORMAT = 1
TRUTH_FILE = "truth.json"
INITIAL_PARAMS_FILE = "initial_params.bin"


def wire_dtype_name(a: np.ndarray) -> str:
    # uint16 on the wire is always bfloat16 (config.layout.numpy_dtype)
    return "bfloat16" if a.dtype == np.uint16 else str(a.dtype)


def sha256_arrays(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class CollectiveRecord:
    index: int
    kind: str  # "all_gather", "broadcast" or "all_reduce"
    what: str
    dtype: str
    count: int  # elements of one rank's buffer
    sha256: str  # of the result (all_gather: the ranks' buffers concatenated in rank order)


class RecordingComm:
    """Wraps a Comm and records every collective's result digest, in issue order."""

    def __init__(self, inner):
        self.inner = inner
        self.records: list[CollectiveRecord] = []

    def _add(self, kind: str, what: str, result: list[np.ndarray]) -> None:
        self.records.append(CollectiveRecord(len(self.records), kind, what, wire_dtype_name(result[0]),
                                             int(result[0].size), sha256_arrays(result)))

    def all_gather(self, per_rank, what):
        out = self.inner.all_gather(per_rank, what)
        self._add("all_gather", what, list(out))
        return out

    def broadcast(self, data, root, what):
        out = self.inner.broadcast(data, root, what)
        self._add("broadcast", what, [out])
        return out

    def all_reduce(self, per_rank, what):
        out = self.inner.all_reduce(per_rank, what)
        self._add("all_reduce", what, [out])
        return out


@dataclass
class IterationRecord:
    index: int  # 0-based iteration
    step: int  # optimizer steps taken after this iteration
    lr: float  # learning rate this iteration's step used
    loss_scale: float | None  # fp16: the scale this iteration's gradients carry
    skipped: bool  # fp16: the step was skipped for inf/nan gradients
    losses: list[float]  # per rank, unscaled
    buckets_sha256: list[str]  # reduced gradient of each bucket, as on the wire
    params_sha256: str  # fp32 master parameters after the step
    optim_sha256: str  # optimizer state after the step
    grad_norm: float | None = None  # total norm clip_grad_norm_ returned, when clipping
    extra: dict = field(default_factory=dict)


def params_bytes(params: list[torch.Tensor]) -> bytes:
    return b"".join(tensor_bytes(p) for p in params)


def truth_dict(result) -> dict:
    """The truth record of a train.TrainResult as a JSON-ready dict."""
    init = params_bytes(result.initial_params)
    first = result.initial_params[0].detach().reshape(-1)[:8].float().tolist() if result.initial_params else []
    return {
        "format": FORMAT,
        "config": result.config,
        "layout": result.layout.to_dict(),
        "initial_params": {
            "file": INITIAL_PARAMS_FILE,
            "dtype": result.layout.grad_dtype,  # the model's dtype, as broadcast by DDP
            "count": result.layout.total_numel,
            "sha256": hashlib.sha256(init).hexdigest(),
            "first8": first,
        },
        "collectives": [asdict(c) for c in result.collectives],
        "iterations": [asdict(it) for it in result.iterations],
    }


def write_truth(result, directory: str | Path) -> Path:
    """Write truth.json and initial_params.bin into ``directory``; returns truth.json's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / INITIAL_PARAMS_FILE).write_bytes(params_bytes(result.initial_params))
    path = d / TRUTH_FILE
    path.write_text(json.dumps(truth_dict(result), sort_keys=True, indent=1) + "\n")
    return path


def read_truth(directory: str | Path) -> dict:
    return json.loads((Path(directory) / TRUTH_FILE).read_text())


def read_initial_params(directory: str | Path) -> list[torch.Tensor]:
    """The initial parameters (model dtype, layout order) from initial_params.bin, digest checked."""
    d = Path(directory)
    truth = read_truth(d)
    raw = (d / INITIAL_PARAMS_FILE).read_bytes()
    if hashlib.sha256(raw).hexdigest() != truth["initial_params"]["sha256"]:
        raise ValueError(f"{d / INITIAL_PARAMS_FILE}: sha256 differs from truth.json's initial_params.sha256")
    layout = JobLayout.from_dict(truth["layout"])
    dtype = truth["initial_params"]["dtype"]
    flat = np.frombuffer(raw, dtype=numpy_dtype(dtype).newbyteorder("<"))
    out, pos = [], 0
    for p in layout.params:
        a = flat[pos:pos + p.numel].astype(numpy_dtype(dtype)).reshape(p.shape)
        t = torch.from_numpy(a.view(np.int16) if dtype == "bfloat16" else a.copy())
        out.append(t.view(torch.bfloat16).clone() if dtype == "bfloat16" else t)
        pos += p.numel
    return out
