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
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from frforensics import __version__
from frforensics._atomic import WriteError, atomic_file, write_atomic
from frforensics._malloc import keep_freed_memory
from frforensics.errors import FrForensicsError, OutputError, UsageError
from frforensics.formats.limits import DEFAULT_LIMITS

if TYPE_CHECKING:
    from rich.progress import TaskID

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Name the rank that hung a PyTorch distributed job, from its flight-recorder dumps.",
)

SUBCOMMANDS = ("analyze", "convert", "timeline", "verdict")
#: ``--window`` with ``--dask``: the straggler detector looks at 512 entries per
#: rank anyway, and 512 columns are ~3.4 KiB per rank on the wire (docs/scaling.md)
DASK_WINDOW = 512
#: without ``--window``, the local pool keeps the whole ring of a job of fewer
#: dumps and cuts to ``DASK_WINDOW`` from this many (docs/performance.md, "The
#: window at scale": 16,384 ranks × 2000 entries in 1.9 GiB instead of 3.3)
AUTO_WINDOW_DUMPS = 8192


class Format(str, Enum):
    text = "text"
    json = "json"
    markdown = "markdown"
    html = "html"
    junit = "junit"


def _stderr(message: str) -> None:
    from frforensics.reporting._escape import printable

    print(f"fr-analyze: {printable(message)}", file=sys.stderr)


def _cannot_write(path: Path, exc: OSError) -> OutputError:
    if isinstance(exc, WriteError):  # names the path it could not write already
        return OutputError(f"{exc}; choose another output path")
    return OutputError(f"{path}: cannot write ({exc.strerror or exc}); "
                       "choose another output path")


def _check_output_file(output: Path) -> None:
    """Fail before the work when ``output`` can never be written (a folder)."""
    if output.is_dir():
        raise OutputError(f"{output}: is a folder; name a file to write")


def _check_output_dir(output_dir: Path) -> None:
    """Fail before the work when ``output_dir`` can never hold the reports."""
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputError(f"{output_dir}: exists and is not a folder; name a folder for --output-dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_write(output_dir, exc) from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise OutputError(f"{output_dir}: folder is not writable; choose another --output-dir")


def _write(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    _check_output_file(output)
    try:
        write_atomic(output, text, make_parents=True)
    except OSError as exc:
        raise _cannot_write(output, exc) from None


@app.command()
def analyze(
    paths: Annotated[list[Path] | None, typer.Argument(
        help="Dump files, directories or .tar.gz/.zip archives.")] = None,
    fmt: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.text,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    output_dir: Annotated[Path | None, typer.Option(
        "--output-dir", help="Write every format (and the timeline) into this folder, for CI.")] = None,
    world_size: Annotated[int | None, typer.Option(
        "--world-size", min=1, max=DEFAULT_LIMITS.max_rank,
        help="The job's world size (native dumps do not record it).")] = None,
    prefix: Annotated[str | None, typer.Option(
        "--prefix", "-p", help="Only files named <prefix><rank> (e.g. nccl_trace_rank_).")] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1,
        help="Decode with this many processes (default and most: the machine's cores).")] = None,
    hang_after: Annotated[float, typer.Option(
        "--hang-after", min=0.0, help="Ops unfinished for less than this many seconds at dump "
        "time count as in flight, not hung.")] = 1.0,
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", help="Progress bar on a terminal.")] = True,
    dask: Annotated[str | None, typer.Option(
        "--dask", metavar="SCHEDULER", help="Decode on a Dask cluster (tcp://host:8786): each "
        "host reads PATHS on its own disks ({host}, {worker} are replaced there) and sends back "
        "compact digests. Needs frforensics[dask].")] = None,
    manifest: Annotated[Path | None, typer.Option(
        "--manifest", help='With --dask: a JSON file {"HOST": ["path", ...]} saying which files '
        "each host (or worker name) holds; then no PATHS are needed.")] = None,
    host_deadline: Annotated[float, typer.Option(
        "--host-deadline", min=1.0, help="With --dask: seconds a host may take; after that its "
        "unread dumps are load problems.")] = 600.0,
    deadline: Annotated[float | None, typer.Option(
        "--deadline", min=0.1, help="Read dumps for at most this many seconds, then give the "
        "verdict of what was read: unread files are listed in the notes and their ranks are "
        "never named culprits.")] = None,
    window: Annotated[int | None, typer.Option(
        "--window", min=0, help="Analyze each ring's newest N entries (from its earliest "
        "unfinished one if older; the rest count as evicted). 0: the whole ring. Default: the "
        f"whole ring up to {AUTO_WINDOW_DUMPS - 1:,} dumps, {DASK_WINDOW} from {AUTO_WINDOW_DUMPS:,} "
        f"dumps and with --dask, so the central process's memory does not grow with the ring "
        "size.")] = None,
) -> None:
    """Analyze dumps and print the verdict (the default command)."""
    from frforensics.analyzer import AnalyzeOptions, load_dumps
    from frforensics.analyzer import analyze as run_analysis
    from frforensics.reporting import render

    if output is not None:
        _check_output_file(output)
    if output_dir is not None:
        _check_output_dir(output_dir)
    show_progress = progress and fmt is not Format.json and _stderr_is_terminal()
    paths = paths or []
    if dask is None and manifest is not None:
        raise UsageError("--manifest goes with --dask")
    if dask is not None and deadline is not None:
        raise UsageError("--deadline does not go with --dask (use --host-deadline)")
    if not paths and manifest is None:
        raise UsageError("no dumps given: pass files, directories or archives")
    window_from = 0
    if window is None:
        window = DASK_WINDOW
        window_from = 0 if dask is not None else AUTO_WINDOW_DUMPS
    cut = window or None
    with _Phases(enabled=show_progress) as phases:
        if dask is not None:
            from frforensics.analyzer.cluster import load_dumps_dask, read_manifest

            hosts = None if manifest is None else read_manifest(manifest)
            dumps = load_dumps_dask([str(p) for p in paths], dask, prefix=prefix,
                                    manifest=hosts, host_deadline_s=host_deadline,
                                    progress=phases.reading("decoding dumps on the cluster"),
                                    window=cut)
        else:
            dumps = load_dumps([str(p) for p in paths], prefix=prefix, jobs=jobs,
                               progress=phases.reading("decoding dumps"), window=cut,
                               deadline_s=deadline, window_from=window_from)
        report = run_analysis(dumps, options=AnalyzeOptions(world_size=world_size,
                                                            hang_after_s=hang_after),
                              progress=phases.analyzing)
    if output_dir is not None:
        from frforensics.analyzer.timeline import write_timeline_file
        from frforensics.reporting import write_all

        try:
            write_all(report, output_dir)
            if not dask:  # the timeline re-reads the dumps: only where they are local
                write_timeline_file(paths, output_dir / "timeline.json", prefix=prefix)
        except OSError as exc:
            raise _cannot_write(output_dir, exc) from None
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
    from frforensics.reporting._escape import printable

    result = convert_dumps([str(p) for p in src], dst, prefix=prefix, jobs=jobs)
    for label, error in result.failed:
        print(printable(f"skipped {label}: {error}"), file=sys.stderr)
    print(f"wrote {len(result.written)} frdump file(s) to {dst}"
          + (f"; skipped {len(result.failed)}" if result.failed else ""))
    raise typer.Exit(0 if result.written else 2)


