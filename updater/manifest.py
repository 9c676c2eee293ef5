"""The checkpoint manifest: sha256 of every file, of every stored item's byte range and of every
tensor's values, written last (and fsync'd) so its presence marks a complete directory.

manifest.json fields:
    format            "mirrorckpt-manifest/1"
    step              training-loop iterations applied (the directory's number)
    optimizer_step    optimizer steps taken
    created_unix      wall-clock time of the commit
    torch_version     torch that wrote the DCP files
    layout, training  the job's layout and training spec (dicts), for the required-key check
    files             {name: {size, sha256}} for every file in the directory but the manifest
    items             {dcp key: {file, offset, length, sha256}} byte range of each stored value,
                      so a damaged file can be traced to the value it holds without unpickling
    tensors           {dcp key: {sha256, dtype, shape}}; sha256 of the tensor's little-endian
                      bytes (bf16 as its 16-bit patterns, as updater.fingerprint.tensor_bytes)
    job               the job's name, when it has one
    verified          absent, or {step, source, fingerprints, unix, match, distance, ...}: the
                      state was proven equal to the trainer's (its per-tensor fingerprints,
                      updater.fingerprint, at this step): ``match`` "exact" (bit for bit) or
                      "tolerance" (a trainer whose arithmetic differs: ``distance`` measured,
                      ``tolerance`` allowed, ``steps_since_exact``, ``largest`` per tensor; see
                      updater.numeric); added after the commit by an atomic rewrite of the manifest
    manifest_sha256   sha256 of the canonical JSON of all the other fields
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

MANIFEST = "manifest.json"
MANIFEST_TMP = ".manifest.json.tmp"  # a rewrite under way; a crash may leave it, it is never read
FORMAT = "mirrorckpt-manifest/1"
_CHUNK = 8 << 20


class ManifestError(ValueError):
    """The manifest is missing, unreadable or inconsistent; the message names the checkpoint."""


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes as stored, hashed in place (no bytes copy)."""
    t = t.detach().cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = t.numpy().reshape(-1).view(np.uint8)
    return hashlib.sha256(memoryview(a)).hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def hash_file(path: Path, ranges: list[tuple[str, int, int]] = (), progress=None) -> tuple[int, str, dict[str, str]]:
    """(size, sha256, {key: sha256 of its byte range}) in one sequential read. Ranges must not overlap.
    ``progress(nbytes)`` is called after each chunk read."""
    whole = hashlib.sha256()
    todo = sorted(ranges, key=lambda r: r[1])
    parts = {k: hashlib.sha256() for k, _, _ in todo}
    pos = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            buf = f.read(_CHUNK)
            if not buf:
                break
            mv = memoryview(buf)
            whole.update(mv)
            end = pos + len(buf)
            for k, off, n in todo:
                if off >= end:
                    break
                a, z = max(off, pos), min(off + n, end)
                if a < z:
                    parts[k].update(mv[a - pos:z - pos])
            todo = [r for r in todo if r[1] + r[2] > end]
            pos = end
            if progress is not None:
                progress(len(buf))
    return pos, whole.hexdigest(), {k: h.hexdigest() for k, h in parts.items()}


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, manifest: dict) -> None:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    body["format"] = FORMAT
    body["manifest_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    fsync_write(Path(directory) / MANIFEST, json.dumps(body, sort_keys=True, indent=1).encode())


def set_verified(directory, info: dict) -> None:
    """Record ``info`` as the manifest's ``verified`` field: temp file, fsync, rename over the old
    manifest, fsync the directory. Every moment the directory holds one valid manifest."""
    d = Path(directory)
    m = read_manifest(d)
    m["verified"] = info
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    body["manifest_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    fsync_write(d / MANIFEST_TMP, json.dumps(body, sort_keys=True, indent=1).encode())
    os.replace(d / MANIFEST_TMP, d / MANIFEST)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{directory}: no {MANIFEST} (not a committed checkpoint)") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read: {e.strerror}") from None
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise ManifestError(f"{path}: format is {got!r}, expected {FORMAT!r}")
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    if hashlib.sha256(_canonical(body)).hexdigest() != m.get("manifest_sha256"):
        raise ManifestError(f"{path}: manifest_sha256 does not match its contents")
    for key in ("step", "files", "items", "tensors"):
        if key not in m:
            raise ManifestError(f"{path}: field {key!r} missing")
    return m


def quick_check(directory) -> str | None:
    """Cheap commit check (no data hashing): manifest valid and every listed file present with its
    size. Returns the first problem, or None."""
    try:
        m = read_manifest(directory)
    except ManifestError as e:
        return str(e)
    for name, info in m["files"].items():
        p = Path(directory) / name
        try:
            size = p.stat().st_size
        except OSError:
            return f"{p}: listed in the manifest but missing"
        if size != info.get("size"):
            return f"{p}: {size} bytes, manifest says {info.get('size')}"
    return None
