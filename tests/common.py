"""Paths and loaders shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FLOWCHECK = SHARED / "captures" / "flowcheck"
PCAPS = REPO / "tests" / "pcaps"


def flowcheck_truth() -> dict:
    return json.loads((FLOWCHECK / "truth.json").read_text())["captures"]


def flowcheck_captures() -> list[str]:
    return sorted(flowcheck_truth())


def wait_for(cond, timeout: float, poll: float = 0.01) -> bool:
    """Polls ``cond`` until it holds or ``timeout`` seconds passed; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll)
    return cond()


def collect(js):
    """A job stream's typed items, sorted: (finished collectives, iterations, initial weights or None)."""
    from mirrorckpt.parser.concat import CollectiveResult
    from mirrorckpt.parser.iteration import InitialWeights, ReducedIteration

    results, iterations, weights = [], [], None
    for item in js:
        if isinstance(item, CollectiveResult):
            results.append(item)
        elif isinstance(item, ReducedIteration):
            iterations.append(item)
        elif isinstance(item, InitialWeights):
            weights = item
    return results, iterations, weights


def make_certs(d: Path) -> dict[str, Path]:
    """A test CA, an appliance certificate (localhost, 127.0.0.1) and a trainer certificate signed
    by it, and a self-signed "rogue" one, with the openssl CLI (tools/install-system-deps.sh)."""
    import subprocess

    d = Path(d)

    def run(*args):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-keyout", d / "ca.key", "-out", d / "ca.pem", "-days", 2,
        "-subj", "/CN=mirrorckpt test CA")
    run("req", "-x509", *key, "-keyout", d / "rogue.key", "-out", d / "rogue.pem", "-days", 2, "-subj", "/CN=trainer")
    out = {"ca": d / "ca.pem", "rogue_cert": d / "rogue.pem", "rogue_key": d / "rogue.key"}
    for who, ext in (("appliance", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                     ("trainer", "extendedKeyUsage=clientAuth")):
        (d / f"{who}.ext").write_text(ext + "\n")
        run("req", *key, "-keyout", d / f"{who}.key", "-out", d / f"{who}.csr", "-subj", f"/CN={who}")
        run("x509", "-req", "-in", d / f"{who}.csr", "-CA", d / "ca.pem", "-CAkey", d / "ca.key", "-CAcreateserial",
            "-out", d / f"{who}.pem", "-days", 2, "-extfile", d / f"{who}.ext")
        out[f"{who}_cert"], out[f"{who}_key"] = d / f"{who}.pem", d / f"{who}.key"
    return out
