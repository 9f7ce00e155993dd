"""The status page's chart of the last hour and its rearm / confirm forms: over HTTP and in headless Chromium."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
from html import unescape
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from replyd import statuspage
from replyd import store as st
from replyd.api import pageform
from replyd.transitions import planting
from tests.api_harness import TOKEN, Harness, running
from tests.test_statuspage import ARTIFACTS, browse, chromium

BASIC = "Basic " + base64.b64encode(f"ops:{TOKEN}".encode()).decode()
FORM = re.compile(r'<form class="act" method="post" action="/page/actions">'
                  r'<input type="hidden" name="action" value="(\w+)">'
                  r'<input type="hidden" name="bot" value="([^"]*)">'
                  r'<input type="hidden" name="parent_id" value="([^"]*)">'
                  r'<input type="hidden" name="csrf" value="([^"]*)">')


@pytest.fixture
def h(tmp_path, monkeypatch):
    """A sim and a daemon serving the API with a token on a loopback bind."""
    with running(tmp_path, monkeypatch) as harness:
        yield harness


def post(h: Harness, pid: str, text: str = "hi") -> int:
    with h.client() as c:
        return c.post("/v1/replies", json={"platform": "sim", "parent_id": pid, "text": text}).status_code


def browser(h: Harness) -> httpx.Client:
    """A client as a browser logged in with Basic: the token as password, Origin on a POST."""
    origin = f"http://{urlsplit(h.url).netloc}"
    return httpx.Client(base_url=h.url, headers={"Authorization": BASIC, "Origin": origin}, timeout=30)


def forms(page: str) -> dict[tuple[str, str], dict[str, str]]:
    """The page's action forms by (action, parent id): their fields."""
    return {(a, unescape(p)): {"action": a, "bot": unescape(b), "parent_id": unescape(p), "csrf": unescape(t)}
            for a, b, p, t in FORM.findall(page)}


def waiting_rows(h: Harness) -> tuple[str, str]:
    """A rejected row (a text the sim refuses) and an unconfirmed one (moved as a no-read-back sweep does)."""
    rejected, unconfirmed = h.parent(), h.parent()
    assert post(h, rejected, "x" * 600) == 409 and post(h, unconfirmed, "x" * 600) == 409
    key = st.Key(h.instance, h.bot.id, unconfirmed)
    with planting(), h.daemon.store.transaction() as tx:  # planted: no event moves rejected to unconfirmed
        assert tx.cas_event(key, states=[st.REJECTED], attempt=1, values={"state": st.UNCONFIRMED})
    return rejected, unconfirmed


def state(h: Harness, pid: str) -> str | None:
    row = h.daemon.store.get(st.Key(h.instance, h.bot.id, pid))
    return row.state if row else None


def test_activity_buckets_and_percentiles():
    """Answers fall in their 5-minute bucket; per minute is count / 5; p50 / p95 are nearest-rank; older ones drop."""
    now = 10_000.0
    answers = [(now - 10, now - 12), (now - 20, now - 21), (now - 30, now - 40), (now - 3000, now - 3100),
               (now - 4000, now - 4001), (now - 5, None)]
    act = statuspage.activity(answers, now)
    counts = [b["count"] for b in act["buckets"]]
    assert len(counts) == 12 and counts[-1] == 4 and counts[2] == 1 and act["total"] == 5
    assert act["buckets"][-1]["per_min"] == pytest.approx(0.8)
    assert act["buckets"][-1]["p50_s"] == 2 and act["buckets"][-1]["p95_s"] == 10
    assert act["p50_s"] == 2 and act["p95_s"] == 100 and act["max_s"] == 100
    html = statuspage._chart_html(act)
    assert sum(int(n) for n in re.findall(r'data-count="(\d+)"', html)) == 5 and "<script" not in html


def test_chart_counts_the_answers_of_the_last_hour(h):
    """After N answers (and one refusal) the page's chart counts exactly N, all in the newest bucket."""
    n = 4
    for _ in range(n):
        assert post(h, h.parent()) == 201
    assert post(h, h.parent(), "x" * 600) == 409
    with browser(h) as c:
        page = c.get("/").text
    assert f'id="answers-hour" data-total="{n}"' in page, page[:2000]
    counts = [int(x) for x in re.findall(r'<rect class="bar"[^>]*data-count="(\d+)"', page)]
    assert len(counts) == 12 and sum(counts) == n and counts[-1] == n
    p50 = re.search(r'id="latency-hour" data-p50="([\d.]+)"', page)
    assert p50 is not None and 0 <= float(p50.group(1)) < 30  # first record to answer: this run's sends


