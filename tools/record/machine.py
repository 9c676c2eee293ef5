"""What the recording machine has and lacks, and the transport that follows from it.

Each ``Probe`` names one thing (GPU, CUDA, torch, the NCCL library, rdma_rxe, the ``rdma`` tool,
libibverbs, the rxe provider, tcpdump, iproute2, network namespaces), whether it is there and
what was found or how to get it. ``mirrorckpt record --check`` prints them; a recording asks
only for the probes its backend and transport need (``NEEDS``) and names every missing one.

Packages the machine's image lacks can travel with the tree as Debian packages (``Carried``):
a folder of ``.deb`` files, unpacked with ``dpkg-deb -x`` into the folder's ``root/``, or a tree
already unpacked. Their programs go on PATH, their libraries on LD_LIBRARY_PATH, and the rxe
provider is named to libibverbs by its path in ``RDMAV_DRIVERS`` (rdma-core loads a driver name
holding a '/' as that file), so nothing is installed into the system.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TRANSPORTS = ("roce", "socket")
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "usr/lib")
BIN_DIRS = ("usr/sbin", "usr/bin", "sbin", "bin")
RXE_PROVIDER = "libibverbs/librxe-rdmav*.so"

# probe names each (backend, transport) needs
BASE = ("netns", "iproute2", "tcpdump", "torch")
NEEDS = {
    ("gloo", "tcp"): BASE,
    ("nccl", "socket"): BASE + ("GPU", "CUDA", "NCCL library"),
    ("nccl", "roce"): BASE + ("GPU", "CUDA", "NCCL library", "rdma_rxe", "rdma tool", "libibverbs", "rxe provider"),
}


class MachineError(RuntimeError):
    """The machine lacks what the recording needs; the message names each missing thing."""


@dataclass
class Probe:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok     ' if self.ok else 'MISSING'} {self.name:14s} {self.detail}"


class Carried:
    """Debian packages that travel with the tree (``--rdma-debs DIR``); see the module docstring."""

    def __init__(self, folder: str | os.PathLike | None):
        self.folder = Path(folder).resolve() if folder else None  # absolute: ranks run elsewhere
        self.root: Path | None = None
        if self.folder is None:
            return
        if not self.folder.is_dir():
            raise MachineError(f"--rdma-debs {self.folder}: no such folder")
        debs = sorted(self.folder.glob("*.deb"))
        if debs:
            if shutil.which("dpkg-deb") is None:
                raise MachineError(f"--rdma-debs {self.folder}: dpkg-deb is needed to unpack {len(debs)} .deb files "
                                   "(or give a folder of files already unpacked)")
            self.root = self.folder / "root"
            for deb in debs:
                r = subprocess.run(["dpkg-deb", "-x", str(deb), str(self.root)], capture_output=True, text=True)
                if r.returncode != 0:
                    raise MachineError(f"{deb}: dpkg-deb -x failed: {r.stderr.strip()}")
        else:
            self.root = self.folder

    def lib_dirs(self) -> list[str]:
        if self.root is None:
            return []
        dirs = [self.root / d for d in LIB_DIRS] + [self.root / d / "libibverbs" for d in LIB_DIRS]
        return [str(d) for d in dirs if d.is_dir()]

    def bin_dirs(self) -> list[str]:
        return [str(self.root / d) for d in BIN_DIRS if self.root is not None and (self.root / d).is_dir()]

    def rxe_provider(self) -> str | None:
        for d in LIB_DIRS if self.root is not None else ():
            found = sorted(glob.glob(str(self.root / d / RXE_PROVIDER)))
            if found:
                return found[0]
        return None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the carried programs and libraries."""
        env = dict(os.environ if base is None else base)
        if self.root is None:
            return env
        env["PATH"] = os.pathsep.join(self.bin_dirs() + [env.get("PATH", "")])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(self.lib_dirs() + [env.get("LD_LIBRARY_PATH", "")]).strip(os.pathsep)
        provider = self.rxe_provider()
        if provider:
            env["RDMAV_DRIVERS"] = provider
        return env


