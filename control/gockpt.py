"""GoCkpt-style multi-step checkpoint: both sides of the protocol.

The state (fp32 master parameters and their optimizer state) is split into ``k`` parts by
``split``, contiguous in layout order and balanced by element count; both ends compute the same
split from the registered layout, so every part's content is known before it arrives.

Schedule on the trainer, for a fallback that starts at boundary N (``iterations_done == N``):

    boundary N+j (after step N+j-1)    start copying part j of the state S_{N+j} (side stream or
                                       copy thread; forward/backward never change the state)
    before step N+j (optimizer pre-hook) wait for part j (a stall only if the copy is late: GoCkpt's
                                       blocking rule), start copying the gradients of iteration
                                       N+j of parts 0..j
    after step N+j (post-hook)         wait for the gradient copies (they overlap the optimizer
                                       step), send GOCKPT_PART j

The last part goes out at the next pre-hook (step N+k), together with the non-tensor state of
S_{N+k} (scheduler, param groups, counters, RNG, data position) and GOCKPT_DONE with the
fingerprints of S_{N+k}. The appliance (``Rebuild``) steps each part with the gradients of the
parts already received, using the trainer's optimizer; after part k-1 every part is at S_{N+k}.

Message content (names of the tensors of GOCKPT_PART j):

    p:<name>           master parameter of part j at version N+j (float32, layout shape)
    o:<name>:<key>     its optimizer state tensors (absent for a parameter never stepped)
    g:<name>           gradient of iteration N+j for every parameter of parts 0..j, in the job's
                       gradient dtype: fp32 jobs send the gradient the trainer stepped with;
                       bf16/fp16 jobs the reduced gradient (the model's, as on the wire), which
                       the rebuild turns into the master gradient as the replica does
                       (``.float()``, fp16: times 1/loss scale, then the clip coefficient)
    rng:<name>         RNG states (last part only, uint8)

and ``slices = {"params": [names of part j], "hparams": [...], "tail": {...} (last part only)}``
where ``hparams`` holds, per param group, the hyper-parameters step N+j ran with (lr, betas,
momentum, weight decay...: whatever the scheduler moves, recorded per step and replayed, so the
rebuild needs no scheduler of its own). Low-precision jobs add ``loss_scale`` (fp16: the scale
step N+j's gradients carry) and ``clip`` (the coefficient the trainer multiplied its master
gradients by, when it clips). The tail carries every group and the scheduler state of S_{N+k}.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import GROUP_OPTIONS, TrainingSpec
from mirrorckpt.control.wire import as_numpy as wire_numpy
from mirrorckpt.updater.dcp_keys import ReplicaState, loads, rng_tensor
from mirrorckpt.updater.fingerprint import STATS_LEN, stats
from mirrorckpt.updater.numeric import Digest, kernel_scalars, replica_flags
from mirrorckpt.updater.optim import LossScaler, build_optimizer, hparams_error, set_hparams, state_keys

MAX_PARTS = 64
GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PartError(ValueError):
    """A GoCkpt message that does not fit the rebuild in progress; nothing was applied."""


# ------------------------------------------------------------------------------------ the split

def split(layout: JobLayout, parts: int) -> list[list[int]]:
    """Parameter indices of each part: contiguous, balanced by element count, none empty."""
    n = len(layout.params)
    parts = max(1, min(int(parts), n))
    sizes = [p.numel for p in layout.params]
    total = max(1, sum(sizes))
    out, cur, acc = [], [], 0
    for i, s in enumerate(sizes):
        cur.append(i)
        acc += s
        left_parts = parts - len(out) - 1  # parts still to open after this one
        left_params = n - i - 1
        if left_parts > 0 and (acc * parts >= total * (len(out) + 1) or left_params == left_parts):
            out.append(cur)
            cur = []
    out.append(cur)
    return [p for p in out if p]


def param_key(name: str) -> str:
    return f"p:{name}"


def state_key(name: str, key: str) -> str:
    return f"o:{name}:{key}"


def grad_key(name: str) -> str:
    return f"g:{name}"


def rng_key(name: str) -> str:
    return f"rng:{name}"


# ------------------------------------------------------------------------------------ fingerprints

_MASK64 = (1 << 64) - 1
_CHUNK_WORDS = 1 << 22


_WEIGHTS: dict = {}  # device -> 2i+1 for one chunk, made once


def device_words(t: torch.Tensor) -> torch.Tensor:
    """``updater.fingerprint.fingerprint`` computed with torch ops on the tensor's own device, as
    a 0-d int64 tensor there (its bits are the u64; no host sync): sum((2i+1) * w_i) mod 2**64
    over its 32-bit words. int64 products and sums wrap modulo 2**64, which is all the definition
    needs; a chunk starting at word ``lo`` adds sum((2j+1) w_j) + 2 lo sum(w_j), so one weight
    vector serves every chunk."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, torch.zeros(4 - b.numel() % 4, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    weights = _WEIGHTS.get(words.device)
    if weights is None:
        weights = _WEIGHTS[words.device] = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=words.device) * 2 + 1
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), _CHUNK_WORDS):
        w = words[lo:lo + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        total += (w * weights[:w.numel()]).sum() + w.sum() * (2 * lo)
    return total


def torch_fingerprint(t: torch.Tensor) -> int:
    """``updater.fingerprint.fingerprint`` on the tensor's own device (a GPU never copies it)."""
    return int(device_words(t)) & _MASK64


def _named_state(names: list[str], params: list[torch.Tensor], optimizer) -> dict[str, torch.Tensor]:
    """The state tensors keyed as ``Replica.named_tensors`` keys them."""
    out = {f"model.{n}": p for n, p in zip(names, params)}
    for n, p in zip(names, params):
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out[f"optim.state.{n}.{k}"] = v
    return out


def state_fingerprints(names: list[str], params: list[torch.Tensor],
                       optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Fingerprints keyed as ``Replica.fingerprints(optimizer=True)`` keys them."""
    return {k: torch_fingerprint(t) for k, t in _named_state(names, params, optimizer).items()}


def state_digest(names: list[str], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 step: int) -> Digest:
    """Exact and distance fingerprints of the trainer's state at ``step`` (updater.numeric), each
    computed on the tensors' own device."""
    return finish_digest(*device_digest(_named_state(names, params, optimizer), step))


def device_digest(named: dict[str, torch.Tensor], step: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(keys, int64 words [K], float64 stats [K, STATS_LEN]) on the tensors' device, no host sync."""
    keys = list(named)
    if not keys:
        return keys, torch.zeros(0, dtype=torch.int64), torch.zeros(0, STATS_LEN, dtype=torch.float64)
    # one device for the stack: a foreach or for-loop optimizer keeps its step counters on the
    # CPU beside CUDA parameters (their words are moved up, a few bytes each)
    dev = next((t.device for t in named.values() if t.device.type != "cpu"), torch.device("cpu"))
    words = torch.stack([device_words(named[k]).to(dev) for k in keys])
    st = torch.stack([stats(named[k], step, k, host=False).to(dev) for k in keys])
    return keys, words, st


def finish_digest(keys: list[str], words: torch.Tensor, st: torch.Tensor) -> Digest:
    w = words.cpu().numpy().view(np.uint64)
    s_ = st.cpu().numpy()
    return Digest({k: int(w[i]) for i, k in enumerate(keys)}, {k: s_[i].copy() for i, k in enumerate(keys)})


STATS_PREFIX = "s:"


def digest_tensors(d: Digest) -> dict[str, torch.Tensor]:
    """The distance stats as FINGERPRINT / GOCKPT_DONE tensors."""
    return {STATS_PREFIX + k: torch.as_tensor(v) for k, v in d.stats.items()}


def digest_of(words: dict, tensors: dict) -> Digest:
    """The trainer's digest from a FINGERPRINT / GOCKPT_DONE message; PartError on a tensor that
    is not a distance fingerprint of a fingerprinted key."""
    out = {}
    for name, t in tensors.items():
        key = name[len(STATS_PREFIX):]
        if not name.startswith(STATS_PREFIX) or key not in words:
            raise PartError(f"tensor {name!r} is not s:<fingerprinted key>")
        a = wire_numpy(t)
        if a.dtype != np.float64 or a.shape != (STATS_LEN,):
            raise PartError(f"{name}: distance stats are {STATS_LEN} float64 values")
        out[key] = a
    return Digest(dict(words), out)


# ------------------------------------------------------------------------------------ copy engines

@dataclass
class Copy:
    """One asynchronous copy: host tensors by name, complete once ``wait`` returns."""

    future: Future | None = None
    tensors: dict = field(default_factory=dict)
    event: object = None  # torch.cuda.Event on the side stream

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()


class HostCopier:
    """CPU training: copies run on one worker thread while the training thread runs forward and
    backward (torch copies release the GIL); ``fence`` waits for them before the state changes."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gockpt-copy")

    def copy(self, tensors: dict[str, torch.Tensor]) -> Copy:
        src = dict(tensors)
        return Copy(future=self._pool.submit(lambda: {n: t.detach().clone() for n, t in src.items()}))

    def run(self, fn) -> Copy:
        """Any other state read on the copy thread."""
        return Copy(future=self._pool.submit(fn))

    def digest(self, named: dict[str, torch.Tensor], step: int) -> Copy:
        """The state's digest (updater.numeric.Digest), read on the copy thread."""
        return self.run(lambda: finish_digest(*device_digest(named, step)))

    def reserve(self, nbytes_list) -> None:
        """Nothing to prepare: host copies are plain clones."""

    def fence(self, c: Copy) -> None:
        """Block until ``c`` is complete: the training thread may change its sources after."""
        c.tensors = c.future.result()

    def result(self, c: Copy):
        self.fence(c)
        return c.tensors

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class PinnedPool:
    """Page-locked host buffers, reused: a buffer goes back to the pool when the last tensor handed
    out on it is gone (the message holding it was written), so a fallback after the first
    allocates nothing, and ``reserve`` can allocate a whole plan ahead, off the training thread."""

    GRAIN = 4096

    def __init__(self, pin: bool = True):
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated so far (not reused)
        self.allocated_bytes = 0

    def _size(self, nbytes: int) -> int:
        return max(self.GRAIN, -(-nbytes // self.GRAIN) * self.GRAIN)

    def _slab(self, size: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            self.allocated += 1
            self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def _give_back(self, size: int, slab: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(slab)

    def reserve(self, nbytes_list) -> None:
        """Make sure buffers for tensors of these sizes are in the pool (allocated now if not)."""
        want: dict[int, int] = {}
        for n in nbytes_list:
            size = self._size(int(n))
            want[size] = want.get(size, 0) + 1
        for size, count in want.items():
            with self._lock:
                missing = count - len(self._free.get(size, ()))
            for _ in range(max(0, missing)):
                slab = self._slab_new(size)
                self._give_back(size, slab)

    def _slab_new(self, size: int) -> torch.Tensor:
        with self._lock:
            self.allocated += 1
            self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on a pooled buffer; the buffer returns when it is collected."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = self._size(nbytes)
        slab = self._slab(size)
        t = slab[:nbytes].view(dtype).view(shape)
        weakref.finalize(t, self._give_back, size, slab)
        return t


class CudaCopier:
    """GPU training: device-to-host copies on a side stream into pooled pinned buffers
    (``PinnedPool``: allocated on the first fallback, or ahead by ``reserve`` when a fallback is
    requested, then reused). The side stream waits for the training stream's work so far (the
    state is final); ``fence`` makes the training stream wait for the copy (a GPU-side wait: the
    host is never blocked); ``result`` is called from a sender thread and waits on the copy's
    event before the bytes are read."""

    def __init__(self, device, pool: PinnedPool | None = None):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.pool = pool if pool is not None else PinnedPool()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gockpt-fingerprint")

    def reserve(self, nbytes_list) -> None:
        self.pool.reserve(nbytes_list)

    def copy(self, tensors: dict[str, torch.Tensor]) -> Copy:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        out = {}
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for n, t in tensors.items():
                buf = self.pool.take(tuple(t.shape), t.dtype)
                buf.copy_(t.detach(), non_blocking=True)
                if t.is_cuda:  # (a CPU step counter is copied at once)
                    t.record_stream(self.stream)  # the allocator must not reuse t before the copy ran
                out[n] = buf
            done = torch.cuda.Event()
            done.record(self.stream)
        return Copy(tensors=out, event=done)

    def run(self, fn) -> Copy:
        """A state read whose result the host needs (fingerprints: their ``int`` waits for the
        GPU): queued on the side stream from a worker thread, so the training thread never waits
        for it unless the step needs the state first (``fence``)."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))

        def work():
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                return fn()
        return Copy(future=self._pool.submit(work))

    def digest(self, named: dict[str, torch.Tensor], step: int) -> Copy:
        """The state's digest computed on the side stream and copied into pinned buffers: the
        training thread only queues it (``fence`` is a GPU-side wait), the sender thread reads it."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            keys, words, st = device_digest(named, step)
            out = {"words": self.pool.take(tuple(words.shape), words.dtype),
                   "stats": self.pool.take(tuple(st.shape), st.dtype)}
            out["words"].copy_(words, non_blocking=True)
            out["stats"].copy_(st, non_blocking=True)
            for t in named.values():
                if t.is_cuda:
                    t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        c = Copy(tensors=out, event=done)
        c.keys = keys
        return c

    def fence(self, c: Copy) -> None:
        if c.future is not None:
            c.tensors = c.future.result()  # fn has read the state when its values are known
        else:
            torch.cuda.current_stream(self.device).wait_event(c.event)

    def result(self, c: Copy):
        if c.future is not None:
            return c.future.result()
        c.event.synchronize()
        if getattr(c, "keys", None) is not None:
            return finish_digest(c.keys, c.tensors["words"], c.tensors["stats"])
        return c.tensors

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.stream.synchronize()


def copier_for(params: list[torch.Tensor]):
    dev = params[0].device if params else torch.device("cpu")
    return CudaCopier(dev) if dev.type == "cuda" else HostCopier()


# ------------------------------------------------------------------------------------ appliance side

def _decoded(text, what: str):
    """Tagged JSON (updater.dcp_keys) from the peer; anything malformed is a PartError."""
    if not isinstance(text, str):
        raise PartError(f"{what} must be a tagged-JSON string")
    try:
        return loads(text)
    except Exception as e:  # noqa: BLE001 - whatever hostile text provokes
        raise PartError(f"{what} is not valid tagged JSON: {type(e).__name__}") from None


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_FLAGS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
# torch's optional per-group parameter names (torchtitan sets them): the replica names by layout
_NOT_HYPER = ("param_names",)


def merged_groups(own: list[dict], given, names: list[list[str]]) -> list[dict]:
    """The trainer's param groups (without params) checked against ours and made ours: its
    hyper-parameters and scheduler keys (initial_lr, max_momentum...) with our implementation
    flags, ``params`` as names. Raises PartError on anything malformed."""
    if not isinstance(given, list) or len(given) != len(own):
        raise PartError(f"{len(own)} param group(s) expected")
    out = []
    for mine, g, ns in zip(own, given, names):
        if not isinstance(g, dict) or "params" in g:
            raise PartError("a param group must be an object without 'params'")
        d = {k: v for k, v in mine.items() if k != "params"}
        for k, v in g.items():
            if k in _FLAGS or k in _NOT_HYPER or not isinstance(k, str):
                continue
            if isinstance(d.get(k), bool) or isinstance(v, bool):
                if d.get(k, v) is not v:
                    raise PartError(f"param group {k} is {v}, the replica's is {d.get(k)}")
            elif isinstance(v, (list, tuple)):
                if not v or not all(map(_finite, v)):
                    raise PartError(f"param group {k} must hold finite numbers")
                v = tuple(v) if k == "betas" else list(v)
            elif not (v is None or _finite(v)):
                raise PartError(f"param group {k} must be a finite number")
            if k in GROUP_OPTIONS and (v is None or (_finite(v) and v < 0)):
                raise PartError(f"param group {k} must be a number >= 0")
            d[k] = v
        d["params"] = list(ns)
        out.append(d)
    return out


class Rebuild:
    """The appliance's half: parts arrive in order, each is stepped with the gradients that come
    after it, and after the last one the state is one consistent version S_{N+k}.

    Every message is validated completely before anything is changed: names, dtypes, shapes,
    part index, step numbers (part j must be state version N+j), gradient set (parts 0..j)."""

    def __init__(self, layout: JobLayout, training: TrainingSpec, parts: int, request_id: int = 0,
                 impl: str = "mirror"):
        self.layout, self.training = layout, training
        self.plan = split(layout, parts)
        self.parts = len(self.plan)
        self.request_id = request_id
        self.names = [p.name for p in layout.params]
        self.shapes = [tuple(p.shape) for p in layout.params]
        # empty: a part either copies into its parameters or lends them its own tensors (set_)
        self.params = [torch.empty(s, dtype=torch.float32) for s in self.shapes]
        groups = training.groups(self.names)  # ValueError (a PartError's base) if they do not fit
        index = {n: i for i, n in enumerate(self.names)}
        self.group_names = [list(names) for names, _ in groups]
        spec = dataclasses.replace(training.optimizer, **replica_flags(training.optimizer, impl))
        self.optimizer = build_optimizer(spec, self.params,
                                         [([self.params[index[n]] for n in names], gs) for names, gs in groups])
        self.keys = {index[n]: set(state_keys(gs)) for names, gs in groups for n in names}
        self.grad_dtype = GRAD_DTYPES[training.grad_dtype]
        self.scaler = LossScaler(training.loss_scale) if training.loss_scale is not None else None
        self.start: int | None = None  # N, from part 0
        self.received = 0
        self.tail: dict | None = None
        self.rng: dict[str, torch.Tensor] = {}

    @property
    def complete(self) -> bool:
        return self.received == self.parts and self.tail is not None

    @property
    def final_step(self) -> int | None:
        return None if self.start is None else self.start + self.parts

    def _expect(self, cond: bool, msg: str) -> None:
        if not cond:
            raise PartError(msg)

    def check_part(self, step: int, index: int, parts: int, slices: dict, tensors: dict) -> None:
        """Raise PartError unless this is exactly the next part of this rebuild."""
        self._expect(parts == self.parts, f"part says {parts} parts, the rebuild has {self.parts}")
        self._expect(index == self.received, f"part {index} arrived, expected part {self.received}")
        if self.start is not None:
            self._expect(step == self.start + index,
                         f"part {index} holds step {step}, expected {self.start + index} (start {self.start})")
        self._expect(isinstance(slices, dict), "slices must be an object")
        mine = [self.names[i] for i in self.plan[index]]
        self._expect(slices.get("params") == mine, f"part {index} lists parameters other than the split's")
        self._check_hparams(slices.get("hparams"))
        self._check_scaling(slices)
        last = index == self.parts - 1
        self._expect(last == ("tail" in slices), "the tail comes with the last part only")
        want: dict[str, tuple] = {}
        for i in self.plan[index]:
            want[param_key(self.names[i])] = self.shapes[i]
        for j in range(index + 1):
            for i in self.plan[j]:
                want[grad_key(self.names[i])] = self.shapes[i]
        for i in self.plan[index]:
            n, keys = self.names[i], self.keys[i]
            have = {k for k in keys if state_key(n, k) in tensors}
            self._expect(not have or have == keys,
                         f"{n}: optimizer state {sorted(have)} is neither complete {sorted(keys)} nor empty")
            for k in have:
                want[state_key(n, k)] = () if k == "step" else self.shapes[i]
        rng = {k for k in tensors if k.startswith("rng:")}
        self._expect(last or not rng, "RNG states come with the last part only")
        extra = sorted(set(tensors) - set(want) - rng)
        missing = sorted(set(want) - set(tensors))
        self._expect(not extra and not missing, f"part {index}: unexpected {extra[:3]}, missing {missing[:3]}")
        for name, shape in want.items():
            t = tensors[name]
            dt = self.grad_dtype if name.startswith("g:") else torch.float32
            self._expect(t.dtype == dt, f"{name}: dtype {t.dtype}, expected {dt}")
            self._expect(tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, layout says {shape}")
        for name in rng:
            self._expect(tensors[name].dtype == torch.uint8 and tensors[name].dim() == 1, f"{name}: not a uint8 vector")
        if last:
            self._check_tail(slices["tail"], step)

    def _check_hparams(self, hp) -> None:
        """Per group, the hyper-parameters of the step: known keys with finite values only."""
        err = hparams_error(hp, self.optimizer.param_groups)
        self._expect(err is None, err or "")

    def _check_scaling(self, slices: dict) -> None:
        """fp16: the loss scale of the step; low precision with clipping: the trainer's coefficient
        (a norm over the parts received so far would not be the trainer's)."""
        scale = slices.get("loss_scale")
        if self.scaler is not None:
            self._expect(_finite(scale) and scale > 0, "fp16 parts need the step's loss_scale, a finite number > 0")
        else:
            self._expect(scale is None, f"loss_scale given for {self.training.grad_dtype} gradients")
        coef = slices.get("clip")
        if self.grad_dtype == torch.float32:
            self._expect(coef is None, "float32 parts carry gradients as stepped: no clip coefficient")
        elif self.training.clip is not None:
            self._expect(_finite(coef) and 0 < coef <= 1, "the step's clip coefficient, in (0, 1], is missing")
        else:
            self._expect(coef is None, "clip coefficient given, the training spec does not clip")

    def master_grads(self, grads: list[torch.Tensor], slices: dict) -> list[torch.Tensor]:
        """The fp32 gradients the trainer's optimizer stepped with (ARCHITECTURE.md, "Trainer
        semantics"): float32 ones as given; bf16/fp16 ones ``.float()`` (exact), unscaled with
        GradScaler's kernel and float32 1/scale (fp16), multiplied by the clip coefficient.
        PartError on a non-finite gradient: the trainer skips such a step and abandons the run."""
        if self.grad_dtype == torch.float32:
            return grads
        out = [g.float() for g in grads]
        if self.scaler is not None:
            self.scaler.scale.fill_(float(slices["loss_scale"]))
            if self.scaler.unscale_(out):
                raise PartError("non-finite gradient in a part: the trainer skips such a step")
        if slices.get("clip") is not None:
            coef = torch.tensor(float(slices["clip"]), dtype=torch.float32)
            for g in out:
                g.mul_(coef)  # what clip_grads_with_norm_ does: one exact-rounded product
        return out

    def _check_tail(self, tail, step: int) -> None:
        self._expect(isinstance(tail, dict), "tail must be an object")
        start = self.start if self.start is not None else step - (self.parts - 1)
        want = start + self.parts
        self._expect(tail.get("iterations_done") == want,
                     f"tail is at iteration {tail.get('iterations_done')}, expected {want}")
        st = tail.get("step")
        self._expect(isinstance(st, int) and not isinstance(st, bool) and 0 <= st <= want,
                     "tail step must be an integer <= iterations_done")
        pg = _decoded(tail.get("param_groups"), "param_groups")
        self._expect(isinstance(pg, list) and len(pg) == len(self.group_names)
                     and all(isinstance(g, dict) and "params" not in g and _finite(g.get("lr")) for g in pg),
                     f"tail needs the {len(self.group_names)} param group(s), each with a finite lr")
        sched = tail.get("lr_scheduler")
        self._expect((sched is None) == (not self.training.lr_schedule.enabled),
                     "scheduler state present exactly when the training spec has a schedule")
        if sched is not None:
            self._expect(isinstance(_decoded(sched, "lr_scheduler"), dict), "lr_scheduler must encode an object")

    @torch.no_grad()
    def add_part(self, step: int, index: int, parts: int, slices: dict, tensors: dict, own: bool = False) -> None:
        """Validate, then load part ``index`` and step parts 0..index with its gradients. ``own``:
        the tensors are the rebuild's from now on (decoded from the wire), so it may keep them."""
        self.check_part(step, index, parts, slices, tensors)
        stepped = [i for j in range(index + 1) for i in self.plan[j]]
        grads = self.master_grads([tensors[grad_key(self.names[i])] for i in stepped], slices)
        if self.start is None:
            self.start = step
        adopt = own and self._adoptable(tensors)
        for i in self.plan[index]:
            n, p = self.names[i], self.params[i]
            src = tensors[param_key(n)]
            if adopt:
                p.set_(src)  # the message's own buffer becomes the parameter: no copy
            else:
                p.copy_(src)
            st = {k: (lambda t: t if adopt else t.clone())(tensors[state_key(n, k)])
                  for k in self.keys[i] if state_key(n, k) in tensors}
            if st:
                self.optimizer.state[p] = st
        for i, g in zip(stepped, grads):
            self.params[i].grad = g
        set_hparams(self.optimizer, slices["hparams"])
        try:
            with kernel_scalars(self.optimizer, self.training.optimizer):
                self.optimizer.step()  # parameters without .grad are skipped, as in the trainer
        finally:
            for i in stepped:
                self.params[i].grad = None
        self.received += 1
        if index == self.parts - 1:
            self.tail = dict(slices["tail"])
            self.rng = {k[4:]: rng_tensor(v, k) for k, v in tensors.items() if k.startswith("rng:")}

    def _adoptable(self, tensors: dict) -> bool:
        """Whether a part keeps the message's tensors instead of copying them. Decoded
        tensors are views of one payload buffer, which then lives as long as the rebuild: worth it
        when the gradients it also holds are no larger than the state (a one-part fallback keeps
        1.33x the state instead of 2.33x at its peak), else the state is copied and the message
        freed. Only contiguous float32 views of writable memory are taken."""
        state = grads = 0
        for k, t in tensors.items():
            if k.startswith("g:"):
                grads += t.numel() * t.element_size()
            elif k.startswith(("p:", "o:")):
                if not (t.is_contiguous() and t.dtype == torch.float32):
                    return False
                state += t.numel() * t.element_size()
        return grads <= state

    def state(self) -> ReplicaState:
        """The consistent version S_{N+k} as a ReplicaState (for Replica.resync)."""
        if not self.complete:
            raise PartError(f"rebuild incomplete: {self.received} of {self.parts} parts")
        t = self.tail
        groups = merged_groups(self.optimizer.param_groups, _decoded(t["param_groups"], "param_groups"),
                               self.group_names)
        ostate = {}
        for n, p in zip(self.names, self.params):
            s = self.optimizer.state.get(p)
            if s:
                ostate[n] = dict(s)
        return ReplicaState(
            params=dict(zip(self.names, self.params)),
            optim={"state": ostate, "param_groups": groups},
            iterations_done=int(t["iterations_done"]),
            step=int(t["step"]),
            lr_scheduler=_decoded(t["lr_scheduler"], "lr_scheduler") if t.get("lr_scheduler") is not None else None,
            loss_scale=t.get("loss_scale"),
            rng=dict(self.rng),
            data_position=t.get("data_position"),
            layout=self.layout.to_dict(),
            training=self.training.to_dict(),
        )
