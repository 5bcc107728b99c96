#!/usr/bin/env bash
# One command on a GPU machine: the recorder's hang, coverage and teardown checks on NCCL.
#
#   scripts/gpu_check.sh            # torch 2.15 venv if present, else `python`
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# Runs tests/integration/test_recorder_gpu.py (pytest marker `gpu`) with the project's
# source on PYTHONPATH, for each backend name the installed torch has:
#   torch 2.15: nccl2 (what "nccl" builds), nccl-legacy, "cpu:gloo,cuda:nccl"
#   torch 2.13: nccl, "cpu:gloo,cuda:nccl"
# Per backend: the wrapped group's inner CUDA backend is the class torch's registered
# creator builds; every op is recorded with its device, CUDA start events stamped
# (stream state), batch_isend_irecv kept batched, _coalescing_manager blocks closed by
# a `coalesced` entry, split_group and DeviceMesh groups recorded; torch's own dump is
# saved beside ours (2.15 nccl2: the entries of torch's FlightRecorderHook); a hang dumps on the watchdog deadline (and the peer on the
# flag); a rank blocked inside NCCL dumps on SIGTERM and dies of SIGTERM.
# World size 2 with >= 2 GPUs, else 1 (a sleeping kernel stands in for the missing peer).
# Under 4 minutes per backend; exit 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
V215=/root/.cache/frforensics/venv-torch-2.15.0
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$V215/bin/python" ]; then PYTHON=$V215/bin/python; else PYTHON=python; fi
fi
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -lt 1 ]; then echo "gpu_check: no CUDA device visible to $PYTHON"; exit 2; fi
"$PYTHON" - <<'PYEOF'
import torch
print("== gpu_check:", torch.__version__, "on", torch.cuda.device_count(), "x",
      torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
PYEOF
"$PYTHON" -c 'import pytest, msgpack, numpy' 2>/dev/null || {
  echo "gpu_check: $PYTHON lacks pytest/msgpack/numpy (pip install pytest pytest-timeout msgpack numpy)"; exit 2; }
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" timeout 1500 "$PYTHON" -m pytest -q -rA \
  -p no:cacheprovider -m gpu tests/integration/test_recorder_gpu.py
RC=$?
echo "== gpu_check: $([ $RC = 0 ] && echo PASS || echo "FAIL (pytest exit $RC)")"
exit $RC
