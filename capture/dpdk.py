"""DPDK capture through ctypes: EAL, a mempool, one port's RX queue, bursts as FrameBatches.

`open_port("net_pcap0,rx_pcap=FILE")` (or `open_source("dpdk:...")`) creates the virtual
device (`rte_vdev_init`) unless the EAL arguments already made it, configures one RX queue
(and the TX queue the drivers want), starts the port in promiscuous mode and returns a
`DpdkPort` to iterate. Supported: DPDK 22.11 (ABI 23) on x86-64, as Debian 12 ships it;
`_dpdk_abi.check` verifies the struct layout against the installed headers before anything
runs and fails clearly on any difference.

Receive path, per batch, with no per-packet Python object:
- `rte_eth_rx_burst` is inline in the headers; it is rebuilt from the exported
  `rte_eth_fp_ops[port]` table: the PMD's `rx_pkt_burst(rxq.data[0], mbufs, n)` (plus
  `rte_eth_call_rx_callbacks` when a callback is installed) fills a numpy array of mbuf
  pointers, burst after burst, until the queue is empty or the batch is full.
- The mempool's memory is one numpy view (its chunks, from `rte_mempool_mem_iter`). One
  gather of the mbufs' header words gives each frame's position (`buf_addr + data_off`) and
  lengths, so `data` is a view of the pool and offsets point into it: no frame byte is
  copied.
- The batch's mbufs go back to the pool with one `rte_pktmbuf_free_bulk` when the next batch
  is requested: **a batch is valid until then, and never after `close()`**.

Details:
- Timestamps: the host clock at each burst, except for drivers in `DEVICE_TS_NS` (net_pcap:
  the file's timestamps, in µs) whose RX timestamp dynamic field is set.
- A frame larger than an mbuf's data room (`data_room`, default 9216 bytes: jumbo frames fit)
  is chained by the driver; the batch then holds its first segment only (caplen < wirelen,
  counted in `stats()["multiseg"]`).
- net_af_packet: its ring (`framecnt`, `framesz`, `blocksz` devargs) must be sized for the
  traffic, and overflow is not counted anywhere (the platform notes); frames longer than
  `framesz` minus the header are cut silently. `netns=` creates the device in that network
  namespace (the driver opens its socket and sets interface flags in the calling thread's
  namespace).

The EAL is initialised once per process by the first port (`eal_args`, see `_dpdk_eal`:
no hugepages, 512 MB, no PCI by default; the calling thread's CPU affinity, which
`rte_eal_init` pins, is restored unless `restore_affinity=False`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import socket
import time
from dataclasses import asdict, dataclass

import numpy as np
from mirrorckpt.capture import _dpdk_abi as abi
from mirrorckpt.capture import _dpdk_eal as eal
from mirrorckpt.capture._dpdk_eal import DEFAULT_EAL_ARGS, eal_init
from mirrorckpt.capture._dpdk_lib import MEM_CB, RX_BURST, DpdkMissingError, load
from mirrorckpt.capture.afpacket import in_netns
from mirrorckpt.capture.batch import LINKTYPE_ETHERNET, CaptureError, FrameBatch

__all__ = ["DEFAULT_EAL_ARGS", "DpdkAbiError", "DpdkMissingError", "DpdkPort", "eal_init",
           "open_port"]

DpdkAbiError = abi.DpdkAbiError

# RX timestamp dynamic field units of drivers known to fill it (ns per unit).
DEVICE_TS_NS = {"net_pcap": 1000}
_ENOTSUP = 95
_pool_ids = itertools.count()


class _MbufFields:
    """Reads struct rte_mbuf fields of many mbufs at once: one gather of their first cache
    lines as opaque 64-byte items (as fast as gathering one word; a structured dtype is five
    times slower), then 8-byte words, shifts and masks."""

    FIELDS = {"buf_addr": 8, "data_off": 2, "nb_segs": 2, "ol_flags": 8, "pkt_len": 4,
              "data_len": 2}

    def __init__(self):
        self.where = {}
        for name, size in self.FIELDS.items():
            off = abi.value(f"mbuf.{name}")
            if off % 8 + size > 8 or off + size > 64:
                raise DpdkAbiError(f"mbuf.{name} at {off} is not inside one word of the "
                                   "first cache line")
            self.where[name] = (off // 8, (off % 8) * 8, (1 << (8 * size)) - 1)

    def read(self, lines: np.ndarray, line_at: np.ndarray) -> dict[str, np.ndarray]:
        """Fields of the mbufs starting at lines[line_at] (`lines`: the pool viewed as 64-byte
        void items; the fields sit in an mbuf's first cache line)."""
        rows = lines[line_at].view(np.uint64).reshape(len(line_at), 8)
        out = {}
        for name, (w, shift, mask) in self.where.items():
            v = rows[:, w]
            if mask != 0xFFFFFFFFFFFFFFFF:
                v = (v >> np.uint64(shift)) & np.uint64(mask)
            out[name] = v.copy() if name == "ol_flags" else v.astype(np.int64)
        return out


@dataclass
class PortStats:
    frames: int = 0  # frames delivered in batches
    bytes: int = 0  # captured bytes delivered
    multiseg: int = 0  # frames chained over several mbufs (batch holds the first segment)
    batches: int = 0
    bursts: int = 0  # rx_burst calls
    ipackets: int = 0  # rte_eth_stats_get: frames the port received
    ibytes: int = 0
    imissed: int = 0  # dropped by the device for lack of RX descriptors/buffers
    ierrors: int = 0
    rx_nombuf: int = 0  # mbuf allocation failures


class DpdkPort:
    """One DPDK port's RX queue 0; iterate for `FrameBatch`es.

    `devargs` is "NAME,KEY=VAL,..." (e.g. "net_pcap0,rx_pcap=/x.pcap,infinite_rx=1",
    "net_af_packet0,iface=eth1,framecnt=16384"). Each batch holds up to `batch_frames`
    frames, received `burst` at a time. Without traffic, `__next__` returns an empty batch
    after `poll_timeout` s (sleeping `idle_sleep` s between empty polls; 0 spins); after
    `idle_timeout` s without a frame iteration ends (None: never). The pool has `mbufs`
    buffers of `data_room` bytes; it must hold a batch plus what the driver keeps (all of a
    file's frames with infinite_rx=1)."""

    def __init__(self, devargs: str, *, burst: int = 64, batch_frames: int = 2048,
                 mbufs: int = 8191, data_room: int = 9216, rx_desc: int = 1024,
                 promiscuous: bool = True, poll_timeout: float = 0.1,
                 idle_timeout: float | None = None, idle_sleep: float = 20e-6,
                 netns: str | None = None, eal_args=None, restore_affinity: bool = True,
                 libraries=None):
        name, _, kv = str(devargs).partition(",")
        self.name = f"dpdk:{devargs}"
        if not name:
            raise ValueError(f"{self.name}: a device name is needed, e.g. net_pcap0,rx_pcap=FILE")
        if not 1 <= burst <= batch_frames < mbufs:
            raise ValueError(f"{self.name}: need 1 <= burst <= batch_frames < mbufs")
        if not 64 <= data_room <= 65535 - abi.value("RTE_PKTMBUF_HEADROOM"):
            raise ValueError(f"{self.name}: data_room {data_room} out of range")
        self.device, self.devargs, self.netns = name, kv, netns
        self.burst, self.batch_frames = int(burst), int(batch_frames)
        self.poll_timeout, self.idle_timeout, self.idle_sleep = poll_timeout, idle_timeout, idle_sleep
        self._closed = True
        self._created = False
        self._pool = None
        self._held = 0
        self._stats = PortStats()

        dpdk = load(libraries)  # DpdkMissingError with the packages to install
        abi.check(dpdk.version)  # DpdkAbiError unless the layout is the one we read
        self._check_iface(kv, netns)
        self.dpdk = eal_init(eal_args, restore_affinity, libraries)
        self.fn = dpdk.fn
        with self._ns():
            self.port = self._attach()
            try:
                self._configure(mbufs, data_room, rx_desc, promiscuous)
            except BaseException:
                self._teardown()
                raise
        self._closed = False
        eal.ports().append(self)
        try:
            self._map_fast_path()
            self._map_pool()
            self._timestamps()
        except BaseException:
            self.close()
            raise
        self._fields = _MbufFields()
        self._lines = self._pool8[: len(self._pool8) // 64 * 64].view("V64")
        self._pool64 = self._pool8[: len(self._pool8) // 8 * 8].view(np.uint64)
        self._ptrs = np.zeros(self.batch_frames, np.uint64)  # mbuf pointers of the batch
        self._ts = np.zeros(self.batch_frames, np.int64)  # host time of each one's burst
        self._ptrs_addr = self._ptrs.ctypes.data
        self._last_frame = time.monotonic()

    # -- set-up -------------------------------------------------------------------------

    def _ns(self):
        return in_netns(self.netns) if self.netns else contextlib.nullcontext()

    def _check_iface(self, kv: str, netns: str | None) -> None:
        """net_af_packet/net_pcap on an interface: name it clearly if it does not exist."""
        for item in kv.split(","):
            key, _, val = item.partition("=")
            if key in ("iface", "rx_iface", "rx_iface_in", "tx_iface") and val:
                with in_netns(netns) if netns else contextlib.nullcontext():
                    try:
                        socket.if_nametoindex(val)
                    except OSError:
                        where = f"network namespace {netns}" if netns else "this network namespace"
                        raise CaptureError(f"{self.name}: no network interface named {val!r} "
                                           f"in {where}") from None
            if key == "rx_pcap" and not os.path.exists(val):
                raise CaptureError(f"{self.name}: capture file {val} does not exist")

    def _attach(self) -> int:
        port = ctypes.c_uint16()
        if self.fn.rte_eth_dev_get_port_by_name(self.device.encode(), ctypes.byref(port)) == 0:
            if any(p.port == port.value for p in eal.ports()):
                raise CaptureError(f"{self.name}: port {self.device} is already open")
            return port.value  # made by --vdev in the EAL arguments: left in place at close
        ret = self.fn.rte_vdev_init(self.device.encode(), self.devargs.encode())
        if ret < 0:
            raise CaptureError(
                f"{self.name}: cannot create device {self.device!r} with {self.devargs!r}: "
                f"{self.dpdk.strerror(ret)} (driver missing? install librte-net-pcap23 / "
                "librte-net-af-packet23; see the EAL log above)")
        self._created = True
        if self.fn.rte_eth_dev_get_port_by_name(self.device.encode(), ctypes.byref(port)) != 0:
            raise CaptureError(f"{self.name}: device {self.device} made no ethdev port")
        if port.value >= abi.value("RTE_MAX_ETHPORTS"):
            raise CaptureError(f"{self.name}: port id {port.value} out of range")
        return port.value

    def _configure(self, mbufs: int, data_room: int, rx_desc: int, promiscuous: bool) -> None:
        fn, port = self.fn, self.port
        info = ctypes.create_string_buffer(abi.value("eth_dev_info.size"))
        self._call("rte_eth_dev_info_get", port, info)
        drv = ctypes.c_char_p.from_buffer(info, abi.value("eth_dev_info.driver_name")).value
        self.driver = (drv or b"").decode()
        sock = fn.rte_socket_id()
        pool_name = f"mck{os.getpid()}_{next(_pool_ids)}".encode()
        room = data_room + abi.value("RTE_PKTMBUF_HEADROOM")
        self._pool = fn.rte_pktmbuf_pool_create(pool_name, mbufs, min(256, mbufs // 16), 0,
                                                room, sock)
        if not self._pool:
            raise CaptureError(
                f"{self.name}: cannot create a pool of {mbufs} mbufs of {room} bytes: out of "
                "EAL memory (raise -m) or the mempool driver is missing (librte-mempool-ring23)")
        conf = ctypes.create_string_buffer(abi.value("eth_conf.size"))  # all defaults
        self._call("rte_eth_dev_configure", port, 1, 1, conf)
        self._call("rte_eth_rx_queue_setup", port, 0, rx_desc, sock, None, self._pool)
        self._call("rte_eth_tx_queue_setup", port, 0, 64, sock, None)
        self._call("rte_eth_dev_start", port)
        self._started = True
        if promiscuous:
            ret = fn.rte_eth_promiscuous_enable(port)
            if ret < 0 and -ret != _ENOTSUP:
                raise CaptureError(f"{self.name}: promiscuous mode: {self.dpdk.strerror(ret)}")

    def _call(self, name: str, *args) -> int:
        ret = getattr(self.fn, name)(*args)
        if ret < 0:
            raise CaptureError(f"{self.name}: {name} failed: {self.dpdk.strerror(ret)}")
        return ret

    def _map_fast_path(self) -> None:
        """rx_burst from rte_eth_fp_ops[port] (filled by rte_eth_dev_start)."""
        ops = self.dpdk.fp_ops + self.port * abi.value("fp_ops.size")
        ptr = ctypes.c_void_p.from_address
        fn_addr = ptr(ops + abi.value("fp_ops.rx_pkt_burst")).value
        qdata = ptr(ops + abi.value("fp_ops.rxq.data")).value
        self._clbk = ptr(ops + abi.value("fp_ops.rxq.clbk")).value
        if not fn_addr or not qdata or not ptr(qdata).value:
            raise CaptureError(f"{self.name}: the port's fast-path table is empty after start")
        self._rx = RX_BURST(fn_addr)
        self._qd = ptr(qdata).value  # rxq.data[0]

    def _map_pool(self) -> None:
        """One numpy view over the pool's memory chunks (they hold the mbufs and their data)."""
        chunks = []
        a_off, l_off = abi.value("mempool_memhdr.addr"), abi.value("mempool_memhdr.len")

        def chunk(_mp, _opaque, memhdr, _idx):
            chunks.append((ctypes.c_void_p.from_address(memhdr + a_off).value,
                           ctypes.c_size_t.from_address(memhdr + l_off).value))

        cb = MEM_CB(chunk)
        self.fn.rte_mempool_mem_iter(self._pool, cb, None)
        if not chunks:
            raise CaptureError(f"{self.name}: the mempool reports no memory")
        # Gaps between chunks are never read: only addresses of mbufs are gathered.
        self._base = min(a for a, _ in chunks) // 64 * 64
        span = max(a + n for a, n in chunks) - self._base
        self._pool8 = np.frombuffer((ctypes.c_char * span).from_address(self._base), np.uint8)
        self.pool_chunks = len(chunks)

    def _timestamps(self) -> None:
        self._ts_off, self._ts_flag, self._ts_unit = -1, 0, 0
        unit = DEVICE_TS_NS.get(self.driver)
        if unit is None:
            return
        off = self.fn.rte_mbuf_dynfield_lookup(b"rte_dynfield_timestamp", None)
        bit = self.fn.rte_mbuf_dynflag_lookup(b"rte_dynflag_rx_timestamp", None)
        if off >= 0 and bit >= 0 and off % 8 == 0:
            self._ts_off, self._ts_flag, self._ts_unit = off, 1 << bit, unit

    # -- receiving ----------------------------------------------------------------------

    def __iter__(self) -> DpdkPort:
        return self

    def __enter__(self) -> DpdkPort:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __next__(self) -> FrameBatch:
        if self._closed:
            raise StopIteration
        self._free_held()
        n = self._fill()
        if n:
            self._last_frame = time.monotonic()
            return self._batch(n)
        if self.idle_timeout is not None and time.monotonic() - self._last_frame >= self.idle_timeout:
            raise StopIteration
        return self._empty()

    def _free_held(self) -> None:
        if self._held:
            self.fn.rte_pktmbuf_free_bulk(self._ptrs_addr, self._held)
            self._held = 0

    def _fill(self) -> int:
        """Bursts into the pointer array until it is full, or the queue runs dry after
        something arrived, or `poll_timeout` passed with nothing."""
        rx, qd, addr, cap, burst = self._rx, self._qd, self._ptrs_addr, self.batch_frames, self.burst
        clbk = ctypes.c_void_p.from_address(self._clbk).value if self._clbk else None
        filled = 0
        bursts = 0
        deadline = time.monotonic() + self.poll_timeout
        while True:
            want = min(burst, cap - filled)
            got = rx(qd, addr + 8 * filled, want)
            bursts += 1
            if clbk:  # a callback installed on queue 0 (rte_eth_add_rx_callback)
                got = self.fn.rte_eth_call_rx_callbacks(self.port, 0, addr + 8 * filled, got,
                                                        want, clbk)
            if got:
                self._ts[filled:filled + got] = time.time_ns()
                filled += got
                self._held = filled  # freed at the next batch even if this one fails
                if filled == cap:
                    break
            if got < want:
                if filled or time.monotonic() >= deadline:
                    break
                if self.idle_sleep:
                    time.sleep(self.idle_sleep)
        self._stats.bursts += bursts
        return filled

    def _batch(self, n: int) -> FrameBatch:
        rel = self._ptrs[:n].astype(np.int64) - self._base
        if rel.min() < 0 or rel.max() >= len(self._pool8) or (rel & 63).any():
            raise CaptureError(f"{self.name}: the driver returned mbufs outside our pool")
        f = self._fields.read(self._lines, rel >> 6)
        start = f["buf_addr"] - self._base + f["data_off"]
        caplen, wirelen = f["data_len"], f["pkt_len"]
        ts = self._ts[:n].copy()
        if self._ts_off >= 0:
            dev = (f["ol_flags"] & np.uint64(self._ts_flag)) != 0
            if dev.any():
                raw = self._pool64[(rel[dev] + self._ts_off) >> 3].astype(np.int64)
                ts[dev] = raw * self._ts_unit
        lo = int(start.min())
        hi = int((start + caplen).max())
        s = self._stats
        batch = FrameBatch(data=self._pool8[lo:hi], offset=start - lo, caplen=caplen,
                           wirelen=wirelen, ts_ns=ts, iface=np.zeros(n, np.int32),
                           source=self.name, first_index=s.frames,
                           linktypes={0: LINKTYPE_ETHERNET})
        s.frames += n
        s.batches += 1
        s.bytes += int(caplen.sum())
        s.multiseg += int(np.count_nonzero(f["nb_segs"] > 1))
        return batch

    def _empty(self) -> FrameBatch:
        z = np.zeros(0, np.int64)
        return FrameBatch(data=np.zeros(0, np.uint8), offset=z, caplen=z, wirelen=z, ts_ns=z,
                          iface=np.zeros(0, np.int32), source=self.name,
                          first_index=self._stats.frames, linktypes={0: LINKTYPE_ETHERNET})

    # -- statistics and shutdown --------------------------------------------------------

    def stats(self) -> dict:
        """Our counters plus the port's `rte_eth_stats_get` (ipackets, imissed, ierrors, ...)."""
        if not self._closed:
            buf = ctypes.create_string_buffer(abi.value("eth_stats.size"))
            if self.fn.rte_eth_stats_get(self.port, buf) == 0:
                for k in ("ipackets", "ibytes", "imissed", "ierrors", "rx_nombuf"):
                    setattr(self._stats, k, ctypes.c_uint64.from_buffer(
                        buf, abi.value(f"eth_stats.{k}")).value)
        return asdict(self._stats)

    @property
    def kernel_drops(self) -> int:
        """Frames the device dropped so far for lack of RX descriptors (`imissed`; what `serve`
        reports). net_af_packet's ring overflow is not counted there (see the module notes)."""
        return self.stats()["imissed"]

    def pool_free(self) -> int:
        """Mbufs available in the pool (all of them once no batch is held)."""
        return int(self.fn.rte_mempool_avail_count(self._pool)) if self._pool else 0

    def close(self) -> None:
        """Frees the held batch, stops and closes the port, removes the device we created and
        frees the pool. Batches of this port must not be used afterwards."""
        if self._closed:
            return
        self.stats()
        self._free_held()
        self._closed = True
        with self._ns():
            self._teardown()
        if self in eal.ports():
            eal.ports().remove(self)
        self._pool8 = self._pool64 = self._lines = None

    def _teardown(self) -> None:
        fn = self.fn
        if getattr(self, "_started", False):
            fn.rte_eth_dev_stop(self.port)
            self._started = False
        if hasattr(self, "port"):
            fn.rte_eth_dev_close(self.port)
        if self._created:
            fn.rte_vdev_uninit(self.device.encode())
            self._created = False
        if self._pool:
            fn.rte_mempool_free(self._pool)
            self._pool = None


def open_port(devargs: str, **opts) -> DpdkPort:
    """`open_source("dpdk:NAME,ARGS", ...)`: a started `DpdkPort` (options as its constructor)."""
    return DpdkPort(devargs, **opts)
