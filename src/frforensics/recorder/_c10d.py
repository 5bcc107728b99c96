"""Installation into torch.distributed: probes, the creator, routing, native dumps.

The only module that touches c10d's private surface; supporting another torch
release means changing this file (docs/recorder.md, "How it hooks in").

* :func:`probe` checks, once at ``enable()``, every private API used below. A
  failed probe means nothing is installed: torch creates every group exactly as
  it would without the recorder, one stderr line says why, ``is_enabled()`` is
  False.
* ``Backend.register_backend("frforensics", creator, extended_api=True)`` makes a
  plugin whose creator returns a :class:`~._pg.RecordingProcessGroup`;
  ``_new_process_group_helper`` uses a returned ``ProcessGroup`` subclass as the
  whole group.
* PyTorch resolves the built-in names before it looks at plugins, so
  :func:`install` wraps ``_new_process_group_helper``: for a routed name it calls
  the original with the plugin name and hands the real backend string to the
  creator, then puts the real name back into ``_world.pg_map`` so
  ``dist.get_backend()`` still says what the user asked for.
* The creator builds each device's real backend with the creator the installed
  torch registered for that name (2.15: ``Backend._plugins[NAME]`` after
  ``Backend._ensure_backend_registered``; 2.13: the built-in classes, as
  2.13's helper does, and ``_plugins`` for plugins). If our creator fails, the
  group is created again exactly as torch would, unrecorded.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch as _torch
import torch.distributed as _dist
from torch.distributed import distributed_c10d as _c10d

from frforensics.recorder._core import GroupState, Recorder
from frforensics.recorder._pg import RecordingProcessGroup

# torch's stubs do not describe the private c10d surface this module drives.
torch: Any = _torch
dist: Any = _dist
c10d: Any = _c10d

PLUGIN_NAME = "frforensics"

# Names never routed: ours, and backends that are not real communication.
_NEVER_ROUTED = ("", "undefined", PLUGIN_NAME, "fake", "mpi", "threaded")


# ---------------------------------------------------------------- probes


@dataclass(frozen=True)
class Probes:
    """What the installed torch offers, checked once at ``enable()``."""

    torch_version: str
    problems: tuple[str, ...]
    # 2.15+: every backend, built-ins included, is created through
    # ``Backend._plugins`` after ``Backend._ensure_backend_registered``.
    registry: bool
    # Names of the optional pieces that are missing (recorded without them).
    degraded: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems


_HELPER_PARAMS = ("backend", "store", "backend_options", "group_desc", "global_ranks_in_group")
_OPTION_FIELDS = ("store", "group_rank", "group_size", "timeout", "group_id",
                  "global_ranks_in_group")


def _probe_register_backend() -> None:
    params = inspect.signature(dist.Backend.register_backend).parameters
    missing = [p for p in ("extended_api", "devices") if p not in params]
    if missing:
        raise RuntimeError(f"Backend.register_backend lacks {missing}")
    if not isinstance(dist.Backend._plugins, dict):
        raise RuntimeError("Backend._plugins is not a dict")


def _probe_helper() -> None:
    params = inspect.signature(c10d._new_process_group_helper).parameters
    missing = [p for p in _HELPER_PARAMS if p not in params]
    if missing:
        raise RuntimeError(f"_new_process_group_helper lacks parameters {missing}")


def _probe_world() -> None:
    world = c10d._world
    for attr in ("pg_map", "pg_backend_config", "default_pg"):
        getattr(world, attr)


def _probe_backend_config() -> None:
    mapping = c10d.BackendConfig("gloo").get_device_backend_map()
    if "cpu" not in {str(d) for d in mapping}:
        raise RuntimeError("BackendConfig('gloo') maps no cpu device")


def _probe_process_group() -> None:
    pg = dist.ProcessGroup
    for attr in ("_register_backend", "_set_default_backend", "BackendType"):
        if not hasattr(pg, attr):
            raise RuntimeError(f"ProcessGroup.{attr} is missing")


def _probe_backend_options() -> None:
    opts = c10d._DistributedBackendOptions()
    for name in _OPTION_FIELDS:
        if not hasattr(opts, name):
            raise RuntimeError(f"_DistributedBackendOptions.{name} is missing")


def _probe_builtins() -> None:
    if _has_registry():
        return
    # 2.13: the helper builds gloo and nccl from their classes.
    if not hasattr(c10d, "ProcessGroupGloo"):
        raise RuntimeError("ProcessGroupGloo is missing")


PROBES: dict[str, Callable[[], None]] = {
    "register_backend": _probe_register_backend,
    "new_process_group_helper": _probe_helper,
    "world": _probe_world,
    "backend_config": _probe_backend_config,
    "process_group": _probe_process_group,
    "backend_options": _probe_backend_options,
    "builtins": _probe_builtins,
}
"""Every private c10d API the recorder relies on (a failure turns the recorder off)."""


def _has_registry() -> bool:
    return callable(getattr(dist.Backend, "_ensure_backend_registered", None))


def _optional_missing() -> tuple[str, ...]:
    missing = []
    for name in ("batch_isend_irecv", "_coalescing_manager", "_check_p2p_op_list"):
        if not callable(getattr(c10d, name, None)):
            missing.append(name)
    return tuple(missing)


def probe() -> Probes:
    """Run every probe; never raises."""
    problems = []
    for name, check in PROBES.items():
        try:
            check()
        except Exception as exc:
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    registry = False
    with contextlib.suppress(Exception):
        registry = _has_registry()
    return Probes(torch_version=str(getattr(torch, "__version__", "?")),
                  problems=tuple(problems), registry=registry,
                  degraded=_optional_missing())


def say(message: str) -> None:
    """One line on stderr (what was not recorded and why); never raises."""
    with contextlib.suppress(Exception):
        print(f"frforensics: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the creator


@dataclass
class GroupRequest:
    """What the patched helper knows about the group being made, for the creator."""

    backend: str
    backend_options: Any
    group_desc: str
    is_default: bool
    device_id: Any = None
    # The backend to split from, as torch's helper would pick it for the real
    # backend name (it picks none for our plugin name).
    split_from: Any = None
    failure: BaseException | None = None


_request = threading.local()


def _device_map(backend: str) -> dict[str, str]:
    config = c10d.BackendConfig(backend)
    return {str(d): str(b) for d, b in config.get_device_backend_map().items()}


def _backend_type(name: str) -> Any:
    bt = dist.ProcessGroup.BackendType
    mapping = getattr(dist.Backend, "backend_type_map", None)
    if isinstance(mapping, dict) and name in mapping:
        return mapping[name]
    return {"gloo": bt.GLOO, "nccl": bt.NCCL}.get(name, bt.CUSTOM)


def _backend_options(opts: Any, store: Any, timeout: timedelta, ranks: list[int],
                     split_from: Any) -> Any:
    """The options torch's helper hands a registered creator, for one device."""
    sub = c10d._DistributedBackendOptions()
    sub.store = store
    sub.group_rank = opts.group_rank
    sub.group_size = opts.group_size
    sub.timeout = timeout
    sub.group_id = opts.group_id
    sub.global_ranks_in_group = ranks
    # 2.15 (distributed_c10d.py, _new_process_group_helper): the group being
    # built (nccl2 reads and sets its bound device there), the split source and
    # the reconfigure flag.
    for name, value in (("process_group", getattr(opts, "process_group", None)),
                        ("split_from", split_from),
                        ("enable_reconfigure", getattr(opts, "enable_reconfigure", False))):
        if hasattr(sub, name) and value is not None:
            setattr(sub, name, value)
    return sub


