"""The simulated platform's JSON and HTML: accounts, statuses and notifications as Mastodon serves them.

Shapes follow the recorded Mastodon responses in ``shared/fixtures/mastodon`` (string ids, ``.000Z``
timestamps, HTML content with h-card mention links).
"""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime
from typing import Any

from replyd.sim.world import _MENTION_RE, Account, Notification, Status, World


def iso(t: float) -> str:
    """Format epoch seconds the way Mastodon does: ``2026-11-29T12:00:00.000Z``."""
    d = datetime.fromtimestamp(t, UTC)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


def account_json(world: World, acc: Account, *, credentials: bool = False) -> dict[str, Any]:
    """Render an account like ``verify_credentials.json`` (with ``source`` when ``credentials``)."""
    base = world.base_url
    last = world.last_status_at(acc.id)
    out: dict[str, Any] = {
        "id": acc.id,
        "username": acc.username,
        "acct": acc.username,
        "display_name": acc.display_name,
        "locked": False,
        "bot": acc.bot,
        "discoverable": None,
        "indexable": False,
        "group": False,
        # Mastodon rounds an account's created_at down to the day.
        "created_at": iso(acc.created_at - acc.created_at % 86400),
        "note": "",
        "url": f"{base}/@{acc.username}",
        "uri": f"{base}/ap/users/{acc.id}",
        "avatar": f"{base}/avatars/original/missing.png",
        "avatar_static": f"{base}/avatars/original/missing.png",
        "avatar_description": "",
        "header": f"{base}/headers/original/missing.png",
        "header_static": f"{base}/headers/original/missing.png",
        "header_description": "",
        "followers_count": 0,
        "following_count": 0,
        "statuses_count": world.statuses_count(acc.id),
        "last_status_at": None if last is None else iso(last)[:10],
        "hide_collections": None,
        "show_media": True,
        "show_media_replies": True,
        "show_featured": True,
        "noindex": False,
        "emojis": [],
        "roles": [],
        "fields": [],
    }
    if credentials:
        out["source"] = {
            "privacy": "public", "sensitive": False, "language": None, "note": "", "fields": [],
            "follow_requests_count": 0, "hide_collections": None, "discoverable": None,
            "indexable": False, "attribution_domains": [], "quote_policy": "public",
        }
        out["role"] = {"id": "-99", "name": "", "permissions": "65536", "color": "", "highlighted": False}
    return out


def content_html(world: World, text: str) -> str:
    """Render plain text as Mastodon HTML: paragraphs, ``<br />``, h-card links for local mentions."""

    def para(chunk: str) -> str:
        """Render one paragraph."""
        parts, pos = [], 0
        for m in _MENTION_RE.finditer(chunk):
            acc = world.find_account(m.group(1))
            if acc is None:
                continue
            parts.append(html.escape(chunk[pos : m.start()], quote=False))
            parts.append(
                f'<span class="h-card" translate="no"><a href="{world.base_url}/@{acc.username}" '
                f'class="u-url mention">@<span>{acc.username}</span></a></span>'
            )
            pos = m.end()
        parts.append(html.escape(chunk[pos:], quote=False))
        return "".join(parts).replace("\n", "<br />")

    return "".join(f"<p>{para(c)}</p>" for c in re.split(r"\n\s*\n", text.strip()) if c)


def status_json(world: World, st: Status, viewer_id: str | None = None) -> dict[str, Any]:
    """Render a status like ``status_post_reply.json``."""
    acc = world.accounts[st.account_id]
    base = world.base_url
    out: dict[str, Any] = {
        "id": st.id,
        "created_at": iso(st.created_at),
        "in_reply_to_id": st.in_reply_to_id,
        "in_reply_to_account_id": st.in_reply_to_account_id,
        "sensitive": st.sensitive,
        "spoiler_text": st.spoiler_text,
        "visibility": st.visibility,
        "language": st.language,
        "uri": f"{base}/ap/users/{acc.id}/statuses/{st.id}",
        "url": f"{base}/@{acc.username}/{st.id}",
        "replies_count": world.replies_count(st.id),
        "reblogs_count": 0,
        "favourites_count": 0,
        "quotes_count": 0,
        "edited_at": iso(st.edited_at) if st.edited_at is not None else None,
        "favourited": False,
        "reblogged": False,
        "muted": False,
        "bookmarked": False,
        "pinned": False,
        "content": content_html(world, st.text),
        "filtered": [],
        "reblog": None,
        "account": account_json(world, acc),
        "media_attachments": [],
        "mentions": [
            {
                "id": m.id,
                "username": m.username,
                "url": f"{base}/@{m.username}",
                "acct": m.username,
            }
            for m in (world.accounts[i] for i in st.mention_ids)
        ],
        "tags": [],
        "emojis": [],
        "tagged_collections": [],
        "quote": None,
        "card": None,
        "poll": None,
        "quote_approval": {"automatic": ["public"], "manual": [], "current_user": "automatic"},
    }
    # Mastodon shows the posting application only to the author.
    if st.via_api and viewer_id == st.account_id:
        out["application"] = {"name": "replyd", "website": None}
    return out


def notification_json(world: World, n: Notification) -> dict[str, Any]:
    """Render a mention notification like ``notifications_mention.json``."""
    return {
        "id": n.id,
        "type": n.type,
        "created_at": iso(n.created_at),
        "group_key": f"ungrouped-{n.id}",
        "account": account_json(world, world.accounts[n.from_account_id]),
        "status": status_json(world, world.statuses[n.status_id], n.account_id),
    }
