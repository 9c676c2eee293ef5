"""Digests of model and optimizer state, defined once for truth files, tests and drift checks.

``state_sha256`` is the exact identity used in the generator's truth.json and by the replica's
tests. ``fingerprint`` is the cheap per-tensor check the trainer sends every K steps: a weighted
sum of the tensor's 32-bit words, ``sum((2i+1) * w_i) mod 2**64``. Any change of a single bit
changes it, it catches swapped elements, and on a GPU it is one reduction.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian bytes of a tensor as stored (bf16 as its 16-bit patterns)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def params_sha256(params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(tensor_bytes(p))
    return h.hexdigest()


def optim_sha256(states: list[dict]) -> str:
    """Per parameter (in layout order), its optimizer state keys in sorted order, name then bytes."""
    h = hashlib.sha256()
    for st in states:
        for k in sorted(st):
            v = st[k]
            h.update(k.encode() + b"\0")
            if isinstance(v, torch.Tensor):
                h.update(tensor_bytes(v))
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def state_sha256(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[str, str]:
    """(params sha256, optimizer-state sha256) for fp32 master ``params`` owned by ``optimizer``."""
    return params_sha256(params), optim_sha256([optimizer.state.get(p, {}) for p in params])


_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def fingerprint(t: torch.Tensor) -> int:
    """Weighted sum of the tensor's 32-bit words mod 2**64 (16-bit tensors padded with a zero word)."""
    b = np.frombuffer(tensor_bytes(t), dtype=np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, np.uint8)])
    w = b.view("<u4").astype(np.uint64)
    weights = np.arange(w.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int(np.sum(w * weights, dtype=np.uint64) & _MASK)
