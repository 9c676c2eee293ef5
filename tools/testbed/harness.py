"""Test harness: real CPU DDP training (gloo) joined to the appliance through real RoCEv2 frames.

``register(ddp_model, ...)`` installs a DDP communication hook that performs the real collective
among the ranks (an all-gather of every rank's bucket over gloo) and reduces it in NCCL's ring
order, so the gradient every rank steps with is bit for bit the value NCCL's LL ring would have
put on the wire. Rank 0 also runs the generator's packetiser (``tools.generator.packetize.NcclRing``)
on the gathered buckets: the frames NCCL would have sent for that all-reduce, one mirror port per
rank's egress, go to the appliance over a loopback TCP frame stream (``FrameStreamServer`` on the
appliance turns it back into ``FrameBatch``es per port, which ``MirrorStreams`` reads as live
captures). Loss is injected in that stream: ``drop`` names (iteration, bucket) all-reduces whose
middle data frames never reach any mirror port, so the iteration cannot be reassembled.

``python -m mirrorckpt.tools.testbed.harness --rank R --world W ...`` is a complete DDP job using it
together with ``control.trainer.attach`` (tests and the stall benchmark run it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.layout import MirrorSpec, RingSpec
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import ringreduce, schedule
from mirrorckpt.tools.generator import topology as topo_mod
from mirrorckpt.tools.generator.faults import FaultInjector, FaultOptions
from mirrorckpt.tools.generator.mirrors import CaptureSet, MirrorFile
from mirrorckpt.tools.generator.noise import NoiseOptions, NoiseSource
from mirrorckpt.tools.generator.packetize import NcclRing
from mirrorckpt.tools.generator.wire import Wire, WireOptions
from torch import nn

log = logging.getLogger("mirrorckpt.tools.testbed.harness")

_MAGIC = 0x4D434B46  # "MCKF": one batch of frames of one mirror port
_BATCH = struct.Struct(">IHHIQ")  # magic, port, reserved, frames, data bytes


def ring_for(world: int, seed: int = 1, protocol: str = "LL", nccl_version: str = "2.18"):
    """(RingSpec with the NIC addresses, Topology) of the simulated fabric, the same on every rank
    and on the appliance (drawn from ``seed``)."""
    ring = RingSpec(nranks=world, nchannels=1, protocol=protocol, nccl_version=nccl_version)
    topo = topo_mod.build(world, ring.orders(), seed, ring.nccl_version)
    ring.addresses = {n.rank: n.ip_text(True) for n in topo.nics}
    return ring, topo


def channels_for(topo, ring: RingSpec) -> dict:
    """Ring connection -> channel of the simulated fabric (what the parser would otherwise infer
    from the first collectives' traffic)."""
    from mirrorckpt.config.layout import wire_address
    from mirrorckpt.parser.roce.nccl import ConnKey

    def addr(rank):
        return wire_address(ring.addresses[rank])

    return {ConnKey(addr(p.sender), addr(p.receiver), p.sport): ch for (ch, _pos), p in topo.ring.items()}


# ------------------------------------------------------------------------------ frame stream

class FrameStreamSender:
    """Sends frame batches per mirror port over one TCP connection; reconnects when the appliance
    comes back (frames sent while it is away are lost, as on a mirror port)."""

    def __init__(self, host: str, port: int, connect_timeout: float = 5.0):
        self.addr = (host, port)
        self.connect_timeout = connect_timeout
        self.sock: socket.socket | None = None
        self.sent_frames = 0
        self.lost_frames = 0

    def _connect(self) -> bool:
        try:
            self.sock = socket.create_connection(self.addr, timeout=self.connect_timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return True
        except OSError:
            self.sock = None
            return False

    def send(self, port: int, batch: FrameBatch) -> None:
        n = len(batch)
        if n == 0:
            return
        lens = batch.caplen.astype(">u4")
        ts = batch.ts_ns.astype(">u8")
        data = b"".join(batch.frame(i) for i in range(n)) if n < 64 else _gather(batch)
        msg = _BATCH.pack(_MAGIC, port, 0, n, len(data)) + lens.tobytes() + ts.tobytes() + data
        for _ in range(2):
            if self.sock is None and not self._connect():
                break
            try:
                self.sock.sendall(msg)
                self.sent_frames += n
                return
            except OSError:
                self.sock.close()
                self.sock = None
        self.lost_frames += n

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None


def _gather(batch: FrameBatch) -> bytes:
    return batch.copy().data.tobytes()


class FrameStreamServer:
    """The appliance's end of the frame stream: per mirror port an iterable of FrameBatches for
    ``parser.roce.streams.MirrorStreams``. A stream ends when the sender disconnects (``end_on_close``)
    or at ``stop``."""

    def __init__(self, ports: int, host: str = "127.0.0.1", port: int = 0, end_on_close: bool = True,
                 max_frames: int = 1 << 20):
        self.nports = ports
        self.queues = [queue.Queue() for _ in range(ports)]
        self.end_on_close = end_on_close
        self.max_frames = max_frames
        self.received = 0
        self._lsock = socket.create_server((host, port))
        self._lsock.settimeout(0.1)
        self.port = self._lsock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="frame-stream", daemon=True)
        self._thread.start()

    def sources(self) -> list[tuple[str, object]]:
        return [(f"mirror{k}", self._iter(k)) for k in range(self.nports)]

    def _iter(self, k: int):
        first = 0
        while True:
            b = self.queues[k].get()
            if b is None:
                return
            b.first_index = first
            first += len(b)
            yield b

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._lsock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self._read(conn)
            except (OSError, ValueError) as e:
                log.warning("frame stream: %s", e)
            finally:
                conn.close()
            if self.end_on_close:
                break
        self._end()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        while not self._stop.is_set():
            head = _recv_exact(conn, _BATCH.size, self._stop, allow_eof=True)
            if head is None:
                return
            magic, port, _, n, nbytes = _BATCH.unpack(head)
            if magic != _MAGIC or port >= self.nports or n > self.max_frames or nbytes > n * 65536:
                raise ValueError(f"frame stream: bad batch header (port {port}, {n} frames, {nbytes} bytes)")
            body = _recv_exact(conn, n * 12 + nbytes, self._stop)
            lens = np.frombuffer(body, ">u4", n).astype(np.int64)
            ts = np.frombuffer(body, ">u8", n, offset=n * 4).astype(np.int64)
            if int(lens.sum()) != nbytes:
                raise ValueError("frame stream: frame lengths do not add up")
            data = np.frombuffer(body, np.uint8, nbytes, offset=n * 12).copy()
            off = np.zeros(n, np.int64)
            np.cumsum(lens[:-1], out=off[1:])
            self.queues[port].put(FrameBatch(data, off, lens, lens.copy(), ts, np.zeros(n, np.int32),
                                             source=f"mirror{port}"))
            self.received += n

    def _end(self) -> None:
        for q in self.queues:
            q.put(None)

    def stop(self) -> None:
        self._stop.set()
        self._lsock.close()
        self._thread.join(5)
        self._end()


def _recv_exact(conn: socket.socket, n: int, stop: threading.Event, allow_eof: bool = False):
    """``n`` bytes from ``conn`` (polling ``stop`` on timeouts); None on a clean EOF before any."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if stop.is_set():
            raise ValueError("frame stream stopped")
        try:
            k = conn.recv_into(view[got:])
        except TimeoutError:
            continue
        if k == 0:
            if allow_eof and got == 0:
                return None
            raise ValueError("frame stream cut in a batch")
        got += k
    return bytes(buf)


# ------------------------------------------------------------------------------ the sink

class _PortWriter:
    """Stands where a capture file writer would: hands batches to the frame stream, dropping
    the frames the loss rule selects."""

    def __init__(self, sink: StreamSink, port: int):
        self.sink, self.port = sink, port

    def write_batch(self, b: FrameBatch) -> None:
        keep = self.sink.keep_mask(b)
        if keep is not None:
            self.sink.dropped += int((~keep).sum())
            b = b.select(np.flatnonzero(keep))
        self.sink.sender.send(self.port, b)

    def close(self) -> None:
        pass


class _StreamPort(MirrorFile):
    """A mirror port whose frames go to the frame stream instead of a file."""

    def __init__(self, sink: StreamSink, port: int, mirror: MirrorSpec, topo, v6: bool):
        self.path = Path(f"mirror{port}")
        self.mirror = mirror
        self.egress = mirror.direction in ("egress", "both")
        self.ingress = mirror.direction in ("ingress", "both")
        self.writer = _PortWriter(sink, port)
        self.noise = NoiseSource(NoiseOptions(), topo, mirror.rank, self.egress, self.ingress, v6, self.path.name)
        self.faults = FaultInjector(FaultOptions(), self.path.name)
        self.noise_t = None
        self.last_ts = -1
        self.frames = 0


class StreamSink(CaptureSet):
    """The packetiser's sink: every rank's egress is one mirror port of the frame stream."""

    def __init__(self, topo, sender: FrameStreamSender, nranks: int, v6: bool = True):
        from mirrorckpt.tools.generator.messages import MessageLog

        self.topo, self.v6, self.fmt, self.switch_ns = topo, v6, "stream", 600
        mirrors = [MirrorSpec(r, "egress") for r in range(nranks)]
        self.sender = sender
        self.files = [_StreamPort(self, k, mm, topo, v6) for k, mm in enumerate(mirrors)]
        self.egress = set(range(nranks))
        self.ingress = set()
        self.log = MessageLog()
        self.flush_packets = 1 << 30  # flushed once per collective by the hook
        self.macs = np.array([list(n.mac) for n in topo.nics], np.uint8)
        self.ips = np.array([list(n.ip(v6)) for n in topo.nics], np.uint8)
        self.drop_middle = False
        self.dropped = 0

    def keep_mask(self, b: FrameBatch) -> np.ndarray | None:
        """While ``drop_middle`` is set: lose the middle fifth of the data frames (>= 200 bytes)
        of this collective on every port; the same bytes on every port, so no copy covers them."""
        if not self.drop_middle or len(b) == 0:
            return None
        data = np.flatnonzero(b.caplen >= 200)
        keep = np.ones(len(b), bool)
        if data.size:
            lo, hi = int(data.size * 0.4), max(int(data.size * 0.6), int(data.size * 0.4) + 1)
            keep[data[lo:hi]] = False
        return keep


# ------------------------------------------------------------------------------ the comm hook

class HarnessState:
    """Per rank: the ring, and on rank 0 the packetiser and its frame stream."""

    def __init__(self, world: int, rank: int, frames: tuple[str, int] | None, seed: int = 1,
                 drop: set[tuple[int, int]] | None = None, group=None, protocol: str = "LL"):
        self.world, self.rank, self.group = world, rank, group
        self.ring, self.topo = ring_for(world, seed, protocol)
        self.drop = set(drop or ())
        self.iteration = 0
        self.calls = 0
        self.used_of: list | None = None  # find_unused_parameters: DDP's parameters, in its order
        self.comm = None
        self.sink = None
        if rank == 0 and frames is not None:
            self.sender = FrameStreamSender(*frames)
            self.sink = StreamSink(self.topo, self.sender, world)
            wire = Wire(self.ring.nccl_version, WireOptions(), self.sink, seed, send_truth=False)
            self.comm = NcclRing(self.ring, self.topo, wire)
        self._proto = nv.protocol(self.ring.protocol)
        self._version = nv.version(self.ring.nccl_version)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.flush()
            self.sender.close()


def _wire_array(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def mirror_allreduce_hook(state: HarnessState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average as the reducer does (x * 1/world), gather every rank's bucket (the
    real collective, over gloo), reduce in NCCL's ring order; rank 0 emits NCCL's frames."""
    buf = bucket.buffer()
    buf.mul_(1.0 / state.world)
    parts = [torch.empty_like(buf) for _ in range(state.world)]
    dist.all_gather(parts, buf, group=state.group)
    inputs = [_wire_array(p.contiguous()) for p in parts]
    b = bucket.index()
    what = f"grad:iter={state.iteration}:bucket={b}"
    if state.comm is not None:
        state.sink.drop_middle = (state.iteration, b) in state.drop
        try:
            result = state.comm.all_reduce(inputs, what)
            state.sink.flush()
        finally:
            state.sink.drop_middle = False
    else:
        plan = schedule.allreduce_plan(inputs[0].size, inputs[0].itemsize, state.world, 1, state._proto,
                                       state._version)
        result = ringreduce.allreduce_result(inputs, plan, ringreduce.BF16 if inputs[0].dtype == np.uint16
                                             else inputs[0].dtype.name)
    out = torch.from_numpy(np.ascontiguousarray(result))
    buf.copy_(out.view(torch.bfloat16) if buf.dtype == torch.bfloat16 else out)
    state.calls += 1
    if bucket.is_last():
        if state.used_of is not None:
            _used_map_allreduce(state)
        state.iteration += 1
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _used_map_allreduce(state: HarnessState) -> None:
    """find_unused_parameters: DDP all-reduces the int32 used-parameter map on the process group
    once the last bucket's all-reduce is launched, not through the comm hook (config.ddp): the
    harness puts the same collective on the wire after the last bucket. A parameter is locally
    used when backward gave it a gradient (the loop zeroes gradients to None)."""
    local = torch.tensor([int(p.grad is not None) for p in state.used_of], dtype=torch.int32)
    parts = [torch.empty_like(local) for _ in range(state.world)]
    dist.all_gather(parts, local, group=state.group)
    if state.comm is not None:
        state.comm.all_reduce([p.numpy() for p in parts], f"used_map:iter={state.iteration}")
        state.sink.flush()


# DDP checks the hook's annotations as objects (this module postpones them as strings)
mirror_allreduce_hook.__annotations__.update(bucket=dist.GradBucket, state=HarnessState,
                                             **{"return": torch.futures.Future[torch.Tensor]})


def register(ddp_model, frames: tuple[str, int] | None, *, seed: int = 1, drop=None,
             protocol: str = "LL") -> HarnessState:
    """Install the hook on ``ddp_model``; ``frames`` is the appliance's frame-stream address
    (used by rank 0)."""
    state = HarnessState(dist.get_world_size(), dist.get_rank(), frames, seed, drop, protocol=protocol)
    if ddp_model.find_unused_parameters:
        from mirrorckpt.config.ddp import reducer_params

        state.used_of = [p for _, p in reducer_params(ddp_model.module)]
    ddp_model.register_comm_hook(state, mirror_allreduce_hook)
    return state


# ------------------------------------------------------------------------------ the job

class Shard:
    """A rank's data: batch ``position`` is drawn from (seed, rank, position); the position is
    the data-loader state the appliance keeps (state_dict / load_state_dict)."""

    def __init__(self, dims, seed: int, rank: int, batch: int = 8):
        self.dims, self.seed, self.rank, self.batch = dims, seed, rank, batch
        self.position = 0

    def next(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 10_007 + self.position)
        self.position += 1
        return torch.randn(self.batch, self.dims[0], generator=g), torch.randn(self.batch, self.dims[-1], generator=g)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, d: dict) -> None:
        self.position = int(d["position"])


