"""Digests of model and optimizer state, defined once for truth files, tests and drift checks.

``state_sha256`` is the exact identity used in the generator's truth.json and by the replica's
tests. ``fingerprint`` is the cheap per-tensor check the trainer sends every K steps: a weighted
sum of the tensor's 32-bit words, ``sum((2i+1) * w_i) mod 2**64``. Any change of a single bit
changes it, it catches swapped elements, and on a GPU it is one reduction.

``stats`` is the fingerprint that measures distance, for a trainer whose arithmetic is not the
replica's (updater.numeric): per tensor, in float64, its sum and sum of squares, the sums of
``CHUNKS`` contiguous chunks, and ``SAMPLES`` elements at positions drawn from (step, key), which
both sides compute alike. ``distance`` turns two of them into one number, relative to the
tensor's root mean square.
"""

from __future__ import annotations

import hashlib
import math

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



# ------------------------------------------------------------------------------ distance fingerprints

CHUNKS = 64
SAMPLES = 32
STATS_LEN = 2 + CHUNKS + SAMPLES  # sum, sum of squares, chunk sums (zero-padded), samples (zero-padded)
_BLOCK = 1 << 22  # float64 elements converted at a time (bounds the temporary on a GPU)


def chunking(n: int) -> tuple[int, int]:
    """(chunk size, number of chunks) of a tensor of ``n`` elements."""
    size = max(1, -(-n // CHUNKS))
    return size, -(-n // size) if n else 0


def sample_positions(n: int, step: int, key: str) -> list[int]:
    """``min(SAMPLES, n)`` element positions, the same on both sides: a stride walk from a start,
    both drawn from a hash of (step, key), so another step looks at other elements."""
    if n <= SAMPLES:
        return list(range(n))
    h = hashlib.blake2b(f"{step}:{key}".encode(), digest_size=16).digest()
    start = int.from_bytes(h[:8], "little") % n
    stride = int.from_bytes(h[8:], "little") % n or 1
    return [(start + j * stride) % n for j in range(SAMPLES)]


@torch.no_grad()
def stats(t: torch.Tensor, step: int, key: str, host: bool = True) -> torch.Tensor:
    """The distance fingerprint of ``t`` (STATS_LEN float64 values), computed with torch ops on the
    tensor's own device; on the host (``host``), else left on the device with no host sync."""
    x = t.detach().reshape(-1)
    n = x.numel()
    size, nchunks = chunking(n)
    out = torch.zeros(STATS_LEN, dtype=torch.float64, device=x.device)
    full = n // size if n else 0
    rows = x[:full * size].view(full, size) if full else x[:0].view(0, 1)
    step_rows = max(1, _BLOCK // size)
    for a in range(0, full, step_rows):
        blk = rows[a:a + step_rows].double()
        out[2 + a:2 + a + blk.shape[0]] = blk.sum(1)
        out[1] += blk.square().sum()
    if full < nchunks:  # the shorter last chunk
        tail = x[full * size:].double()
        out[2 + full] = tail.sum()
        out[1] += tail.square().sum()
    out[0] = out[2:2 + nchunks].sum()
    pos = sample_positions(n, step, key)
    if pos:
        idx = torch.tensor(pos, dtype=torch.int64).to(x.device, non_blocking=True)
        out[2 + CHUNKS:2 + CHUNKS + len(pos)] = x.index_select(0, idx).double()
    return out.cpu() if host else out


def distance(want, have, n: int) -> float:
    """How far two tensors of ``n`` elements are apart, from their ``stats``: the largest of the
    differences of sum, norm, each chunk's sum (each over the noise that independent rounding
    of its elements would give: sqrt(elements)) and each sample, all over the tensor's root mean
    square. Independent relative errors of size e give about e; one element off by E gives at
    least E / sqrt(chunk size) (E where it is sampled); inf for non-finite values."""
    a = np.asarray(want, dtype=np.float64)
    b = np.asarray(have, dtype=np.float64)
    if a.shape != (STATS_LEN,) or b.shape != (STATS_LEN,):
        raise ValueError(f"distance fingerprints hold {STATS_LEN} values, got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    if n == 0:
        return 0.0
    size, nchunks = chunking(n)
    rms = math.sqrt(max(a[1], b[1]) / n)
    if rms == 0.0:
        return 0.0 if np.array_equal(a, b) else math.inf
    counts = np.full(nchunks, float(size))
    counts[-1] = n - size * (nchunks - 1)
    ns = min(SAMPLES, n)
    d = max(abs(a[0] - b[0]) / math.sqrt(n),
            abs(math.sqrt(a[1]) - math.sqrt(b[1])),
            float(np.max(np.abs(a[2:2 + nchunks] - b[2:2 + nchunks]) / np.sqrt(counts))),
            float(np.max(np.abs(a[2 + CHUNKS:2 + CHUNKS + ns] - b[2 + CHUNKS:2 + CHUNKS + ns]))))
    return d / rms
