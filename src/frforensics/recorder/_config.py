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
RECORDER_PATHS = ("auto", "python", "cxx")

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
    # PyTorch's dump saved with its stacks, as its own default dump is: ~1 s of
    # symbolizing on a process's first dump, which at hang time slowed the live
    # verdict's hand-over (measured in CI: digests late, another rank elected), so off
    native_stacks: bool = False
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
    # How each op is recorded (docs/recorder-native.md): "auto" (the default) the
    # native backend wrapper (_cxx/recorder.cpp) where it is built on this machine,
    # else the Python wrapper (_pg.py) while one background build per machine makes it
    # for the next job; "cxx" the native path, built now if need be (falls back to
    # "python", said once, where it cannot be built); "python" the wrapper only.
    recorder_path: str = "auto"

    def __post_init__(self) -> None:
        for name in _NUMBERS:
            value = getattr(self, name)
            if value is not None or not _NUMBERS[name][3]:
                parse_number(name, value, name)
        if self.dump_on_exit not in DUMP_ON_EXIT_MODES:
            raise ValueError("dump_on_exit must be 'auto', 'always' or 'never'")
        if self.recorder_path not in RECORDER_PATHS:
            raise ValueError("recorder_path must be 'auto', 'python' or 'cxx'")
        if self.verdict_source not in VERDICT_SOURCES:
            raise ValueError("verdict_source must be 'auto', 'dir' or 'store'")
        if self.on_verdict_command is not None and (
                not isinstance(self.on_verdict_command, str)
                or len(self.on_verdict_command) > _MAX_TEXT):
            raise SettingError(f"on_verdict_command: a command line of at most {_MAX_TEXT} "
                               "characters")

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
            if name in _NUMBERS:
                value = None if value is None and _NUMBERS[name][3] else parse_number(
                    name, value, name)
            elif name in ("dump_signals", "teardown_signals"):
                value = tuple(int(s) for s in value)
            elif name == "wrap_backends":
                value = tuple(str(b).strip().lower() for b in value if str(b).strip())
            elif name == "extra_notes":
                value = tuple(str(n) for n in value)
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
                try:
                    options[name] = parse_number(name, raw.strip(), var) if name in _NUMBERS \
                        else parse(raw.strip())
                except SettingError:
                    raise
                except (ValueError, TypeError) as exc:
                    raise SettingError(f"{var}={raw.strip()[:80]!r}: {exc}") from None
            elif raw is not None and name in ("dump_signals", "teardown_signals"):
                options[name] = ()
        dump_dir = env.get("FRFORENSICS_DUMP_DIR") or "frforensics_dumps"
        return cls.build(dump_dir, **options)


class SettingError(ValueError):
    """A setting out of its range: one line naming the variable (or argument) and the range."""


_MAX_TEXT = 4096

#: every numeric setting: (kind, lowest, highest, None allowed); a float's lowest is
#: excluded (a time of 0 s is no time), an int's included
_NUMBERS: dict[str, tuple[type, float, float, bool]] = {
    "timeout_s": (float, 0.0, 7 * 86400.0, False),
    "buffer_size": (int, 1, 1 << 22, False),
    "poll_interval_s": (float, 0.0, 60.0, False),
    "store_poll_interval_s": (float, 0.0, 3600.0, False),
    "stack_depth": (int, 0, 256, False),
    "heartbeat_stale_s": (float, 0.0, 86400.0, True),
    "store_timeout_s": (float, 0.0, 3600.0, False),
    "stale_check_max_world": (int, 0, 1 << 20, False),
    "verdict_timeout_s": (float, 0.0, 86400.0, False),
    "hook_timeout_s": (float, 0.0, 86400.0, False),
    "straggler_interval_s": (float, 0.0, 86400.0, True),
}


def accepted_range(name: str) -> str:
    """The accepted values of a numeric setting, in words."""
    kind, lo, hi, optional = _NUMBERS[name]
    text = (f"an integer in {lo:g}..{hi:g}" if kind is int
            else f"a number of seconds in ({lo:g}, {hi:g}]")
    return text + (" (or unset)" if optional else "")


def parse_number(name: str, value: Any, label: str) -> Any:
    """The one parser of every numeric setting (``enable()``'s argument or the text of an
    ``FRFORENSICS_*`` variable): finite, within its range, else :class:`SettingError`
    naming ``label`` and the accepted range (NaN, inf, 1e308, negatives, non-numbers)."""
    kind, lo, hi, _ = _NUMBERS[name]
    shown = repr(value)[:80]
    bad = SettingError(f"{label}={shown}: expected {accepted_range(name)}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        if len(value) > 64:
            raise bad
        try:
            number = float(value)
        except ValueError:
            raise bad from None
    elif isinstance(value, int | float):
        number = float(value) if not isinstance(value, int) or abs(value) < 1 << 60 else float(
            "inf")
    else:
        raise bad
    if number != number or number in (float("inf"), float("-inf")):
        raise bad
    if kind is int:
        if not number.is_integer() or not lo <= number <= hi:
            raise bad
        return int(number)
    if not lo < number <= hi:
        raise bad
    return number


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
                raise ValueError(f"unknown signal {name[:40]!r} (names like USR1, TERM; "
                                 "or none)")
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
    "FRFORENSICS_NATIVE_STACKS": ("native_stacks", _flag),
    "FRFORENSICS_BACKENDS": ("wrap_backends", _names),
    "FRFORENSICS_CUDA_EVENTS": ("cuda_events", _flag),
    "FRFORENSICS_VERDICT": ("verdict", _flag),
    "FRFORENSICS_VERDICT_SOURCE": ("verdict_source", str),
    "FRFORENSICS_VERDICT_TIMEOUT_S": ("verdict_timeout_s", float),
    "FRFORENSICS_ON_VERDICT": ("on_verdict_command", str),
    "FRFORENSICS_HOOK_TIMEOUT_S": ("hook_timeout_s", float),
    "FRFORENSICS_ABORT_AFTER_VERDICT": ("abort_after_verdict", _flag),
    "FRFORENSICS_STRAGGLER_INTERVAL_S": ("straggler_interval_s", float),
    "FRFORENSICS_RECORDER_PATH": ("recorder_path", lambda raw: raw.lower()),
}


def option_names() -> Iterable[str]:
    """Every option ``enable()`` accepts besides ``dump_dir``."""
    return tuple(f.name for f in dataclasses.fields(RecorderConfig) if f.name != "dump_dir")
