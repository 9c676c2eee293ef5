"""Compiled kernels of the hot path: every `*.pyx` under the stage folders becomes an extension
`mirrorckpt.<folder>.<name>`. Everything else is declared in pyproject.toml."""
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

here = Path(__file__).parent
ext = [
    Extension(f"mirrorckpt.{p.parent.name}.{p.stem}", [str(p.relative_to(here))],
              include_dirs=[numpy.get_include()], libraries=["z"], extra_compile_args=["-O3"])
    for folder in ("capture", "parser", "updater")
    for p in sorted((here / folder).glob("*.pyx"))
]

setup(ext_modules=cythonize(ext, language_level=3, quiet=True,
                            compiler_directives={"boundscheck": False, "wraparound": False,
                                                 "initializedcheck": False, "cdivision": True}))