def test_rearm_and_confirm_through_the_forms(h):
    """Each waiting row has its forms; posting one changes the row in the store (event by "page") and 303s back
    to the page, which shows the signed result line; the rows' forms are gone afterwards."""
    rejected, unconfirmed = waiting_rows(h)
    with browser(h) as c:
        page = c.get("/").text
        f = forms(page)
        assert set(f) == {("rearm", rejected), ("rearm", unconfirmed), ("confirm", unconfirmed)}, page[:3000]
        assert re.search(r'<tr data-state="unconfirmed">', page) and "waiting for a decision" in page
        r = c.post("/page/actions", data=f[("confirm", unconfirmed)])
        assert r.status_code == 303, r.text
        assert state(h, unconfirmed) == st.CLOSED
        back = c.get(r.headers["location"])
        assert f"confirmed parent {unconfirmed} of bot sim" in back.text and 'id="action-result"' in back.text
        r = c.post("/page/actions", data=f[("rearm", rejected)])
        assert r.status_code == 303 and state(h, rejected) == st.RELEASED
        after = c.get(r.headers["location"]).text
        assert f"rearmed parent {rejected} of bot sim (was rejected)" in after
        assert forms(after) == {}
        # The same form again: the row moved on, so nothing is done and the line says why.
        r = c.post("/page/actions", data=f[("rearm", rejected)])
        assert r.status_code == 303 and "not rearmed" in c.get(r.headers["location"]).text
    store = h.daemon.store
    kinds = {e.kind: json.loads(e.detail) for e in store.history(st.Key(h.instance, h.bot.id, rejected))}
    assert kinds["rearmed"]["by"] == "page" and kinds["rearmed"]["from"] == "rejected"
    assert json.loads(store.last_event(st.Key(h.instance, h.bot.id, unconfirmed), ["confirmed"]).detail)["by"] == "page"
    assert post(h, rejected) == 201  # rearmed: the next offer answers it


def test_forms_refuse_forged_tokens_foreign_origins_and_no_login(h):
    """No login: 401. A missing, forged, expired or other row's token: 403. A foreign, null or missing Origin with
    Basic: 403. Bad fields: 400; an unknown bot or row: 404. Nothing changes, and no answer holds the token."""
    rejected, unconfirmed = waiting_rows(h)
    answers = []
    with browser(h) as c:
        f = forms(c.get("/").text)
        good = f[("rearm", rejected)]
        now = time.time()

        def send(data: dict[str, str], **headers: str) -> httpx.Response:
            r = c.post("/page/actions", data=data, headers=headers)
            answers.append(r)
            return r

        assert send({k: v for k, v in good.items() if k != "csrf"}).status_code == 403
        assert send({**good, "csrf": good["csrf"][:-4] + "0000"}).status_code == 403
        assert send({**good, "csrf": f[("rearm", unconfirmed)]["csrf"]}).status_code == 403  # another row's
        assert send({**good, "csrf": f[("confirm", unconfirmed)]["csrf"], "parent_id": unconfirmed}).status_code == 403
        old = pageform.form_token(TOKEN, "rearm", "sim", rejected, now - pageform.FORM_MAX_AGE_S - 10)
        assert send({**good, "csrf": old}).status_code == 403
        assert send({**good, "csrf": pageform.form_token("another-token", "rearm", "sim", rejected, now)}).status_code == 403
        r = send(good, Origin="https://evil.example")
        assert r.status_code == 403 and "Origin" in r.text
        assert send(good, Origin="null").status_code == 403
        assert send({**good, "action": "delete"}).status_code == 400
        assert send({"action": "rearm", "bot": "sim", "parent_id": "", "csrf": "x"}).status_code == 400
        r = c.post("/page/actions", content=b"action=rearm&action=rearm", headers={
            "Content-Type": "application/x-www-form-urlencoded"})
        answers.append(r)
        assert r.status_code == 400 and r.text.count("\n") == 1
        assert send({**good, "bot": "nobot",
                     "csrf": pageform.form_token(TOKEN, "rearm", "nobot", rejected, now)}).status_code == 404
        assert send({**good, "parent_id": "999999",
                     "csrf": pageform.form_token(TOKEN, "rearm", "sim", "999999", now)}).status_code == 404
    with httpx.Client(base_url=h.url, timeout=30) as anon:
        for headers in ({}, {"Authorization": "Basic " + base64.b64encode(b"ops:wrong").decode()}):
            r = anon.post("/page/actions", data=good, headers={**headers, "Origin": f"http://{urlsplit(h.url).netloc}"})
            answers.append(r)
            assert r.status_code == 401
        # A browser sends Origin on a POST; Basic without it is refused (a bearer caller need not send it).
        r = anon.post("/page/actions", data=good, headers={"Authorization": BASIC})
        answers.append(r)
        assert r.status_code == 403 and "Origin" in r.text
    assert state(h, rejected) == st.REJECTED and state(h, unconfirmed) == st.UNCONFIRMED
    for r in answers:
        assert TOKEN not in r.text and TOKEN not in str(r.headers), r.text
    with h.client() as c:  # a bearer caller with a good token and no Origin passes
        assert c.post("/page/actions", data=good).status_code == 303 and state(h, rejected) == st.RELEASED


