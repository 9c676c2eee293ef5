"""The whole suite as `make test` runs it, in two pytest processes at once: the end-to-end tests
that start trainers, appliances or namespaces (marked ``serial`` by conftest), one at a time; and
beside them the unit tests and the end-to-end tests on capture files (``offline``), which use the
core the others leave while they wait. Tests marked ``alone`` (wall times compared with a model) run
last, with nothing beside them.

    python tests/run_suite.py [PYTEST_ARGS...]

The end-to-end run's output streams live; the unit run's is kept and printed when it ends. The exit
status is the first non-zero of the three (0 when all pass).
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
        unit = subprocess.Popen([*base, "-m", "not serial and not alone", "tests"], cwd=ROOT, stdout=unit_log,
                                stderr=subprocess.STDOUT, text=True)
        try:
            print("== end-to-end tests with processes (serial); the others run beside them", flush=True)
            e2e = subprocess.run([*base, "-m", "serial and not alone", "tests"], cwd=ROOT).returncode
            unit_rc = unit.wait()
        finally:
            if unit.poll() is None:  # interrupted: the unit run goes too
                unit.terminate()
                unit.wait()
        unit_log.seek(0)
        print("\n== unit tests and end-to-end tests on capture files (not serial)", flush=True)
        sys.stdout.write(unit_log.read())
    print("\n== tests that measure wall time (alone)", flush=True)
    alone = subprocess.run([*base, "-m", "alone", "tests"], cwd=ROOT).returncode
    print(f"\n== suite: serial exit {e2e}, the rest exit {unit_rc}, alone exit {alone}, "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return next((rc for rc in (e2e, unit_rc, alone) if rc), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
