"""The DPDK struct layout `capture.dpdk` relies on, checked against the installed headers.

`capture.dpdk` reads DPDK structs by byte offset (ctypes, numpy), so every offset and size it
uses is listed once in `EXPECTED`, as the code expects it. `check()` compiles a small probe
that prints the same quantities with `offsetof`/`sizeof` against the installed headers
(gcc, `pkg-config --cflags libdpdk`; nothing is linked against DPDK) and compares: any
difference raises `DpdkAbiError` naming each field, so a DPDK with another layout fails at
start-up instead of returning garbage. The probe's output is cached per header set (the key
hashes the probe source, the compiler flags and every header's size and mtime), so the
compiler runs once per installation. The running library's version must match the headers'.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from mirrorckpt.capture.batch import CaptureError

# name -> (C expression, value the code expects). DPDK 22.11 (ABI 23), x86-64.
EXPECTED: dict[str, tuple[str, int]] = {
    "version.year": ("RTE_VER_YEAR", 22),
    "version.month": ("RTE_VER_MONTH", 11),
    "RTE_MAX_ETHPORTS": ("RTE_MAX_ETHPORTS", 32),
    "RTE_PKTMBUF_HEADROOM": ("RTE_PKTMBUF_HEADROOM", 128),
    "RTE_ETHDEV_RXTX_CALLBACKS": ("RXTX_CALLBACKS", 1),
    "fp_ops.size": ("sizeof(struct rte_eth_fp_ops)", 128),
    "fp_ops.rx_pkt_burst": ("offsetof(struct rte_eth_fp_ops, rx_pkt_burst)", 0),
    "fp_ops.rxq.data": ("offsetof(struct rte_eth_fp_ops, rxq.data)", 24),
    "fp_ops.rxq.clbk": ("offsetof(struct rte_eth_fp_ops, rxq.clbk)", 32),
    "mbuf.size": ("sizeof(struct rte_mbuf)", 128),
    "mbuf.buf_addr": ("offsetof(struct rte_mbuf, buf_addr)", 0),
    "mbuf.data_off": ("offsetof(struct rte_mbuf, data_off)", 16),
    "mbuf.nb_segs": ("offsetof(struct rte_mbuf, nb_segs)", 20),
    "mbuf.port": ("offsetof(struct rte_mbuf, port)", 22),
    "mbuf.ol_flags": ("offsetof(struct rte_mbuf, ol_flags)", 24),
    "mbuf.pkt_len": ("offsetof(struct rte_mbuf, pkt_len)", 36),
    "mbuf.data_len": ("offsetof(struct rte_mbuf, data_len)", 40),
    "mempool_memhdr.addr": ("offsetof(struct rte_mempool_memhdr, addr)", 16),
    "mempool_memhdr.len": ("offsetof(struct rte_mempool_memhdr, len)", 32),
    "eth_conf.size": ("sizeof(struct rte_eth_conf)", 2272),
    "eth_dev_info.size": ("sizeof(struct rte_eth_dev_info)", 376),
    "eth_dev_info.driver_name": ("offsetof(struct rte_eth_dev_info, driver_name)", 8),
    "eth_stats.size": ("sizeof(struct rte_eth_stats)", 704),
    "eth_stats.ipackets": ("offsetof(struct rte_eth_stats, ipackets)", 0),
    "eth_stats.ibytes": ("offsetof(struct rte_eth_stats, ibytes)", 16),
    "eth_stats.imissed": ("offsetof(struct rte_eth_stats, imissed)", 32),
    "eth_stats.ierrors": ("offsetof(struct rte_eth_stats, ierrors)", 40),
    "eth_stats.rx_nombuf": ("offsetof(struct rte_eth_stats, rx_nombuf)", 56),
}

DEFAULT_CFLAGS = ["-I/usr/include/dpdk", "-I/usr/include/x86_64-linux-gnu/dpdk",
                  "-include", "rte_config.h", "-march=corei7"]
_HEADERS = ("rte_ethdev.h", "rte_mbuf.h", "rte_mempool.h", "rte_version.h")


class DpdkAbiError(CaptureError):
    """The installed DPDK's struct layout or version differs from what the code expects."""