def _run(argv: list[str], env=None, timeout: float = 20) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None


def probe_netns() -> Probe:
    if os.geteuid() != 0:
        return Probe("netns", False, "not root: network namespaces, veths and tcpdump need root")
    if shutil.which("sysctl") is None:
        return Probe("netns", False, "no `sysctl` (procps): the namespaces' interfaces are set with it")
    name = f"mkrecprobe{os.getpid()}"
    steps = [["ip", "netns", "add", name], ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]]
    try:
        for argv in steps:
            r = _run(argv)
            if r is None or r.returncode != 0:
                return Probe("netns", False, f"`{' '.join(argv)}` failed: {(r.stderr if r else 'not found').strip()}")
    finally:
        _run(["ip", "netns", "del", name])
    return Probe("netns", True, "root; ip netns add/exec work")


def probe_tool(name: str, argv: list[str], env) -> Probe:
    r = _run(argv, env)
    if r is None or r.returncode != 0:
        return Probe(name, False, f"`{argv[0]}` not found or failed (Debian: apt-get download it and give "
                                  "the .deb with --rdma-debs)")
    text = (r.stdout or r.stderr).strip().splitlines()
    return Probe(name, True, f"{shutil.which(argv[0], path=env.get('PATH'))}: {text[0] if text else ''}")


def probe_torch() -> list[Probe]:
    try:
        import torch
    except ImportError as e:
        return [Probe("torch", False, str(e)), Probe("CUDA", False, "no torch")]
    cuda = torch.version.cuda
    if cuda and torch.cuda.is_available():
        return [Probe("torch", True, torch.__version__), Probe("CUDA", True, f"CUDA {cuda}, "
                                                                        f"{torch.cuda.device_count()} device(s)")]
    return [Probe("torch", True, torch.__version__),
            Probe("CUDA", False, f"torch {torch.__version__} " + ("sees no CUDA device" if cuda else "is a CPU build"))]


def gpu_info() -> dict[str, str] | None:
    """Name and driver of the first GPU, from nvidia-smi."""
    r = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if r is None or r.returncode != 0 or not r.stdout.strip():
        return None
    name, _, driver = r.stdout.strip().splitlines()[0].partition(",")
    return {"name": name.strip(), "driver": driver.strip()}


def probe_gpu() -> Probe:
    info = gpu_info()
    if info is None:
        return Probe("GPU", False, "nvidia-smi found no NVIDIA GPU")
    return Probe("GPU", True, f"{info['name']}, driver {info['driver']}")


def bundled_nccl() -> str | None:
    """The libnccl.so.2 torch loads: mapped into this process once torch is imported (wheels link it
    dynamically), else an nvidia-nccl-* package beside torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if os.path.basename(path).startswith("libnccl.so"):
                return path
    except OSError:
        pass
    for base in sys.path:
        found = sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnccl.so*")) +
                       glob.glob(os.path.join(base, "nvidia", "nccl", "lib", "libnccl.so*")))
        if found:
            return found[0]
    return None


def probe_nccl(path: str | None) -> tuple[Probe, str | None]:
    """(probe, resolved path): ``path`` or torch's bundled libnccl.so.2, loaded and asked its version."""
    from mirrorckpt.tools.record.nccl import Library, NcclError

    where = path or bundled_nccl()
    if where is None:
        return Probe("NCCL library", False, "no --nccl-lib given and torch has no libnccl.so.2 beside it (unpack an "
                                            "nvidia-nccl-cu12/cu13 wheel and give nvidia/nccl/lib/libnccl.so.2)"), None
    try:
        lib = Library(where)
    except NcclError as e:
        return Probe("NCCL library", False, str(e)), None
    return Probe("NCCL library", True, f"NCCL {lib.version}: {where}" + ("" if path else " (torch's)")), where


