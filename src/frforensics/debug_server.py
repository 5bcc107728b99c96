"""A "Verdict" page for PyTorch's own debug server (``torch.distributed.debug``).

::

    from torch.distributed.debug import start_debug_server
    from torch.distributed.debug._debug_handlers import default_handlers
    from frforensics.debug_server import VerdictHandler

    start_debug_server(handlers=[*default_handlers(), VerdictHandler()])

``torch.distributed.debug.start_debug_server(handlers=[...])`` (checked in the
wheels of torch 2.15.0 and 2.13.0, ``torch/distributed/debug/__init__.py``) serves every handler's routes from
rank 0's frontend process; a handler is a ``DebugHandler`` subclass with
``routes()``, ``nav_links()`` and ``templates()`` (``_frontend.py``). This one
adds ``/frforensics_verdict``: the newest verdict of the job (the store key
``frforensics/<restart>/verdict/<k>`` the recorder's elected rank sets), shown
as the same report the HTML reporter writes (``verdict.html`` next to
``verdict.json``), inside the debug server's own page; before any hang it
says so. It reads the store and a file: no analysis runs in the server.

The store is written by every rank, so its verdict key is a peer's word
(docs/security.md): the report is shown only when the key names
``verdict.json`` in *this job's* dump folder (``dump_dir``, default the
recorder's, or ``FRFORENSICS_DUMP_DIR``) and ``verdict.html`` there is a
regular file (not a link) of at most :data:`MAX_REPORT_BYTES`; anything else
shows the verdict's text only. The report is rendered in a sandboxed iframe
(``sandbox`` with no ``allow-same-origin`` or ``allow-scripts``), never as the
debug server's origin.
"""

from __future__ import annotations

import html
import json
import os
import stat
from pathlib import Path
from typing import Any

from torch.distributed.debug._frontend import (  # type: ignore[import-not-found,unused-ignore]
    DebugHandler,
    NavLink,
    Route,
)

from frforensics.verdict import Verdict, VerdictError

__all__ = ["VerdictHandler"]

PATH = "/frforensics_verdict"
#: the largest report file shown
MAX_REPORT_BYTES = 16 << 20

_TEMPLATE = """
{% extends "base.html" %}
{% block header %}<h1>frforensics verdict</h1>{% endblock %}
{% block content %}
  <p>{{ summary }}</p>
  {% if report_html %}
  <iframe title="frforensics report" sandbox srcdoc="{{ report_html }}"
          style="width:100%;height:80vh;border:1px solid #ccc"></iframe>
  {% endif %}
{% endblock %}
"""


class VerdictHandler(DebugHandler):  # type: ignore[misc,unused-ignore]
    """Adds the "Verdict" page (``/frforensics_verdict``) to PyTorch's debug server."""

    def __init__(self, *, max_incidents: int = 64,
                 dump_dir: str | os.PathLike[str] | None = None) -> None:
        self.max_incidents = max_incidents
        self._dump_dir = None if dump_dir is None else Path(dump_dir)

    def dump_dir(self) -> Path | None:
        """This job's dump folder: the one given, the recorder's, or FRFORENSICS_DUMP_DIR."""
        if self._dump_dir is not None:
            return self._dump_dir.expanduser().resolve()
        try:
            from frforensics.recorder import session

            sess = session()
            if sess is not None:
                return Path(sess.rec.config.dump_dir).resolve()
        except Exception:  # no recorder in this process: the variable then
            pass
        env = os.environ.get("FRFORENSICS_DUMP_DIR")
        return Path(env).expanduser().resolve() if env else None

    def report_path(self, verdict: Verdict) -> tuple[Path | None, str]:
        """``verdict.html`` of this job's dump folder when the verdict names it, else
        ``(None, why)``."""
        named = Path(verdict.verdict_json or "")
        mine = self.dump_dir()
        if mine is None:
            return None, "this job's dump folder is not known to the debug server"
        if named.name != "verdict.json" or named.parent.resolve() != mine:
            return None, f"{named} is not this job's report ({mine / 'verdict.json'})"
        report = mine / "verdict.html"
        try:
            st = os.lstat(report)
        except OSError as exc:
            return None, f"{report} is not readable from this host ({type(exc).__name__})"
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REPORT_BYTES:
            return None, f"{report} is not a regular file of at most {MAX_REPORT_BYTES} bytes"
        return report, ""

    def routes(self) -> list[Route]:
        return [Route(PATH, self._handle)]

    def nav_links(self) -> list[NavLink]:
        return [NavLink(PATH, "Verdict")]

    def templates(self) -> dict[str, str]:
        return {"frforensics_verdict.html": _TEMPLATE}

    def latest(self) -> Verdict | None:
        """The newest verdict in the job's store (``Verdict.loads``: a peer's word,
        every field checked), or None; a value that is not one is shown as such."""
        from torch.distributed.debug._store import (  # type: ignore[import-not-found,unused-ignore]
            tcpstore_client,
        )

        # the recorder's keys: PrefixStore("frforensics/<restart>") + "verdict/<k>"
        store = tcpstore_client(prefix=f"frforensics/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        base = "verdict/"
        found = None
        for k in range(self.max_incidents):
            if not store.check([f"{base}{k}"]):
                break
            found = f"{base}{k}"
        if found is None:
            return None
        k = int(found.rsplit("/", 1)[-1])
        try:
            return Verdict.loads(bytes(store.get(found)))
        except VerdictError as exc:
            return Verdict(status=None, incident=k, headline=f"(not a verdict: {exc.detail})",
                           text="", verdict_json="")

    def page(self) -> tuple[str, str]:
        """``(summary, escaped report html)`` for the page."""
        verdict = self.latest()
        if verdict is None:
            return "No verdict yet: the recorder has not seen a hang in this job.", ""
        summary = html.escape(
            f"Incident {verdict.incident}: {verdict.headline} "
            f"(elected rank {verdict.elected_rank} on {verdict.host}; "
            f"report {verdict.verdict_json})")
        report, why = self.report_path(verdict)
        body = None
        if report is not None:
            try:
                fd = os.open(report, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                with os.fdopen(fd, "rb") as fh:
                    body = fh.read(MAX_REPORT_BYTES).decode("utf-8", "replace")
            except OSError as exc:
                why = f"{report} is not readable from this host ({type(exc).__name__})"
        if body is None:
            text = verdict.text or ""
            body = f"<pre>{html.escape(text)}</pre><p>{html.escape(why)}.</p>"
        return summary, html.escape(body, quote=True)

    def _handle(self, req: Any) -> bytes:
        summary, body = self.page()
        rendered: bytes = req.frontend.render_template(
            "frforensics_verdict.html", summary=summary, report_html=body)
        return rendered

    def dump(self) -> str | None:
        verdict = self.latest()
        return None if verdict is None else json.dumps(verdict.to_json(), indent=2)

    def dump_filename(self) -> str:
        return "frforensics_verdict"