def _make_inner_213(name: str, store: Any, opts: Any, backend_options: Any,
                    timeout: timedelta, ranks: list[int]) -> Any:
    """torch 2.13's helper: gloo and nccl from their classes (distributed_c10d.py 2.13)."""
    if name == "gloo":
        pg = c10d.ProcessGroupGloo(store, opts.group_rank, opts.group_size, timeout=timeout)
        pg.options.global_ranks_in_group = ranks
        pg.options.group_name = opts.group_id
        pg._set_sequence_number_for_group()
        return pg
    nccl_opts = backend_options
    if nccl_opts is None or not isinstance(nccl_opts, c10d.ProcessGroupNCCL.Options):
        nccl_opts = c10d.ProcessGroupNCCL.Options()
        nccl_opts.is_high_priority_stream = False
    nccl_opts._timeout = timeout
    nccl_opts.global_ranks_in_group = ranks
    nccl_opts.group_name = opts.group_id
    with contextlib.suppress(Exception):
        default = c10d._world.default_pg
        if default is not None:
            split_from = c10d._get_split_source(default)
            if split_from is not None:
                nccl_opts.split_from = split_from
                nccl_opts.split_color = c10d._process_group_color(ranks)
    pg = c10d.ProcessGroupNCCL(store, opts.group_rank, opts.group_size, nccl_opts)
    pg._set_sequence_number_for_group()
    return pg


def registered_creator(name: str) -> Any | None:
    """The ``Backend._BackendPlugin`` torch would create ``name`` with (None: a 2.13 built-in)."""
    if _has_registry():
        dist.Backend._ensure_backend_registered(name)
        plugin = dist.Backend._plugins.get(name.upper())
        if plugin is None:
            raise RuntimeError(f"torch has no creator registered for backend {name!r}")
        return plugin
    if name in ("gloo", "nccl"):
        return None
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise RuntimeError(f"frforensics cannot wrap backend {name!r}")
    return plugin


