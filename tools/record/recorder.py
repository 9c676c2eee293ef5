"""One recording: R ranks in network namespaces, tcpdump on each rank's veth, truth from the ranks.

``record(RecordOptions(...))`` runs, in order: the machine probes (``tools.record.machine``;
what the backend and transport need, each missing thing named); a ``testbed.netns.Topology``
(one namespace per rank on a bridge, static neighbours, offloads off, addresses 10.SUBNET.0.R+1);
for RoCE a Soft-RoCE device per rank (``rdma link add rxe<R> type rxe netdev <veth>``) and its
RoCEv2 GID; tcpdump per rank and direction; the ranks (``tools.record.workload``) with the
backend's environment; the truth merge; the folder's README.md and replay.args; the replay check
(``tools.record.verify``). Namespaces and rxe devices are removed however it ends.

NCCL ranks share the one GPU (CUDA_VISIBLE_DEVICES) and differ in NCCL_HOSTID, so NCCL's
duplicate-GPU check (same host hash and bus id) passes and the ranks talk through the net
transport, as between nodes.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mirrorckpt.tools.record import machine
from mirrorckpt.tools.record.truth import merge
from mirrorckpt.tools.record.verify import EGRESS, INGRESS, REPLAY_ARGS, Verdict, check_folder
from mirrorckpt.tools.testbed.gloo_harness import Tcpdump
from mirrorckpt.tools.testbed.netns import Topology

# NCCL settings every recording makes: the decoder follows ring all-reduce (NCCL_ALGO=Ring unless
# --algo says otherwise), and the log says which protocol each collective took (TUNING).
NCCL_FIXED = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV,TUNING", "NCCL_COLLNET_ENABLE": "0",
              "NCCL_NVLS_ENABLE": "0"}


class RecordError(RuntimeError):
    """The recording could not be made; the message says what failed and where its logs are."""


@dataclass
class RecordOptions:
    out: Path
    backend: str = "nccl"  # nccl | gloo
    ranks: int = 2
    transport: str = "auto"  # roce | socket | auto (nccl); gloo is TCP
    nccl_lib: str | None = None
    rdma_debs: str | None = None
    gpu: str = "0"
    algo: str = "Ring"
    nccl_env: dict[str, str] = field(default_factory=dict)  # NCCL_PROTO, NCCL_IB_QPS_PER_CONNECTION, ...
    model: str = "mlp:16,64,96,384"
    steps: int = 3
    dtype: str = "float32"
    bucket_cap_mb: float | None = 0.01
    batch_size: int = 4
    seed: int = 0
    mtu: int = 1500
    subnet: int | None = None
    ingress: bool = True
    max_mb: float = 16.0
    timeout: float = 180.0
    replay: bool = True


@dataclass
class Recording:
    folder: Path
    transport: str
    truth: dict
    verdict: Verdict | None


def rank_env(opts: RecordOptions, topo: Topology, rank: int, transport: str, gids: dict[int, int]) -> dict[str, str]:
    host = topo.hosts[rank]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if opts.backend == "gloo":
        env["GLOO_SOCKET_IFNAME"] = host.ifname
        env.update(opts.nccl_env)  # --env GLOO_...: the user's settings win
        return env
    env.update(NCCL_FIXED)
    env.update(CUDA_VISIBLE_DEVICES=opts.gpu, NCCL_HOSTID=f"{topo.prefix}-rank{rank}",
               NCCL_SOCKET_IFNAME=f"={host.ifname}", NCCL_ALGO=opts.algo)
    if transport == "socket":
        env.update(NCCL_NET="Socket", NCCL_IB_DISABLE="1")
    else:
        env.update(NCCL_NET="IB", NCCL_IB_DISABLE="0", NCCL_IB_HCA=f"=rxe{rank}:1",
                   NCCL_IB_GID_INDEX=str(gids[rank]))
    env.update(opts.nccl_env)  # the user's settings win
    return env


def nccl_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith("NCCL_") or k == "CUDA_VISIBLE_DEVICES"}


def add_rxe(topo: Topology) -> dict[int, int]:
    """A Soft-RoCE device per rank on its veth; returns each rank's RoCEv2 GID index of its IPv4 address."""
    gids = {}
    for h in topo.hosts:
        topo.run(h, "rdma", "link", "add", f"rxe{h.index}", "type", "rxe", "netdev", h.ifname)
        gids[h.index] = roce_v2_gid(topo, h)
    return gids


def roce_v2_gid(topo: Topology, host, wait_s: float = 5.0) -> int:
    """The GID index whose GID is the host's IPv4 address (::ffff:a.b.c.d) of type RoCE v2."""
    import ipaddress

    want = ipaddress.IPv6Address(f"::ffff:{host.ip}")
    port = f"/sys/class/infiniband/rxe{host.index}/ports/1"
    deadline = time.monotonic() + wait_s
    while True:
        r = topo.run(host, "sh", "-c", f"cd {port} && for g in gids/*; do i=${{g#gids/}}; "
                                       f"echo $i $(cat $g) $(cat gid_attrs/types/$i 2>/dev/null); done", check=False)
        for line in r.stdout.splitlines():
            parts = line.split(None, 2)
            if len(parts) == 3 and "v2" in parts[2]:
                try:
                    if ipaddress.IPv6Address(parts[1]) == want:
                        return int(parts[0])
                except ValueError:
                    continue
        if time.monotonic() > deadline:
            raise RecordError(f"rxe{host.index}: no RoCE v2 GID for {host.ip} in {port} ({r.stdout.strip()[:300]})")
        time.sleep(0.2)


