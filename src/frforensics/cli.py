"""``fr-analyze``: the command line. Thin: parse, call the library, render.

``analyze`` is the default command, so ``fr-analyze PATH...`` and
``fr-analyze analyze PATH...`` are the same. Errors become exit codes here and
nowhere else: 0 no error finding, 1 at least one, 2 usage error or nothing
readable, 3 an internal error (a bug: set ``FRFORENSICS_DEBUG=1`` for the
traceback).
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from frforensics import __version__
from frforensics.errors import FrForensicsError, UsageError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Name the rank that hung a PyTorch distributed job, from its flight-recorder dumps.",
)

SUBCOMMANDS = ("analyze", "convert", "timeline")


class Format(str, Enum):
    text = "text"
    json = "json"
    markdown = "markdown"
    html = "html"
    junit = "junit"


def _stderr(message: str) -> None:
    print(f"fr-analyze: {message}", file=sys.stderr)


def _write(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")


@app.command()
def analyze(
    paths: Annotated[list[Path], typer.Argument(help="Dump files, directories or .tar.gz/.zip archives.")],
    fmt: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.text,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    output_dir: Annotated[Path | None, typer.Option(
        "--output-dir", help="Write every format (and the timeline) into this folder, for CI.")] = None,
    world_size: Annotated[int | None, typer.Option(
        "--world-size", min=1, help="The job's world size (native dumps do not record it).")] = None,
    prefix: Annotated[str | None, typer.Option(
        "--prefix", "-p", help="Only files named <prefix><rank> (e.g. nccl_trace_rank_).")] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, help="Decode with this many processes (default: all cores).")] = None,
    hang_after: Annotated[float, typer.Option(
        "--hang-after", min=0.0, help="Ops unfinished for less than this many seconds at dump "
        "time count as in flight, not hung.")] = 1.0,
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", help="Progress bar on a terminal.")] = True,
) -> None:
    """Analyze dumps and print the verdict (the default command)."""
    from frforensics.analyzer import AnalyzeOptions, load_dumps
    from frforensics.analyzer import analyze as run_analysis
    from frforensics.reporting import render

    show_progress = progress and fmt is Format.text and output is None and sys.stderr.isatty()
    dumps = _with_progress(
        lambda cb: load_dumps([str(p) for p in paths], prefix=prefix, jobs=jobs, progress=cb),
        enabled=show_progress,
        what="decoding dumps",
    )
    report = run_analysis(dumps, options=AnalyzeOptions(world_size=world_size, hang_after_s=hang_after))
    if output_dir is not None:
        from frforensics.reporting import write_all

        write_all(report, output_dir, dump_paths=[str(p) for p in paths], prefix=prefix)
    if fmt is Format.text and output is None:
        from frforensics.reporting import text

        sys.stdout.write(text.render(report, color=sys.stdout.isatty()))
    else:
        _write(render(report, fmt.value), output)
    raise typer.Exit(report.exit_code)


@app.command()
def convert(
    src: Annotated[list[Path], typer.Argument(help="Native dumps (files, directories, archives).")],
    dst: Annotated[Path, typer.Argument(help="Folder for the frdump files.")],
    prefix: Annotated[str | None, typer.Option("--prefix", "-p")] = None,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", min=1)] = None,
) -> None:
    """Convert dumps of any format into frforensics' compact frdump format."""
    from frforensics.analyzer.convert import convert_dumps

    result = convert_dumps([str(p) for p in src], dst, prefix=prefix, jobs=jobs)
    for label, error in result.failed:
        print(f"skipped {label}: {error}", file=sys.stderr)
    print(f"wrote {len(result.written)} frdump file(s) to {dst}"
          + (f"; skipped {len(result.failed)}" if result.failed else ""))
    raise typer.Exit(0 if result.written else 2)


def _with_progress(work, *, enabled: bool, what: str):  # type: ignore[no-untyped-def]
    if not enabled:
        return work(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(f"[progress.description]{what}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True,
                  console=__import__("rich.console").console.Console(stderr=True)) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return work(update)


def _route_default(argv: list[str]) -> list[str]:
    """Insert ``analyze`` unless the first argument names a subcommand or asks for help."""
    if not argv or argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help", "--version"):
        return argv
    return ["analyze", *argv]


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: errors become exit codes here, in one place."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--version"]:
        print(f"fr-analyze {__version__}")
        sys.exit(0)
    try:
        code = app(args=_route_default(args), prog_name="fr-analyze", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (UsageError, FrForensicsError) as exc:
        _stderr(str(exc))
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # typer's usage errors, and real bugs
        show = getattr(exc, "show", None)
        if isinstance(exc, typer.exceptions.TyperException) or callable(show):
            if callable(show):
                show()
            else:
                _stderr(str(exc))
            sys.exit(2)
        if os.environ.get("FRFORENSICS_DEBUG"):
            raise
        _stderr(f"internal error: {type(exc).__name__}: {exc} "
                "(a bug: rerun with FRFORENSICS_DEBUG=1 and report the traceback)")
        sys.exit(3)
    sys.exit(code if isinstance(code, int) else 0)
