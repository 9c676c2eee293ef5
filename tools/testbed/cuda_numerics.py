"""How a CUDA optimizer step rounds against the CPU implementations the replica can run.

Run where a GPU is. Each step starts every CPU implementation from the CUDA side's state (copied
down), applies the same gradient on both, and counts the elements whose new value is not the
CUDA value bit for bit: the per-step exact rate, free of any drift accumulated before. One
candidate is not a torch implementation but an emulation of torch's CUDA fused Adam(W) kernel
(``emulate_fused``), and two are torch's CPU implementations with the float32 betas that kernel
uses. NUMERICS.md holds the results.

    python -m mirrorckpt.tools.testbed.cuda_numerics --steps 30 --out DIR   # DIR/cuda_numerics.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = ((1024, 512), (1024,), (3, 100_003), (257, 129))


def emulate_fused(p, g, m, v, step: int, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, decoupled: bool):
    """One step of torch's CUDA fused Adam/AdamW on float32 numpy arrays, returned as (p, m, v):
    every scalar a float32, a*b + c contracted to one rounding (a float32 FMA, emulated through
    an exact double product) where the kernel as compiled contracts it, the bias corrections
    from float32 powers. Found against recorded steps of torch 2.11 on an H100
    (tests/data/cuda_fused_adam_h100.npz): AdamW bit-exact, Adam with L2 decay 1 value in
    458,752 off by an ulp. Another build may contract differently."""
    f32 = np.float32

    def fma(a, b, c):
        return (np.float64(a) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(f32)
    lr, b1, b2, eps, wd = (f32(x) for x in (lr, beta1, beta2, eps, weight_decay))
    if wd:
        if decoupled:
            p = fma(-(lr * wd), p, p)
        else:
            g = fma(p, wd, g)
    m = fma(b1, m, (f32(1) - b1) * g)
    v = fma(b2, v, (f32(1) - b2) * (g * g))
    bc1 = f32(1) - b1 ** f32(step)
    bc2_sqrt = np.sqrt(f32(1) - b2 ** f32(step))
    step_size = lr / bc1
    denom = np.sqrt(v) / bc2_sqrt + eps
    p = p - (step_size * m) / denom
    return p, m, v


def _opt(kind: str, params, hp: dict):
    cls = torch.optim.AdamW if hp["decoupled"] else torch.optim.Adam
    betas = (hp["beta1"], hp["beta2"])
    if kind.endswith("fp32 betas"):
        betas, kind = tuple(float(np.float32(b)) for b in betas), kind.split(",")[0]
    flags = {"fused": kind == "fused", "foreach": kind == "foreach"} if kind != "default" else {}
    return cls(params, lr=hp["lr"], betas=betas, eps=hp["eps"], weight_decay=hp["weight_decay"], **flags)


def _state(opt, params):
    return [(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]


def run(hp: dict, steps: int, seed: int = 0) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) * 0.02 for s in SHAPES]
    gpu_kinds = ("fused", "foreach", "for-loop")
    cpu_kinds = ("for-loop", "foreach", "fused", "for-loop, fp32 betas", "fused, fp32 betas", "emulated-fused")
    cuda_fused_only = {"for-loop, fp32 betas", "fused, fp32 betas", "emulated-fused"}
    gpu = {k: [torch.nn.Parameter(t.to(dev)) for t in init] for k in gpu_kinds}
    gopt = {k: _opt(k, gpu[k], hp) for k in gpu_kinds}
    cpu = {k: [torch.nn.Parameter(t.clone()) for t in init] for k in cpu_kinds if not k.startswith("emulated")}
    copt = {k: _opt(k, cpu[k], hp) for k in cpu}
    n = sum(t.numel() for t in init)
    mismatched = {f"{c} vs cuda {g}": [] for g in gpu_kinds for c in cpu_kinds
                  if g == "fused" or c not in cuda_fused_only}
    by_kind = {key: [0, 0, 0] for key in mismatched}  # param, exp_avg, exp_avg_sq
    worst = {key: 0.0 for key in mismatched}
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=gen) * (10.0 ** -float(torch.randint(0, 4, (1,), generator=gen)))
                 for s in SHAPES]
        before = {}
        for k in gpu_kinds:
            if step > 1:
                before[k] = [tuple(x.cpu().clone() for x in trio) for trio in _state(gopt[k], gpu[k])]
            for p, gr in zip(gpu[k], grads):
                p.grad = gr.to(dev)
            gopt[k].step()
        torch.cuda.synchronize()
        after = {k: [tuple(x.cpu() for x in trio) for trio in _state(gopt[k], gpu[k])] for k in gpu_kinds}
        for g in gpu_kinds:
            start = before.get(g) or [(t, torch.zeros_like(t), torch.zeros_like(t)) for t in init]
            for c in cpu_kinds:
                if c in cuda_fused_only and g != "fused":
                    continue
                key = f"{c} vs cuda {g}"
                bad, rel = 0, 0.0
                if c == "emulated-fused":
                    for (p0, m0, v0), gr, (p1, m1, v1) in zip(start, grads, after[g]):
                        got = emulate_fused(p0.numpy(), gr.numpy(), m0.numpy(), v0.numpy(), step, hp["lr"],
                                            hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"], hp["decoupled"])
                        for j, (a, b) in enumerate(zip(got, (p1, m1, v1))):
                            b = b.numpy()
                            n_bad = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
                            bad += n_bad
                            by_kind[key][j] += n_bad
                            d = np.abs(a.astype(np.float64) - b) / np.maximum(np.abs(b), 1e-30)
                            rel = max(rel, float(d.max()))
                else:
                    params, opt = cpu[c], copt[c]
                    for p, (p0, m0, v0), gr in zip(params, start, grads):
                        p.data.copy_(p0)
                        p.grad = gr.clone()
                        if step > 1:
                            opt.state[p]["exp_avg"].copy_(m0)
                            opt.state[p]["exp_avg_sq"].copy_(v0)
                            opt.state[p]["step"].fill_(step - 1)
                    opt.step()
                    for (p, m, v), (p1, m1, v1) in zip(_state(opt, params), after[g]):
                        for j, (a, b) in enumerate(((p, p1), (m, m1), (v, v1))):
                            n_bad = int((a.view(torch.int32) != b.view(torch.int32)).sum())
                            bad += n_bad
                            by_kind[key][j] += n_bad
                            rel = max(rel, float(((a.double() - b.double()).abs()
                                                  / b.double().abs().clamp_min(1e-30)).max()))
                mismatched[key].append(bad)
                worst[key] = max(worst[key], rel)
    return {"hyper": hp, "steps": steps, "elements_per_step": 3 * n,
            "rows": [{"pair": k, "mismatched_total": sum(v), "steps_all_exact": sum(b == 0 for b in v),
                      "mismatch_rate": sum(v) / (3 * n * steps), "max_relative": worst[k],
                      "param_exp_avg_exp_avg_sq": by_kind[k]}
                     for k, v in mismatched.items()]}


HYPERS = [
    {"name": "adamw lr 1e-3 wd 0.01", "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
     "weight_decay": 0.01, "decoupled": True},
    {"name": "adamw lr 3e-4 wd 0.1 betas (0.9, 0.95)", "lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
     "weight_decay": 0.1, "decoupled": True},
    {"name": "adam lr 1e-2 wd 1e-4", "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
     "weight_decay": 1e-4, "decoupled": False},
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cuda_numerics: no CUDA device (torch.cuda.is_available() is False)")
    a.out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "cases": []}
    for hp in HYPERS:
        t0 = time.perf_counter()
        r = run(hp, a.steps)
        results["cases"].append(r)
        print(f"{hp['name']} ({time.perf_counter() - t0:.1f} s, {r['elements_per_step']} values a step)")
        for row in r["rows"]:
            print(f"  {row['pair']:40s} mismatched {row['mismatched_total']:>9d} ({row['mismatch_rate']:.2e}; "
                  f"p/m/v {row['param_exp_avg_exp_avg_sq']})  exact steps {row['steps_all_exact']}/{a.steps}",
                  flush=True)
    (a.out / "cuda_numerics.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
