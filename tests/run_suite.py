"""The whole suite as `make test` runs it: the end-to-end tests (tests/e2e) and the unit tests in two
pytest processes at once, so the unit tests use the core the end-to-end tests leave while they wait
on trainers, appliances and namespaces. The end-to-end tests still run one at a time.

    python tests/run_suite.py [PYTEST_ARGS...]

The end-to-end run's output streams live; the unit run's is kept and printed when it ends. The exit
status is the first non-zero of the two (0 when both pass).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(args: list[str]) -> int:
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as unit_log:
        unit = subprocess.Popen([*base, "--ignore=tests/e2e", "tests"], cwd=ROOT, stdout=unit_log,
                                stderr=subprocess.STDOUT, text=True)
        try:
            print("== end-to-end tests (tests/e2e); the unit tests run beside them", flush=True)
            e2e = subprocess.run([*base, "tests/e2e"], cwd=ROOT).returncode
            unit_rc = unit.wait()
        finally:
            if unit.poll() is None:  # interrupted: the unit run goes too
                unit.terminate()
                unit.wait()
        unit_log.seek(0)
        print("\n== unit tests (tests/, without tests/e2e)", flush=True)
        sys.stdout.write(unit_log.read())
    print(f"\n== suite: end-to-end exit {e2e}, unit exit {unit_rc}, {time.monotonic() - start:.0f} s", flush=True)
    return next((rc for rc in (e2e, unit_rc) if rc), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
