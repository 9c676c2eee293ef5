"""The DPDK EAL: initialised once per process, cleaned up at interpreter exit.

Defaults (`default_eal_args`): `DEFAULT_EAL_ARGS` (no hugepages, 512 MB, no PCI, no shared
config files, no telemetry socket, warnings and errors only), a `--file-prefix` unique to the
process (several processes may run DPDK at once) and `--lcores=0@(CPUS)` with every CPU the
process may use, so the main lcore is not pinned to one CPU. Pass other arguments (e.g.
`--vdev=net_pcap0,rx_pcap=FILE`, `--huge-dir=/mnt/huge --huge-unlink`) as `eal_args`.

CPU affinity: `rte_eal_init` sets the calling thread's affinity to its main lcore's CPUs,
and threads created later (torch's, OpenMP's) inherit it. `restore_affinity=True` (default)
puts the thread's previous affinity back right after; with False the EAL's pinning stays,
which is what a dedicated poller thread on an isolated core wants.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
from dataclasses import dataclass

from mirrorckpt.capture._dpdk_lib import Dpdk, load
from mirrorckpt.capture.batch import CaptureError

DEFAULT_EAL_ARGS = ("--no-huge", "-m", "512", "--no-pci", "--no-shconf", "--no-telemetry",
                    "--log-level=5")


@dataclass
class _Eal:
    args: list[str]
    dpdk: Dpdk
    ports: list
    argv: object = None  # the C argv: the EAL may keep pointers into it


_EAL: _Eal | None = None


def default_eal_args() -> list[str]:
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return [*DEFAULT_EAL_ARGS, f"--file-prefix=mirrorckpt{os.getpid()}", f"--lcores=0@({cpus})"]


def ports() -> list:
    """The open ports (closed at exit before the EAL is cleaned up)."""
    return _EAL.ports if _EAL is not None else []


def eal_init(args=None, restore_affinity: bool = True, libraries=None) -> Dpdk:
    """Initialises the EAL once per process (root needed) and returns the libraries. Later
    calls return the same; they fail if they ask for other arguments (None: any)."""
    global _EAL
    dpdk = load(libraries)
    if _EAL is not None:
        if args is not None and list(args) != _EAL.args:
            raise CaptureError(f"the DPDK EAL is already initialised in this process with "
                               f"{_EAL.args}; it cannot be initialised again with {list(args)}")
        return _EAL.dpdk
    args = list(default_eal_args() if args is None else args)
    if os.geteuid() != 0:
        raise CaptureError("DPDK needs root (the EAL writes /var/run/dpdk and maps memory)")
    _remove_stale_runtime_dirs()
    argv = [b"mirrorckpt", *(a.encode() for a in args)]
    c_argv = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
    saved = os.sched_getaffinity(0)
    ret = dpdk.fn.rte_eal_init(len(argv), c_argv)
    if restore_affinity:
        os.sched_setaffinity(0, saved)
    if ret < 0:
        _remove_runtime_dir(args)
        raise CaptureError(f"rte_eal_init failed (see the EAL log above) with {args}")
    _EAL = _Eal(args, dpdk, [], (argv, c_argv))
    atexit.register(_shutdown)
    return dpdk


def _shutdown() -> None:
    if _EAL is None:
        return
    for port in list(_EAL.ports):
        with contextlib.suppress(Exception):
            port.close()
    _EAL.dpdk.fn.rte_eal_cleanup()
    _remove_runtime_dir(_EAL.args)


def _remove_runtime_dir(args: list[str]) -> None:
    """The EAL leaves an empty /var/run/dpdk/PREFIX behind even with --no-shconf."""
    for a in args:
        if a.startswith("--file-prefix="):
            with contextlib.suppress(OSError):
                os.rmdir(f"/var/run/dpdk/{a.split('=', 1)[1]}")


def _remove_stale_runtime_dirs() -> None:
    """Empty runtime directories of our default prefix whose process is gone (killed before
    its exit handler ran)."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/var/run/dpdk"):
            pid = name[len("mirrorckpt"):]
            if name.startswith("mirrorckpt") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.rmdir(f"/var/run/dpdk/{name}")