def make_inner(name: str, device: str, opts: Any, backend_options: Any, prefix_store: Any,
               timeout: timedelta, split_from: Any = None) -> Any:
    """One device's real backend, built the way the installed torch builds ``name``."""
    store = dist.PrefixStore(f"{device}/", prefix_store)
    ranks = list(opts.global_ranks_in_group)
    plugin = registered_creator(name)
    if plugin is None:
        return _make_inner_213(name, store, opts, backend_options, timeout, ranks)
    if plugin.extended_api:
        sub = _backend_options(opts, store, timeout, ranks, split_from)
        return plugin.creator_fn(sub, backend_options)
    return plugin.creator_fn(store, opts.group_rank, opts.group_size, timeout)


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def build_group(recorder: Recorder, req: GroupRequest, opts: Any,
                backend_options: Any) -> Any:
    """The recording wrapper around the backends torch would build for ``req``."""
    timeout = opts.timeout if opts.timeout is not None else c10d.default_pg_timeout
    prefix_store = getattr(opts.store, "underlying_store", None) or opts.store
    dmap = _device_map(req.backend)
    backends: dict[str, Any] = {}
    by_name: dict[str, Any] = {}
    for device, name in dmap.items():
        if name not in by_name:
            inner = make_inner(name, device, opts, backend_options, prefix_store, timeout,
                               req.split_from)
            if inner is None:
                raise RuntimeError(f"the creator of {name!r} returned no backend")
            by_name[name] = inner
        backends[device] = by_name[name]
    ranks = tuple(int(r) for r in opts.global_ranks_in_group) or tuple(range(opts.group_size))
    names = set(dmap.values())
    default_device = ("cuda" if "cuda" in backends and any(n.startswith("nccl") for n in names)
                      else next(iter(backends)))
    state: GroupState = recorder.new_group(
        name=str(opts.group_id), desc=req.group_desc, ranks=ranks,
        backend=req.backend, timeout_ms=int(timeout.total_seconds() * 1000),
    )
    # A plain "gloo" maps cuda to gloo too: CUDA matters only where it exists.
    state.cuda = "cuda" in backends and _cuda_available()
    for device, inner in backends.items():
        _note_native_source(dmap[device], inner)
    bound = req.device_id
    torch_pg = getattr(opts, "process_group", None)
    if torch_pg is not None and getattr(torch_pg, "bound_device_id", None) is not None:
        bound = torch_pg.bound_device_id  # nccl2 binds a device when none was given
    dispatch, hook = _hooked_dispatch(req, opts, dmap, backends, default_device, ranks,
                                      prefix_store, bound)
    if recorder.cxx is not None and hook is None and not state.cuda:
        return _native_group(recorder, state, opts, backends, dmap, default_device,
                             prefix_store, bound)
    pg = RecordingProcessGroup(recorder, state, opts.group_rank, opts.group_size, dispatch,
                               default_device, store=prefix_store)
    pg._frf_fr_hook = hook
    for device, inner in backends.items():
        pg._register_backend(torch.device(device), _backend_type(dmap[device]), inner)
    pg._set_default_backend(_backend_type(dmap[default_device]))
    if bound is not None:
        with contextlib.suppress(Exception):
            pg.bound_device_id = bound
    return pg


# The groups the native path records (plain ProcessGroups), with their state.
_native_states: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
_native_parents: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def native_ring(rec: Recorder, build_now: bool = True) -> Any:
    """The native ring for ``rec`` (docs/recorder-native.md), or None.

    ``build_now`` (``recorder_path="cxx"``): built now if need be, a failure said once.
    Else (``"auto"``): only a cached build; without one the job records with the
    Python wrapper, said once by the process that starts the machine's background
    build, and every dump notes why."""
    from frforensics.recorder import _cxx
    from frforensics.recorder import _ring as R

    if build_now:
        module, why = _cxx.load()
        if module is None:
            say(f"the native recording path is unavailable: {why}; recording with the "
                "Python wrapper")
    else:
        module, why, started = _cxx.load_if_built()
        if started:
            say(f"the native recording path is not built on this machine yet: building it "
                f"in the background ({_cxx.LOG} under {_cxx.cache_dir(torch.__version__)}); "
                "this job records with the Python wrapper, later ones natively")
    if module is None:
        rec.native_why = why
        return None
    return module.Ring(rec.config.buffer_size, rec.stack_depth,
                       list(R.default_skip_prefixes()), 100_000)


def state_of(pg: Any) -> GroupState | None:
    """The recorder's state of a group we built (either path), else None."""
    state = getattr(pg, "_frf_state", None)
    if state is None:
        with contextlib.suppress(TypeError):
            state = _native_states.get(pg)
    return state


