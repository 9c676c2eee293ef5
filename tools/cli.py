"""The `mirrorckpt` command. Each subcommand lives in its own module and is imported on use,
so `mirrorckpt inspect` does not pay for importing torch."""

from __future__ import annotations

import errno
import importlib
import os
import sys

# numpy's OpenBLAS starts a thread per core at import, and each spins about 0.1 s waiting for work
# that the appliance never gives it (no command multiplies matrices: torch has threads of its own).
# On two cores that was a third of a short replay's CPU time (0.43 -> 0.29 s user). Before numpy
# is imported; an operator's own setting stands.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402
from mirrorckpt.tools.cliutil import json_error  # noqa: E402

# name -> (module, attribute, one-line help)
COMMANDS = {
    "inspect": ("mirrorckpt.tools.cmd_inspect", "inspect",
                "Decode a capture: RoCE packets, RDMA messages, NCCL sends."),
    "doctor": ("mirrorckpt.tools.cmd_doctor", "doctor",
               "What NCCL traffic captures hold; what to change when the appliance cannot follow it."),
    "replay": ("mirrorckpt.tools.cmd_replay", "replay", "Replay mirror captures through the whole pipeline."),
    "gen": ("mirrorckpt.tools.cmd_gen", "gen", "Generate NCCL ring all-reduce RoCEv2 traffic of a real training job."),
    "restore": ("mirrorckpt.tools.cmd_restore", "restore", "Verify or load a committed checkpoint."),
    "serve": ("mirrorckpt.tools.cmd_serve", "serve", "Run the appliance on live mirror ports."),
    "status": ("mirrorckpt.tools.cmd_status", "status", "Show the state of a running appliance."),
    "bench": ("mirrorckpt.tools.cmd_bench", "bench", "Run the benchmarks and write BENCHMARKS.md."),
    "plan": ("mirrorckpt.tools.cmd_plan", "plan", "Checkpoint interval and expected goodput per strategy."),
    "record": ("mirrorckpt.tools.record.command", "record",
               "Record real NCCL traffic of a DDP-shaped job on a GPU machine, with its truth, and check replay."),
}
# commands whose modules the wheel does not ship: the packages they need
SOURCE_ONLY = {"record": ("mirrorckpt.tools.record", "mirrorckpt.tools.testbed")}


class LazyGroup(click.Group):
    """Subcommands imported on use; every error, a usage error included, ends as one ``error:``
    line and a non-zero exit (with ``--json``, also ``{"error": ...}`` on stdout), never a traceback
    (see tools.cliutil)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # `mirrorckpt` alone: its help, as click shows it
            if not standalone_mode:
                raise
            e.show()
            code = e.exit_code
        except click.ClickException as e:
            if not standalone_mode:
                raise
            code = _report(e.format_message() + _usage_hint(e), "--json" in args, e.exit_code)
        except click.Abort:
            if not standalone_mode:
                raise
            code = _report("interrupted", "--json" in args, 130)
        except OSError as e:  # a file or socket the command was pointed at: said, not a traceback
            if not standalone_mode:
                raise
            if e.errno == errno.EPIPE:  # the reader of stdout went away (`| head`)
                sys.exit(1)
            where = f"{e.filename}: " if e.filename else ""
            code = _report(f"{where}{e.strerror or e}", "--json" in args, 1)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        mod, attr, _ = COMMANDS[name]
        try:
            return getattr(importlib.import_module(mod), attr)
        except ModuleNotFoundError as e:
            if name in SOURCE_ONLY and (e.name or "").startswith(SOURCE_ONLY[name]):
                raise click.ClickException(f"{name} runs from a source checkout: the wheel ships neither "
                                           "tools/record nor the rigs it drives (tools/testbed)") from None
            if e.name == mod:
                return None
            raise

    def format_commands(self, ctx, formatter):
        rows = [(n, COMMANDS[n][2]) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _usage_hint(e: click.ClickException) -> str:
    ctx = getattr(e, "ctx", None)
    return f" (see `{ctx.command_path} --help`)" if isinstance(e, click.UsageError) and ctx is not None else ""


def _report(message: str, as_json: bool, code: int) -> int:
    if as_json:
        click.echo(json_error(message))
    click.echo(f"error: {message}", err=True)
    return code


@click.group(cls=LazyGroup)
@click.version_option(package_name="mirrorckpt")
def main():
    """mirrorckpt: checkpoints from a switch mirror of NCCL ring all-reduce traffic."""


if __name__ == "__main__":
    main()
