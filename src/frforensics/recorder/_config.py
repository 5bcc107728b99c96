"""The recorder's settings, with their defaults in one place (torch-free).

:class:`RecorderConfig`'s field defaults are the only defaults: ``enable()``'s
signature reads them from the class, and :meth:`RecorderConfig.from_env` (the
``FRFORENSICS_*`` variables) falls back to them for every variable not set.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DUMP_ON_EXIT_MODES = ("auto", "always", "never")
VERDICT_SOURCES = ("auto", "dir", "store")

# Every backend name PyTorch 2.13-2.15 registers for GPUs and CPUs (2.15 adds the
# three NCCL variants; distributed_c10d.py, ``_register_builtin_*_backend``).
DEFAULT_BACKENDS = ("gloo", "nccl", "nccl-legacy", "nccl2", "nccl-lazy")


@dataclass(frozen=True)
class RecorderConfig:
    """Settings of :func:`frforensics.recorder.enable` (see its docstring)."""

    dump_dir: Path
    timeout_s: float = 600.0
    buffer_size: int = 2000
    poll_interval_s: float = 0.01
    store_poll_interval_s: float = 1.0
    stack_depth: int = 8
    heartbeat_stale_s: float | None = None
    dump_signals: tuple[int, ...] = (int(signal.SIGUSR1),)
    # Signals that end the process (torchrun's SIGTERM, Ctrl-C): dump, then hand
    # the signal on so the process dies as it would have (docs/recorder.md).
    teardown_signals: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGINT))
    dump_on_exception: bool = True
    dump_on_exit: str = "auto"
    save_native: bool = True
    wrap_backends: tuple[str, ...] = DEFAULT_BACKENDS
    cuda_events: bool = True
    store_timeout_s: float = 5.0
    stale_check_max_world: int = 4096
    extra_notes: tuple[str, ...] = field(default=())
    # The verdict at hang time (recorder/_verdict.py, docs/orchestrators.md).
    verdict: bool = True
    verdict_source: str = "auto"  # auto | dir | store
    verdict_timeout_s: float = 60.0
    on_verdict: Callable[[dict[str, Any]], None] | None = None
    on_verdict_command: str | None = None
    hook_timeout_s: float = 30.0
    abort_after_verdict: bool = False
    straggler_interval_s: float | None = None

    def __post_init__(self) -> None:
        if (self.timeout_s <= 0 or self.buffer_size < 1 or self.poll_interval_s <= 0
                or self.store_poll_interval_s <= 0):
            raise ValueError("timeout_s, buffer_size and the poll intervals must be positive")
        if self.dump_on_exit not in DUMP_ON_EXIT_MODES:
            raise ValueError("dump_on_exit must be 'auto', 'always' or 'never'")
        if self.verdict_source not in VERDICT_SOURCES:
            raise ValueError("verdict_source must be 'auto', 'dir' or 'store'")
        if self.verdict_timeout_s <= 0 or self.hook_timeout_s <= 0 or (
                self.straggler_interval_s is not None and self.straggler_interval_s <= 0):
            raise ValueError("verdict_timeout_s, hook_timeout_s and straggler_interval_s "
                             "must be positive")

    @property
    def deadline_ms(self) -> int:
        return int(self.timeout_s * 1000)

    @property
    def stale_limit_s(self) -> float:
        """Heartbeat age past which a peer counts as silent."""
        if self.heartbeat_stale_s is not None:
            return self.heartbeat_stale_s
        return max(3.0 * self.store_poll_interval_s, 2.0)

    @classmethod
    def build(cls, dump_dir: str | os.PathLike[str], **options: Any) -> RecorderConfig:
        """A config from ``enable()``'s arguments (normalized types; ValueError if bad)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown recorder options: {sorted(unknown)}")
        path = Path(dump_dir).expanduser().resolve()
        norm: dict[str, Any] = {}
        for name, value in options.items():
            if name in ("dump_signals", "teardown_signals"):
                value = tuple(int(s) for s in value)
            elif name == "wrap_backends":
                value = tuple(str(b).strip().lower() for b in value if str(b).strip())
            elif name == "extra_notes":
                value = tuple(str(n) for n in value)
            elif name in ("timeout_s", "poll_interval_s", "store_poll_interval_s",
                          "store_timeout_s", "verdict_timeout_s", "hook_timeout_s"):
                value = float(value)
            elif name in ("buffer_size", "stack_depth", "stale_check_max_world"):
                value = int(value)
            norm[name] = value
        return cls(dump_dir=path, **norm)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RecorderConfig:
        """The config the ``FRFORENSICS_*`` variables ask for (ValueError if one is bad)."""
        env = os.environ if env is None else env
        options: dict[str, Any] = {}
        for var, (name, parse) in _ENV.items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                options[name] = parse(raw.strip())
            elif raw is not None and name in ("dump_signals", "teardown_signals"):
                options[name] = ()
        dump_dir = env.get("FRFORENSICS_DUMP_DIR") or "frforensics_dumps"
        return cls.build(dump_dir, **options)


