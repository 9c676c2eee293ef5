"""The `mirrorckpt` command. Each subcommand lives in its own module and is imported on use,
so `mirrorckpt inspect` does not pay for importing torch."""

from __future__ import annotations

import importlib

import click

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


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        mod, attr, _ = COMMANDS[name]
        try:
            return getattr(importlib.import_module(mod), attr)
        except ModuleNotFoundError as e:
            if e.name == mod:
                return None
            raise

    def format_commands(self, ctx, formatter):
        rows = [(n, COMMANDS[n][2]) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="mirrorckpt")
def main():
    """mirrorckpt: checkpoints from a switch mirror of NCCL ring all-reduce traffic."""


if __name__ == "__main__":
    main()
