"""Run one function in a forked child under the hostile corpus' caps (``fork_runner.py``'s:
1.5 GiB of address space, a 30 s alarm) and report how it ended, its time and peak RSS."""

from __future__ import annotations

import os
import resource
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

ADDRESS_SPACE = int(1.5 * (1 << 30))
TIMEOUT_S = 30


def run_capped(fn: Callable[[], str]) -> dict[str, Any]:
    """``fn()`` in a capped child: ``{"exit", "out", "seconds", "peak_rss_mib"}``.

    ``exit`` 0: ``fn`` returned ``out``; 99: it raised (``out`` is the traceback);
    a signal number's negative when killed (the alarm: -14)."""
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(read)
            resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
            signal.alarm(TIMEOUT_S)
            out = fn()
        except BaseException:
            out, code = traceback.format_exc(), 99
        try:
            os.write(write, out.encode("utf-8", "replace")[:1 << 16])
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while True:
        b = os.read(read, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(read)
    _, status, usage = os.wait4(pid, 0)
    return {"exit": os.waitstatus_to_exitcode(status), "out": b"".join(chunks).decode(),
            "seconds": round(time.perf_counter() - start, 3),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}
