"""`mirrorckpt restore CHECKPOINT_DIR`: check a committed checkpoint (or a root's latest one).

Without --verify only the manifest and file sizes are checked; --verify hashes every file and reads
every tensor back through dcp.load. Exit status 1 on any failure, with the reason on stderr (or in
the JSON), never a traceback."""

from __future__ import annotations

import json
import sys

import click


def _fail(msg: str, as_json: bool, path: str) -> None:
    if as_json:
        click.echo(json.dumps({"path": path, "ok": False, "problems": [msg]}, indent=1))
    else:
        click.echo(f"mirrorckpt restore: {msg}", err=True)
    sys.exit(1)


@click.command("restore")
@click.argument("checkpoint_dir", type=click.Path())
@click.option("--verify", "do_verify", is_flag=True, help="Hash every file and read back every tensor.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def restore(checkpoint_dir: str, do_verify: bool, as_json: bool) -> None:
    """Verify or inspect a committed checkpoint. CHECKPOINT_DIR is a step-* directory or a checkpoint
    root (its latest committed checkpoint is used)."""
    try:
        from mirrorckpt.updater.restore import resolve, summarize, verify

        d = resolve(checkpoint_dir)
        report = verify(d) if do_verify else summarize(d)
    except Exception as e:  # the command reports, it does not crash
        msg = str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
        _fail(msg, as_json, checkpoint_dir)
        return
    if as_json:
        click.echo(json.dumps(dict(report.to_dict(), verified=do_verify), indent=1))
    else:
        click.echo(f"checkpoint  {report.path}")
        if report.step is not None:
            click.echo(f"step        {report.step} iterations, {report.optimizer_step} optimizer steps")
        click.echo(f"contents    {report.files} files, {report.bytes:,} bytes, {report.tensors} tensors")
        if report.ok:
            click.echo("verified    every file and tensor sha256 matches" if do_verify
                       else "checked     manifest and file sizes (use --verify to hash the data)")
        for p in report.problems:
            click.echo(f"mirrorckpt restore: {p}", err=True)
    if not report.ok:
        sys.exit(1)
