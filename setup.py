"""Compiled kernels of the hot path: every `*.pyx` under the stage folders becomes an extension
`mirrorckpt.<folder>.<name>`. Everything else is declared in pyproject.toml.

The ICRC (parser/roce/_fast.pyx) uses ISA-L's CRC-32 when its header is installed (Debian libisal-dev),
zlib's otherwise; MIRRORCKPT_ICRC=zlib forces zlib (to measure the difference). `python3 setup.py
--icrc` prints which of the two a build here would link ("isa-l" or "zlib") with no build
dependency imported: the Makefile rebuilds when that changes (libisal-dev installed later)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent


def isal_include_dirs() -> list[str] | None:
    """Include dirs for ISA-L's isa-l/crc.h, or None when it is not installed (or not wanted)."""
    if os.environ.get("MIRRORCKPT_ICRC", "").lower() == "zlib":
        return None
    dirs = ["/usr/include", "/usr/local/include"]
    if shutil.which("pkg-config"):
        r = subprocess.run(["pkg-config", "--cflags-only-I", "libisal"], capture_output=True, text=True)
        if r.returncode == 0:
            dirs = [f[2:] for f in r.stdout.split() if f.startswith("-I")] + dirs
    return [d for d in dirs if (Path(d) / "isa-l" / "crc.h").is_file()][:1] or None


if __name__ == "__main__" and sys.argv[1:] == ["--icrc"]:
    print("isa-l" if isal_include_dirs() else "zlib")
    sys.exit(0)

import numpy  # noqa: E402  (build dependencies: not needed to answer --icrc)
from Cython.Build import cythonize  # noqa: E402
from setuptools import Extension, setup  # noqa: E402
from setuptools.command.build_py import build_py  # noqa: E402

isal = isal_include_dirs()
print(f"mirrorckpt: ICRC through {'ISA-L' if isal else 'zlib (slow: install libisal-dev)'}")


def extension(p: Path) -> Extension:
    rel = p.relative_to(here)
    e = Extension(".".join(("mirrorckpt", *rel.parent.parts, p.stem)), [str(rel)],
                  include_dirs=[numpy.get_include()], extra_compile_args=["-O3"])
    if rel.with_suffix("") == Path("parser/roce/_fast"):  # the ICRC
        e.include_dirs += isal or []
        e.libraries = ["isal"] if isal else ["z"]
        e.define_macros = [("MIRRORCKPT_ISAL", "1")] if isal else []
    return e


class BuildPy(build_py):
    """The repository root is the package: everything in it but this file (mirrorckpt.setup would
    run the build when imported)."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] != ("mirrorckpt", "setup")]


ext = [extension(p) for folder in ("capture", "parser", "updater") for p in sorted((here / folder).rglob("*.pyx"))]

setup(cmdclass={"build_py": BuildPy},
      ext_modules=cythonize(ext, language_level=3, quiet=True,
                            compiler_directives={"boundscheck": False, "wraparound": False,
                                                 "initializedcheck": False, "cdivision": True}))
