"""`mirrorckpt restore CHECKPOINT_DIR`: check a committed checkpoint, or choose one in a root.

Without --verify only the manifest and file sizes are checked; --verify hashes every file and reads
every tensor back through dcp.load. From a root it gives the newest checkpoint proven equal to the
trainer, else the newest intact one (--newest: the newest intact one), says which and why, and
reports every problem it met: a torn or dangling `latest`, a damaged or uncommitted checkpoint.
Exit status 1 when nothing can be given, or when a newer checkpoint than the one given is named
but damaged or missing; the reasons are `error:` lines on stderr (and, with --json, the report's
"problems" and "error"), never a traceback. --verify shows its progress on a terminal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from mirrorckpt.tools.progress import Progress


def _fail(msg: str, as_json: bool, path: str) -> None:
    if as_json:
        click.echo(json.dumps({"path": path, "ok": False, "problems": [msg], "error": msg}, indent=1))
    click.echo(f"error: {msg}", err=True)
    sys.exit(1)


class _Bar:
    """``verify``'s progress on one bar per checkpoint hashed and read back (a terminal only)."""

    def __init__(self):
        self.bar, self.path = None, None

    def __call__(self, path, done: int, total: int) -> None:
        if path != self.path:
            self.close()
            self.path = path
            self.bar = Progress(f"[verify] {Path(path).name}", total=total / 1e6, unit="MB")
        self.bar.set(done / 1e6)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@click.command("restore")
@click.argument("checkpoint_dir", type=click.Path())
@click.option("--verify", "do_verify", is_flag=True, help="Hash every file and read back every tensor.")
@click.option("--newest", is_flag=True, help="From a root: the newest intact checkpoint, verified against the "
              "trainer or not.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def restore(checkpoint_dir: str, do_verify: bool, newest: bool, as_json: bool) -> None:
    """Verify or inspect a committed checkpoint. CHECKPOINT_DIR is a step-* directory or a checkpoint
    root (the checkpoint to resume from is chosen, and the choice explained)."""
    sel = None
    bar = _Bar()
    try:
        from mirrorckpt.updater.restore import WEIGHTS_ONLY, _is_checkpoint, select, summarize, verify

        path = Path(checkpoint_dir)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such directory")
        if not path.is_dir():
            raise NotADirectoryError(f"{path}: not a directory (a step-* checkpoint or a checkpoint root)")
        if _is_checkpoint(path):
            report = verify(path, progress=bar) if do_verify else summarize(path)
        else:
            sel = select(path, verify_data=do_verify, prefer_verified=not newest, check_newer=True, progress=bar)
            report = sel.report
    except Exception as e:  # the command reports, it does not crash
        msg = str(e) if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {e}"
        _fail(msg, as_json, checkpoint_dir)
        return
    finally:
        bar.close()
    problems = list(report.problems if report is not None else [])
    if sel is not None:
        problems = sel.problems + [p for p in problems if p not in sel.problems]
        if sel.path is None:
            problems.append(f"{sel.root}: {sel.reason}")
    failed = (report is None or not report.ok) or (sel is not None and sel.short)
    if as_json:
        out = dict(report.to_dict() if report is not None else {"path": None}, verified=do_verify,
                   ok=not failed, problems=problems)
        if failed:
            out["error"] = problems[0] if problems else "no checkpoint can be given"
        if sel is not None:
            out.update(root=sel.root, reason=sel.reason, notes=sel.notes, newest=sel.newest)
        click.echo(json.dumps(out, indent=1))
    else:
        if report is not None:
            click.echo(f"checkpoint  {report.path}")
        if sel is not None:
            click.echo(f"chosen      {sel.reason}")
            if sel.pointer_torn and sel.path is not None:
                click.echo(f"NOT PROVEN  `latest` is unreadable: step {sel.step} is the newest intact one here")
            elif sel.short and sel.path is not None:
                click.echo(f"NOT NEWEST  step {sel.newest} is named in this root but cannot be given; "
                           f"step {sel.step} is the newest intact one")
        if report is not None:
            if report.step is not None:
                click.echo(f"step        {report.step} iterations, {report.optimizer_step} optimizer steps")
            if report.weights_only:
                click.echo(f"kind        WEIGHTS ONLY: {WEIGHTS_ONLY}")
            click.echo(f"contents    {report.files} files, {report.bytes:,} bytes, {report.tensors} tensors")
            if report.ok:
                click.echo("verified    every file and tensor sha256 matches" if do_verify
                           else "checked     manifest and file sizes (use --verify to hash the data)")
        for n in sel.notes if sel is not None else []:
            click.echo(f"note        {n}")
        for p in problems:
            click.echo(f"error: {p}", err=True)
    if failed:
        sys.exit(1)
