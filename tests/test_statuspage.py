"""The status page in a real browser (Debian's headless Chromium) with the counts from a real run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from replyd import statuspage
from tests.api_harness import ROOT, TOKEN, running

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ARTIFACTS = ROOT / "test-artifacts"


def chromium() -> str:
    """Return the chromium binary; skip locally (fail under CI=true) when it is missing."""
    path = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if path is None:
        msg = "chromium is not installed: run .ci/install-chromium (Debian's chromium package)"
        if IN_CI:
            pytest.fail(msg + " — required under CI=true")
        pytest.skip(msg)
    return path


def browse(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run headless Chromium once on ``url`` with ``extra`` flags (--dump-dom, --screenshot=...)."""
    args = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1200,900", *extra, url,
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})


def test_render_escapes_log_values():
    """Values from the log are escaped: a parent id cannot inject markup into the page."""
    html = statuspage.render({
        "generated_at": 0.0, "store": {"url": "sqlite://", "up": True, "error": None},
        "counts": [{"platform": "p", "state": "closed", "rows": 1}], "open_rows": 0, "oldest_open_age_s": 0.0,
        "oldest_open": [], "bots": {},
        "recent_events": [{"at": 0.0, "platform": "p", "parent_id": "<script>alert(1)</script>", "kind": "closed",
                           "state": "closed", "attempt": 1, "detail": {"x": "<b>"}, "path": "api"}],
    })
    assert "<script>alert(1)" not in html and "&lt;script&gt;" in html
    assert '<meta http-equiv="refresh" content="5">' in html


def test_status_page_in_headless_chromium(tmp_path, monkeypatch):
    """After real posts (answered, refused, in flight) the page shows those counts in Chromium; a screenshot is kept."""
    chromium()
    with running(tmp_path, monkeypatch) as h:
        with h.client() as c:
            for _ in range(3):
                assert c.post("/v1/replies", json={"platform": "sim", "parent_id": h.parent(), "text": "hi"}).status_code == 201
            assert c.post("/v1/replies", json={"platform": "sim", "parent_id": h.parent(), "text": "x" * 600}).status_code == 409
            h.world.queue_faults(next_creates=["lost_504"])
            assert c.post("/v1/replies", json={"platform": "sim", "parent_id": h.parent(), "text": "hi"}).status_code == 202
        # The token as a Basic password in the URL: what a browser's login prompt would send.
        page_url = h.url.replace("http://", f"http://ops:{TOKEN}@") + "/"
        dom = browse(page_url, tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        page = dom.stdout
        inst = re.escape(h.instance)
        assert "<title>replyd status</title>" in page
        for state, n in (("closed", 3), ("rejected", 1), ("open", 1), ("gave_up", 0)):
            assert re.search(rf'data-platform="{inst}" data-state="{state}">{n}<', page), (state, page[:3000])
        assert re.search(r'id="card-closed">closed<b>3</b>', page)
        assert page.count('class="kind">claimed<') == 5 and 'class="kind">rejected<' in page
        assert 'id="oldest-open"' in page and "logged in" in page
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "statuspage.png"
        shot.unlink(missing_ok=True)
        r = browse(page_url, tmp_path, f"--screenshot={shot}")
        assert r.returncode == 0, r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_outage_headline_says_what_is_wrong_in_chromium(tmp_path, monkeypatch):
    """The sim refuses every send (503): the page leads with "sending is paused on bot …" in red, the sending
    tile reads PAUSED, and parent ids link to their history. Screenshots of both states are kept."""
    chromium()
    ARTIFACTS.mkdir(exist_ok=True)
    with running(tmp_path, monkeypatch) as h:
        page_url = h.url.replace("http://", f"http://ops:{TOKEN}@") + "/"
        with h.client() as c:
            assert c.post("/v1/replies", json={"platform": "sim", "parent_id": h.parent(), "text": "hi"}).status_code == 201
            healthy = browse(page_url, tmp_path, "--dump-dom").stdout
            assert 'id="headline" data-level="ok"' in healthy and "All well" in healthy, healthy[:3000]
            assert browse(page_url, tmp_path, f"--screenshot={ARTIFACTS / 'statuspage-healthy.png'}").returncode == 0
            h.world.queue_faults(next_creates=["error_503_before"] * 12)
            for _ in range(8):
                c.post("/v1/replies", json={"platform": "sim", "parent_id": h.parent(), "text": "hi"})
            status = c.get("/v1/status").json()
        assert any((b.get("breaker") or {}).get("open") for b in status["liveness"].values()), status["liveness"]
        page = browse(page_url, tmp_path, "--dump-dom").stdout
        assert 'id="headline" data-level="bad"' in page and "Sending is paused on bot" in page, page[:3000]
        assert re.search(r'id="card-sending">sending<b>PAUSED</b>', page)
        assert re.search(r'<a href="/v1/replies/[^"]+/[^"]+"><code>', page)  # parent ids link to their history
        assert browse(page_url, tmp_path, f"--screenshot={ARTIFACTS / 'statuspage-outage.png'}").returncode == 0
    assert (ARTIFACTS / "statuspage-outage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
