"""Bytes per rank of a digest on the wire: pickle vs ``analyzer.wire``, and the cost to encode.

::

    python bench/wire_size.py [--world 64] [--ring 2000] [--batch 64]
                              [--noise-ns 0] [--window 0]

Builds the benchmark's healthy TP 8 × DP job (2000 entries per rank, 8 frames
per entry), writes it as native pickles and as frdump under a temporary folder,
digests every rank as a worker does, and prints per-rank sizes: the pickled
digest (what the local process pool sends), zlib -1 of it, and the wire
encoding of single digests and of host batches, zlib and lzma.

The builder's clocks tick on a 10 µs grid and its ranks run in lock step, which
compresses far better than real clocks: ``--noise-ns N`` adds independent
uniform noise in ``[0, N)`` ns to every timestamp of every rank (what real
nanosecond clocks look like to a compressor). ``--window K`` measures digests
cut to their newest K entries (a measurement only: the analysis keeps every
entry).
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from frforensics.analyzer import wire
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.load import digest_paths
from frforensics.testing import JobBuilder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--ring", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--noise-ns", type=int, default=0)
    ap.add_argument("--window", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    job = JobBuilder(world_size=args.world, tp=8, dp=args.world // 8, ring_size=args.ring,
                     seed=0).steps(max(10, args.ring // 10)).build()
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"native": job.write_native(Path(tmp) / "native", jobs=2),
                "frdump": job.write_frdump(Path(tmp) / "frdump", jobs=2)}
        print(f"{args.world} ranks, ring {args.ring}, time noise {args.noise_ns} ns, "
              f"window {args.window or 'all'}; bytes per rank (mean):")
        print("| dump | file | pickle | zlib -1 of pickle | wire zlib, 1 rank | wire lzma, 1 rank "
              f"| wire zlib, batch {args.batch} | wire lzma, batch {args.batch} "
              "| encode ms/rank (zlib, batch) | decode ms/rank |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, files in sets.items():
            outs = digest_paths([str(p) for p in files])
            digests = [o for o in outs if isinstance(o, RankDigest)]
            assert len(digests) == len(files), [o for o in outs if not isinstance(o, RankDigest)][:3]
            if args.noise_ns:
                digests = [_noisy(d, rng, args.noise_ns) for d in digests]
            if args.window:
                digests = [_window(d, args.window) for d in digests]
            file_b = statistics.mean(p.stat().st_size for p in files)
            pick = [pickle.dumps(d, protocol=5) for d in digests]
            pick_b = statistics.mean(map(len, pick))
            pick_z = statistics.mean(len(zlib.compress(p, 1)) for p in pick)
            one_z = statistics.mean(len(wire.encode_batch([d])) for d in digests)
            one_x = statistics.mean(len(wire.encode_batch([d], codec="lzma")) for d in digests)
            batches = [digests[i:i + args.batch] for i in range(0, len(digests), args.batch)]
            t0 = time.perf_counter()
            payloads = [wire.encode_batch(b) for b in batches]
            enc_ms = (time.perf_counter() - t0) * 1e3 / len(digests)
            batch_z = sum(map(len, payloads)) / len(digests)
            batch_x = sum(len(wire.encode_batch(b, codec="lzma")) for b in batches) / len(digests)
            t0 = time.perf_counter()
            back = [d for p in payloads for d in wire.decode_batch(p)]
            dec_ms = (time.perf_counter() - t0) * 1e3 / len(digests)
            assert len(back) == len(digests)
            kib = 1024
            print(f"| {name} | {file_b / kib:.1f} KiB | {pick_b / kib:.1f} KiB | {pick_z / kib:.1f} KiB "
                  f"| {one_z / kib:.2f} KiB | {one_x / kib:.2f} KiB | {batch_z / kib:.2f} KiB "
                  f"| {batch_x / kib:.2f} KiB | {enc_ms:.2f} | {dec_ms:.2f} |")


def _noisy(d: RankDigest, rng: np.random.Generator, ns: int) -> RankDigest:
    def jitter(a: np.ndarray) -> np.ndarray:
        return np.where(a > 0, a + rng.integers(0, ns, len(a)), a)

    details = {r: det._replace(t_enqueue_ns=det.t_enqueue_ns + int(rng.integers(0, ns)),
                               t_complete_ns=det.t_complete_ns + int(rng.integers(0, ns))
                               if det.t_complete_ns > 0 else det.t_complete_ns)
               for r, det in d.details.items()}
    return dataclasses.replace(d, t_enqueue_ns=jitter(d.t_enqueue_ns),
                               t_complete_ns=jitter(d.t_complete_ns), details=details)


def _window(d: RankDigest, k: int) -> RankDigest:
    cut = {f.name: getattr(d, f.name)[-k:] for f in dataclasses.fields(d)
           if isinstance(getattr(d, f.name), np.ndarray)}
    return dataclasses.replace(d, **cut)


if __name__ == "__main__":
    main()