def _native_wrappers(pg: Any) -> list[Any]:
    """The native recording backends registered on ``pg`` (one per backend object)."""
    from frforensics.recorder import _cxx

    module, _ = _cxx.load()
    if module is None:
        return []
    found: dict[int, Any] = {}
    for device in getattr(pg, "_device_types", []):
        with contextlib.suppress(Exception):
            backend = pg._get_backend(device)
            if isinstance(backend, module.RecordingBackend):
                found[id(backend)] = backend
    return list(found.values())


class _NativeGroups:
    """``_reconfig.NativeGroups``: a re-formed group on the native path."""

    def state_of(self, group: Any) -> GroupState | None:
        return state_of(group)

    def counters(self, group: Any) -> tuple[int, int] | None:
        wrappers = _native_wrappers(group)
        if not wrappers:
            return None
        cgroup = wrappers[0].group()
        return int(cgroup.seq), int(cgroup.p2p_seq)

    def rebind(self, group: Any, state: GroupState) -> None:
        rec = _installed.get("recorder")
        if rec is None or rec.cxx is None:
            return
        cgroup = rec.cxx.new_group(state.index, list(state.ranks), int(state.timeout_ms))
        for wrapper in _native_wrappers(group):
            wrapper.set_group(cgroup)
        _native_states[group] = state


NATIVE_GROUPS = _NativeGroups()


def _native_backends(rec: Recorder, state: GroupState,
                     backends: dict[str, Any]) -> dict[str, Any]:
    """Device -> the native recording wrapper of its backend (one per backend object)."""
    from frforensics.recorder import _cxx

    module, _ = _cxx.load()
    cgroup = rec.cxx.new_group(state.index, list(state.ranks), int(state.timeout_ms))
    wrapped: dict[int, Any] = {}
    for inner in backends.values():
        if id(inner) not in wrapped:
            wrapped[id(inner)] = module.wrap(inner, rec.cxx, cgroup)
    return {device: wrapped[id(inner)] for device, inner in backends.items()}


def _native_group(rec: Recorder, state: GroupState, opts: Any, backends: dict[str, Any],
                  dmap: dict[str, str], default_device: str, prefix_store: Any,
                  bound: Any) -> Any:
    """A plain ProcessGroup whose backends are the native recording wrappers."""
    pg = dist.ProcessGroup(prefix_store, opts.group_rank, opts.group_size)
    for device, wrapper in _native_backends(rec, state, backends).items():
        pg._register_backend(torch.device(device), _backend_type(dmap[device]), wrapper)
    pg._set_default_backend(_backend_type(dmap[default_device]))
    if bound is not None:
        with contextlib.suppress(Exception):
            pg.bound_device_id = bound
    _native_states[pg] = state
    return pg


def _self_recording(name: str) -> bool:
    """Whether torch counts ``name`` as feeding a FlightRecorder by itself (2.15)."""
    names = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    return names is None or name in names


def _hooked_dispatch(req: GroupRequest, opts: Any, dmap: dict[str, str],
                     backends: dict[str, Any], default_device: str, ranks: tuple[int, ...],
                     prefix_store: Any, bound: Any) -> tuple[dict[str, Any], Any]:
    """Per device, what the wrapper calls: the backend, or a hooked inner group.

    torch 2.15 (``_maybe_attach_flight_recorder``) attaches a C++
    ``FlightRecorderHook`` to groups whose backends do not record themselves
    (nccl2, nccl-lazy, plugins); its pre/post hooks fire in c10d's dispatcher
    kernels (Ops.cpp), which the wrapper's Python methods never reach. So for
    those devices the wrapper calls a plain ``ProcessGroup`` built like torch's
    (same backends, name, desc, bound device) with torch's own hook attached by
    torch's own function: the native entries are exactly those torch would
    record, once. Self-recording backends (gloo, legacy nccl) are called
    directly. On 2.13 (no hook) every device calls its backend.
    """
    attach = getattr(c10d, "_maybe_attach_flight_recorder", None)
    hooks = getattr(c10d._world, "pg_flight_recorder_hooks", None)
    if attach is None or not isinstance(hooks, dict) or all(
            _self_recording(n) for n in dmap.values()):
        return backends, None
    try:
        inner_pg = dist.ProcessGroup(
            getattr(opts.store, "underlying_store", None) or opts.store,
            opts.group_rank, opts.group_size)
        for device, backend in backends.items():
            inner_pg._register_backend(torch.device(device), _backend_type(dmap[device]),
                                       backend)
        inner_pg._set_default_backend(_backend_type(dmap[default_device]))
        inner_pg._set_group_name(str(opts.group_id))
        inner_pg._set_group_desc(req.group_desc or "undefined")
        if bound is not None:
            inner_pg.bound_device_id = bound
        attach(inner_pg, c10d.BackendConfig(req.backend), list(ranks))
        hook = hooks.pop(inner_pg, None)
    except Exception as exc:
        raise RuntimeError(f"attaching torch's FlightRecorderHook failed: {exc}") from exc
    if hook is None:  # TORCH_FR_BUFFER_SIZE=0: torch attaches nothing either
        return backends, None
    dispatch = {device: (backend if _self_recording(dmap[device]) else inner_pg)
                for device, backend in backends.items()}
    return dispatch, hook