def probe_rxe(env) -> list[Probe]:
    release = platform.release()
    if Path("/sys/module/rdma_rxe").is_dir():
        module = Probe("rdma_rxe", True, f"loaded (kernel {release})")
    else:
        files = glob.glob(f"/lib/modules/{release}/**/rdma_rxe.ko*", recursive=True)
        r = _run(["modprobe", "rdma_rxe"]) if files and os.geteuid() == 0 else None
        if r is not None and r.returncode == 0:
            module = Probe("rdma_rxe", True, f"loaded now by modprobe (kernel {release})")
        else:
            why = (f"modprobe failed: {r.stderr.strip()}" if r is not None else
                   f"no rdma_rxe.ko under /lib/modules/{release}" if not files else "modprobe unavailable")
            link = _run(["rdma", "link", "show"], env)
            if link is not None and link.returncode != 0 and "NETLINK_RDMA" in (link.stderr or ""):
                why += "; the kernel has no RDMA netlink (CONFIG_INFINIBAND off)"
            module = Probe("rdma_rxe", False, f"kernel {release}: module not loaded, {why}")
    tool = shutil.which("rdma", path=env.get("PATH"))
    probes = [module, Probe("rdma tool", tool is not None,
                            tool or "no `rdma` (iproute2's; carry iproute2's .deb with --rdma-debs)")]
    lib_dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    r = _run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libibverbs.so.1')"], env)
    probes.append(Probe("libibverbs", r is not None and r.returncode == 0,
                        "libibverbs.so.1 loads" if r is not None and r.returncode == 0 else
                        "libibverbs.so.1 does not load: " + ((r.stderr.strip().splitlines() or ["?"])[-1] if r else "?")
                        + " (carry libibverbs1, libnl-3-200, libnl-route-3-200 with --rdma-debs)"))
    provider = env.get("RDMAV_DRIVERS") or next(
        (p for d in lib_dirs + [f"/usr/{x}" for x in ("lib/x86_64-linux-gnu", "lib64", "lib")]
         for p in sorted(glob.glob(os.path.join(d, "librxe-rdmav*.so")) + glob.glob(os.path.join(d, RXE_PROVIDER)))),
        None)
    probes.append(Probe("rxe provider", provider is not None,
                        provider or "no librxe-rdmav*.so (carry ibverbs-providers with --rdma-debs)"))
    return probes


def probe_all(nccl_lib: str | None = None, carried: Carried | None = None,
              gpu: bool = True) -> tuple[list[Probe], str | None]:
    """Every probe; with ``gpu`` the GPU, CUDA, NCCL and RDMA ones too. (probes, NCCL library path)."""
    env = (carried or Carried(None)).env()
    probes = [probe_netns(), probe_tool("iproute2", ["ip", "-V"], env),
              probe_tool("tcpdump", ["tcpdump", "--version"], env)]
    probes += probe_torch()
    nccl_path = None
    if gpu:
        probes.append(probe_gpu())
        nccl, nccl_path = probe_nccl(nccl_lib)
        probes.append(nccl)
        probes += probe_rxe(env)
    return probes, nccl_path


def missing(probes: list[Probe], backend: str, transport: str) -> list[Probe]:
    need = NEEDS[(backend, transport)]
    return [p for p in probes if p.name in need and not p.ok]


def choose_transport(requested: str, probes: list[Probe]) -> str:
    """roce, socket, or (auto) roce when everything it needs is there, else socket."""
    if requested == "auto":
        return "roce" if not missing(probes, "nccl", "roce") else "socket"
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be roce, socket or auto, not {requested!r}")
    return requested


def require(probes: list[Probe], backend: str, transport: str) -> None:
    lacking = missing(probes, backend, transport)
    if lacking:
        raise MachineError(f"this machine cannot record {backend}" + (f" over {transport}" if backend == "nccl" else "")
                           + ": " + "; ".join(f"{p.name}: {p.detail}" for p in lacking))
