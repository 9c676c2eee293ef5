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
    return _view(t).tobytes()


def _view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy where it is contiguous on the CPU (hashing 80M
    parameters must not copy them)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy().reshape(-1).view("u1"))


def params_sha256(params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(_view(p))
    return h.hexdigest()


def optim_sha256(states: list[dict]) -> str:
    """Per parameter (in layout order), its optimizer state keys in sorted order, name then bytes."""
    h = hashlib.sha256()
    for st in states:
        for k in sorted(st):
            v = st[k]
            h.update(k.encode() + b"\0")
            if isinstance(v, torch.Tensor):
                h.update(_view(v))
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def state_sha256(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[str, str]:
    """(params sha256, optimizer-state sha256) for fp32 master ``params`` owned by ``optimizer``."""
    return params_sha256(params), optim_sha256([optimizer.state.get(p, {}) for p in params])


_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK = 1 << 20  # words per pass: the uint64 temporaries stay small whatever the tensor's size


def _words(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as little-endian 32-bit words (a view when they need no padding)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    b = t.numpy().reshape(-1).view(np.uint8)
    if b.size % 4:
        b = np.concatenate([b, np.zeros(4 - b.size % 4, np.uint8)])
    return b.view("<u4")


def fingerprint(t: torch.Tensor) -> int:
    """Weighted sum of the tensor's 32-bit words mod 2**64 (16-bit tensors padded with a zero word).
    Computed in chunks: a chunk from word ``lo`` adds sum((2j+1) w_j) + 2 lo sum(w_j)."""
    words = _words(t)
    weights = np.arange(min(words.size, _CHUNK), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for lo in range(0, words.size, _CHUNK):
            w = words[lo:lo + _CHUNK].astype(np.uint64)
            part = np.sum(w * weights[:w.size], dtype=np.uint64)
            total = total + part + np.uint64(2 * lo) * np.sum(w, dtype=np.uint64)
    return int(total & _MASK)
