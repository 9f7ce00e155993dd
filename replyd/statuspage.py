"""The status page at ``/``: what is wrong, counts, the last hour's answers, rows waiting for a decision.

One self-contained HTML document (no script, no external assets, a meta
refresh), so it works behind any proxy and in a locked-down browser; it is served
with ``CSP`` (only its own inline style) and may not be framed. Every
value from the log is escaped: parent ids and event details come from other
people's posts. The chart is inline SVG drawn here; the only writes are the
rearm and confirm forms, which post to this origin only (``replyd.api.pageform``).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from datetime import datetime, timezone
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from replyd import store as st

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2330;background:#f7f8fa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.meta{color:#5b6475;margin-bottom:16px}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:10px 14px;min-width:110px}
.card b{display:block;font-size:22px}
.bad b{color:#b3261e}.ok b{color:#1b7f3b}
table{border-collapse:collapse;background:#fff;border:1px solid #dde1e8;width:100%}
th,td{padding:4px 8px;border-bottom:1px solid #eceef2;text-align:left;font-variant-numeric:tabular-nums}
th{background:#eef0f4;font-weight:600}td.n{text-align:right}
code{font-size:12px;word-break:break-all}.empty{color:#5b6475;font-style:italic}
.path{display:block}.stale{color:#b3261e;font-weight:600}.failing{color:#9a5b00}
.headline{border-radius:6px;padding:10px 14px;margin:0 0 16px;font-size:15px}
.headline.ok{background:#e6f4ea;border:1px solid #9bd3ae}.headline.bad{background:#fde7e7;border:1px solid #f0a8a8}
.headline.warn{background:#fff4de;border:1px solid #f1cf8a}.headline li{margin:2px 0}
.result{border-radius:6px;padding:8px 14px;margin:0 0 16px;background:#e8f0fe;border:1px solid #a8c1f0}
.charts{display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start}
.chart{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 12px}
.chart svg{display:block}.chart text{font:11px system-ui,sans-serif;fill:#5b6475}
.figures{margin:4px 0 0;color:#1d2330}
form.act{display:inline;margin:0 4px 0 0}td.acts{white-space:nowrap}
form.act button{font:13px system-ui,sans-serif;padding:2px 10px;border:1px solid #8a94a6;border-radius:4px;
background:#fff;cursor:pointer}
form.act button.confirm{border-color:#1b7f3b;color:#1b7f3b}
"""

# The page runs no script and loads nothing: only its one inline style, allowed by hash; never framed.
# Its forms (rearm, confirm) may post to this origin only.
CSP = ("default-src 'none'; style-src 'sha256-" + base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()
       + "'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")


def _ts(t: float | None) -> str:
    return "" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _parent_link(platform: str, parent_id: str, names: dict[str, str]) -> str:
    """A parent id as a link to its row and history (``GET /v1/replies/{bot}/{parent id}``)."""
    href = "/v1/replies/" + quote(names.get(platform, platform), safe="") + "/" + quote(parent_id, safe="/")
    return f'<a href="{_e(href)}"><code>{_e(parent_id)}</code></a>'


# -- the last hour's answers ---------------------------------------------------------------------

CHART_WINDOW_S = 3600
CHART_STEP_S = 300


