"""Linux AF_PACKET capture through a TPACKET_V3 memory-mapped receive ring, read with numpy.

The kernel writes frames into a ring of fixed-size blocks shared with us and hands a block
over when it is full or when `block_timeout_ms` passed since its first frame. Each
`FrameBatch` covers a run of consecutive handed-over blocks: `_ring.walk_blocks` (Cython; the
packets of a block form a chain of uneven steps) reads the packet headers into offset,
length and timestamp columns, and `data` is a view of those blocks, so no frame byte is
copied. **The blocks go back to the kernel when the next batch is requested: a batch's bytes
are valid only until then** (a stage that keeps bytes copies them), as `FrameBatch` says.

- No BPF: every frame of the interface reaches the ring; filtering happens in numpy later.
- Frames this host sends on the interface are left out by default (`ignore_outgoing`): a
  mirror port only receives.
- VLAN: the kernel moves a frame's outer 802.1Q/802.1ad tag into the packet header (even on
  veths); the walk writes it back into the frame, as libpcap does, so frames are
  byte-identical to the wire.
- Timestamps are the kernel's receive times (ns). Frames longer than a block can hold are
  cut (caplen < wirelen) and counted as truncated.
- Fanout (`fanout_workers` > 1): N processes each open the interface as worker 0..N-1 of one
  PACKET_FANOUT group and each receives exactly `parser.split.worker_of(frames, N) == worker`
  (the mirrored flow's UDP source port mod N, non-UDP to worker 0), split in the kernel by a
  classic BPF program (capture.fanout_bpf) that walks the frame as the packet decoder does:
  `fanout_walk`, from `parser.encap.split_walk`; see "Fanout" below.
- `stats()` adds the kernel's PACKET_STATISTICS: `kernel_drops` counts frames lost because
  no block was free (the consumer was too slow or the ring too small).

    ring = open_ring("eth1", block_size=1 << 20, block_count=64)
    for batch in ring: ...            # an empty batch every `poll_timeout` s without traffic
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import time
import weakref
from dataclasses import asdict, dataclass

import numpy as np
from mirrorckpt.capture import _ring
from mirrorckpt.capture.batch import LINKTYPE_ETHERNET, CaptureError, FrameBatch
from mirrorckpt.capture.fanout_bpf import fanout_program

# linux/if_packet.h, linux/if_ether.h, linux/if_arp.h
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_VERSION = 10
PACKET_IGNORE_OUTGOING = 23
PACKET_MR_PROMISC = 1
TPACKET_V3 = 2
TP_STATUS_KERNEL = 0
TP_STATUS_USER = 1
ETH_P_ALL = 3
ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772  # frames carry an Ethernet header too
CLONE_NEWNET = 0x40000000

# tpacket_req3 frame size: TPACKET_V3 only checks it for consistency (block_size must be a
# multiple); packets are packed into blocks by their real size.
_FRAME_SIZE = 2048
_BLOCK_STATUS = 8  # byte offset of block_status in a block
_BLOCK_NUM_PKTS = 12

SO_ATTACH_FILTER = 26
PACKET_FANOUT = 18
PACKET_FANOUT_DATA = 22
PACKET_FANOUT_CBPF = 6
PACKET_FANOUT_FLAG_IGNORE_OUTGOING = 0x4000  # the group's hook: the member's own setting is unused
FANOUT_DIR = "/run/mirrorckpt/fanout"  # members of each group, for joining in worker order


class _DropAll:
    """A one-instruction classic BPF program, `ret #0` (accept no bytes)."""

    def __init__(self):
        self.insn = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0), 8)
        self.fprog = struct.pack("HxxxxxxQ", 1, ctypes.addressof(self.insn))


_DROP_ALL = _DropAll()


# -- fanout -------------------------------------------------------------------------------
#
# The kernel hands a frame to member `program(frame) % members` of a PACKET_FANOUT_CBPF group,
# where member i is the i-th socket that joined (a member that leaves is replaced by the last
# one). So the program returns the worker itself (UDP source port mod N, computed with BPF_MOD)
# and worker k must be the k-th to join: `_FanoutRegistry` makes joins wait their turn. Every
# member also carries a socket filter that accepts only its own share, so a socket never holds
# another worker's frame: not between its bind and its join (the socket then still receives on
# its own), nor while fewer than N have joined (the kernel reduces the program's result mod the
# members joined so far: a missing worker's frames reach a member that drops them). Rollover
# stays off: a worker whose ring is full drops and counts, its frames do not move elsewhere.

class _Prog:
    """A `struct sock_fprog` (keeps its instructions alive)."""

    def __init__(self, rows):
        self.insn = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *r) for r in rows))
        self.fprog = struct.pack("HxxxxxxQ", len(rows), ctypes.addressof(self.insn))


class _FanoutRegistry:
    """The members of fanout group `group` in the current thread's network namespace, as a
    file (FANOUT_DIR/NETNS-INODE-GROUP) under an exclusive flock: worker -> socket inode.
    A member counts while its socket lives (listed in /proc/thread-self/net/packet), so a
    killed worker leaves no stale entry. Processes must share FANOUT_DIR (one mount namespace)."""

    def __init__(self, group: int):
        ns = os.stat("/proc/thread-self/ns/net").st_ino
        os.makedirs(FANOUT_DIR, exist_ok=True)
        self.path = os.path.join(FANOUT_DIR, f"{ns}-{group}")

    @contextlib.contextmanager
    def locked(self):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def read(fd: int) -> dict:
        """{"workers": N, "members": {worker: inode}} of the members whose sockets live."""
        raw = os.pread(fd, 1 << 16, 0)
        state = json.loads(raw) if raw.strip() else {}
        with open("/proc/thread-self/net/packet") as f:
            live = {int(line.split()[8]) for line in f.readlines()[1:]}
        members = {int(k): v for k, v in state.get("members", {}).items() if v in live}
        return {"workers": state.get("workers"), "members": members}

    @staticmethod
    def write(fd: int, state: dict) -> None:
        raw = json.dumps(state).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, raw, 0)

    def members(self) -> list[int]:
        with self.locked() as fd:
            return sorted(self.read(fd)["members"])


def fanout_members(group: int, netns: str | None = None) -> list[int]:
    """The workers of fanout group `group` (in `netns`) that have joined, in worker order.
    Each worker receives its whole share only once all have: [0, 1, ..., N-1]."""
    with in_netns(netns) if netns else contextlib.nullcontext():
        return _FanoutRegistry(group).members()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


@contextlib.contextmanager
def in_netns(name: str):
    """Runs the block with the calling thread in network namespace `name` (a name made by
    `ip netns add`, or a path to a namespace file). Sockets created inside stay in that
    namespace after the block; other threads are not affected."""
    path = name if name.startswith("/") else f"/run/netns/{name}"
    try:
        target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CaptureError(f"no network namespace {name!r} ({path} does not exist)") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise CaptureError(f"cannot enter network namespace {name!r}: {os.strerror(e)}")
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "cannot return to the original network namespace")
    finally:
        os.close(target)
        os.close(home)


@dataclass
class RingStats:
    frames: int = 0  # frames delivered in batches
    bytes: int = 0  # captured bytes delivered
    truncated: int = 0  # frames cut to fit a block (caplen < wirelen)
    blocks: int = 0  # blocks walked
    vlan_restored: int = 0  # outer VLAN tags written back into frames
    vlan_left_out: int = 0  # tags that could not be written back (no room; never seen)
    kernel_packets: int = 0  # PACKET_STATISTICS tp_packets: frames the socket saw (incl. drops)
    kernel_drops: int = 0  # tp_drops: frames lost, no free block
    kernel_freezes: int = 0  # tp_freeze_q_cnt: times the ring ran full
    errors: int = 0  # socket errors reported by poll (e.g. ENETDOWN when the link went down)


class AfPacketRing:
    """An AF_PACKET TPACKET_V3 receive ring bound to one interface; iterate for batches.

    `block_size` (a multiple of the page size) times `block_count` is the ring's memory.
    A batch holds at most `max_blocks` blocks (default: a quarter of the ring, so the kernel
    keeps most of it while a batch is processed). Without traffic `__next__` returns an empty
    batch after `poll_timeout` seconds; after `idle_timeout` seconds without a frame (None:
    never) iteration ends. `netns`: open the socket in that network namespace.

    Fanout: with `fanout_workers` N > 1 (or a `fanout_group`) the ring is worker
    `fanout_worker` (0..N-1) of fanout group `fanout_group` (0..65535; default the interface's
    index, so each port has its own) and receives only the frames `parser.split.worker_of`
    gives that worker: `fanout_walk` (`parser.encap.split_walk`) holds the header facts and the
    mirror encapsulations its BPF program walks through. Worker k joins the group only after
    workers 0..k-1 have (the kernel numbers members in join order): the constructor waits up to
    `fanout_timeout` seconds for them. A worker receives its whole share only once all N have
    joined (`wait_fanout`)."""

    def __init__(self, iface: str, *, block_size: int = 1 << 20, block_count: int = 64,
                 block_timeout_ms: int = 10, promiscuous: bool = True,
                 ignore_outgoing: bool = True, max_blocks: int | None = None,
                 poll_timeout: float = 0.1, idle_timeout: float | None = None,
                 netns: str | None = None, fanout_workers: int = 1, fanout_worker: int = 0,
                 fanout_group: int | None = None, fanout_timeout: float = 30.0,
                 fanout_walk: dict | None = None):
        self.iface = str(iface)
        self.netns = netns
        self.name = f"afpacket:{self.iface}" + (f"@{netns}" if netns else "")
        self.fanout_workers, self.fanout_worker, self.fanout_group = _check_fanout(
            self.name, fanout_workers, fanout_worker, fanout_group)
        self.fanout_timeout = float(fanout_timeout)
        self.fanout_walk = fanout_walk
        if (self.fanout_workers > 1 or self.fanout_group is not None) and fanout_walk is None:
            raise ValueError(f"{self.name}: fanout needs fanout_walk, the split's header facts "
                             "(parser.encap.split_walk)")
        page = mmap.PAGESIZE
        if block_size < page or block_size % page or block_size % _FRAME_SIZE:
            raise ValueError(f"{self.name}: block_size {block_size} must be a multiple of the "
                             f"page size ({page}) and of {_FRAME_SIZE}")
        if block_count < 2:
            raise ValueError(f"{self.name}: block_count must be at least 2, not {block_count}")
        if not 1 <= int(block_timeout_ms) <= 60000:
            raise ValueError(f"{self.name}: block_timeout_ms must be 1..60000")
        self.block_size, self.block_count = int(block_size), int(block_count)
        self.max_blocks = max(1, min(int(max_blocks or block_count // 4), block_count - 1))
        self.poll_timeout, self.idle_timeout = float(poll_timeout), idle_timeout
        self._stats = RingStats()
        self._sock = None
        self._mm = None
        self._closed = False
        with in_netns(netns) if netns else contextlib.nullcontext():
            self._open(block_timeout_ms, promiscuous, ignore_outgoing)
        self._ring8 = np.frombuffer(self._mm, np.uint8)
        self._ring32 = self._ring8.view(np.uint32)
        self._status_at = (np.arange(self.block_count, dtype=np.int64) * self.block_size
                           + _BLOCK_STATUS) // 4
        self._cur = 0  # next block to look at
        self._held = (0, 0)  # (first block, count) of the batch handed out last
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN | select.POLLRDNORM | select.POLLERR)
        self._last_frame = time.monotonic()

    def _open(self, block_timeout_ms: int, promiscuous: bool, ignore_outgoing: bool) -> None:
        try:
            ifindex = socket.if_nametoindex(self.iface)
        except OSError:
            raise CaptureError(f"{self.name}: no network interface named {self.iface!r} "
                               "in this network namespace") from None
        try:
            # Protocol 0: nothing is received until bind, which comes after the ring exists.
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        except PermissionError:
            raise CaptureError(f"{self.name}: AF_PACKET sockets need root or CAP_NET_RAW") from None
        self._sock = sock
        try:
            sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            if ignore_outgoing:
                sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            frames = self.block_size // _FRAME_SIZE * self.block_count
            req = struct.pack("7I", self.block_size, self.block_count, _FRAME_SIZE, frames,
                              int(block_timeout_ms), 0, 0)
            try:
                sock.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
            except OSError as e:
                raise CaptureError(f"{self.name}: cannot set up a ring of {self.block_count} "
                                   f"blocks of {self.block_size} bytes: {e.strerror}") from None
            self._mm = mmap.mmap(sock.fileno(), self.block_size * self.block_count,
                                 mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            fanout = self.fanout_workers > 1 or self.fanout_group is not None
            if fanout:  # from bind on, only this worker's frames (also before it joins)
                share = _Prog(fanout_program(self.fanout_workers, self.fanout_worker, self.fanout_walk))
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, share.fprog)
            sock.bind((self.iface, ETH_P_ALL))
            hatype = sock.getsockname()[3]
            if hatype not in (ARPHRD_ETHER, ARPHRD_LOOPBACK):
                raise CaptureError(f"{self.name}: not an Ethernet interface (ARPHRD {hatype})")
            if promiscuous:
                mreq = struct.pack("iHH8s", ifindex, PACKET_MR_PROMISC, 0, b"")
                sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
            if fanout:
                if self.fanout_group is None:
                    self.fanout_group = ifindex & 0xFFFF
                self._join_fanout(ignore_outgoing)
        except OSError as e:
            self._release_mapping()
            raise CaptureError(f"{self.name}: {e.strerror or e}") from e
        except BaseException:
            self._release_mapping()
            raise

    def _join_fanout(self, ignore_outgoing: bool) -> None:
        """Joins the fanout group as member `fanout_worker`, after workers 0..k-1 (they must
        hold the kernel's member slots 0..k-1), and installs the group's program."""
        n, k, group = self.fanout_workers, self.fanout_worker, self.fanout_group
        what = f"{self.name}: fanout group {group}"
        flags = PACKET_FANOUT_CBPF | (PACKET_FANOUT_FLAG_IGNORE_OUTGOING if ignore_outgoing else 0)
        args = struct.pack("HHI", group, flags, n)  # struct fanout_args; max_num_members = N
        prog = _Prog(fanout_program(n, None, self.fanout_walk))
        inode = os.fstat(self._sock.fileno()).st_ino
        reg = _FanoutRegistry(group)
        deadline = time.monotonic() + self.fanout_timeout
        while True:
            with reg.locked() as fd:
                state = reg.read(fd)
                members = state["members"]
                if members and state["workers"] != n:
                    raise CaptureError(f"{what} has {state['workers']} workers, not {n}")
                if k in members:
                    raise CaptureError(f"{what}: worker {k} is already capturing (another process)")
                if set(members) == set(range(k)):
                    try:
                        self._sock.setsockopt(SOL_PACKET, PACKET_FANOUT, args)
                    except OSError as e:
                        why = {errno.EINVAL: "the group exists in this namespace on another "
                                             "interface or with other settings",
                               errno.ENOSPC: f"the group already has {n} members (a process "
                                             "outside this appliance joined it?)"}
                        raise CaptureError(f"{what}: cannot join: "
                                           f"{why.get(e.errno, e.strerror)}") from None
                    self._sock.setsockopt(SOL_PACKET, PACKET_FANOUT_DATA, prog.fprog)
                    members[k] = inode
                    reg.write(fd, {"workers": n, "members": members})
                    return
            if time.monotonic() >= deadline:
                missing = sorted(set(range(k)) - set(members))
                later = sorted(j for j in members if j > k)
                msg = (f"{what}: worker {k} waited {self.fanout_timeout:g} s for workers "
                       f"{missing} to join first (members join in worker order)")
                if later:
                    msg += (f"; workers {later} are still members: one that left has had its "
                            "slot given to the last member, restart them all")
                raise CaptureError(msg)
            time.sleep(0.01)

    def fanout_members(self) -> list[int]:
        """The workers of this ring's fanout group that have joined (see `fanout_members`)."""
        if self.fanout_group is None:
            return []
        return fanout_members(self.fanout_group, self.netns)

    def wait_fanout(self, timeout: float = 30.0) -> bool:
        """Waits until all `fanout_workers` workers have joined the group (True), or False
        after `timeout` seconds. Until then frames of the missing workers are not captured."""
        deadline = time.monotonic() + timeout
        while self.fanout_members() != list(range(self.fanout_workers)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    # -- iteration ----------------------------------------------------------------------

    def __iter__(self) -> AfPacketRing:
        return self

    def __enter__(self) -> AfPacketRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __next__(self) -> FrameBatch:
        if self._closed:
            raise StopIteration
        self._give_back()
        count = self._ready()
        if not count:
            self._wait()
            count = self._ready()
            if not count:
                idle = time.monotonic() - self._last_frame
                if self.idle_timeout is not None and idle >= self.idle_timeout:
                    raise StopIteration
                return self._empty()
        return self._walk(self._cur, count)

    def _give_back(self) -> None:
        """Hands the previous batch's blocks back to the kernel (x86 stores stay in order
        after our loads, so the kernel cannot overwrite a frame we are still reading)."""
        first, count = self._held
        if count:
            self._ring32[self._status_at[first:first + count]] = TP_STATUS_KERNEL
            self._held = (first, 0)

    def _ready(self) -> int:
        """How many consecutive blocks from the current one belong to us (not past the
        ring's end, so a batch's data stays one slice)."""
        hi = min(self._cur + self.max_blocks, self.block_count)
        ready = (self._ring32[self._status_at[self._cur:hi]] & TP_STATUS_USER) != 0
        return len(ready) if ready.all() else int(np.argmin(ready))

    def _wait(self) -> None:
        for _, ev in self._poll.poll(int(self.poll_timeout * 1000)):
            if ev & select.POLLERR:
                err = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err in (errno.ENODEV, errno.ENXIO):
                    raise CaptureError(f"{self.name}: the interface went away")
                if err:
                    self._stats.errors += 1

    def _walk(self, first: int, count: int) -> FrameBatch:
        bs = self.block_size
        starts = np.arange(first, first + count, dtype=np.int64) * bs
        total = int(self._ring32[(starts + _BLOCK_NUM_PKTS) // 4].sum())
        cols = [np.empty(total, np.int64) for _ in range(4)]
        n, restored, left_out, status, b, k = _ring.walk_blocks(
            self._ring8, starts, bs, first * bs, *cols)
        self._held = (first, count)
        self._cur = (first + count) % self.block_count
        if status != _ring.OK:
            what = {_ring.PAST_BLOCK: "runs past its block", _ring.ZERO_NEXT: "has no successor",
                    _ring.TOO_MANY: "is beyond the block's packet count"}[status]
            raise CaptureError(f"{self.name}: ring block {first + b}, packet {k} {what} "
                               "(corrupt ring)")
        offset, caplen, wirelen, ts_ns = (c[:n] for c in cols)
        s = self._stats
        batch = FrameBatch(data=self._ring8[first * bs:(first + count) * bs], offset=offset,
                           caplen=caplen, wirelen=wirelen, ts_ns=ts_ns,
                           iface=np.zeros(n, np.int32), source=self.name,
                           first_index=s.frames, linktypes={0: LINKTYPE_ETHERNET})
        s.frames += n
        s.bytes += int(caplen.sum())
        s.truncated += int(np.count_nonzero(caplen < wirelen))
        s.blocks += count
        s.vlan_restored += restored
        s.vlan_left_out += left_out
        if n:
            self._last_frame = time.monotonic()
        return batch

    def _empty(self) -> FrameBatch:
        z = np.zeros(0, np.int64)
        return FrameBatch(data=np.zeros(0, np.uint8), offset=z, caplen=z, wirelen=z, ts_ns=z,
                          iface=np.zeros(0, np.int32), source=self.name,
                          first_index=self._stats.frames, linktypes={0: LINKTYPE_ETHERNET})

    # -- statistics and shutdown --------------------------------------------------------

    def stats(self) -> RingStats:
        """Counters so far; reads (and so resets) the kernel's PACKET_STATISTICS."""
        if self._sock is not None and not self._closed:
            packets, drops, freezes = struct.unpack(
                "3I", self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 12))
            self._stats.kernel_packets += packets
            self._stats.kernel_drops += drops
            self._stats.kernel_freezes += freezes
        return RingStats(**asdict(self._stats))

    @property
    def kernel_drops(self) -> int:
        """Frames the kernel dropped so far because no block was free (what `serve` reports)."""
        return self.stats().kernel_drops

    def close(self) -> None:
        """Stops capturing. The ring is unmapped once no batch views it any more."""
        if self._closed:
            return
        self.stats()
        self._closed = True
        self._ring8 = self._ring32 = None
        self._release_mapping()

    def _release_mapping(self) -> None:
        sock, mm = self._sock, self._mm
        self._sock = self._mm = None
        if mm is None:
            if sock is not None:
                sock.close()
            return
        try:
            mm.close()
        except BufferError:
            # Batches still view the ring: stop reception now (a filter that drops every
            # frame) and close the socket with the mapping, not under it.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, _DROP_ALL.fprog)
            weakref.finalize(mm, sock.close)
            return
        sock.close()


def _check_fanout(name: str, workers, worker, group) -> tuple[int, int, int | None]:
    def integer(what, v):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name}: {what} must be an integer, not {v!r}")
        return int(v)

    workers, worker = integer("fanout_workers", workers), integer("fanout_worker", worker)
    if not 1 <= workers <= 256:
        raise ValueError(f"{name}: fanout_workers must be 1..256, not {workers}")
    if not 0 <= worker < workers:
        raise ValueError(f"{name}: fanout_worker must be 0..{workers - 1} "
                         f"(fanout_workers {workers}), not {worker}")
    if group is not None:
        group = integer("fanout_group", group)
        if not 0 <= group <= 0xFFFF:
            raise ValueError(f"{name}: fanout_group must be 0..65535, not {group}")
    return workers, worker, group


def open_ring(iface: str, **opts) -> AfPacketRing:
    """`open_source("afpacket:IFACE", ...)`: an `AfPacketRing` (options as its constructor);
    "afpacket:IFACE@NETNS" captures IFACE in network namespace NETNS (an appliance whose mirror
    port sits in a namespace or container while its control plane listens outside).

    Fanout: `open_source("afpacket:IFACE", fanout_workers=N, fanout_worker=k)` in each of N
    processes (k = 0..N-1; optional `fanout_group`, default the interface index, and
    `fanout_timeout`, how long worker k waits for workers 0..k-1 to join first; `fanout_walk`,
    `parser.encap.split_walk()`). Each ring receives the frames
    `parser.split.worker_of(frames, N) == k`, all of them once every worker has joined
    (`ring.wait_fanout()`, or `fanout_members(group, netns)` from anywhere)."""
    name, sep, netns = iface.partition("@")
    if sep:
        if not name or not netns:
            raise CaptureError(f"afpacket:{iface}: expected IFACE@NETNS")
        opts["netns"] = netns
    return AfPacketRing(name, **opts)
