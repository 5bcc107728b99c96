"""Decode dumps where they lie, on a Dask cluster, and stream compact digests to the merge.

``fr-analyze DUMPS --dask SCHEDULER`` (and :func:`load_dumps_dask`): every host
lists and decodes its own dumps; only compressed digests (``analyzer.wire``)
cross the network, and the central process merges them as they arrive, then
analyzes as for a local load. ``distributed`` is an optional dependency
(``pip install 'frforensics[dask]'``), imported only here and only when asked.

Where the dumps are:

* ``DUMPS`` are paths that each host resolves on its own disks (a node-local
  ``/var/tmp/fr``): one *listing* task per host (Dask workers grouped by their
  ``host``), pinned to a worker there, walks the paths (names only, the walk
  rules of ``formats.sources.discover``); then *decode* tasks, pinned to the same
  host's workers, read batches of its files through the one reader
  (:func:`digest_here`) and send back one wire payload per batch.
* ``{host}`` and ``{worker}`` in a path are replaced on each worker by its host
  and its worker name; with ``{worker}`` every worker is its own unit (several
  workers on one machine, each with its own folder).
* a manifest (``--manifest FILE``, JSON ``{"HOST": ["path", ...], ...}``) says
  which files each host holds; a key names a host, a worker name or a worker
  address. A host in the manifest that no worker runs on becomes load problems
  for its files right away.

Failures never hang the client: a task that fails (it raised on the worker, or
its result could not come back: that batch only), a host all of whose workers
left the cluster (killed, lost), and a host that has not finished within
``host_deadline_s`` become
:class:`~frforensics.report.LoadProblem`\\ s naming the files (so the ranks)
that were not read; the verdict is given on the rest, and ranks expected from
the job's groups but not read are the report's missing ranks.

Trust: Dask brings task results back with pickle, so the cluster's workers must
be trusted (docs/security.md, "Workers"): run ``--dask`` only on your own
cluster. The digests themselves are ``bytes`` decoded by ``wire.decode_batch``
(no pickle, the file readers' limits); a result of any other shape, and a
digest naming a file its batch was not asked to read, is a load problem for
that batch's files.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from frforensics._gc import gc_paused
from frforensics.analyzer import wire

# the seam with the local loader: ``digest_source`` decodes on the worker (after
# the one reader's ``discover``), ``DumpSet.add`` settles duplicates centrally
# exactly as load_dumps does
from frforensics.analyzer.digest import DEFAULT_TAIL, RankDigest
from frforensics.analyzer.load import DumpSet, digest_source
from frforensics.errors import UsageError
from frforensics.formats.sources import Skipped, discover
from frforensics.report import LoadProblem

# distributed's API is only partly typed (and absent where the extra is not
# installed): its objects are ``Any`` here
Client = Any
Future = Any

__all__ = ["digest_here", "load_dumps_dask", "read_manifest"]

#: one listed file: label (``HOST:path``), path on its host, named explicitly
_Item = tuple[str, str, bool]

DEFAULT_HOST_DEADLINE_S: Final = 600.0
_POLL_S: Final = 0.5  # how often the workers' liveness and the deadlines are checked
_SLEEP_S: Final = 0.02
_MAX_BATCH: Final = 64


# ---------------------------------------------------------------- worker side


def _list_here(paths: Sequence[str], unit: str) -> tuple[list[_Item], list[tuple[str, str]]]:
    """On a worker: the candidate dumps under ``paths`` on this host (no bytes read).

    The rules are those of ``formats.sources.discover`` (hidden names skipped, directories
    walked in sorted order); archives are opened by the decode task, on the host.
    """
    items: list[_Item] = []
    problems: list[tuple[str, str]] = []
    for raw in paths:
        path = os.path.abspath(os.path.expanduser(raw))
        label = f"{unit}:{path}"
        if not os.path.exists(path):
            problems.append((label, "no such file or directory on this host"))
            continue
        try:
            if os.path.isdir(path):
                for dirpath, dirnames, filenames in os.walk(path):
                    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                    for name in sorted(filenames):
                        if not name.startswith("."):  # temp files of atomic writes
                            full = os.path.join(dirpath, name)
                            items.append((f"{unit}:{full}", full, False))
            else:
                items.append((label, path, True))
        except OSError as exc:
            problems.append((label, f"cannot list: {exc}"))
    return items, problems


def digest_here(items: Sequence[_Item], *, prefix: str | None = None, tail: int = DEFAULT_TAIL,
                window: int | None = None) -> list[RankDigest | LoadProblem | Skipped]:
    """On a worker: digest listed files (archives opened here) under their ``HOST:path`` labels.

    Each file goes through the one reader (``formats.sources.discover``, which
    refuses FIFOs, devices and oversized or hostile archives, then
    ``load.digest_source``); a file found by the walk keeps the walk's quiet
    rules for non-dumps. Never raises for a bad file.
    """
    out: list[RankDigest | LoadProblem | Skipped] = []
    for label, path, explicit in items:
        host = label[: len(label) - len(path) - 1]
        try:
            for src in discover([path]):
                if isinstance(src, LoadProblem):
                    out.append(replace(src, path=f"{host}:{src.path}"))
                    continue
                src = replace(src, label=f"{host}:{src.label}",
                              explicit=explicit if src.path == path else src.explicit)
                out.append(digest_source(src, prefix=prefix, tail=tail, window=window))
        except UsageError as exc:  # gone since it was listed
            out.append(LoadProblem(label, f"cannot read: {exc}"))
    return out


def _decode_here(items: Sequence[_Item], prefix: str | None, tail: int,
                 codec: str, window: int | None = None) -> tuple[bytes, list[tuple[str, str, bool]]]:
    """On a worker: ``items`` as one wire payload, plus ``(label, error, quiet)`` problems."""
    with gc_paused():
        results = digest_here(items, prefix=prefix, tail=tail, window=window)
    digests = [r for r in results if isinstance(r, RankDigest)]
    problems = [(r.path, r.error, False) for r in results if isinstance(r, LoadProblem)]
    problems.extend((r.label, r.reason, True) for r in results if isinstance(r, Skipped))
    return wire.encode_batch(digests, codec=codec), problems


# ---------------------------------------------------------------- client side


@dataclass(slots=True)
class _Unit:
    """The dumps of one host (or one worker, with ``{worker}`` paths)."""

    key: str
    workers: list[str]
    paths: list[str]
    started: float = 0.0
    listed: bool = False
    items: list[_Item] = field(default_factory=list)  # files listed (or named by the manifest)
    pending: dict[str, list[_Item]] = field(default_factory=dict)  # future key -> its files
    failed: bool = False


def read_manifest(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """``{"HOST": ["path", ...]}`` from a JSON file (a usage error if malformed)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read the manifest: {exc}") from None
    if not isinstance(doc, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(p, str) for p in v)
            for k, v in doc.items()):
        raise UsageError(f'{path}: a manifest is a JSON object {{"host": ["path", ...], ...}}')
    return {k: list(v) for k, v in doc.items()}