def creator(opts: Any, backend_options: Any = None) -> Any:
    """The creator registered with torch under ``frforensics``."""
    rec = _installed.get("recorder")
    req: GroupRequest | None = getattr(_request, "value", None)
    if rec is None:
        raise RuntimeError("frforensics backend requested but the recorder is not enabled")
    if req is None:  # someone asked for the plugin by name: wrap the device default
        req = GroupRequest("undefined", backend_options, "", False)
    try:
        return build_group(rec, req, opts, backend_options)
    except BaseException as exc:
        req.failure = exc
        raise


# ---------------------------------------------------------------- routing

_installed: dict[str, Any] = {}


def _routes(recorder: Recorder, backend: Any) -> bool:
    if not recorder.active or backend is None:
        return False
    name = str(backend).lower()
    if name in _NEVER_ROUTED:
        return False
    try:
        backends = set(_device_map(name).values())
    except Exception:
        return False
    return bool(backends) and backends <= set(recorder.wrap_backends)


def _split_source(backend: str, backend_options: Any, default: Any) -> Any:
    """The split source torch 2.15's helper would pick for ``backend`` (None on 2.13).

    2.15 (``_new_process_group_helper``): only when the default group has a bound
    device, the subgroup is not ``lazy_init``, and the parent's backend for that
    device is the requested one (``_get_split_source(pg, backend)``). 2.13 picks
    its split source inside the NCCL branch (see ``_make_inner_213``).
    """
    if not _has_registry() or default is None:
        return None
    try:
        if not default.bound_device_id or getattr(backend_options, "lazy_init", False):
            return None
        return c10d._get_split_source(default, backend)
    except Exception:
        return None


def install(recorder: Recorder) -> None:
    """Register the plugin and route the recorder's backend names through it (idempotent)."""
    if PLUGIN_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(PLUGIN_NAME, creator, extended_api=True,
                                      devices=["cpu", "cuda"])
    _installed["recorder"] = recorder
    if "helper" not in _installed:
        _install_helper()
    if "batch" not in _installed and not _optional_missing():
        _install_batch()
    if "split" not in _installed and callable(getattr(c10d, "split_group", None)):
        _install_split()
    if "set_timeout" not in _installed and callable(getattr(c10d, "_set_pg_timeout", None)) \
            and not callable(getattr(c10d, "set_timeout", None)):
        _install_set_timeout()


def _install_set_timeout() -> None:
    """torch's ``_set_pg_timeout`` (which ``dist.breakpoint(timeout_s=...)`` calls on
    every group) changes a live group's timeout only on backends that are
    ``ProcessGroupGloo``/``ProcessGroupNCCL`` instances (distributed_c10d.py, 2.13.0
    l. 1641-1661): on a group the native path records, whose registered backends are
    our wrappers, it would warn and change nothing. There it reaches the wrapped
    backends' own setter; every other group goes to torch's function as before.
    torch 2.15 has ``set_timeout`` (``_set_pg_timeout`` calls it): the group's C++
    ``setTimeout`` reaches every backend, which our wrapper forwards to its inner
    one, so nothing is wrapped there."""
    original = c10d._set_pg_timeout

    def _set_pg_timeout(timeout: Any, group: Any = None) -> None:
        target = c10d._world.default_pg if group is None else group
        inner: list[Any] = []
        with contextlib.suppress(TypeError):
            if target is not None and target in _native_states:
                inner = [w.inner() for w in _native_wrappers(target)]
        if not inner:
            original(timeout, group)
            return None
        if c10d._rank_not_in_group(target):
            raise ValueError("Invalid process group specified")
        setters = [s for s in (getattr(b, "_set_default_timeout", None) for b in inner)
                   if callable(s)]
        if not setters:
            warnings.warn("Set timeout is now only supported for either nccl or gloo.",
                          stacklevel=2)
        for setter in setters:
            setter(timeout)
        return None

    _set_pg_timeout.__wrapped__ = original  # type: ignore[attr-defined]
    _installed["set_timeout"] = original
    c10d._set_pg_timeout = _set_pg_timeout


