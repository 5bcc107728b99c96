"""The "Verdict" page plugged into PyTorch 2.15's debug server (``DebugHandler``).

Runs against torch's own ``FrontendServer`` (present in torch 2.13 and 2.15); on a
torch without ``torch.distributed.debug._frontend`` it is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.debug._frontend",
                    reason="this torch has no torch.distributed.debug DebugHandler API")
pytest.importorskip("jinja2", reason="torch's debug server needs jinja2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_verdict_page_shows_the_newest_verdict_from_the_store(tmp_path: Path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.debug._frontend import FrontendServer

    from frforensics.debug_server import PATH, VerdictHandler

    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("FRFORENSICS_DUMP_DIR", str(tmp_path))  # this job's dump folder
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    server = FrontendServer(port=0, handlers=[VerdictHandler()])
    url = f"http://127.0.0.1:{server._server.server_port}{PATH}"

    def get(u: str) -> str:
        with urllib.request.urlopen(u, timeout=20) as resp:
            return resp.read().decode()

    empty = get(url)
    assert "No verdict yet" in empty
    assert f'<a href="{PATH}">Verdict</a>' in empty  # in the debug server's own nav bar
    (tmp_path / "verdict.html").write_text("<html><body><h1>HANG &amp; report</h1></body></html>")
    for k, headline in enumerate(["HANG — first", "HANG — missing_rank: Rank 2 never entered"]):
        master.set(f"frforensics/0/verdict/{k}", json.dumps({
            "schema": "frforensics.verdict/1", "incident": k, "headline": headline,
            "elected_rank": 0, "host": "node0", "text": headline,
            "verdict_json": str(tmp_path / "verdict.json")}))
    page = get(url)
    assert "Incident 1: HANG — missing_rank: Rank 2 never entered" in page
    assert "first" not in page
    # the HTML report, escaped into the iframe's srcdoc
    assert 'srcdoc="&lt;html&gt;&lt;body&gt;&lt;h1&gt;HANG &amp;amp; report' in page
    # sandboxed: the report never runs as the debug server's origin
    assert "<iframe title=\"frforensics report\" sandbox srcdoc=" in page
    assert "allow-same-origin" not in page
    # a verdict key naming another file (a peer's word) shows the text, never that file
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    (elsewhere / "verdict.html").write_text("<h1>SECRET</h1>")
    master.set("frforensics/0/verdict/2", json.dumps({
        "schema": "frforensics.verdict/1", "incident": 2, "headline": "forged", "text": "forged",
        "verdict_json": str(elsewhere / "verdict.json")}))
    page = get(url)
    assert "SECRET" not in page and "is not this job" in page
    os.environ.pop("MASTER_PORT", None)
    del master
