"""Built-in models of the generator, their synthetic data shards and their losses.

A model is named by a spec string:

* ``linear:N``  -- exactly ``nn.Linear(N, 1, bias=False)`` (``linear:5000`` with seed 2024 has the
  initial weights of the real capture ``iter_40000_p2p_iter10``);
* ``mlp:IN,H,...,OUT`` -- Linear layers with ReLU between them, as an ``nn.Sequential``;
* ``gpt:layers=L,d=D,heads=H,vocab=V,ctx=C`` -- a small pre-LN GPT decoder.

No model registers a buffer: DDP would broadcast buffers before every forward, which is traffic
the real jobs we imitate do not have. The GPT computes its causal mask on the fly for that reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GPT_KEYS = ("layers", "d", "heads", "vocab", "ctx")


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "linear", "mlp" or "gpt"
    dims: tuple[int, ...] = ()  # linear: (N,); mlp: (IN, H, ..., OUT)
    gpt: dict = field(default_factory=dict)  # gpt: layers, d, heads, vocab, ctx

    @property
    def text(self) -> str:
        if self.kind == "gpt":
            return "gpt:" + ",".join(f"{k}={self.gpt[k]}" for k in GPT_KEYS)
        return f"{self.kind}:" + ",".join(str(n) for n in self.dims)


def parse_spec(spec: str | ModelSpec) -> ModelSpec:
    if isinstance(spec, ModelSpec):
        return spec
    kind, _, rest = spec.partition(":")
    try:
        if kind == "linear":
            dims = (int(rest),)
        elif kind == "mlp":
            dims = tuple(int(x) for x in rest.split(","))
            if len(dims) < 2:
                raise ValueError("an mlp needs at least IN and OUT")
        elif kind == "gpt":
            kv = dict(item.split("=", 1) for item in rest.split(","))
            if sorted(kv) != sorted(GPT_KEYS):
                raise ValueError(f"gpt needs exactly the keys {', '.join(GPT_KEYS)}")
            g = {k: int(kv[k]) for k in GPT_KEYS}
            if g["d"] % g["heads"]:
                raise ValueError(f"d={g['d']} is not a multiple of heads={g['heads']}")
            return ModelSpec("gpt", (), g)
        else:
            raise ValueError(f"unknown model kind {kind!r} (known: linear, mlp, gpt)")
    except ValueError as e:
        raise ValueError(f"model spec {spec!r}: {e}") from None
    if any(n < 1 for n in dims):
        raise ValueError(f"model spec {spec!r}: sizes must be positive")
    return ModelSpec(kind, dims)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        # Built per call, never registered: a buffer would be broadcast by DDP every iteration.
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, vocab: int, ctx: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(spec: str | ModelSpec, seed: int) -> nn.Module:
    """The model in float32, its initial weights drawn right after ``torch.manual_seed(seed)``."""
    s = parse_spec(spec)
    torch.manual_seed(seed)
    if s.kind == "linear":
        return nn.Linear(s.dims[0], 1, bias=False)
    if s.kind == "mlp":
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(s.dims, s.dims[1:])):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(a, b))
        return nn.Sequential(*layers)
    return GPT(**s.gpt)


def shard_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A generator of its own for each (seed, rank, step): every rank reads a different shard,
    and a step's batch does not depend on how many batches were drawn before."""
    state = np.random.SeedSequence([seed, rank, step]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def make_batch(spec: str | ModelSpec, seed: int, rank: int, step: int, batch_size: int,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``rank`` at 0-based ``step``; float inputs in the model's ``dtype``."""
    s = parse_spec(spec)
    g = shard_generator(seed, rank, step)
    if s.kind == "gpt":
        tokens = torch.randint(0, s.gpt["vocab"], (batch_size, s.gpt["ctx"] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(batch_size, s.dims[0], generator=g)
    y = torch.randn(batch_size, 1 if s.kind == "linear" else s.dims[-1], generator=g)
    return x.to(dtype), y.to(dtype)


def compute_loss(spec: str | ModelSpec, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error for linear and mlp, next-token cross entropy for gpt."""
    if parse_spec(spec).kind == "gpt":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)
