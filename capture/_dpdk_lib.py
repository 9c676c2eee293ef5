"""Loading the DPDK 22.11 libraries with ctypes and declaring the functions `capture.dpdk` calls.

The libraries are opened with RTLD_GLOBAL so the drivers the EAL loads later (mempool ring,
net_pcap, net_af_packet from pmds-23.0/) resolve their symbols against them. A missing
library raises `DpdkMissingError` with the Debian packages to install.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_uint, c_uint16, c_void_p

from mirrorckpt.capture.batch import CaptureError

LIBRARIES = ("librte_eal.so.23", "librte_mempool.so.23", "librte_mbuf.so.23",
             "librte_ethdev.so.23", "librte_bus_vdev.so.23")
PACKAGES = ("librte-eal23", "librte-mempool23", "librte-mbuf23", "librte-ethdev23",
            "librte-bus-vdev23", "librte-mempool-ring23", "librte-net-pcap23",
            "librte-net-af-packet23", "libdpdk-dev")
INSTALL = "apt-get install " + " ".join(PACKAGES)


class DpdkMissingError(CaptureError):
    """The DPDK libraries are not installed (or not the 22.11 / ABI 23 ones)."""


# name -> (restype, argtypes)
_PROTOTYPES = {
    "rte_eal_init": (c_int, [c_int, POINTER(c_char_p)]),
    "rte_eal_cleanup": (c_int, []),
    "rte_version": (c_char_p, []),
    "rte_strerror": (c_char_p, [c_int]),
    "rte_socket_id": (c_uint, []),
    "rte_vdev_init": (c_int, [c_char_p, c_char_p]),
    "rte_vdev_uninit": (c_int, [c_char_p]),
    "rte_eth_dev_get_port_by_name": (c_int, [c_char_p, POINTER(c_uint16)]),
    "rte_eth_dev_info_get": (c_int, [c_uint16, c_void_p]),
    "rte_eth_dev_configure": (c_int, [c_uint16, c_uint16, c_uint16, c_void_p]),
    "rte_eth_rx_queue_setup": (c_int, [c_uint16, c_uint16, c_uint16, c_uint, c_void_p, c_void_p]),
    "rte_eth_tx_queue_setup": (c_int, [c_uint16, c_uint16, c_uint16, c_uint, c_void_p]),
    "rte_eth_dev_start": (c_int, [c_uint16]),
    "rte_eth_dev_stop": (c_int, [c_uint16]),
    "rte_eth_dev_close": (c_int, [c_uint16]),
    "rte_eth_promiscuous_enable": (c_int, [c_uint16]),
    "rte_eth_stats_get": (c_int, [c_uint16, c_void_p]),
    "rte_eth_stats_reset": (c_int, [c_uint16]),
    "rte_eth_call_rx_callbacks": (c_uint16, [c_uint16, c_uint16, c_void_p, c_uint16, c_uint16,
                                             c_void_p]),
    "rte_pktmbuf_pool_create": (c_void_p, [c_char_p, c_uint, c_uint, c_uint16, c_uint16, c_int]),
    "rte_pktmbuf_free_bulk": (None, [c_void_p, c_uint]),
    "rte_mempool_free": (None, [c_void_p]),
    "rte_mempool_avail_count": (c_uint, [c_void_p]),
    "rte_mempool_mem_iter": (c_uint, [c_void_p, c_void_p, c_void_p]),
    "rte_mbuf_dynfield_lookup": (c_int, [c_char_p, c_void_p]),
    "rte_mbuf_dynflag_lookup": (c_int, [c_char_p, c_void_p]),
}

# void (*)(struct rte_mempool *, void *opaque, struct rte_mempool_memhdr *, unsigned idx)
MEM_CB = ctypes.CFUNCTYPE(None, c_void_p, c_void_p, c_void_p, c_uint)
# uint16_t (*)(void *rxq, struct rte_mbuf **pkts, uint16_t nb_pkts)
RX_BURST = ctypes.CFUNCTYPE(c_uint16, c_void_p, c_void_p, c_uint16)


class Dpdk:
    """The loaded libraries: `fn.<name>` are the functions, `fp_ops` the address of the
    exported `rte_eth_fp_ops` array (rx_burst is inline in the headers, so we rebuild it)."""

    def __init__(self, libraries=LIBRARIES):
        self.libs = []
        for name in libraries:
            try:
                self.libs.append(ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL))
            except OSError as e:
                raise DpdkMissingError(
                    f"DPDK 22.11 is not installed: cannot load {name} ({e}). "
                    f"On Debian 12: {INSTALL}") from None
        self.fn = _Functions()
        for name, (res, args) in _PROTOTYPES.items():
            f = self._find(name)
            f.restype, f.argtypes = res, args
            setattr(self.fn, name, f)
        self.fp_ops = ctypes.addressof(self._find_data("rte_eth_fp_ops"))
        self.version = self.fn.rte_version().decode()

    def _find(self, name: str):
        for lib in self.libs:
            try:
                return getattr(lib, name)
            except AttributeError:
                continue
        raise DpdkMissingError(f"the loaded DPDK libraries lack {name}: not DPDK 22.11? "
                               f"On Debian 12: {INSTALL}")

    def _find_data(self, name: str):
        for lib in self.libs:
            try:
                return ctypes.c_char.in_dll(lib, name)
            except ValueError:
                continue
        raise DpdkMissingError(f"the loaded DPDK libraries lack {name}: not DPDK 22.11?")

    def strerror(self, ret: int) -> str:
        return self.fn.rte_strerror(abs(int(ret))).decode(errors="replace")


class _Functions:
    pass


_loaded: dict[tuple[str, ...], Dpdk] = {}


def load(libraries=None) -> Dpdk:
    """The libraries (loaded once per list of names); `libraries` defaults to `LIBRARIES`."""
    key = tuple(LIBRARIES if libraries is None else libraries)
    if key not in _loaded:
        _loaded[key] = Dpdk(key)
    return _loaded[key]
