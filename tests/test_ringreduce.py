"""NCCL-exact ring reduction: summation order, per-type rounding, values of every message."""

import numpy as np
import pytest
import torch
from mirrorckpt.parser.roce import ringreduce as RR
from mirrorckpt.parser.roce import schedule as S


def spread_fp32(rng, n):
    """float32 values of widely varying magnitude, so the summation order shows in the result."""
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 4, n)).astype(np.float32)


def random_bf16(rng, n):
    """Finite bf16 bit patterns of all exponents (subnormals included), both signs."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    finite = (bits & 0x7F80) != 0x7F80
    return bits[finite]


def torch_bf16(bits):
    return torch.from_numpy(bits.astype(np.int16)).view(torch.bfloat16)


def slow_ring_fp32(xs, chunk, count):
    """Scalar reference of doc 2.2 for a one-loop plan whose chunk c is [c*chunk, (c+1)*chunk)."""
    R = len(xs)
    out = np.empty(count, np.float32)
    for i in range(count):
        c = i // chunk
        acc = np.float32(xs[(c + 1) % R][i])
        for j in range(2, R + 1):
            acc = np.float32(acc + xs[(c + j) % R][i])
        out[i] = acc
    return out


def test_two_ranks_is_the_elementwise_sum():
    rng = np.random.default_rng(1)
    plan = S.allreduce_plan(5000, 4, 2, 2, "LL", "2.18")
    x = [spread_fp32(rng, 5000) for _ in range(2)]
    assert np.array_equal(RR.allreduce_result(x, plan, "float32"), x[0] + x[1])
    xi = [rng.integers(-2**31, 2**31, 5000, dtype=np.int64).astype(np.int32) for _ in range(2)]
    assert np.array_equal(RR.allreduce_result(xi, plan, np.int32), xi[0] + xi[1])


@pytest.mark.parametrize("R", [3, 4])
def test_ring_order_fp32_against_scalar_reference(R):
    rng = np.random.default_rng(R)
    count = 1000
    plan = S.allreduce_plan(count, 4, R, 1, "LL", "2.23")  # cells, one loop: chunk = alignUp(divUp(n,R), 4)
    chunk = (-(-count // R) + 3) // 4 * 4  # alignUp(divUp(count, R), 4)
    assert [(o, n) for _, o, n in plan.chunk_ranges(0)][:2] == [(0, chunk), (chunk, chunk)]
    xs = [spread_fp32(rng, count) for _ in range(R)]
    got = RR.allreduce_result(xs, plan, "float32")
    assert np.array_equal(got, slow_ring_fp32(xs, chunk, count))
    naive = np.sum(np.stack(xs), axis=0, dtype=np.float32)
    assert np.count_nonzero(got != naive) > 0  # the ring order is not numpy's order


def test_message_values_along_the_ring():
    rng = np.random.default_rng(7)
    R, count = 4, 3000
    plan = S.allreduce_plan(count, 4, R, 2, "Simple", "2.18")
    xs = [spread_fp32(rng, count) for _ in range(R)]
    final = RR.allreduce_result(xs, plan, "float32")
    nchecked = 0
    for ch in plan.channels:
        for r in range(R):
            for k, m in enumerate(plan.messages(r, ch)):
                vals = RR.message_values(xs, plan, r, ch, k, "float32")
                lo, hi = m.offset, m.offset + m.nelem
                assert vals.size == m.nelem
                if m.phase == "own":
                    assert np.array_equal(vals, xs[r][lo:hi])
                elif m.phase == "reduced":
                    assert np.array_equal(vals, final[lo:hi])
                else:  # partial: positions c+1 .. r, left to right
                    acc = xs[(m.chunk + 1) % R][lo:hi]
                    for j in range(2, m.step + 2):
                        acc = (acc + xs[(m.chunk + j) % R][lo:hi]).astype(np.float32)
                    assert (m.chunk + m.step + 1) % R == r and np.array_equal(vals, acc)
                nchecked += m.nelem > 0
    assert nchecked > 0
    with pytest.raises(IndexError, match="no message 99"):
        RR.message_values(xs, plan, 0, plan.channels[0], 99, "float32")


def test_bf16_add_rounds_like_torch():
    rng = np.random.default_rng(3)
    a, b = random_bf16(rng, 200_000), random_bf16(rng, 200_000)
    n = min(a.size, b.size)
    a, b = a[:n], b[:n]
    want = torch.add(torch_bf16(a), torch_bf16(b)).view(torch.int16).numpy().astype(np.uint16)
    got = RR.add(a, b, "bfloat16")
    fin = ~np.isnan(RR.bf16_to_f32(want))  # NaN payloads are not compared (doc 10)
    assert np.array_equal(got[fin], want[fin]) and np.isnan(RR.bf16_to_f32(got[~fin])).all()
    # ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7
    assert RR.f32_to_bf16(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)).tolist() == [0x3F80, 0x3F82]


def test_bf16_ring_result_matches_torch_in_ring_order():
    rng = np.random.default_rng(5)
    R, count = 3, 3000
    plan = S.allreduce_plan(count, 2, R, 1, "LL128", "2.20")
    xs = [(rng.standard_normal(count).astype(np.float32) * 3).view(np.uint32) for _ in range(R)]
    xs = [RR.f32_to_bf16(x.view(np.float32)) for x in xs]
    got = RR.allreduce_result(xs, plan, "bfloat16")
    want = np.empty(count, np.uint16)
    ts = [torch_bf16(x) for x in xs]
    for c, off, n in plan.chunk_ranges(0):
        acc = ts[(c + 1) % R][off:off + n]
        for j in range(2, R + 1):
            acc = torch.add(acc, ts[(c + j) % R][off:off + n])
        want[off:off + n] = acc.view(torch.int16).numpy().astype(np.uint16)
    assert np.array_equal(got, want)


def test_fp16_add_is_correctly_rounded_and_int32_wraps():
    rng = np.random.default_rng(11)
    a = rng.integers(0, 1 << 16, 100_000).astype(np.uint16).view(np.float16)
    b = rng.integers(0, 1 << 16, 100_000).astype(np.uint16).view(np.float16)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    with np.errstate(over="ignore"):
        exact = (a.astype(np.float64) + b.astype(np.float64)).astype(np.float16)  # sum is exact in f64
    assert np.array_equal(RR.add(a, b, "float16").view(np.uint16), exact.view(np.uint16))
    big = np.array([2**31 - 1, -2**31], np.int32)
    assert RR.add(big, np.array([1, -1], np.int32), "int32").tolist() == [-2**31, 2**31 - 1]


def test_broadcast_and_allgather_messages_copy_the_origin():
    rng = np.random.default_rng(2)
    xs = [rng.integers(0, 1000, 40000).astype(np.int32) for _ in range(3)]
    b = S.broadcast_plan(40000, 4, 3, 1, "LL", "2.18", root=1)
    for r in (1, 2):
        for k, m in enumerate(b.messages(r, 0)):
            assert np.array_equal(RR.message_values(xs, b, r, 0, k, "int32"), xs[1][m.offset:m.offset + m.nelem])
    a = S.allgather_plan(40000, 4, 3, 2, "Simple", "2.30")
    msgs = a.messages(0, a.channels[0])
    k = next(i for i, m in enumerate(msgs) if m.step == 1)  # forwarded data of position 2
    m = msgs[k]
    assert m.chunk == 2 and m.phase == "forward"
    assert np.array_equal(RR.message_values(xs, a, 0, a.channels[0], k, "int32"), xs[2][m.offset:m.offset + m.nelem])


def test_input_errors_name_the_problem():
    plan = S.allreduce_plan(100, 4, 2, 1, "LL", "2.18")
    x = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match="3 input buffers for a ring of 2"):
        RR.allreduce_result([x, x, x], plan, "float32")
    with pytest.raises(ValueError, match="position 1 is float64"):
        RR.allreduce_result([x, x.astype(np.float64)], plan, "float32")
    with pytest.raises(ValueError, match="has 50 elements"):
        RR.allreduce_result([x, x[:50]], plan, "float32")
    with pytest.raises(ValueError, match="reduction type 'complex64'"):
        RR.allreduce_result([x, x], plan, "complex64")
