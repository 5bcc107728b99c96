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
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.debug._frontend import (  # type: ignore[import-not-found,unused-ignore]
    DebugHandler,
    NavLink,
    Route,
)

__all__ = ["VerdictHandler"]

PATH = "/frforensics_verdict"

_TEMPLATE = """
{% extends "base.html" %}
{% block header %}<h1>frforensics verdict</h1>{% endblock %}
{% block content %}
  <p>{{ summary }}</p>
  {% if report_html %}
  <iframe title="frforensics report" srcdoc="{{ report_html }}"
          style="width:100%;height:80vh;border:1px solid #ccc"></iframe>
  {% endif %}
{% endblock %}
"""


class VerdictHandler(DebugHandler):  # type: ignore[misc,unused-ignore]
    """Adds the "Verdict" page (``/frforensics_verdict``) to PyTorch's debug server."""

    def __init__(self, *, max_incidents: int = 64) -> None:
        self.max_incidents = max_incidents

    def routes(self) -> list[Route]:
        return [Route(PATH, self._handle)]

    def nav_links(self) -> list[NavLink]:
        return [NavLink(PATH, "Verdict")]

    def templates(self) -> dict[str, str]:
        return {"frforensics_verdict.html": _TEMPLATE}

    def latest(self) -> dict[str, Any] | None:
        """The newest verdict in the job's store, or None."""
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
        raw = store.get(found)
        value: dict[str, Any] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return value

    def page(self) -> tuple[str, str]:
        """``(summary, escaped report html)`` for the page."""
        verdict = self.latest()
        if verdict is None:
            return "No verdict yet: the recorder has not seen a hang in this job.", ""
        summary = html.escape(
            f"Incident {verdict.get('incident')}: {verdict.get('headline')} "
            f"(elected rank {verdict.get('elected_rank')} on {verdict.get('host')}; "
            f"report {verdict.get('verdict_json')})")
        report = Path(str(verdict.get("verdict_json", ""))).with_suffix(".html")
        try:
            body = report.read_text(encoding="utf-8")
        except OSError as exc:
            text = str(verdict.get("text", ""))
            body = (f"<pre>{html.escape(text)}</pre><p>{html.escape(str(report))} is not "
                    f"readable from this host ({html.escape(type(exc).__name__)}).</p>")
        return summary, html.escape(body, quote=True)

    def _handle(self, req: Any) -> bytes:
        summary, body = self.page()
        rendered: bytes = req.frontend.render_template(
            "frforensics_verdict.html", summary=summary, report_html=body)
        return rendered

    def dump(self) -> str | None:
        verdict = self.latest()
        return None if verdict is None else json.dumps(verdict, indent=2)

    def dump_filename(self) -> str:
        return "frforensics_verdict"