def test_a_result_line_needs_our_signature(h):
    """A crafted link cannot make the page show a result line: only a signed, recent one is shown."""
    at = int(time.time())
    with browser(h) as c:
        assert "action-result" not in c.get("/", params={"done": "rearmed everything", "at": at, "sig": "0"}).text
        sig = pageform.result_sig(TOKEN, at, "rearmed x")
        assert 'id="action-result">rearmed x<' in c.get("/", params={"done": "rearmed x", "at": at, "sig": sig}).text
        old = at - pageform.RESULT_SHOWN_S - 5
        sig = pageform.result_sig(TOKEN, old, "rearmed x")
        assert "action-result" not in c.get("/", params={"done": "rearmed x", "at": old, "sig": sig}).text


def _cdp_click(h: Harness, tmp_path: Path) -> str:
    """In headless Chromium (DevTools protocol), open the page with the Basic login, press the rejected row's
    rearm button, wait for the redirect; return the page's URL and text after it."""
    from websockets.sync.client import connect

    profile = tmp_path / "cdp-profile"
    proc = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={profile}", "--remote-debugging-port=0", "--window-size=1200,900",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        end = time.monotonic() + 30
        while not port_file.exists() and time.monotonic() < end:
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        with connect(ws_url, max_size=None, open_timeout=10) as ws:
            ids = iter(range(1, 1000))

            def call(method: str, **params: object) -> dict:
                n = next(ids)
                ws.send(json.dumps({"id": n, "method": method, "params": params}))
                while True:
                    msg = json.loads(ws.recv(timeout=30))
                    if msg.get("id") == n:
                        assert "error" not in msg, msg
                        return msg["result"]

            def text() -> str:
                got = call("Runtime.evaluate", returnByValue=True,
                           expression="location.href + '\\n' + (document.body ? document.body.innerText : '')")
                return str(got["result"].get("value", ""))

            call("Network.enable")
            call("Network.setExtraHTTPHeaders", headers={"Authorization": BASIC})  # the login a prompt would send
            call("Page.navigate", url=h.url + "/")
            end = time.monotonic() + 20
            while "waiting for a decision" not in text() and time.monotonic() < end:
                time.sleep(0.2)
            # DevTools' evaluation is not page script: the page's CSP forbids script, not the debugger.
            call("Runtime.evaluate", expression="document.querySelector('tr[data-state=rejected] form.act button').click()")
            end = time.monotonic() + 20
            # The URL changes before the new page's body is there: wait for the result line itself.
            while "rearmed parent" not in text().partition("\n")[2] and time.monotonic() < end:
                time.sleep(0.2)
            return text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_page_with_chart_and_actions_in_chromium(h, tmp_path):
    """Chromium shows the chart and the action buttons (screenshot kept), and pressing rearm in it posts the form
    (its Origin, the page's token, the CSP's form-action 'self') and lands back on the page with the result."""
    chromium()
    for _ in range(3):
        assert post(h, h.parent()) == 201
    rejected, _ = waiting_rows(h)
    page_url = h.url.replace("http://", f"http://ops:{TOKEN}@") + "/"
    dom = browse(page_url, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'id="answers-hour" data-total="3"' in dom.stdout and "<svg" in dom.stdout
    assert dom.stdout.count('<button type="submit"') == 3
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "statuspage-actions.png"
    shot.unlink(missing_ok=True)
    r = browse(page_url, tmp_path, f"--screenshot={shot}", "--window-size=1200,1400")
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    after = _cdp_click(h, tmp_path)
    assert f"rearmed parent {rejected} of bot sim (was rejected)" in after, after[:2000]
    assert state(h, rejected) == st.RELEASED
    assert parse_qs(urlsplit(after.splitlines()[0]).query)["sig"]


def test_the_chart_reads_one_index_range(tmp_path):
    """The last hour's answers come from one range of ix_events_kind_at, each row by its primary key."""
    import sqlalchemy as sa

    store = st.Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    seen: list[tuple[str, object]] = []

    def grab(conn, cursor, statement, params, context, executemany):  # SQLAlchemy's hook
        if "FROM events" in statement:
            seen.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", grab)
    assert store.answers_since(time.time() - 3600) == []
    sa.event.remove(store.engine, "before_cursor_execute", grab)
    (sql, params), = seen
    with store.engine.connect() as conn:
        plan = " | ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params))
    assert "USING INDEX ix_events_kind_at (kind=? AND at>?)" in plan and "SCAN" not in plan, plan
    store.dispose()
