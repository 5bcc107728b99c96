"""How many generated noisy healthy jobs (16-64 ranks) the analyzer flags (docs/builder.md, "Noise").

Usage: ``python scripts/count_noisy_flagged.py [N]`` (default 16 jobs, seeds 0..N-1).
"""
import random
import sys
import time

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.testing import JobBuilder

N = int(sys.argv[1]) if len(sys.argv) > 1 else 16
flagged = 0
t0 = time.time()
for seed in range(N):
    rng = random.Random(seed)
    size = rng.choice([16, 32, 64])
    tp, pp = rng.choice([2, 4, 8]), rng.choice([1, 2])
    dp = size // (tp * pp)
    d = JobBuilder(tp=tp, pp=pp, dp=dp, seed=seed).steps(20).jitter(ms=0.2).noise().build()
    ds = DumpSet()
    for r, t in d.traces().items():
        ds.digests[r] = digest(t, rank=r)
    rep = analyze(ds, options=AnalyzeOptions(world_size=d.world_size))
    bad = rep.culprit_ranks or rep.findings
    flagged += bool(bad)
    print(seed, size, (tp, pp, dp), rep.status.value, list(rep.culprit_ranks), [n[:200] for n in rep.notes if "straggler" in n], flush=True)
print(f"flagged {flagged} of {N}  ({time.time()-t0:.0f}s)")
