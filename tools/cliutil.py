"""What every `mirrorckpt` command shares: parameter types that check a value where it is parsed,
and one way an error reaches the user.

An error is an ``error: ...`` line on stderr and a non-zero exit, never a traceback. A command run
with ``--json`` also prints exactly one JSON object on stdout: its report, or ``{"error": ...}``
when it failed before it had one (``tools.cli.Main`` does that for every ``CliError`` and usage
error).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import NoReturn

import click


class CliError(click.ClickException):
    """An error the user can act on; ``exit_code`` is the command's documented code."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def fail(message: str, exit_code: int = 2) -> NoReturn:
    raise CliError(message, exit_code)


def json_error(message: str) -> str:
    return json.dumps({"error": message}, indent=1)


class Number(click.FloatRange):
    """A float range that refuses nan (click's ranges let it through: it compares false) and, unless
    ``inf_ok``, infinity."""

    def __init__(self, *args, inf_ok: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.inf_ok = inf_ok

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number is not None and (math.isnan(number) or (math.isinf(number) and not self.inf_ok)):
            self.fail(f"{value!r} is not a {'number' if self.inf_ok else 'finite number'}", param, ctx)
        return number


class NcclVersion(click.ParamType):
    """An NCCL release the appliance describes (2.12 .. 2.30, as ``2.18`` or ``2.18.6``); the text as given."""

    name = "version"

    def convert(self, value, param, ctx):
        if value is None:
            return None
        problem = _version_problem(value)
        if problem:
            self.fail(problem, param, ctx)
        return str(value).strip()


def _version_problem(text) -> str | None:
    from mirrorckpt.parser.roce import nccl_versions  # numpy: not for commands that take no release

    try:
        nccl_versions.version(str(text))
    except ValueError as e:
        return str(e)
    return None


def check_nccl_version(text: str | None, where: str) -> None:
    """A release read from a job file, checked as the option is (``where`` names the file and key)."""
    problem = _version_problem(text) if text is not None else None
    if problem:
        fail(f"{where}: {problem}")


class Pace(click.ParamType):
    """``recorded`` (the capture's own timing) or a positive rate in Gbit/s."""

    name = "recorded|GBIT/S"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float) or value == "recorded":
            return value
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if not rate > 0 or rate == float("inf"):
            self.fail(f"{value!r}: expected 'recorded' or a rate in Gbit/s above 0 (e.g. 10)", param, ctx)
        return rate


def unwritable_dir(path: str | os.PathLike, what: str) -> str | None:
    """Why ``path`` cannot be a directory this command writes into (it is created when missing), or
    None. A file is made and removed there: permission bits alone say nothing to root."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".mirrorckpt-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{what} {path}: cannot write there ({e.strerror or e})"
    return None


def writable_dir(path: str | os.PathLike, what: str) -> None:
    problem = unwritable_dir(path, what)
    if problem:
        fail(problem)