def _pct(sorted_v: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of sorted values (None when there are none)."""
    if not sorted_v:
        return None
    return sorted_v[max(0, min(len(sorted_v) - 1, math.ceil(q * len(sorted_v)) - 1))]


def activity(answers: Sequence[tuple[float, float | None]], now: float, *, truncated: bool = False,
             window_s: int = CHART_WINDOW_S, step_s: int = CHART_STEP_S) -> dict[str, Any]:
    """Answers per minute and latency per ``step_s`` over the last ``window_s``, from (close time, created_at).

    The latency is the close time minus the row's ``created_at``: from replyd's first record of the parent
    to its answer on the platform. A rearmed row counts from its first record, not from the rearm.
    """
    start = now - window_s
    n = window_s // step_s
    per: list[list[float]] = [[] for _ in range(n)]
    counts = [0] * n
    every: list[float] = []
    for at, created in answers:
        if not start <= at <= now:
            continue
        i = min(n - 1, int((at - start) // step_s))
        counts[i] += 1
        if created is not None:
            lat = max(0.0, at - created)
            per[i].append(lat)
            every.append(lat)
    buckets = []
    for i in range(n):
        v = sorted(per[i])
        buckets.append({"start": start + i * step_s, "count": counts[i], "per_min": counts[i] * 60 / step_s,
                        "p50_s": _pct(v, 0.5), "p95_s": _pct(v, 0.95)})
    every.sort()
    return {"window_s": window_s, "step_s": step_s, "start": start, "total": sum(counts), "buckets": buckets,
            "p50_s": _pct(every, 0.5), "p95_s": _pct(every, 0.95), "max_s": every[-1] if every else None,
            "truncated": truncated}


def _secs(v: float | None) -> str:
    """A latency in words: "-" when none, seconds below 100 s, else minutes."""
    if v is None:
        return "-"
    return f"{v:.1f} s" if v < 100 else f"{v / 60:.1f} min"


def _chart_html(act: dict[str, Any] | None) -> str:
    """Two small inline SVG charts: answers per minute (bars), p50 and p95 latency (lines), per bucket."""
    if act is None:
        return '<p class="empty" id="chart-empty">no chart: the store did not answer</p>'
    w, h, pad = 360, 110, 24
    buckets = act["buckets"]
    n = len(buckets)
    bw = (w - pad) / n
    top = max([b["per_min"] for b in buckets] + [0.2])
    bars = []
    for i, b in enumerate(buckets):
        bh = 0 if not b["count"] else max(1.0, (h - 2 * pad) * b["per_min"] / top)
        x, y = pad + i * bw + 1, h - pad - bh
        bars.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{bh:.1f}" '
                    f'fill="#3b6fd4" data-count="{b["count"]}" data-start="{b["start"]:.0f}">'
                    f'<title>{_e(_ts(b["start"]))} UTC: {b["count"]} answers, {b["per_min"]:.2f}/min</title></rect>')
    axis = (f'<line x1="{pad}" y1="{h - pad}" x2="{w}" y2="{h - pad}" stroke="#8a94a6"/>'
            f'<text x="{pad}" y="{h - 8}">-60 min</text><text x="{w / 2 + pad / 2 - 14:.0f}" y="{h - 8}">-30 min</text>'
            f'<text x="{w - 24}" y="{h - 8}">now</text>')
    rate = (f'<div class="chart" id="chart-rate"><b>answers per minute</b> (per 5 min, last hour)'
            f'<svg role="img" aria-label="answers per minute" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
            f'<text x="0" y="{pad - 6}">{top:.2g}/min</text>'
            f'<line x1="{pad}" y1="{pad}" x2="{w}" y2="{pad}" stroke="#eceef2"/>{"".join(bars)}{axis}</svg>'
            f'<p class="figures" id="answers-hour" data-total="{act["total"]}">{act["total"]} answers in the last '
            f'hour ({act["total"] / 60:.2f}/min){"; over the read limit, counts are a floor" if act["truncated"] else ""}'
            f'</p></div>')
    lat_top = max([b["p95_s"] or 0 for b in buckets] + [1.0])

    def line(key: str, colour: str) -> str:
        pts = [(pad + (i + 0.5) * bw, h - pad - (h - 2 * pad) * b[key] / lat_top)
               for i, b in enumerate(buckets) if b[key] is not None]
        dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}"/>' for x, y in pts)
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        return (f'<polyline class="{key}" points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>' if len(pts) > 1
                else "") + dots
    lat = (f'<div class="chart" id="chart-latency"><b>latency</b> (first record to answer; '
           f'<span class="p50">p50</span> blue, p95 orange)'
           f'<svg role="img" aria-label="answer latency p50 and p95" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
           f'<text x="0" y="{pad - 6}">{_e(_secs(lat_top))}</text>'
           f'<line x1="{pad}" y1="{pad}" x2="{w}" y2="{pad}" stroke="#eceef2"/>'
           f'{line("p95_s", "#d9822b")}{line("p50_s", "#3b6fd4")}{axis}</svg>'
           f'<p class="figures" id="latency-hour" data-p50="{act["p50_s"] if act["p50_s"] is not None else ""}" '
           f'data-p95="{act["p95_s"] if act["p95_s"] is not None else ""}">last hour: p50 {_e(_secs(act["p50_s"]))}, '
           f'p95 {_e(_secs(act["p95_s"]))}, max {_e(_secs(act["max_s"]))}</p></div>')
    return f'<div class="charts" id="chart">{rate}{lat}</div>'


# -- rows waiting for a decision -----------------------------------------------------------------

FormToken = Callable[[str, str, str], str]  # (action, bot, parent id) -> the form's CSRF token


def _action_form(action: str, bot: str, parent_id: str, form_token: FormToken) -> str:
    cls = ' class="confirm"' if action == "confirm" else ""
    return (f'<form class="act" method="post" action="/page/actions">'
            f'<input type="hidden" name="action" value="{_e(action)}">'
            f'<input type="hidden" name="bot" value="{_e(bot)}">'
            f'<input type="hidden" name="parent_id" value="{_e(parent_id)}">'
            f'<input type="hidden" name="csrf" value="{_e(form_token(action, bot, parent_id))}">'
            f'<button type="submit"{cls}>{_e(action)}</button></form>')


def _waiting_table(rows: list[dict[str, Any]] | None, names: dict[tuple[str, str], str],
                   form_token: FormToken | None) -> str:
    """The rows an operator decides on, newest change first, each with its rearm (and confirm) form."""
    if rows is None:
        return '<p class="empty" id="waiting-empty">the store did not answer</p>'
    if not rows:
        return '<p class="empty" id="waiting-empty">nothing waits for a decision</p>'
    note = ("" if form_token is not None else
            '<p class="empty" id="actions-off">actions need an API token (api.token_env); use the CLI meanwhile</p>')
    body = []
    for r in rows:
        bot = names.get((r["platform"], r["sender_id"]))
        link = _parent_link(r["platform"], r["parent_id"], {r["platform"]: bot} if bot else {})
        if bot is None:
            acts = '<span class="empty">bot not running</span>'
        elif form_token is None:
            acts = ""
        else:
            acts = _action_form("rearm", bot, r["parent_id"], form_token)
            if r["state"] == st.UNCONFIRMED:
                acts = _action_form("confirm", bot, r["parent_id"], form_token) + acts
        err = (r.get("error") or "")[:200]
        body.append(f'<tr data-state="{_e(r["state"])}"><td>{_e(bot or r["platform"])}</td><td>{link}</td>'
                    f'<td>{_e(r["state"])}</td><td class="n">{_e(r["attempt"])}</td>'
                    f'<td>{_e(_ts(r["updated_at"]))}</td><td><code>{_e(err)}</code></td><td class="acts">{acts}</td></tr>')
    return (f'{note}<table id="waiting"><tr><th>bot</th><th>parent id</th><th>state</th><th>attempt</th>'
            f'<th>changed (UTC)</th><th>why</th><th>action</th></tr>{"".join(body)}</table>')


def _counts_table(counts: list[dict[str, Any]]) -> str:
    if not counts:
        return '<p class="empty" id="counts-empty">no rows yet: nothing answered</p>'
    by: dict[str, dict[str, int]] = {}
    for c in counts:
        by.setdefault(c["platform"], {})[c["state"]] = c["rows"]
    head = "".join(f"<th>{_e(s)}</th>" for s in st.STATES)
    body = []
    for plat in sorted(by):
        cells = "".join(
            f'<td class="n" data-platform="{_e(plat)}" data-state="{_e(s)}">{by[plat].get(s, 0)}</td>' for s in st.STATES
        )
        body.append(f"<tr><td><code>{_e(plat)}</code></td>{cells}</tr>")
    return f'<table id="counts"><tr><th>platform</th>{head}</tr>{"".join(body)}</table>'


def _open_table(rows: list[dict[str, Any]], names: dict[str, str]) -> str:
    if not rows:
        return '<p class="empty" id="open-empty">no open rows</p>'
    body = "".join(
        f'<tr><td><code>{_e(r["platform"])}</code></td><td>{_parent_link(r["platform"], r["parent_id"], names)}</td>'
        f'<td>{_e(_ts(r["opened_at"]))}</td><td class="n">{r["age_s"]:.0f}</td><td>{_e(r["attempt"])}</td></tr>'
        for r in rows
    )
    return (f'<table id="oldest-open"><tr><th>platform</th><th>parent id</th><th>opened (UTC)</th>'
            f'<th>age (s)</th><th>attempt</th></tr>{body}</table>')


def _events_table(events: list[dict[str, Any]], names: dict[str, str]) -> str:
    if not events:
        return '<p class="empty" id="events-empty">no events yet</p>'
    body = "".join(
        f'<tr><td>{_e(_ts(ev["at"]))}</td><td><code>{_e(ev["platform"])}</code></td>'
        f'<td>{_parent_link(ev["platform"], ev["parent_id"], names)}</td><td class="kind">{_e(ev["kind"])}</td><td>{_e(ev["state"])}</td>'
        f'<td>{_e(ev["attempt"])}</td><td>{_e(ev.get("path"))}</td>'
        f'<td><code>{_e(json.dumps(ev["detail"], sort_keys=True) if not isinstance(ev["detail"], str) else ev["detail"])}</code></td></tr>'
        for ev in events
    )
    return (f'<table id="events"><tr><th>at (UTC)</th><th>platform</th><th>parent id</th><th>event</th><th>state</th>'
            f'<th>attempt</th><th>path</th><th>detail</th></tr>{body}</table>')


def _paths_cell(bot: str, live: dict[str, Any] | None) -> str:
    """Each path of one bot in words; a stale or failing one (not ready) red, one with a failure amber."""
    if not live or not live["paths"]:
        return '<span class="empty">not running yet</span>'
    spans = []
    for path, p in sorted(live["paths"].items()):
        failing = bool(p.get("failing"))
        cls = "path stale" if p["stale"] or failing else ("path failing" if p["failures"] else "path")
        spans.append(f'<span class="{cls}" id="path-{_e(bot)}-{_e(path)}" data-stale="{str(p["stale"]).lower()}" '
                     f'data-failing="{str(failing).lower()}">{_e(p["words"])}</span>')
    due = live.get("oldest_due_open_age_s")
    if due is not None:
        spans.append(f'<span class="path failing">oldest due open row: {due:.0f} s past its deadline</span>')
    return "".join(spans)


def _listing_table(bots: dict[str, dict[str, Any]]) -> str:
    """Per bot: the configured listing delay, the delay in use, and the observed lag it was learned from."""
    rows = [(name, b["listing"]) for name, b in sorted(bots.items()) if b.get("listing")]
    if not rows:
        return '<p class="empty" id="listing-empty">no bot running yet</p>'

    def cls(v: dict[str, Any]) -> str:  # in use above configured: the configured delay is too short
        return ' class="n failing"' if v["in_use_s"] > v["configured_s"] else ' class="n"'

    body = "".join(
        f'<tr id="listing-{_e(name)}"><td>{_e(name)}</td><td><code>{_e(v["platform"])}</code></td>'
        f'<td class="n">{v["configured_s"]:g}</td><td{cls(v)} data-in-use="{v["in_use_s"]:g}">{v["in_use_s"]:g}</td>'
        f'<td>{"learned" if v["auto"] else "configured (listing_delay_auto = false)"}</td>'
        f'<td class="n">{v["samples"]}</td><td class="n">{v["observed_p50_s"]:g}</td>'
        f'<td class="n">{v["observed_p99_s"]:g}</td></tr>'
        for name, v in rows
    )
    return (f'<table id="listing"><tr><th>bot</th><th>platform</th><th>configured (s)</th><th>in use (s)</th>'
            f'<th>delay</th><th>samples</th><th>observed p50 (s)</th><th>observed p99 (s)</th></tr>{body}</table>')


def _state_cell(bot: dict[str, Any], live: dict[str, Any] | None) -> str:
    """Whether a bot runs: logged in, or starting / failed to start with the reason (red: not ready)."""
    start = (live or {}).get("start")
    if start is not None and start["state"] != "running":
        adopting = ' data-adopting="1"' if start.get("adopting") else ""
        return f'<span class="stale" data-start="{_e(start["state"])}"{adopting}>{_e(start["words"])}</span>'
    return "logged in" if bot["ready"] else "not logged in"


def _breaker_cell(live: dict[str, Any] | None) -> str:
    """The bot's write breaker: closed, or open (red) since when and why."""
    brk = (live or {}).get("breaker")
    if not brk or not brk["open"]:
        return '<span data-breaker="closed">closed</span>'
    why = f": {brk['reason']}" if brk.get("reason") else ""
    return f'<span class="stale" data-breaker="open">open since {_e(_ts(brk.get("since")))} UTC{_e(why)}</span>'


def headline(summary: dict[str, Any]) -> tuple[str, list[str]]:
    """What is wrong, worst first, each with what to do: ("bad" | "warn" | "ok", sentences)."""
    bad: list[str] = []
    warn: list[str] = []
    if not summary["store"]["up"]:
        bad.append(f"The store is down ({summary['store'].get('error') or 'no answer'}). Nothing is answered "
                   "until it is back; check the database.")
    for bot, b in sorted(summary.get("liveness", {}).items()):
        brk, start = b.get("breaker") or {}, b.get("start") or {}
        if brk.get("open"):
            why = f": {brk['reason']}" if brk.get("reason") else ""
            bad.append(f"Sending is paused on bot {bot} since {_ts(brk.get('since'))} UTC{why}. No attempt is spent; "
                       "replyd resumes by itself when the platform answers again.")
        if start and start.get("state") != "running":
            bad.append(f"Bot {bot} is not running: {start.get('words', '')}.")
        for path in b.get("stale", []) + [p for p in b.get("failing", []) if p not in b.get("stale", [])]:
            words = b["paths"].get(path, {}).get("words", "")
            bad.append(f"Path {bot}/{path} is not finding posts: {words}.")
    totals: dict[str, int] = {}
    for c in summary["counts"]:
        totals[c["state"]] = totals.get(c["state"], 0) + c["rows"]
    if totals.get(st.UNCONFIRMED):
        n = totals[st.UNCONFIRMED]
        warn.append(f"{n} {'answer waits' if n == 1 else 'answers wait'} for a decision (unconfirmed): check the chat, then "
                    "press confirm or rearm below (or `replyd confirm BOT PARENT`, `replyd rearm BOT PARENT`).")
    if totals.get(st.GAVE_UP):
        n = totals[st.GAVE_UP]
        warn.append(f"{n} {'parent was' if n == 1 else 'parents were'} given up: `replyd log --state gave_up` says why; "
                    "`replyd rearm --state gave_up` answers them again.")
    dups = sum(int(b.get("duplicates") or 0) for b in summary.get("bots", {}).values())
    if dups:
        warn.append(f"{dups} duplicate {'reply was' if dups == 1 else 'replies were'} seen on the platforms: `replyd log --kind duplicate_detected`.")
    if bad:
        return "bad", bad + warn
    if warn:
        return "warn", warn
    return "ok", ["All well: every bot is running, sending and finding posts."]


def _headline_html(summary: dict[str, Any]) -> str:
    level, lines = headline(summary)
    items = "".join(f"<li>{_e(line)}</li>" for line in lines)
    return f'<div class="headline {level}" id="headline" data-level="{level}"><ul>{items}</ul></div>'


def render(summary: dict[str, Any], *, refresh_s: int = 5, chart: dict[str, Any] | None = None,
           waiting: list[dict[str, Any]] | None = None, form_token: FormToken | None = None,
           result: str | None = None) -> str:
    """Render the status page from a ``/v1/status`` summary, the last hour's ``chart`` (``activity``), the rows ``waiting``
    for a decision (their forms signed by ``form_token``; None: no forms) and an action's ``result`` line."""
    totals: dict[str, int] = {}
    for c in summary["counts"]:
        totals[c["state"]] = totals.get(c["state"], 0) + c["rows"]
    store_ok = summary["store"]["up"]
    bots = summary.get("bots", {})
    cards = [
        f'<div class="card {"ok" if store_ok else "bad"}" id="card-store">store<b>{"up" if store_ok else "down"}</b></div>',
        *(f'<div class="card" id="card-{_e(s)}">{_e(s.replace("_", " "))}<b>{totals.get(s, 0)}</b></div>'
          for s in (st.CLOSED, st.OPEN, st.NOT_LANDED, st.REJECTED, st.GAVE_UP, st.UNCONFIRMED)),
        f'<div class="card" id="card-oldest">oldest open (s)<b>{summary["oldest_open_age_s"]:.0f}</b></div>',
    ]
    live = summary.get("liveness", {})
    stale = sorted(f"{bot}/{p}" for bot, b in live.items() for p in b["stale"])
    failing = sorted(f"{bot}/{p}" for bot, b in live.items() for p in b.get("failing", []))
    word = "STALE" if stale else ("FAILING" if failing else "fresh")
    cards.insert(1, f'<div class="card {"bad" if stale or failing else "ok"}" id="card-liveness">paths'
                    f'<b>{word}</b></div>')
    paused = sorted(bot for bot, b in live.items() if (b.get("breaker") or {}).get("open"))
    cards.insert(2, f'<div class="card {"bad" if paused else "ok"}" id="card-sending">sending'
                    f'<b>{"PAUSED" if paused else "on"}</b></div>')
    gave_up: dict[str, int] = {}
    unconfirmed: dict[str, int] = {}
    for c in summary["counts"]:
        if c["state"] == st.GAVE_UP:
            gave_up[c["platform"]] = gave_up.get(c["platform"], 0) + c["rows"]
        if c["state"] == st.UNCONFIRMED:
            unconfirmed[c["platform"]] = unconfirmed.get(c["platform"], 0) + c["rows"]
    bot_rows = "".join(
        f'<tr id="bot-{_e(name)}"><td>{_e(name)}</td><td>{_state_cell(b, live.get(name))}</td>'
        f'<td><code>{_e(b.get("platform") or "")}</code></td><td><code>{_e(b.get("sender_id") or "")}</code></td>'
        f'<td>{_breaker_cell(live.get(name))}</td>'
        f'<td class="n" data-gave-up="{gave_up.get(b.get("platform") or "", 0)}">{gave_up.get(b.get("platform") or "", 0)}</td>'
        f'<td class="n" data-unconfirmed="{unconfirmed.get(b.get("platform") or "", 0)}">'
        f'{unconfirmed.get(b.get("platform") or "", 0)}</td>'
        f'<td class="n{" stale" if b.get("duplicates") else ""}" data-duplicates="{int(b.get("duplicates") or 0)}">'
        f'{int(b.get("duplicates") or 0)}</td>'
        f'<td>{_paths_cell(name, live.get(name))}</td></tr>'
        for name, b in sorted(bots.items())
    )
    bots_html = (f'<table id="bots"><tr><th>bot</th><th>state</th><th>platform</th><th>sender id</th>'
                 f'<th>write breaker</th><th>gave up</th><th>unconfirmed</th><th>duplicates</th><th>paths (last success)</th></tr>{bot_rows}</table>'
                 if bots else '<p class="empty">no bots configured</p>')
    names = {b["platform"]: name for name, b in bots.items() if b.get("platform")}  # links use the bot's name
    by_sender = {(b["platform"], b["sender_id"]): name for name, b in bots.items()
                 if b.get("platform") and b.get("sender_id")}
    result_html = f'<p class="result" id="action-result">{_e(result)}</p>' if result else ""
    store_note = "" if store_ok else f'<p class="bad" id="store-error">store unavailable: {_e(summary["store"].get("error"))}</p>'
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(refresh_s)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>replyd status</title><style>{_CSS}</style></head>
<body>
<h1>replyd</h1>
<div class="meta">status &middot; generated <span id="generated">{_e(_ts(summary["generated_at"]))}</span> UTC
&middot; refreshes every {int(refresh_s)} s &middot; store <code>{_e(summary["store"]["url"])}</code></div>
{store_note}
{result_html}
{_headline_html(summary)}
<div class="cards">{"".join(cards)}</div>
<h2>last hour</h2>{_chart_html(chart)}
<h2>waiting for a decision</h2>{_waiting_table(waiting, by_sender, form_token)}
<h2>bots</h2>{bots_html}
<h2>listing delay (the sweep looks for own replies this long after a send)</h2>{_listing_table(bots)}
<h2>rows by state</h2>{_counts_table(summary["counts"])}
<h2>oldest open rows</h2>{_open_table(summary["oldest_open"], names)}
<h2>recent events</h2>{_events_table(summary["recent_events"], names)}
</body></html>
"""
