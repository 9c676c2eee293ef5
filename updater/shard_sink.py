"""A sharded optimizer's ring, cut to the one replica shard it keeps.

A ring's job stream (``parser.collectives.JobModel.sharded``) yields what its communicator
carries: all-reduce buffers laid out and padded by the framework (``config.shards.DpGroup.wire``:
FSDP2 pads every parameter's dim-0 shard, ZeRO's buckets hold every partition's slices), and, where
the ring's start-up broadcasts carry them (DeepSpeed), the whole model's initial weights.
``ShardSink`` hands its inner sink (an ``Appliance`` of ``DpGroup.job_layout``) only the group's
slices: each complete iteration's buckets with the padding and the other groups' slices left out
(never stepped), the initial weights cut to the group's slices. ``seed_weights`` reads the slices
of a seed checkpoint (torchtitan's: the model at step 0 as DCP ``model.<fqn>`` keys) for rings
whose communicator carries no weights at start (FSDP2 broadcasts nothing).

With global-norm clipping and every shard's ring in this process, each iteration's coefficient
comes from a ``shard_clip.NormExchange`` (the shards' norms summed as the trainer sums them) and
reaches the replica as the trainer's own coefficient would (``meta["clip"]``).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.shards import PAD, DpGroup, Shard, ShardedLayout
from mirrorckpt.parser.iteration import GatheredWeights, InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.updater.replica import wire_tensor
from mirrorckpt.updater.shard_clip import NormExchange, local_norm

log = logging.getLogger("mirrorckpt.shards")


def kept_ranges(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, stop) element ranges of a padded buffer that hold the group's slices, in order
    (adjacent slices as one range)."""
    out: list[tuple[int, int]] = []
    pos = 0
    for i, n in segments:
        if i != PAD:
            if out and out[-1][1] == pos:
                out[-1] = (out[-1][0], pos + n)
            else:
                out.append((pos, pos + n))
        pos += n
    return out


def group_slice(s: Shard, whole):
    """Slice ``s`` of a whole parameter (numpy array or tensor of the global shape), in the shape
    the group holds it (a block, or a flat range of one)."""
    block = whole[tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))]
    return block if s.flat is None else block.reshape(-1)[s.flat[0]:s.flat[1]]


def group_slices(group: DpGroup, params: dict[str, np.ndarray]) -> np.ndarray:
    """The group's slices, flat and in its order, of whole parameters (FQN -> array of the global
    shape)."""
    out = [np.ascontiguousarray(group_slice(s, params[s.fqn])).reshape(-1) for s in group.shards]
    return np.concatenate(out) if out else np.empty(0, np.float32)


def seed_weights(seed, layout: ShardedLayout, group: str, grad_dtype: str = "float32") -> InitialWeights:
    """The group's slices of a seed checkpoint (a DCP directory of ``model.<fqn>`` tensors)."""
    from mirrorckpt.updater.ckptdir import dcp_module

    dcp = dcp_module()
    g = layout.group(group)
    d = Path(seed)
    try:
        md = dcp.FileSystemReader(str(d)).read_metadata()
    except Exception as e:  # DCP raises whatever its reader met: name the directory
        raise ValueError(f"seed checkpoint {d}: not a readable DCP checkpoint ({type(e).__name__}: {e})") from None
    want = {p.name: p for p in layout.params if any(s.fqn == p.name for s in g.shards)}
    sd = {}
    for fqn, p in want.items():
        m = md.state_dict_metadata.get(f"model.{fqn}")
        if m is None or tuple(m.size) != tuple(p.shape):
            what = "missing" if m is None else f"of shape {list(m.size)}, the layout's {list(p.shape)}"
            raise ValueError(f"seed checkpoint {d}: model.{fqn} {what}")
        sd[f"model.{fqn}"] = torch.empty(p.shape, dtype=torch.float32)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)
    flat = group_slices(g, {fqn: sd[f"model.{fqn}"].numpy() for fqn in want})
    return InitialWeights(g.job_layout(grad_dtype), flat)


class ShardSink:
    """The sink of the ring of ``group``: see the module text. ``clip``: the process's norm
    exchange when the job clips by the global norm (None: no clipping, or the trainer reports it)."""

    def __init__(self, layout: ShardedLayout, group: str, inner, clip: NormExchange | None = None,
                 grad_dtype: str = "float32"):
        self.shards, self.group = layout, layout.group(group)
        self.layout: JobLayout = self.group.job_layout(grad_dtype)
        self.inner = inner
        self.clip = clip
        self.keep = [kept_ranges(segments) for segments in self.group.wire]
        self.whole = [ranges == [(0, n)] for ranges, n in zip(self.keep, self.group.wire_numel())]

    def _unpad(self, b: int, values: np.ndarray) -> np.ndarray:
        if self.whole[b]:
            return values
        return np.concatenate([values[a:z] for a, z in self.keep[b]])

    def initial_weights(self, w: InitialWeights) -> None:
        if w.layout.params != self.shards.params:  # already the group's (a seed checkpoint's slices)
            self.inner.initial_weights(w)
            return
        params, pos = {}, 0
        for p in w.layout.params:
            params[p.name] = np.asarray(w.values[pos:pos + p.numel]).reshape(p.shape)
            pos += p.numel
        self.inner.initial_weights(InitialWeights(self.layout, group_slices(self.group, params)))

    def bucket(self, b: ReducedBucket) -> None:
        if self.clip is None:  # with a global norm no bucket can be stepped ahead of the others' norms
            self.inner.bucket(ReducedBucket(b.iteration, b.bucket, self._unpad(b.bucket, b.values)))

    def apply(self, it: ReducedIteration) -> None:
        buckets = [self._unpad(b, v) for b, v in enumerate(it.buckets)] if it.complete else []
        it = dataclasses.replace(it, buckets=buckets)
        if self.clip is not None:
            it = self._clipped(it)
        self.inner.apply(it)

    def _clipped(self, it: ReducedIteration) -> ReducedIteration:
        norm = None
        if it.complete and len(it.buckets) == len(self.layout.buckets):
            grads: list[torch.Tensor | None] = [None] * len(self.layout.params)
            for spec, flat in zip(self.layout.bucket_list(it.layout_index), it.buckets):
                t = wire_tensor(flat, self.layout.grad_dtype)
                for i, a, z in self.layout.bucket_slices(spec):
                    grads[i] = t[a:z]
            norm = local_norm(grads, self.clip.norm_type)
        coef = self.clip.coefficient(self.group.name, it.index, norm)
        if coef is None:
            if it.complete:
                log.warning("iteration %d of ring %s: another shard's ring has no gradient norm for it, so the "
                            "global norm is unknown and no shard can step it exactly", it.index, self.group.name)
            return dataclasses.replace(it, complete=False, buckets=[])
        return dataclasses.replace(it, meta=dict(it.meta, clip={"coef": float(coef)}))

    def weights(self, g: GatheredWeights) -> None:
        """The ring's parameter all-gathers (ZeRO's): the replica holds the masters themselves."""

    def ended(self) -> None:
        """The ring's stream ended: the other rings no longer wait for its norms."""
        if self.clip is not None:
            self.clip.ended(self.group.name)