class LoaderShard:
    """A rank's data through torchdata's StatefulDataLoader over a map-style dataset and a seeded
    DistributedSampler (shuffled per epoch): the position is the loader's state and the epoch."""

    def __init__(self, dims, seed: int, rank: int, world: int, batch: int = 8, samples: int = 48):
        from torchdata.stateful_dataloader import StatefulDataLoader

        g = torch.Generator().manual_seed(seed)
        data = [(torch.randn(dims[0], generator=g), torch.randn(dims[-1], generator=g)) for _ in range(samples)]
        self.sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                                           seed=seed)
        # its own generator: an iterator started from the global one draws its base seed there, and
        # a resumed loader starts one mid-epoch where the uninterrupted run did not
        self.loader = StatefulDataLoader(data, batch_size=batch, sampler=self.sampler,
                                         generator=torch.Generator().manual_seed(seed))
        self.epoch, self._it = 0, None

    def next(self):
        while True:
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self.epoch, self._it = self.epoch + 1, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self._it = int(d["epoch"]), None
        self.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(d["loader"])


class SometimesUsed(nn.Module):
    """A model with a layer backward reaches only on some steps (``use_spare``): with DDP's
    find_unused_parameters its parameters then have no gradient and are not stepped."""

    def __init__(self, body: nn.Module, width: int):
        super().__init__()
        self.body, self.spare = body, nn.Linear(width, width)
        self.use_spare = False

    def forward(self, x):
        out = self.body(x)
        return out + self.spare(out) if self.use_spare else out


