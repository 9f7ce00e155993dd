"""The read-only status page at ``/``: counts, oldest open rows, recent events; refreshes itself.

One self-contained HTML document (no script, no external assets, a meta
refresh), so it works behind any proxy and in a locked-down browser; it is served
with ``CSP`` (only its own inline style) and may not be framed. Every
value from the log is escaped: parent ids and event details come from other
people's posts.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from datetime import datetime, timezone
from typing import Any

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
"""

# The page runs no script and loads nothing: only its one inline style, allowed by hash; never framed.
CSP = ("default-src 'none'; style-src 'sha256-" + base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()
       + "'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def _ts(t: float | None) -> str:
    return "" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v), quote=True)


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


def _open_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return '<p class="empty" id="open-empty">no open rows</p>'
    body = "".join(
        f'<tr><td><code>{_e(r["platform"])}</code></td><td><code>{_e(r["parent_id"])}</code></td>'
        f'<td>{_e(_ts(r["opened_at"]))}</td><td class="n">{r["age_s"]:.0f}</td><td>{_e(r["attempt"])}</td></tr>'
        for r in rows
    )
    return (f'<table id="oldest-open"><tr><th>platform</th><th>parent id</th><th>opened (UTC)</th>'
            f'<th>age (s)</th><th>attempt</th></tr>{body}</table>')


def _events_table(events: list[dict[str, Any]]) -> str:
    if not events:
        return '<p class="empty" id="events-empty">no events yet</p>'
    body = "".join(
        f'<tr><td>{_e(_ts(ev["at"]))}</td><td><code>{_e(ev["platform"])}</code></td>'
        f'<td><code>{_e(ev["parent_id"])}</code></td><td class="kind">{_e(ev["kind"])}</td><td>{_e(ev["state"])}</td>'
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
        return f'<span class="stale" data-start="{_e(start["state"])}">{_e(start["words"])}</span>'
    return "logged in" if bot["ready"] else "not logged in"


def _breaker_cell(live: dict[str, Any] | None) -> str:
    """The bot's write breaker: closed, or open (red) since when and why."""
    brk = (live or {}).get("breaker")
    if not brk or not brk["open"]:
        return '<span data-breaker="closed">closed</span>'
    why = f": {brk['reason']}" if brk.get("reason") else ""
    return f'<span class="stale" data-breaker="open">open since {_e(_ts(brk.get("since")))} UTC{_e(why)}</span>'


def render(summary: dict[str, Any], *, refresh_s: int = 5) -> str:
    """Render the status page from a ``/v1/status`` summary."""
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
        f'<td>{_paths_cell(name, live.get(name))}</td></tr>'
        for name, b in sorted(bots.items())
    )
    bots_html = (f'<table id="bots"><tr><th>bot</th><th>state</th><th>platform</th><th>sender id</th>'
                 f'<th>write breaker</th><th>gave up</th><th>unconfirmed</th><th>paths (last success)</th></tr>{bot_rows}</table>'
                 if bots else '<p class="empty">no bots configured</p>')
    store_note = "" if store_ok else f'<p class="bad" id="store-error">store unavailable: {_e(summary["store"].get("error"))}</p>'
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{int(refresh_s)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>replyd status</title><style>{_CSS}</style></head>
<body>
<h1>replyd</h1>
<div class="meta">read-only status &middot; generated <span id="generated">{_e(_ts(summary["generated_at"]))}</span> UTC
&middot; refreshes every {int(refresh_s)} s &middot; store <code>{_e(summary["store"]["url"])}</code></div>
{store_note}
<div class="cards">{"".join(cards)}</div>
<h2>bots</h2>{bots_html}
<h2>listing delay (the sweep looks for own replies this long after a send)</h2>{_listing_table(bots)}
<h2>rows by state</h2>{_counts_table(summary["counts"])}
<h2>oldest open rows</h2>{_open_table(summary["oldest_open"])}
<h2>recent events</h2>{_events_table(summary["recent_events"])}
</body></html>
"""