def _distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise UsageError("--dask needs Dask's distributed package: "
                         "pip install 'frforensics[dask]'") from None
    return distributed


def _connect(scheduler: str | Client, timeout_s: float) -> tuple[Client, bool]:
    dd = _distributed()
    if not isinstance(scheduler, str):
        return scheduler, False
    try:
        return dd.Client(scheduler, timeout=timeout_s, set_as_default=False), True
    except (OSError, TimeoutError, ValueError) as exc:
        raise UsageError(f"cannot reach the Dask scheduler at {scheduler}: {exc}") from None


def _units(workers: dict[str, Any], paths: Sequence[str],
           manifest: dict[str, list[str]] | None) -> tuple[list[_Unit], list[LoadProblem]]:
    problems: list[LoadProblem] = []
    if manifest is not None:
        units = []
        for key, files in manifest.items():
            mine = sorted(a for a, w in workers.items()
                          if key in (a, str(w.get("name")), str(w.get("host"))))
            if not mine:
                problems.extend(LoadProblem(f"{key}:{f}", f"not read: no Dask worker runs on {key}")
                                for f in files)
                continue
            units.append(_Unit(key, mine, files))
        return units, problems
    per_worker = any("{worker}" in p for p in paths)
    by_key: dict[str, list[str]] = {}
    for addr, w in sorted(workers.items()):
        key = str(w.get("name")) if per_worker else str(w.get("host"))
        by_key.setdefault(key, []).append(addr)
    units = []
    for key, addrs in sorted(by_key.items()):
        w = workers[addrs[0]]
        resolved = [p.replace("{host}", str(w.get("host"))).replace("{worker}", str(w.get("name")))
                    for p in paths]
        units.append(_Unit(key, addrs, resolved))
    return units, problems