def _install_helper() -> None:
    original = c10d._new_process_group_helper
    signature = inspect.signature(original)

    def _new_process_group_helper(*args: Any, **kwargs: Any) -> Any:
        rec = _installed.get("recorder")
        try:
            bound = signature.bind(*args, **kwargs)
            backend = bound.arguments.get("backend")
            route = rec is not None and _routes(rec, backend)
        except Exception:
            route = False
        if not route or rec is None:
            return original(*args, **kwargs)
        default = c10d._world.default_pg
        backend_options = bound.arguments.get("backend_options")
        members = bound.arguments.get("global_ranks_in_group") or []
        if default is not None and members and default.rank() not in members:
            # Not a member: torch returns before any creator runs (after the
            # no-color split the members' split needs, for the real name).
            return original(*args, **kwargs)
        split_from = _split_source(str(backend), backend_options, default)
        req = GroupRequest(
            backend=str(backend),
            backend_options=backend_options,
            group_desc=str(bound.arguments.get("group_desc") or ""),
            is_default=default is None,
            device_id=bound.arguments.get("device_id"),
            split_from=split_from,
        )
        routed = bound.arguments.copy()
        routed["backend"] = PLUGIN_NAME
        previous = getattr(_request, "value", None)
        _request.value = req
        try:
            pg, prefix_store = original(**routed)
        except Exception as exc:
            if req.failure is None:
                raise  # torch's own error, as it would have raised it
            what = f"group {bound.arguments.get('group_name')} ({backend})"
            rec.unrecorded.append(f"{what}: {type(exc).__name__}: {exc}")
            say(f"{what} not recorded: creating its backend under the recorder failed "
                f"({type(exc).__name__}: {exc}); created by torch as usual")
            return original(*args, **kwargs)
        finally:
            _request.value = previous
        if state_of(pg) is not None:
            _adopt(rec, pg, str(backend), bound.arguments.get("store"), req.is_default)
        return pg, prefix_store

    _new_process_group_helper.__wrapped__ = original  # type: ignore[attr-defined]
    _installed["helper"] = original
    c10d._new_process_group_helper = _new_process_group_helper


def _adopt(rec: Recorder, pg: Any, backend: str, store: Any,
           is_default: bool) -> None:
    """Make the new group look like torch's own: its real backend name, name, desc.

    torch 2.15 attached a FlightRecorderHook to the wrapper (our plugin name is
    not self-recording); it would never fire (see ``_hooked_dispatch``): it is
    replaced by the hook on the inner group, or dropped where torch would attach
    none, and kept in ``_world`` so ``destroy_process_group`` releases it.
    """
    hooks = getattr(c10d._world, "pg_flight_recorder_hooks", None)
    if isinstance(hooks, dict):
        with contextlib.suppress(Exception):
            stray = hooks.pop(pg, None)
            if stray is not None:
                stray.remove()
            own = getattr(pg, "_frf_fr_hook", None)
            if own is not None:
                hooks[pg] = own
    with contextlib.suppress(Exception):
        c10d._world.pg_map[pg] = (backend, c10d._world.pg_map[pg][1])
        c10d._world.pg_backend_config[pg] = str(c10d.BackendConfig(backend))
    with contextlib.suppress(Exception):
        state = state_of(pg)
        if state is not None:
            state.name = str(pg.group_name)
            state.desc = str(pg.group_desc)
    if is_default:
        rec.set_store(store_client(rec, store), pg.rank(), pg.size())


def store_client(rec: Recorder, store: Any) -> Any:
    """A store client of our own for the flag and heartbeats (None if impossible)."""
    try:
        root = store
        while isinstance(root, dist.PrefixStore):
            root = root.underlying_store
        client = root
        if isinstance(root, dist.TCPStore):
            with contextlib.suppress(Exception):
                client = root.clone()
        with contextlib.suppress(Exception):
            client.set_timeout(timedelta(seconds=rec.config.store_timeout_s))
        return dist.PrefixStore(rec.namespace, client)
    except Exception as exc:
        rec.note_error("store client", exc)
        return None


def _install_batch() -> None:
    original_batch = c10d.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list[Any]) -> Any:
        try:
            group = p2p_op_list[0].group if p2p_op_list else None
            if group is None and p2p_op_list:
                group = c10d._get_default_group()
            device = p2p_op_list[0].tensor.device if p2p_op_list else None
            batched = isinstance(group, RecordingProcessGroup) and bool(
                group._get_backend(device).supports_coalescing)
        except Exception:
            batched = False
        if not batched:
            return original_batch(p2p_op_list)
        # PyTorch batches only `type(group) is ProcessGroup`: keep NCCL p2p batched.
        c10d._check_p2p_op_list(p2p_op_list)
        with c10d._coalescing_manager(group, device, async_ops=True) as cm:
            for p2p_op in p2p_op_list:
                key = "group_dst" if p2p_op.op is c10d.isend else "group_src"
                p2p_op.op(p2p_op.tensor, group=p2p_op.group, tag=p2p_op.tag,
                          **{key: p2p_op.group_peer})
        return cm.works

    batch_isend_irecv.__wrapped__ = original_batch  # type: ignore[attr-defined]
    _installed["batch"] = original_batch
    c10d.batch_isend_irecv = batch_isend_irecv
    if dist.batch_isend_irecv is original_batch:
        dist.batch_isend_irecv = batch_isend_irecv


