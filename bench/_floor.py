"""The floor: merely unpickle every file of a directory, in parallel, and drop the result.

``python bench/_floor.py DIR --jobs N [--no-gc]``. Plain ``pickle.loads`` (it
trusts the bytes: the benchmark's own files only), the same process pool and
batching as ``fr-analyze``. ``--no-gc`` pauses the cyclic collector while
unpickling, as fr-analyze's reader does: the tightest floor.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
from concurrent.futures import ProcessPoolExecutor


def _unpickle(paths: list[str], no_gc: bool) -> int:
    if no_gc:
        gc.disable()
    n = 0
    for path in paths:
        with open(path, "rb") as fh:
            doc = pickle.loads(fh.read())
        n += len(doc["entries"])
        del doc
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-gc", action="store_true")
    args = ap.parse_args()
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if not f.startswith("."))
    size = max(1, min(64, len(files) // (args.jobs * 4) or 1))
    batches = [files[i:i + size] for i in range(0, len(files), size)]
    with ProcessPoolExecutor(args.jobs) as pool:
        total = sum(pool.map(_unpickle, batches, [args.no_gc] * len(batches)))
    print(total)


if __name__ == "__main__":
    main()