def parse_signals(raw: str) -> tuple[int, ...]:
    """``"USR1,TERM"`` → signal numbers; ``none``/``0`` → ()."""
    if raw.strip().lower() in ("", "none", "0"):
        return ()
    out: list[int] = []
    for name in raw.split(","):
        name = name.strip().upper()
        if name:
            full = name if name.startswith("SIG") else "SIG" + name
            sig = getattr(signal, full, None)
            if not isinstance(sig, int):
                raise ValueError(f"unknown signal {name!r}")
            out.append(int(sig))
    return tuple(out)


def _flag(raw: str) -> bool:
    return raw.lower() not in ("0", "false", "no", "off")


def _names(raw: str) -> tuple[str, ...]:
    return tuple(b.strip() for b in raw.split(",") if b.strip())


_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "FRFORENSICS_TIMEOUT_S": ("timeout_s", float),
    "FRFORENSICS_BUFFER_SIZE": ("buffer_size", int),
    "FRFORENSICS_POLL_INTERVAL_S": ("poll_interval_s", float),
    "FRFORENSICS_STORE_POLL_INTERVAL_S": ("store_poll_interval_s", float),
    "FRFORENSICS_STACK_DEPTH": ("stack_depth", int),
    "FRFORENSICS_HEARTBEAT_STALE_S": ("heartbeat_stale_s", float),
    "FRFORENSICS_SIGNALS": ("dump_signals", parse_signals),
    "FRFORENSICS_TEARDOWN_SIGNALS": ("teardown_signals", parse_signals),
    "FRFORENSICS_DUMP_ON_EXIT": ("dump_on_exit", str),
    "FRFORENSICS_SAVE_NATIVE": ("save_native", _flag),
    "FRFORENSICS_BACKENDS": ("wrap_backends", _names),
    "FRFORENSICS_CUDA_EVENTS": ("cuda_events", _flag),
    "FRFORENSICS_VERDICT": ("verdict", _flag),
    "FRFORENSICS_VERDICT_SOURCE": ("verdict_source", str),
    "FRFORENSICS_VERDICT_TIMEOUT_S": ("verdict_timeout_s", float),
    "FRFORENSICS_ON_VERDICT": ("on_verdict_command", str),
    "FRFORENSICS_HOOK_TIMEOUT_S": ("hook_timeout_s", float),
    "FRFORENSICS_ABORT_AFTER_VERDICT": ("abort_after_verdict", _flag),
    "FRFORENSICS_STRAGGLER_INTERVAL_S": ("straggler_interval_s", float),
}


def option_names() -> Iterable[str]:
    """Every option ``enable()`` accepts besides ``dump_dir``."""
    return tuple(f.name for f in dataclasses.fields(RecorderConfig) if f.name != "dump_dir")
