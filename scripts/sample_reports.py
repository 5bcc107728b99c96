"""The JSON report of every ``sample_dumps/`` directory, byte for byte.

``fr-analyze sample_dumps/<kind> --format json`` (both variants together) and
``fr-analyze sample_dumps/<kind>/<variant> --format json --world-size 4`` (each
alone), run from the repository root so the reports hold relative paths; each
report is compared with ``tests/data/sample_reports/<name>.json``
(``tests/integration/test_sample_reports.py`` runs ``--check`` in CI). A change
that means to change a verdict or a report rewrites them with ``--write`` and
shows the difference in its commit; a refactoring leaves them as they are.

    python scripts/sample_reports.py --check   # exit 1 and the names on a difference
    python scripts/sample_reports.py --write   # rewrite the expected reports
    python scripts/sample_reports.py --write --out DIR   # write elsewhere (a baseline)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = "sample_dumps"
EXPECTED = ROOT / "tests" / "data" / "sample_reports"


def cases() -> dict[str, list[str]]:
    """Report name -> ``fr-analyze`` arguments, for every sample directory."""
    out: dict[str, list[str]] = {}
    for kind in sorted(p.name for p in (ROOT / SAMPLES).iterdir() if p.is_dir()):
        out[kind] = [f"{SAMPLES}/{kind}", "--format", "json"]
        for variant in ("frdump", "native"):
            if (ROOT / SAMPLES / kind / variant).is_dir():
                out[f"{kind}-{variant}"] = [f"{SAMPLES}/{kind}/{variant}", "--format", "json",
                                            "--world-size", "4"]
    return out


def report(args: list[str]) -> tuple[int, str]:
    """``fr-analyze ARGS``'s exit code and standard output, run in this process."""
    from frforensics import cli

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            cli.main(args)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    ap.add_argument("--out", type=Path, default=EXPECTED)
    opts = ap.parse_args()
    os.chdir(ROOT)
    differ = []
    opts.out.mkdir(parents=True, exist_ok=True)
    for name, args in cases().items():
        code, text = report(args)
        if code not in (0, 1):
            print(f"{name}: fr-analyze exit {code}", file=sys.stderr)
            return 2
        path = opts.out / f"{name}.json"
        if opts.write:
            path.write_text(text, encoding="utf-8")
        elif not path.exists() or path.read_text(encoding="utf-8") != text:
            differ.append(name)
    if differ:
        print("reports differ from tests/data/sample_reports/: " + ", ".join(differ),
              file=sys.stderr)
        return 1
    print(f"{len(cases())} sample reports {'written' if opts.write else 'identical'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