@app.command()
def timeline(
    paths: Annotated[list[Path], typer.Argument(help="Dump files, directories or archives.")],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Chrome-trace JSON file to write (open in ui.perfetto.dev).")
    ] = Path("trace.json"),
    prefix: Annotated[str | None, typer.Option("--prefix", "-p")] = None,
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", help="Progress bar on a terminal.")] = True,
) -> None:
    """Export every rank's ops as a Chrome-trace / Perfetto timeline (stuck ops marked)."""
    from frforensics.analyzer.timeline import write_timeline
    from frforensics.formats import read_sources
    from frforensics.reporting._escape import printable

    _check_output_file(output)
    try:
        with atomic_file(output, make_parents=True) as fh:
            summary = _with_progress(
                lambda cb: write_timeline(read_sources([str(p) for p in paths], prefix=prefix),
                                          fh, progress=cb),
                enabled=progress and _stderr_is_terminal(),
                what="reading dumps",
            )
    except OSError as exc:  # reading never raises OSError (those are load problems)
        raise _cannot_write(output, exc) from None
    for label, error in summary.problems[:20]:
        print(printable(f"skipped {label}: {error}"), file=sys.stderr)
    if len(summary.problems) > 20:
        print(f"... and {len(summary.problems) - 20} more", file=sys.stderr)
    print(f"wrote {output}: {len(summary.ranks)} rank(s), {summary.events} events, "
          f"{summary.stuck} stuck op(s); open it in https://ui.perfetto.dev", file=sys.stderr)
    raise typer.Exit(0 if summary.ranks else 2)