def remove_rxe(topo: Topology) -> None:
    for h in topo.hosts:
        topo.run(h, "rdma", "link", "delete", f"rxe{h.index}", check=False)


def start_ranks(opts: RecordOptions, topo: Topology, work: Path, logs: Path, transport: str,
                gids: dict[int, int], nccl_path: str | None) -> tuple[list[subprocess.Popen], dict]:
    procs, envs = [], {}
    for r, h in enumerate(topo.hosts):
        env = rank_env(opts, topo, r, transport, gids)
        envs[r] = nccl_settings(env)
        argv = [sys.executable, "-m", "mirrorckpt.tools.record.workload", "--rank", r, "--world", opts.ranks,
                "--master", topo.hosts[0].ip, "--out", work, "--backend", opts.backend, "--model", opts.model,
                "--steps", opts.steps, "--dtype", opts.dtype, "--batch-size", opts.batch_size, "--seed", opts.seed,
                "--timeout", opts.timeout]
        if opts.bucket_cap_mb is not None:
            argv += ["--bucket-cap-mb", opts.bucket_cap_mb]
        if nccl_path:
            argv += ["--nccl-lib", nccl_path]
        with open(logs / f"rank{r}.log", "w") as log:
            procs.append(topo.popen(h, *argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, envs


def wait_ranks(procs: list[subprocess.Popen], logs: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            failed = bad or [r for r, p in enumerate(procs) if p.poll() is None]
            break
        time.sleep(0.05)
    failed = failed or [r for r, p in enumerate(procs) if p.returncode != 0]
    if not failed:
        return
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    tails = []
    for r in failed:
        lines = (logs / f"rank{r}.log").read_text(errors="replace").strip().splitlines()
        tails.append(f"rank {r} ({'exit ' + str(procs[r].returncode) if procs[r].returncode else 'timed out'}): "
                     + " / ".join(lines[-3:]))
    raise RecordError("the workload failed: " + "; ".join(tails) + f" (logs in {logs})")


def wait_quiet(topo: Topology, quiet_s: float = 0.3, limit_s: float = 5.0) -> None:
    """Returns once no rank's bridge port has passed a frame for ``quiet_s`` (at most ``limit_s``)."""
    def count():
        return sum(int(Path(f"/sys/class/net/{h.port}/statistics/{k}").read_text())
                   for h in topo.hosts for k in ("rx_packets", "tx_packets"))

    deadline, last, since = time.monotonic() + limit_s, count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def record(opts: RecordOptions, say=print) -> Recording:
    """Make one recording into ``opts.out``; see the module docstring. Raises MachineError when the
    machine lacks something, RecordError when the recording fails."""
    if not 2 <= opts.ranks <= 4:
        raise ValueError(f"ranks must be 2..4, got {opts.ranks}")
    out = Path(opts.out)
    if out.exists() and any(out.iterdir()):
        raise RecordError(f"{out}: not empty (a recording never writes over another; choose a new --out)")
    carried = machine.Carried(opts.rdma_debs)
    os.environ.update(carried.env())  # carried programs and libraries for every process started here
    probes, nccl_path = machine.probe_all(opts.nccl_lib, carried, gpu=opts.backend == "nccl")
    transport = "tcp" if opts.backend == "gloo" else machine.choose_transport(opts.transport, probes)
    machine.require(probes, opts.backend, transport)
    say(f"[record] {opts.backend} over {transport}, {opts.ranks} ranks" +
        (f", NCCL from {nccl_path}" if nccl_path else ""))
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir()
    topo = Topology(hosts=opts.ranks, monitors=0, mtu=opts.mtu, subnet=opts.subnet)
    dumps: dict[str, Tcpdump] = {}
    started = datetime.datetime.now(datetime.UTC)
    with tempfile.TemporaryDirectory(prefix="mirrorckpt-record-") as work:
        topo.setup()
        try:
            addresses = [h.ip for h in topo.hosts]
            gids = add_rxe(topo) if transport == "roce" else {}
            for h in topo.hosts:
                dumps[EGRESS.format(rank=h.index)] = Tcpdump(topo, h, out / EGRESS.format(rank=h.index), "out")
                if opts.ingress:
                    dumps[INGRESS.format(rank=h.index)] = Tcpdump(topo, h, out / INGRESS.format(rank=h.index), "in")
            t0 = time.monotonic()
            procs, envs = start_ranks(opts, topo, Path(work), logs, transport, gids, nccl_path)
            wait_ranks(procs, logs, opts.timeout)
            took = time.monotonic() - t0
            wait_quiet(topo)  # the connections' last frames (FINs, ACKs) reach every capture
        finally:
            for d in dumps.values():
                d.stop()
            if transport == "roce":
                remove_rxe(topo)
            topo.teardown()
        dropped = {name: d.dropped() for name, d in dumps.items()}
        if any(dropped.values()):
            raise RecordError(f"tcpdump dropped frames: {dropped}; the captures are incomplete")
        sizes = {name: (out / name).stat().st_size for name in dumps}
        total_mb = sum(sizes.values()) / 1e6
        if total_mb > opts.max_mb:
            raise RecordError(f"the captures hold {total_mb:.1f} MB, over --max-mb {opts.max_mb}: cap the workload "
                              "(fewer --steps, a smaller --model), not the capture")
        gpu = machine.gpu_info() if opts.backend == "nccl" else None
        config = {"model": opts.model, "ranks": opts.ranks, "steps": opts.steps, "seed": opts.seed,
                  "batch_size": opts.batch_size, "bucket_cap_mb": opts.bucket_cap_mb,
                  "training": {"optimizer": {"name": "adam", "lr": 1e-3}, "grad_dtype": opts.dtype},
                  "torch": _torch_version()}
        rec = {"backend": opts.backend, "transport": transport, "environment": envs[0], "gpu": gpu,
               "kernel": platform.release(), "date": started.isoformat(timespec="seconds"),
               "addresses": addresses, "mtu": opts.mtu, "captures": sizes,
               "workload_seconds": round(took, 2), "options": _options(opts)}
        truth = merge(Path(work), out, opts.ranks, config, rec)
    args = replay_options(opts.backend, transport)
    (out / REPLAY_ARGS).write_text(shlex.join(args) + "\n" if args else "")
    verdict = check_folder(out) if opts.replay else None
    (out / "README.md").write_text(readme(out.name, truth, envs, verdict, args))
    return Recording(out, transport, truth, verdict)


def replay_options(backend: str, transport: str) -> list[str]:
    """What replay needs to decode the captures: nothing for RoCE (the default)."""
    return {"gloo": ["--transport", "gloo"], "socket": ["--transport", "nccl-socket"]}.get(
        backend if backend == "gloo" else transport, [])


def _torch_version() -> str:
    import torch

    return torch.__version__


def _options(opts: RecordOptions) -> dict:
    d = asdict(opts)
    d["out"] = str(opts.out)
    return d


def readme(name: str, truth: dict, envs: dict, verdict: Verdict | None, args: list[str]) -> str:
    replay_line = shlex.join(args) + " " if args else ""
    rec, cfg, layout = truth["record"], truth["config"], truth["layout"]
    gpu = rec.get("gpu") or {}
    ars = [c for c in truth["collectives"] if c["kind"] == "all_reduce"]
    sizes = sorted({c["count"] for c in ars})
    lines = [
        f"# {name}",
        "",
        f"Recorded by `mirrorckpt record` on {rec['date']}: {cfg['ranks']} ranks, {rec['backend']}"
        + (f" over {rec['transport']}" if rec["backend"] == "nccl" else " over TCP") + ".",
        "",
        f"- library: {rec['library']}",
        f"- GPU: {gpu.get('name', 'none (CPU)')}, driver {gpu.get('driver', '-')}; kernel {rec['kernel']}; "
        f"torch {cfg['torch']}",
        f"- workload: model `{cfg['model']}`, {cfg['steps']} iterations, {layout['grad_dtype']}, bucket_cap_mb "
        f"{cfg['bucket_cap_mb']}; {len(truth['collectives'])} collectives, {len(ars)} all-reduces of "
        f"{', '.join(str(s) for s in sizes)} elements",
        f"- addresses: {', '.join(rec['addresses'])} (MTU {rec['mtu']})",
        "- environment (rank 0; NCCL_HOSTID and the interface differ per rank):",
    ]
    lines += [f"  - `{k}={v}`" for k, v in envs[0].items()] or ["  - (none)"]
    lines += ["- captures: " + ", ".join(f"`{n}` ({s / 1e6:.2f} MB)" for n, s in rec["captures"].items()),
              f"- replay: `mirrorckpt replay --json {replay_line}rank*-egress.pcap`, every all-reduce compared with "
              "truth.json's",
              f"- verdict when recorded: {verdict.text().splitlines()[0] if verdict else 'not checked (--no-replay)'}",
              "", "Made with:", "", "```", "mirrorckpt record " + shlex.join(_cli_args(rec["options"])), "```", ""]
    return "\n".join(lines)


def _cli_args(o: dict) -> list[str]:
    args = ["--out", Path(o["out"]).name, "--backend", o["backend"], "--ranks", str(o["ranks"]),
            "--transport", o["transport"], "--algo", o["algo"], "--model", o["model"], "--steps", str(o["steps"]),
            "--dtype", o["dtype"]]
    if o["bucket_cap_mb"] is not None:
        args += ["--bucket-cap-mb", str(o["bucket_cap_mb"])]
    for k, v in o["nccl_env"].items():
        args += ["--env", f"{k}={v}"]
    return args