def _install_split() -> None:
    original = c10d.split_group

    def split_group(*args: Any, **kwargs: Any) -> Any:
        pg = original(*args, **kwargs)
        rec = _installed.get("recorder")
        if (rec is None or not isinstance(pg, dist.ProcessGroup)
                or state_of(pg) is not None):
            return pg
        try:
            backend = str(c10d._world.pg_map[pg][0])
            if not _routes(rec, backend):
                return pg
            return wrap_split(rec, pg, backend)
        except Exception as exc:
            name = getattr(pg, "group_name", "?")
            rec.unrecorded.append(f"split group {name}: {type(exc).__name__}: {exc}")
            say(f"split group {name} not recorded ({type(exc).__name__}: {exc}); "
                "it works as torch made it")
            return pg

    split_group.__wrapped__ = original  # type: ignore[attr-defined]
    _installed["split"] = original
    c10d.split_group = split_group
    if getattr(dist, "split_group", None) is original:
        dist.split_group = split_group
    mesh: Any = sys.modules.get("torch.distributed.device_mesh")
    if mesh is not None and getattr(mesh, "split_group", None) is original:
        mesh.split_group = split_group  # DeviceMesh imported it by name


_WORLD_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
                 "pg_coalesce_state", "pg_flight_recorder_hooks")


def wrap_split(rec: Recorder, split: Any, backend: str) -> Any:
    """The recording wrapper around a group ``split_group`` made, put in its place.

    ``split_group`` builds its group with the parent's C++ ``splitGroup`` (no
    creator runs), registers it in ``_world`` and c10d's group registry, and on
    2.15 attaches torch's FlightRecorderHook to it. The wrapper serves each device
    with the split backend (self-recording ones) or through the split group itself
    (so the hook still fires), and takes the split group's place in every
    ``_world`` table and in the registry (functional collectives resolve groups by
    name there). The split group stays alive as the wrapper's inner group.
    """
    world = c10d._world
    devices = [str(d.type) for d in split._device_types]
    full = _device_map(backend)
    dmap = {d: full.get(d, backend) for d in devices}
    backends = {d: split._get_backend(torch.device(d)) for d in devices}
    mapping = world.pg_group_ranks[split]  # global rank -> group rank
    ranks = tuple(int(g) for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))
    default_device = ("cuda" if "cuda" in backends and any(
        n.startswith("nccl") for n in dmap.values()) else devices[0])
    timeout_ms = 0
    with contextlib.suppress(Exception):
        timeout_ms = int(backends[default_device].options._timeout.total_seconds() * 1000)
    state = rec.new_group(name=str(split.group_name), desc=str(split.group_desc), ranks=ranks,
                          backend=backend, timeout_ms=timeout_ms)
    state.cuda = "cuda" in backends and _cuda_available()
    hooks = getattr(world, "pg_flight_recorder_hooks", None)
    hooked = isinstance(hooks, dict) and hooks.get(split) is not None
    dispatch = {d: (split if hooked and not _self_recording(dmap[d]) else be)
                for d, be in backends.items()}
    store = None
    with contextlib.suppress(Exception):
        store = split.get_group_store()
    for d, be in backends.items():
        _note_native_source(dmap[d], be)
    if rec.cxx is not None and not hooked and not state.cuda:
        return _native_split(rec, state, split, backends, dmap, default_device, store)
    pg = RecordingProcessGroup(rec, state, split.rank(), split.size(), dispatch, default_device,
                               store=store)
    pg._frf_split_from = split
    return _put_in_place_of(split, pg, backends, dmap, default_device)


def _put_in_place_of(split: Any, pg: Any, backends: dict[str, Any], dmap: dict[str, str],
                     default_device: str) -> Any:
    """``pg`` over ``backends`` (device -> backend), named as ``split``, in its place."""
    for d, be in backends.items():
        pg._register_backend(torch.device(d), _backend_type(dmap[d]), be)
    pg._set_default_backend(_backend_type(dmap[default_device]))
    pg._set_group_name(str(split.group_name))
    pg._set_group_desc(str(split.group_desc))
    if split.bound_device_id is not None:
        pg.bound_device_id = split.bound_device_id
    _replace_in_world(split, pg)
    return pg