@app.command()
def verdict(
    paths: Annotated[list[Path] | None, typer.Argument(help="Dump files or directories.")] = None,
    out_dir: Annotated[Path, typer.Option(
        "--out-dir", help="Folder for verdict.json, verdict.txt and verdict.html.")] = Path("."),
    paths_from: Annotated[Path | None, typer.Option(
        "--paths-from", help="A file listing dump paths, one per line (for 10,000 ranks).")] = None,
    world_size: Annotated[int | None, typer.Option("--world-size", min=1)] = None,
    hang_after: Annotated[float, typer.Option("--hang-after", min=0.0)] = 1.0,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", min=1)] = None,
) -> None:
    """Write verdict.json (the JSON report), verdict.txt and verdict.html; print the text.

    What the recorder's elected rank runs in a child process at hang time
    (docs/orchestrators.md); usable by hand on any dumps.
    """
    from frforensics.analyzer import AnalyzeOptions, load_dumps
    from frforensics.analyzer import analyze as run_analysis
    from frforensics.reporting import html, json_report, text

    listed = [str(p) for p in paths or []]
    if paths_from is not None:
        try:
            listed += [line.strip() for line in paths_from.read_text(encoding="utf-8").splitlines()
                       if line.strip()]
        except OSError as exc:
            raise UsageError(f"{paths_from}: cannot read the path list: {exc}") from None
    if not listed:
        raise UsageError("no dump paths given")
    dumps = load_dumps(listed, jobs=jobs)
    report = run_analysis(dumps, options=AnalyzeOptions(world_size=world_size,
                                                        hang_after_s=hang_after))
    human = text.render(report, color=False)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_write(out_dir, exc) from None
    for name, body in (("verdict.json", json_report.render(report)), ("verdict.txt", human),
                       ("verdict.html", html.render(report))):
        try:
            write_atomic(out_dir / name, body)
        except OSError as exc:
            raise _cannot_write(out_dir / name, exc) from None
    sys.stdout.write(human)
    raise typer.Exit(report.exit_code)


#: Loads with fewer files than this finish before a bar is worth drawing.
PROGRESS_MIN_FILES = 16

_T = TypeVar("_T")


def _stderr_is_terminal() -> bool:
    """A progress bar only on an interactive terminal (never in pipes, logs or CI)."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def _with_progress(
    work: Callable[[Callable[[int, int], None] | None], _T], *, enabled: bool, what: str
) -> _T:
    """Run ``work(progress_callback)``; with ``enabled``, draw a transient rich bar on stderr.

    The bar appears only once the total is known to be at least
    ``PROGRESS_MIN_FILES`` files, and disappears when done, so small loads and
    the output that follows stay clean.
    """
    if not enabled:
        return work(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress(f"[progress.description]{what}", BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), transient=True, console=Console(stderr=True))
    task: list[TaskID] = []

    def update(done: int, total: int) -> None:
        if not task:
            if total < PROGRESS_MIN_FILES:
                return
            bar.start()
            task.append(bar.add_task(what, total=total))
        bar.update(task[0], completed=done, total=total)

    try:
        return work(update)
    finally:
        if task:
            bar.stop()


class _Phases:
    """The analysis's progress on a terminal: one line per phase (reading the dumps,
    then analyzing them), each with its count, elapsed time and an estimate of the
    time left, on stderr and transient.

    Shown only when ``enabled`` and the job has at least ``PROGRESS_MIN_FILES``
    files (small loads and the output that follows stay clean); the analysis line
    follows only a shown reading line.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.read_task: TaskID | None = None
        self.analyze_task: TaskID | None = None

    def __enter__(self) -> _Phases:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def reading(self, what: str) -> Callable[[int, int], None] | None:
        """The progress callback of a load (``None`` when nothing is shown)."""
        if not self.enabled:
            return None

        def update(done: int, total: int) -> None:
            if self.read_task is None:
                if total < PROGRESS_MIN_FILES:
                    return
                self._start()
                self.read_task = self.bar.add_task(what, total=total)
            self.bar.update(self.read_task, completed=done, total=total)

        return update

    def analyzing(self, phase: str, done: int, total: int) -> None:
        """The analysis's progress callback (``analyze(..., progress=)``)."""
        if self.bar is None:
            return
        if self.analyze_task is None:
            self.analyze_task = self.bar.add_task("analyzing", total=total)
        self.bar.update(self.analyze_task, completed=done, total=total,
                        description=f"analyzing: {phase}")

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("left"), TimeRemainingColumn(),
                            transient=True, console=Console(stderr=True))
        self.bar.start()


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
    keep_freed_memory()  # a one-shot process: freed temporaries are reused, not faulted in again
    try:
        code = app(args=_route_default(args), prog_name="fr-analyze", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (UsageError, FrForensicsError) as exc:
        _stderr(str(exc))
        sys.exit(2)
    except MemoryError:
        _stderr("out of memory (see docs/security.md for the limits; try fewer --jobs)")
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