def build_model(dims, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(len(dims) - 1):
        layers.append(nn.Linear(dims[k], dims[k + 1]))
        if k < len(dims) - 2:
            layers += [nn.ReLU(), nn.Dropout(0.1)]  # dropout: the RNG state matters for a resume
    return nn.Sequential(*layers)


def digest(link_or_none, module, optimizer, scheduler, shard) -> dict:
    """The five state components of a rank, hashed: parameters, optimizer state, schedule and
    counters, RNG state, data position; ``groups`` and ``sched_state`` are every param group's
    hyper-parameters and the scheduler's whole state, as the checkpoint's tagged JSON."""
    from mirrorckpt.control.trainer import group_dicts, reducer_params
    from mirrorckpt.updater.dcp_keys import dumps
    from mirrorckpt.updater.fingerprint import state_sha256

    params = [p for _, p in reducer_params(module)]
    ps, os_ = state_sha256(params, optimizer)
    return {"params": ps, "optim": os_, "lr": optimizer.param_groups[0]["lr"],
            "sched": scheduler.state_dict()["last_epoch"] if scheduler is not None else None,
            "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "data": shard.state_dict(),
            "groups": dumps(group_dicts(optimizer), "param_groups"),
            "sched_state": dumps(scheduler.state_dict(), "lr_scheduler") if scheduler is not None else None}


def build_recipe(name: str, ddp, total_steps: int):
    """(optimizer, scheduler) of a recipe: ``adam-steplr`` (one group, StepLR) or ``llm``: AdamW in
    two param groups, weight decay on the weights (matrices) only, OneCycleLR (cycled beta1)."""
    if name == "adam-steplr":
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2, foreach=False)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    if name != "llm":
        raise ValueError(f"unknown recipe {name!r}")
    decay = [p for p in ddp.parameters() if p.dim() >= 2]
    plain = [p for p in ddp.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total_steps, pct_start=0.25)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="a DDP job joined to the appliance (tests, benchmark)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--control-port", type=int, default=0, help="appliance control plane (0: none)")
    ap.add_argument("--frames-port", type=int, default=0, help="appliance frame stream (0: no mirror)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dims", default="32,64,16")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--ring-seed", type=int, default=1,
                    help="the simulated fabric's draw (NIC addresses, QPs, ports): a restarted job's new communicator")
    ap.add_argument("--parts", type=int, default=3)
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's)")
    ap.add_argument("--fingerprint-every", type=int, default=2)
    ap.add_argument("--drop", default="", help="iteration:bucket,... all-reduces that lose frames")
    ap.add_argument("--restore", default="", help="'appliance' or a checkpoint root")
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--wait-file", default="", help="before each step, wait while this file exists")
    ap.add_argument("--recipe", default="adam-steplr", choices=("adam-steplr", "llm"))
    ap.add_argument("--total-steps", type=int, default=1000, help="the llm recipe's OneCycleLR total_steps")
    ap.add_argument("--protocol", default="LL", choices=("LL", "LL128", "Simple"), help="NCCL protocol on the wire")
    ap.add_argument("--digest-ranks", default="all", choices=("all", "0"), help="ranks that record digests")
    ap.add_argument("--digest-restored", action="store_true", help="record the restored state before any step")
    ap.add_argument("--clip-norm", type=float, default=None,
                    help="clip with torch.nn.utils.clip_grad_norm_ to this norm (attach(max_grad_norm=) says so)")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step (no_sync on all "
                                                                   "but the last)")
    ap.add_argument("--loader", default="shard", choices=("shard", "stateful"),
                    help="the data: the synthetic Shard, or torchdata's StatefulDataLoader (LoaderShard)")
    ap.add_argument("--find-unused", action="store_true",
                    help="DDP find_unused_parameters=True, with a layer used on every third step only")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    secret = os.environ["MIRRORCKPT_SECRET"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format=f"rank{a.rank} %(asctime)s %(name)s: %(message)s")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.master_port}", rank=a.rank,
                            world_size=a.world)
    from mirrorckpt.control.trainer import attach

    dims = tuple(int(x) for x in a.dims.split(","))
    model = build_model(dims, a.seed + a.rank)  # differs per rank: DDP's broadcast makes them agree
    if a.find_unused:
        model = SometimesUsed(model, dims[-1])
    # One RNG stream on every rank (dropout, noise): the appliance keeps the leader's RNG state,
    # which is then every rank's.
    torch.manual_seed(a.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=a.find_unused, **({"bucket_cap_mb": a.bucket_cap_mb} if a.bucket_cap_mb else {}))
    drop = {tuple(int(v) for v in d.split(":")) for d in a.drop.split(",") if d}
    hs = register(ddp, ("127.0.0.1", a.frames_port) if a.frames_port else None, seed=a.ring_seed, drop=drop,
                  protocol=a.protocol)
    opt, sched = build_recipe(a.recipe, ddp, a.total_steps)
    shard = Shard(dims, a.seed, a.rank) if a.loader == "shard" else LoaderShard(dims, a.seed, a.rank, a.world)
    link = None
    appliance = ("127.0.0.1", a.control_port) if a.control_port else None
    if appliance is not None or a.restore:
        link = attach(ddp, opt, appliance=appliance, secret=secret, scheduler=sched, data=shard, ring=hs.ring,
                      parts=a.parts, fingerprint_every=a.fingerprint_every,
                      restore=a.restore or None, connect_timeout=10.0, max_grad_norm=a.clip_norm,
                      client_options={"backoff_max": 0.2})
    start = link.iterations_done if link is not None else 0
    digests = a.digest_ranks == "all" or a.rank == 0
    rec = open(out / f"digests_rank{a.rank}.jsonl", "a")
    if a.restore and a.digest_restored and digests:  # the state as restored, before any step
        rec.write(json.dumps({"step": start, "restored": True, **digest(link, model, opt, sched, shard)}) + "\n")
    for _ in range(a.steps):
        while a.wait_file and os.path.exists(a.wait_file):
            time.sleep(0.01)
        if a.find_unused:
            model.use_spare = start % 3 == 0
        opt.zero_grad(set_to_none=True)
        for micro in range(a.accumulate):  # DDP all-reduces on the last micro-step only
            x, y = shard.next()
            x = x + 0.01 * torch.randn_like(x)  # input noise from the global RNG
            with ddp.no_sync() if micro < a.accumulate - 1 else contextlib.nullcontext():
                (nn.functional.mse_loss(ddp(x), y) / a.accumulate).backward()
        clipped = None
        if a.clip_norm is not None:
            clipped = float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.clip_norm))  # the user's own call
        opt.step()
        sched.step()
        start += 1
        if digests:
            rec.write(json.dumps({"step": start, "clip_total_norm": clipped,
                                  **digest(link, model, opt, sched, shard)}) + "\n")
            rec.flush()
        if a.step_delay:
            time.sleep(a.step_delay)
    rec.close()
    if link is not None:
        link.close()
        if link.stats.fallbacks:
            (out / f"fallbacks_rank{a.rank}.json").write_text(json.dumps(link.stats.fallbacks))
    hs.close()
    dist.barrier()  # every rank's results are written


