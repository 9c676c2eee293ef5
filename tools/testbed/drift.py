"""How far a replica drifts from a trainer whose optimizer arithmetic is not its own.

A real training loop (an MLP on the harness's data, optional bf16 autocast, global-norm clipping)
steps its optimizer with one implementation (e.g. fused AdamW); a ``Replica`` running another
(e.g. the for-loop) is fed the same pre-clip gradients, as the wire carries them, and the clip
coefficient the trainer applied, as STEP_META carries it. Every ``every`` steps each state tensor
of the two is compared: the true relative L2 distance, and the distance the fingerprints
(updater.fingerprint.stats) estimate. NUMERICS.md holds the results; the tolerance of
updater.numeric is chosen from them.

    python -m mirrorckpt.tools.testbed.drift --steps 2000 --out DIR   # DIR/drift.json, DIR/drift.png
    python -m mirrorckpt.tools.testbed.drift --device cuda --out DIR  # the trainer's step on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import ClipSpec, OptimizerSpec, TrainingSpec
from mirrorckpt.control.gockpt import _named_state
from mirrorckpt.control.trainer import clip_coefficient
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.tools.testbed.harness import Shard, build_model
from mirrorckpt.updater import fingerprint as fp
from mirrorckpt.updater.numeric import UNIT_ROUNDOFF
from mirrorckpt.updater.replica import Replica
from torch import nn

DIMS = (32, 128, 128, 16)


@dataclass
class Case:
    name: str
    optimizer: str = "adamw"
    trainer: str = "fused"  # fused | foreach | for-loop
    replica: str = "for-loop"
    lr: float = 1e-3
    weight_decay: float = 0.01
    momentum: float = 0.0
    max_norm: float | None = 0.05
    autocast: bool = False


CASES = [
    Case("adamw fused vs for-loop, clip 0.05"),
    Case("adamw fused vs for-loop, clip 0.05, bf16 autocast", autocast=True),
    Case("adamw fused vs for-loop, lr 1e-2", lr=1e-2),
    Case("adamw fused vs for-loop, lr 1e-1", lr=1e-1),
    Case("adamw fused vs for-loop, lr 1e-4", lr=1e-4),
    Case("adam fused vs for-loop, clip 0.02", optimizer="adam", weight_decay=0.0, max_norm=0.02),
    Case("sgd fused vs for-loop, momentum 0.9", optimizer="sgd", lr=1e-2, momentum=0.9, weight_decay=1e-4),
    Case("adamw foreach vs for-loop (cpu)", trainer="foreach"),
    Case("adamw for-loop vs for-loop (cpu)", trainer="for-loop"),
]


def _optimizer(case: Case, params):
    flags = {"fused": case.trainer == "fused", "foreach": case.trainer == "foreach"}
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=case.momentum, weight_decay=case.weight_decay, **flags)
    cls = torch.optim.AdamW if case.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=case.lr, weight_decay=case.weight_decay, **flags)


def run_case(case: Case, steps: int, every: int, seed: int = 0, device: str = "cpu") -> dict:
    model = build_model(DIMS, seed).to(device)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    opt = _optimizer(case, params)
    layout = JobLayout([ParamSpec(n, tuple(p.shape)) for n, p in zip(names, params)],
                       [BucketSpec(tuple(reversed(range(len(params)))))])
    spec = OptimizerSpec(name=case.optimizer, lr=case.lr, weight_decay=case.weight_decay, momentum=case.momentum,
                         fused=case.trainer == "fused", foreach=case.trainer == "foreach",
                         device=torch.device(device).type)
    training = TrainingSpec(optimizer=spec, clip=ClipSpec(case.max_norm) if case.max_norm else None)
    rep = Replica(layout, training, {n: p.detach().cpu().clone() for n, p in zip(names, params)}, impl=case.replica)
    shard = Shard(DIMS, seed + 1, 0)
    bucket = layout.bucket_list(1)[0]
    series: dict[str, list] = {}
    exact_steps, clipped = 0, 0
    t0 = time.perf_counter()
    for i in range(steps):
        x, y = (t.to(device) for t in shard.next())
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=case.autocast):
            out = model(x)
        nn.functional.mse_loss(out.float(), y).backward()
        flat = torch.cat([params[k].grad.reshape(-1) for k in bucket.params]).cpu().numpy().copy()  # the wire: pre-clip
        meta = {}
        if case.max_norm:
            total = torch.nn.utils.get_total_norm([p.grad for p in params])
            coef = clip_coefficient(total, case.max_norm)
            torch.nn.utils.clip_grads_with_norm_(params, case.max_norm, total)
            meta["clip"] = {"total_norm": float(total), "coef": float(coef)}
            clipped += float(coef) < 1.0
        opt.step()
        rep.apply(ReducedIteration(i, [flat], meta=meta))
        t = i + 1
        if t % every and t != 1:
            continue
        mine = _named_state(names, params, opt)
        theirs = rep.named_tensors()
        same = True
        for k, a in mine.items():
            b = theirs[k]
            if a.numel() == 1:
                continue  # the step counter: always exact
            eq = torch.equal(a.cpu(), b)
            same &= eq
            a = a.detach().cpu()
            true = 0.0 if eq else float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))
            est = fp.distance(fp.stats(a, t, k), fp.stats(b, t, k), a.numel())
            series.setdefault(k, []).append((t, true, est))
        exact_steps += same
    u = UNIT_ROUNDOFF["float32"]
    ratio = max((est / (u * math.sqrt(t + 1)) for s in series.values() for t, _, est in s), default=0.0)
    true_ratio = max((tr / (u * math.sqrt(t + 1)) for s in series.values() for t, tr, _ in s), default=0.0)
    return {"case": asdict(case), "steps": steps, "seconds": time.perf_counter() - t0, "series": series,
            "exact_checks": exact_steps, "checks": len(next(iter(series.values()), [])),
            "clipped_steps": clipped, "max_ratio": ratio, "max_true_ratio": true_ratio}


def plot(results: list[dict], path: Path, tolerance_coefficient: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r["max_ratio"] > 0][:4]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 3.2 * len(shown)), sharex=True, squeeze=False)
    u = UNIT_ROUNDOFF["float32"]
    for ax, r in zip(axes[:, 0], shown):
        steps = None
        for k, s in r["series"].items():
            a = np.array(s)
            steps = a[:, 0]
            ax.plot(a[:, 0], np.maximum(a[:, 1], 1e-12), lw=0.8, label=k.replace("optim.state.", "") + " (true)")
        worst = np.max([np.array(s)[:, 2] for s in r["series"].values()], axis=0)
        ax.plot(steps, np.maximum(worst, 1e-12), "k:", lw=1.2, label="largest fingerprint distance")
        ax.plot(steps, tolerance_coefficient * u * np.sqrt(steps + 1), "r--", lw=1.5, label="tolerance")
        ax.set_yscale("log")
        ax.set_ylim(1e-11, 1e-3)
        ax.set_title(r["case"]["name"], fontsize=9)
        ax.set_ylabel("relative distance")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=6, ncol=3, loc="upper left")
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="where the trainer steps (cpu, cuda); the replica is on the cpu")
    ap.add_argument("--cases", default="", help="comma-separated case numbers (default: all)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    picked = [CASES[int(k)] for k in a.cases.split(",")] if a.cases else CASES
    for case in picked:
        r = run_case(case, a.steps, a.every, device=a.device)
        r["device"] = a.device
        results.append(r)
        label = f"{case.name} [{a.device}]"
        print(f"{label:60s} exact checks {r['exact_checks']}/{r['checks']}  clipped {r['clipped_steps']}  "
              f"max d/(u sqrt t): fingerprint {r['max_ratio']:.3f} true {r['max_true_ratio']:.3f}  "
              f"({r['seconds']:.1f} s)", flush=True)
    from mirrorckpt.updater.numeric import COEFFICIENTS

    (a.out / "drift.json").write_text(json.dumps(results))
    plot(results, a.out / "drift.png", COEFFICIENTS["adamw"])


if __name__ == "__main__":
    main()