def value(name: str) -> int:
    """The layout value the code uses (checked by `check`)."""
    return EXPECTED[name][1]


def probe_source() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>"]
    lines += [f"#include <{h}>" for h in _HEADERS]
    lines += ["#ifdef RTE_ETHDEV_RXTX_CALLBACKS", "#define RXTX_CALLBACKS 1", "#else",
              "#define RXTX_CALLBACKS 0", "#endif", "int main(void) {"]
    lines += [f'    printf("%s %lld\\n", "{name}", (long long)({expr}));'
              for name, (expr, _) in EXPECTED.items()]
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def cflags() -> list[str]:
    """Compiler flags for the installed headers (pkg-config, else Debian's paths)."""
    if shutil.which("pkg-config"):
        r = subprocess.run(["pkg-config", "--cflags", "libdpdk"], capture_output=True, text=True,
                           check=False)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.split()
    return list(DEFAULT_CFLAGS)


def _include_dirs(flags: list[str]) -> list[Path]:
    return [Path(f[2:]) for f in flags if f.startswith("-I") and Path(f[2:]).is_dir()]


def _cache_key(source: str, flags: list[str]) -> str:
    h = hashlib.sha256(source.encode())
    h.update("\0".join(flags).encode())
    for d in _include_dirs(flags):
        for p in sorted(d.rglob("*.h")):
            st = p.stat()
            h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    base = os.environ.get("MIRRORCKPT_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "mirrorckpt" if base else Path.home() / ".cache" / "mirrorckpt"


def measure(use_cache: bool = True) -> dict[str, int]:
    """What the installed headers say, from the cache or by compiling and running the probe."""
    source = probe_source()
    flags = cflags()
    headers = [d / h for d in _include_dirs(flags) for h in _HEADERS]
    if not any(p.exists() for p in headers):
        raise DpdkAbiError("the DPDK ABI check needs the DPDK 22.11 headers, not found "
                           f"(looked in {', '.join(map(str, _include_dirs(flags))) or 'nowhere'}); "
                           "install them: apt-get install libdpdk-dev")
    cached = cache_dir() / f"dpdk-abi-{_cache_key(source, flags)}.json"
    if use_cache and cached.exists():
        try:
            return json.loads(cached.read_text())
        except (OSError, ValueError):
            pass  # rebuilt below
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise DpdkAbiError("the DPDK ABI check compiles an offsetof() probe and needs gcc "
                           "(apt-get install gcc)")
    with tempfile.TemporaryDirectory(prefix="mirrorckpt-abi-") as tmp:
        c, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        c.write_text(source)
        r = subprocess.run([gcc, *flags, "-o", str(exe), str(c)], capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            raise DpdkAbiError(f"the DPDK ABI probe does not compile against the installed "
                               f"headers ({' '.join(flags)}):\n{r.stderr.strip()[-2000:]}")
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    found = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found))
        os.replace(tmp, cached)
    except OSError:
        pass  # an unwritable cache only costs a compile next time
    return found


def check(library_version: str | None = None, use_cache: bool = True) -> dict[str, int]:
    """Raises `DpdkAbiError` unless the headers match `EXPECTED` and, when given, the running
    library's `rte_version()` string (e.g. "DPDK 22.11.11") has the headers' year.month."""
    found = measure(use_cache)
    bad = [f"{name}: the code expects {want}, the installed headers say {found.get(name)}"
           for name, (_, want) in EXPECTED.items() if found.get(name) != want]
    if bad:
        raise DpdkAbiError("unsupported DPDK ABI (struct layout differs from what "
                           "mirrorckpt.capture.dpdk reads; it supports DPDK 22.11 on x86-64):\n  "
                           + "\n  ".join(bad))
    if library_version is not None:
        want = f"{found['version.year']}.{found['version.month']:02d}"
        parts = library_version.split()
        got = parts[-1] if parts else ""
        if not (got == want or got.startswith(want + ".")):
            raise DpdkAbiError(f"the running DPDK library is {library_version!r} but the "
                               f"headers are DPDK {want}: install matching packages "
                               "(libdpdk-dev and the librte-*23 libraries of one release)")
    return found