def load_dumps_dask(
    paths: Sequence[str | os.PathLike[str]],
    scheduler: str | Client,
    *,
    prefix: str | None = None,
    tail: int = DEFAULT_TAIL,
    manifest: dict[str, list[str]] | None = None,
    host_deadline_s: float = DEFAULT_HOST_DEADLINE_S,
    connect_timeout_s: float = 30.0,
    codec: str = "zlib",
    progress: Callable[[int, int], None] | None = None,
    window: int | None = None,
) -> DumpSet:
    """Like :func:`~frforensics.analyzer.load_dumps`, with every host decoding its own dumps.

    ``scheduler`` is the scheduler's address (``tcp://host:8786``) or a
    ``distributed.Client``. ``host_deadline_s`` bounds each host's work, from
    the start of its listing to its last batch. ``progress(done, total)``: files
    decoded, files listed so far.
    """
    client, own = _connect(scheduler, connect_timeout_s)
    try:
        with gc_paused(settle=True):
            return _load(client, [str(p) for p in paths], prefix=prefix, tail=tail,
                         manifest=manifest, deadline_s=host_deadline_s, codec=codec,
                         progress=progress, window=window)
    finally:
        if own:
            client.close(timeout=10)


def _load(client: Client, paths: list[str], *, prefix: str | None, tail: int,
          manifest: dict[str, list[str]] | None, deadline_s: float, codec: str,
          progress: Callable[[int, int], None] | None, window: int | None = None) -> DumpSet:
    workers = _workers(client)
    if not workers:
        raise UsageError("the Dask cluster has no workers")
    units, early = _units(workers, paths, manifest)
    result = DumpSet(problems=early)
    cache = wire.WireCache()
    owner: dict[str, _Unit] = {}  # future key -> unit
    futures: dict[str, Future] = {}
    # the futures that finished, as Dask's callbacks (on its own thread) report them:
    # the loop reads these, not every outstanding future per turn (1,563 futures
    # scanned every 20 ms were ~7 s of the client's CPU in a 100,000-rank load)
    ready: deque[Future] = deque()
    total = done = 0

    def submit(unit: _Unit, fn: Callable[..., Any], *args: Any) -> str:
        fut = client.submit(fn, *args, workers=unit.workers, allow_other_workers=False,
                            pure=False, retries=0)
        futures[fut.key] = fut
        owner[fut.key] = unit
        fut.add_done_callback(ready.append)  # after the maps: a done future reports at once
        return str(fut.key)

    def fail(unit: _Unit, why: str) -> None:
        """Everything of ``unit`` not yet read becomes load problems."""
        nonlocal done
        unit.failed = True
        if not unit.listed:
            result.problems.append(LoadProblem(
                f"{unit.key}:{','.join(unit.paths)}", f"not read: {why} (its dumps were never listed)"))
        for key, items in unit.pending.items():
            fut = futures.pop(key, None)
            if fut is not None:
                fut.cancel()
            owner.pop(key, None)
            result.problems.extend(LoadProblem(label, f"not read: {why}") for label, *_ in items)
            done += len(items)
        unit.pending.clear()

    def batches(unit: _Unit, items: list[_Item]) -> None:
        nonlocal total
        unit.listed, unit.items = True, items
        total += len(items)
        size = max(1, min(_MAX_BATCH, len(items) // (4 * len(unit.workers)) or 1))
        for i in range(0, len(items), size):
            chunk = items[i:i + size]
            unit.pending[submit(unit, _decode_here, chunk, prefix, tail, codec, window)] = chunk

    now = time.monotonic()
    for unit in units:
        unit.started = now
        if manifest is not None:
            batches(unit, [(f"{unit.key}:{p}", p, True) for p in unit.paths])
        else:
            unit.pending[submit(unit, _list_here, unit.paths, unit.key)] = []
    if progress and total:
        progress(0, total)
    last_check = 0.0
    while futures:
        # polled, not ``distributed.wait``: that needs a default client; the done
        # callbacks fill ``ready``, and every outstanding future is looked at once
        # more with the liveness check below (a callback Dask lost delays a batch by
        # that long, never by the host's deadline)
        finished = []
        while ready:
            fut = ready.popleft()
            if fut.key in futures:  # (not one cancelled with its unit, nor one seen)
                finished.append(fut)
        if not finished:
            time.sleep(_SLEEP_S)
        for fut in finished:
            key = str(fut.key)
            futures.pop(key, None)
            if key not in owner:
                continue
            unit = owner.pop(key)
            items = unit.pending.pop(key, [])
            try:
                value = fut.result() if fut.status == "finished" else None
            except Exception:  # a result that cannot be brought back counts as a failure
                value = None
            if value is None:
                why = _exception(fut)
                if not unit.listed:
                    fail(unit, f"listing on {unit.key} failed: {why}")
                else:  # this batch only: the host's other batches may be fine
                    result.problems.extend(
                        LoadProblem(label, f"not read: decoding on {unit.key} failed: {why}")
                        for label, *_ in items)
                    done += len(items)
                continue
            if not unit.listed:
                try:
                    listed, found = _check_listing(value, unit)
                except wire.WireError as exc:
                    fail(unit, f"listing on {unit.key} sent back {exc}")
                    continue
                result.problems.extend(LoadProblem(label, msg) for label, msg in found)
                batches(unit, listed)
            else:
                labels = {label for label, *_ in items}
                try:
                    payload, problems = _check_batch(value, labels)
                    digests = wire.decode_batch(payload, cache=cache)
                    for digest in digests:
                        _check_source(digest, labels)
                except wire.WireError as exc:  # another version, or a broken or hostile worker
                    digests = []
                    problems = [(label, f"not read: {unit.key} sent back {exc}", False)
                                for label, *_ in items]
                for digest in digests:
                    result.add(digest)
                for label, msg, quiet in problems:
                    if quiet:
                        result.skipped.append(label)
                    else:
                        result.problems.append(LoadProblem(label, msg))
                done += len(items)
            if progress and total:
                progress(done, total)
        now = time.monotonic()
        # the scheduler's answer lists every worker: ask less often on big clusters
        # (every 10 s at 1,000 workers)
        if now - last_check >= max(2 * _POLL_S, len(workers) / 100):
            last_check = now
            ready.extend(fut for fut in futures.values() if fut.done())
            try:
                alive = set(_workers(client))
            except Exception as exc:  # whatever the scheduler's connection raised
                for unit in units:
                    if unit.pending and not unit.failed:
                        fail(unit, f"the Dask scheduler did not answer ({type(exc).__name__})")
                continue
            for unit in units:
                if not (unit.pending and not unit.failed):
                    continue
                if not alive.intersection(unit.workers):
                    fail(unit, f"the Dask worker(s) of {unit.key} left the cluster")
                elif now - unit.started > deadline_s:
                    fail(unit, f"{unit.key} did not finish within {deadline_s:g} s")
                if progress and total:
                    progress(done, total)
    return result


#: a worker's answer is bounded like a payload: labels and messages of at most this
#: many characters, at most this many listed files per host
_MAX_TEXT: Final = 1 << 16
_MAX_LISTED: Final = 1 << 22


def _text_ok(x: Any) -> bool:
    return type(x) is str and len(x) <= _MAX_TEXT


def _check_listing(value: Any, unit: _Unit) -> tuple[list[_Item], list[tuple[str, str]]]:
    """A listing task's result, checked: ``([(label, path, explicit)], [(label, msg)])``.

    Dask brings results back with pickle (the cluster is trusted: docs/security.md);
    this only keeps a broken or mismatched worker from breaking the client."""
    if not (type(value) in (tuple, list) and len(value) == 2
            and type(value[0]) in (tuple, list) and type(value[1]) in (tuple, list)
            and len(value[0]) <= _MAX_LISTED and len(value[1]) <= _MAX_LISTED):
        raise wire.WireError(f"a {type(value).__name__}, not (files, problems)")
    listed, problems = value
    if not all(type(i) in (tuple, list) and len(i) == 3 and _text_ok(i[0]) and _text_ok(i[1])
               and type(i[2]) is bool for i in listed):
        raise wire.WireError("a listed file that is not (label, path, explicit)")
    if not all(type(p) in (tuple, list) and len(p) == 2 and _text_ok(p[0]) and _text_ok(p[1])
               for p in problems):
        raise wire.WireError("a problem that is not (label, message)")
    return [(a, b, c) for a, b, c in listed], [(a, b) for a, b in problems]


def _check_batch(value: Any, labels: set[str]) -> tuple[bytes, list[tuple[str, str, bool]]]:
    """A decode task's result, checked: ``(payload bytes, [(label, msg, quiet)])``, every
    problem about one of the batch's own files."""
    if not (type(value) in (tuple, list) and len(value) == 2 and type(value[0]) is bytes
            and type(value[1]) in (tuple, list) and len(value[1]) <= _MAX_LISTED):
        raise wire.WireError(f"a {type(value).__name__}, not (payload bytes, problems)")
    payload, problems = value
    if not all(type(p) in (tuple, list) and len(p) == 3 and _text_ok(p[0]) and _text_ok(p[1])
               and type(p[2]) is bool for p in problems):
        raise wire.WireError("a problem that is not (label, message, quiet)")
    if not all(_within(p[0], labels) for p in problems):
        raise wire.WireError("a problem about a file that batch was not asked to read")
    return payload, [(a, b, c) for a, b, c in problems]


def _within(label: str, labels: set[str]) -> bool:
    """``label`` is one of ``labels`` or inside one (an archive's member, a walked folder)."""
    if label in labels:
        return True
    return any(label.startswith(x) and label[len(x):len(x) + 1] in ("/", ":", "!")
               for x in labels)


def _check_source(digest: RankDigest, labels: set[str]) -> None:
    """A digest names a file its batch was asked to read: a worker cannot send one under
    another host's name (a forged duplicate of a rank read elsewhere)."""
    if not _within(digest.source, labels):
        raise wire.WireError(f"a digest of rank {digest.rank} from {digest.source[:200]!r}, "
                             "a file that batch was not asked to read")


def _workers(client: Client) -> dict[str, Any]:
    """The scheduler's workers now (address -> info), never waiting more than 30 s."""
    info = client.sync(client.scheduler.identity, n_workers=-1, callback_timeout=30)
    return dict(info["workers"])


def _exception(fut: Future) -> str:
    try:
        exc = fut.exception(timeout=5)
    except Exception as err:  # the scheduler may be gone too
        return f"{type(err).__name__}: {err}"
    return f"{type(exc).__name__}: {exc}" if exc is not None else str(fut.status)