if __name__ == "__main__":
    main()
    # No gloo teardown: with rank 0 (the rendezvous store's host) exiting at the same time it aborted
    # a rank now and then ("terminate called without an active exception", exit -6) after every
    # result was written and the barrier passed. The ranks end here, their files closed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------ launching (tests)

def followed(plane, world: int):
    """A frame stream for ``world`` ranks (rank 0's hook sends to ``frames.port``) and a
    MirrorFollower feeding ``plane`` from it, started; (frames, follower)."""
    from mirrorckpt.parser.roce.streams import MirrorStreams
    from mirrorckpt.tools.testbed.follower import MirrorFollower

    frames = FrameStreamServer(world)
    ring, topo = ring_for(world)
    follower = MirrorFollower(plane, MirrorStreams(frames.sources()), ring, channels=channels_for(topo, ring),
                              psn_window=16)
    follower.start()
    return frames, follower


_GIVEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port that nothing listens on, chosen outside the kernel's ephemeral range: a port 0
    bind hands out ephemeral ports, which every outgoing connection of the tests running beside
    (gloo pairs, store clients) may take before the caller binds it again."""
    lo, hi = _ephemeral_range()
    pool = range(10000, lo) if lo - 10000 >= 2000 else range(hi + 1, 65536)
    for _ in range(200):
        port = random.choice(pool)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {pool.start}..{pool.stop - 1}")


@contextlib.contextmanager
def relayed_mirror(frames: FrameStreamServer, world: int, hook: str = "ingress"):
    """A namespace topology (tools.testbed.netns) of one host per rank and one monitor interface
    to which tc mirrors every rank's port (``hook``); each rank's frames from ``frames`` are sent
    from its host by a relay thread. Yields the topology; at exit the frame stream stops, the
    senders close and the topology is torn down."""
    from mirrorckpt.tools.testbed.netns import FrameSender, Topology

    def relay(source, sender) -> None:
        for batch in source:
            sender.send(batch)

    with Topology(hosts=world, monitors=1) as topo:
        for r in range(world):
            topo.mirror(r, hook)
        senders = [FrameSender(h.ifname, netns=h.netns) for h in topo.hosts]
        for (_, src), s in zip(frames.sources(), senders):
            threading.Thread(target=relay, args=(src, s), daemon=True).start()
        try:
            yield topo
        finally:
            frames.stop()
            for s in senders:
                s.close()


def spawn_ranks(world: int, out, secret: str, *, control_port: int = 0, frames_port: int = 0, steps: int = 10,
                extra: list[str] | None = None, rank_extra: dict[int, list[str]] | None = None):
    """Start the job of ``main`` as ``world`` processes on 127.0.0.1; returns the Popen list."""
    import subprocess
    import sys

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MIRRORCKPT_SECRET=secret, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    master = free_port()
    procs = []
    for r in range(world):
        logf = open(out / f"rank{r}.log", "a")
        cmd = [sys.executable, "-m", "mirrorckpt.tools.testbed.harness", "--rank", str(r), "--world", str(world),
               "--master-port", str(master), "--control-port", str(control_port), "--frames-port",
               str(frames_port), "--steps", str(steps), "--out", str(out), *(extra or []),
               *((rank_extra or {}).get(r, []))]
        procs.append(subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT))
        logf.close()
    return procs


def kill_ranks(procs) -> None:
    """A rank dies (SIGKILL to rank 1), and the job with it: every rank is killed and reaped."""
    import signal

    try:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        for p in procs:
            p.kill()
            p.wait(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def wait_ranks(procs, out, timeout: float = 120.0, error: type[Exception] = RuntimeError) -> None:
    """Wait for every rank; on a failure or timeout kill the rest and raise ``error`` with the rank's log."""
    import subprocess

    deadline = time.monotonic() + timeout
    try:
        for r, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise error(f"rank {r} did not finish in {timeout:g} s:\n"
                            f"{(Path(out) / f'rank{r}.log').read_text()[-3000:]}") from None
            if rc != 0:
                raise error(f"rank {r} exited {rc}:\n{(Path(out) / f'rank{r}.log').read_text()[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def read_digests(out, rank: int = 0) -> dict[int, dict]:
    path = Path(out) / f"digests_rank{rank}.jsonl"
    return {d["step"]: d for d in map(json.loads, path.read_text().splitlines())}