def _native_split(rec: Recorder, state: GroupState, split: Any, backends: dict[str, Any],
                  dmap: dict[str, str], default_device: str, store: Any) -> Any:
    """``wrap_split`` on the native path: a plain group over the recording backends."""
    pg = (dist.ProcessGroup(store, split.rank(), split.size()) if store is not None
          else dist.ProcessGroup(split.rank(), split.size()))
    _native_states[pg] = state
    _native_parents[pg] = split  # kept alive: its backends are the wrapped ones
    return _put_in_place_of(split, pg, _native_backends(rec, state, backends), dmap,
                            default_device)


def _replace_in_world(old: Any, new: Any) -> None:
    world = c10d._world
    for table in _WORLD_TABLES:
        d = getattr(world, table, None)
        if isinstance(d, dict) and old in d:
            d[new] = d.pop(old)
    tags = getattr(world, "tags_to_pg", None)
    if isinstance(tags, dict):
        for members in tags.values():
            for k, member in enumerate(members):
                if member is old:
                    members[k] = new
    name = world.pg_names[new]
    c10d._unregister_process_group(name)
    c10d._register_process_group(name, new)


def uninstall() -> None:
    """Stop routing new groups (existing groups keep their wrapper, now recording nothing)."""
    _installed.pop("recorder", None)


def torn_down() -> bool:
    """True once the job destroyed its default group."""
    return c10d._world.default_pg is None


def dist_initialized() -> bool:
    return bool(dist.is_available() and dist.is_initialized())


# ---------------------------------------------------------------- native dumps


_native_sources: dict[tuple[str, str], None] = {}
"""(api, key) of every native recorder our groups' backends feed, in creation order."""


def _note_native_source(name: str, backend: Any) -> None:
    with contextlib.suppress(Exception):
        legacy_nccl = hasattr(c10d, "ProcessGroupNCCL") and isinstance(
            backend, c10d.ProcessGroupNCCL)
        if legacy_nccl:
            # Stock ProcessGroupNCCL records into its CUDA FlightRecorder,
            # dumped by _dump_nccl_trace on 2.13 and 2.15 alike.
            _native_sources.setdefault(("nccl_trace", "nccl"), None)
        else:
            # FlightRecorder<c10::Event>: gloo's own, and on 2.15 the instance
            # torch's FlightRecorderHook fills, keyed by the backend's name.
            _native_sources.setdefault(("fr_trace", str(backend.name())), None)


def _native_dump(api: str, key: str, stacks: bool) -> bytes | None:
    # ``stacks`` (``native_stacks``): with stack traces, as PyTorch's own dumps are by
    # default; symbolizing costs ~1 s on a process's first dump (0.86-1.10 s measured
    # for 2000 gloo entries; 14-16 ms after)
    from torch._C import _distributed_c10d as C

    if api == "nccl_trace":
        fn = getattr(C, "_dump_nccl_trace", None)
        return None if fn is None else bytes(fn(includeStackTraces=stacks))
    fn = getattr(C, "_dump_fr_trace", None)
    if fn is None:
        return None
    try:
        return bytes(fn(includeStackTraces=stacks, backend=key))
    except TypeError:
        # 2.13: no backend argument; its one FlightRecorder<c10::Event> is gloo's.
        return bytes(fn(includeStackTraces=stacks)) if key == "gloo" else None


def native_dumps(rec: Recorder) -> list[tuple[str, bytes]]:
    """PyTorch's own dumps of this process, one per native recorder with entries.

    Each with gloo's empty ``pg_config`` filled in from our groups and a
    top-level ``rank``. The first (a GPU backend's when there is one) is saved as
    ``nccl_trace_rank_<rank>``, the others as ``nccl_trace_<key>_rank_<rank>``.
    """
    out: list[tuple[str, bytes]] = []
    sources = sorted(_native_sources, key=lambda s: s[1] == "gloo")
    for api, key in sources:
        try:
            raw = _native_dump(api, key, rec.config.native_stacks)
            data = _repaired(rec, raw) if raw else None
        except Exception as exc:
            rec.note_error(f"native dump {key}", exc)
            continue
        if data is not None:
            out.append((key, data))
    return out


def _repaired(rec: Recorder, raw: bytes) -> bytes | None:
    from frforensics.formats.native import decode_pickle

    doc = decode_pickle(raw, source="torch native flight recorder")
    if not isinstance(doc, dict) or not doc.get("entries"):
        return None
    config = doc.get("pg_config")
    broken = not isinstance(config, dict) or any(
        not (isinstance(v, dict) and v.get("name")) for v in config.values())
    if broken or not config:
        doc["pg_config"] = {
            g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))}
            for g in rec.groups
        }
    with contextlib.suppress(Exception):
        doc.setdefault("rank", rec.current_rank())
    return pickle.dumps(doc, protocol=4)
