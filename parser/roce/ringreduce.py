"""NCCL-exact values on the wire of a ring collective, computed on the CPU.

The final value of all-reduce chunk c is built along the ring from position c+1, the owner adding
its own contribution last: ``((x[c+1] + x[c+2]) + ...) + x[c]``, every ``+`` rounded in the element
type (doc 2.2, /work/shared/docs/nccl-ring-schedule.md). float32/float64: numpy add (IEEE RNE,
subnormals kept). float16: numpy's half add (float32 add, one rounding: exact, since 24 >= 2*11+2).
bfloat16 (uint16 bit patterns): float32 add, then round-to-nearest-even to bf16, NaN -> 0x7FFF as
CUDA's __float2bfloat16 does. Integers: wrapping add. Work is vectorised per chunk; the only Python
loops run over ring positions and chunks.
"""

from __future__ import annotations

import numpy as np
from mirrorckpt.parser.placement import RingStep
from mirrorckpt.parser.roce.schedule import ALLGATHER, ALLREDUCE, BROADCAST, AllReducePlan, RingPlan

BF16 = "bfloat16"
_NUMPY_TYPES = {"float32", "float64", "float16", "int32", "int64", "uint8", "int8"}


def _check_dtype(dtype) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name != BF16 and name not in _NUMPY_TYPES:
        raise ValueError(f"reduction type {name!r} is not bfloat16 or one of {sorted(_NUMPY_TYPES)}")
    return name


def _storage(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == BF16 else np.dtype(dtype)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even; NaN -> 0x7FFF (CUDA's canonical NaN)."""
    f = np.asarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    out[np.isnan(f)] = 0x7FFF
    return out


def add(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """One element-wise NCCL ``FuncSum`` step ``a + b``, rounded in ``dtype``."""
    dtype = _check_dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are values here, not errors
        if dtype == BF16:
            return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b))
        return np.add(a, b, dtype=np.dtype(dtype))


def ring_sum(inputs, first: int, nterms: int, start: int, stop: int, dtype) -> np.ndarray:
    """``((x[first] + x[first+1]) + ...)`` over ``nterms`` ring positions (mod R), elements [start, stop)."""
    R = len(inputs)
    acc = np.array(inputs[first % R][start:stop], copy=True)
    for j in range(1, nterms):
        acc = add(acc, inputs[(first + j) % R][start:stop], dtype)
    return acc


def _inputs(inputs, plan: RingPlan, dtype: str) -> list[np.ndarray]:
    if len(inputs) != plan.nranks:
        raise ValueError(f"{len(inputs)} input buffers for a ring of {plan.nranks} positions")
    st = _storage(dtype)
    out = []
    for r, x in enumerate(inputs):
        x = np.asarray(x)
        if x.dtype != st:
            raise ValueError(f"input of ring position {r} is {x.dtype}, expected {st} for {dtype}")
        if x.size < plan.count:
            raise ValueError(f"input of ring position {r} has {x.size} elements, the collective needs {plan.count}")
        out.append(x.reshape(-1))
    return out


def step_values(inputs, plan: RingPlan, msg: RingStep, dtype) -> np.ndarray:
    """The elements message ``msg`` (one of ``plan``'s) carries."""
    dtype = _check_dtype(dtype)
    xs = _inputs(inputs, plan, dtype)
    lo, hi = msg.offset, msg.offset + msg.nelem
    if plan.kind == ALLREDUCE:
        # chunk c at ring step s holds the sum of positions c+1 .. c+1+s (s+1 terms, at most R)
        return ring_sum(xs, msg.chunk + 1, min(msg.step + 1, plan.nranks), lo, hi, dtype)
    if plan.kind in (ALLGATHER, BROADCAST):
        return np.array(xs[msg.chunk][lo:hi], copy=True)
    raise ValueError(f"no wire values for collective {plan.kind!r}")


def message_values(inputs, plan: RingPlan, rank_pos: int, channel: int, k: int, dtype) -> np.ndarray:
    """Elements of the k-th message ring position ``rank_pos`` sends on ``channel``: own input
    (s = 0), the partial sum along the ring (1 <= s <= R-2), or the final value (s >= R-1)."""
    msgs = plan.messages(rank_pos, channel)
    if not 0 <= k < len(msgs):
        raise IndexError(f"ring position {rank_pos} sends {len(msgs)} messages on channel {channel}, no message {k}")
    return step_values(inputs, plan, msgs[k], dtype)


def chunk_labels(plan: AllReducePlan) -> np.ndarray:
    """Chunk index c of every element of the all-reduce buffer (int16); raises if the plan leaves
    an element out or covers one twice."""
    labels = np.full(plan.count, -1, np.int16)
    seen = np.zeros(plan.count, np.int32)
    for ch in plan.channels:
        for c, off, n in plan.chunk_ranges(ch):
            labels[off:off + n] = c
            seen[off:off + n] += 1
    bad = np.flatnonzero(seen != 1)
    if bad.size:
        raise AssertionError(f"all-reduce plan covers element {bad[0]} {seen[bad[0]]} times")
    return labels


def allreduce_result(inputs, plan: AllReducePlan, dtype) -> np.ndarray:
    """The whole reduced buffer as NCCL's ring all-reduce produces it (bf16 as uint16 bits)."""
    dtype = _check_dtype(dtype)
    if plan.kind != ALLREDUCE:
        raise ValueError(f"allreduce_result needs an all-reduce plan, not {plan.kind!r}")
    xs = _inputs(inputs, plan, dtype)
    labels = chunk_labels(plan)
    out = np.empty(plan.count, _storage(dtype))
    R = plan.nranks
    for c in range(R):  # every element of chunk index c shares one summation order
        idx = np.flatnonzero(labels == c)
        if idx.size == 0:
            continue
        acc = xs[(c + 1) % R][idx]
        for j in range(2, R + 1):
            acc = add(acc, xs[(c + j) % R][idx], dtype)
        out[idx] = acc
    return out
