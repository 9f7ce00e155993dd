"""Neutralising mentions in outgoing text: a reply pings its author, never a room, a group or a stranger.

A responder's text may echo what a stranger wrote (a prompt injection): each adapter passes its outgoing
text through the function for its platform's syntax before it sends or edits, unless the bot's
``allow_mentions`` setting is true. A neutralised mention stays readable: a zero-width space follows the
``@`` (or Slack's ``<`` is escaped), so the platform no longer parses it as a mention.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

ZWSP = "\u200b"  # zero-width space: "@\u200beveryone" reads as "@everyone" and pings nobody

# "@name", "@name@domain" (fediverse), "@org/team" (GitHub): an "@" not inside a word, an address or a path.
_AT = re.compile(r"(?<![\w@/.+-])@([\w][\w.-]*(?:@[\w-]+(?:\.[\w-]+)+|/[\w.-]+)?)", re.UNICODE)
# Slack's special mentions (<!channel>, <!here>, <!everyone>, <!subteam^ID|@handle>) and user mentions (<@U1>).
_SLACK = re.compile(r"<(!(?:channel|here|everyone|group|subteam\^)[^>]*|@[A-Z0-9]+(?:\|[^>]*)?)>", re.IGNORECASE)
_SLACK_USER = re.compile(r"@([A-Z0-9]+)", re.IGNORECASE)
_DISCORD_BROADCAST = re.compile(r"@(everyone|here)\b", re.IGNORECASE)
_MATRIX_ROOM = re.compile(r"@room\b", re.IGNORECASE)


def _keep(names: Iterable[str]) -> set[str]:
    return {n.strip().removeprefix("@").casefold() for n in names if n and n.strip()}


def at_names(text: str, keep: Iterable[str] = ()) -> str:
    """``text`` with every ``@name`` mention defused except those of ``keep`` (the author: case-insensitive).

    Covers Mastodon's ``@user@domain``, GitHub's ``@user`` and ``@org/team``, Discourse's and Telegram's
    ``@name``; an e-mail address is not a mention and stays as it is.
    """
    kept = _keep(keep)
    return _AT.sub(lambda m: m[0] if m[1].casefold() in kept else f"@{ZWSP}{m[1]}", text)


def slack(text: str, keep: Iterable[str] = ()) -> str:
    """``text`` with Slack's ``<!channel>``, ``<!here>``, ``<!everyone>``, ``<!subteam^…>`` and user mentions
    other than ``keep`` (user ids) escaped, so Slack shows them as text."""
    kept = _keep(keep)

    def defuse(m: re.Match[str]) -> str:
        user = _SLACK_USER.fullmatch(m[1].split("|", 1)[0])
        if user is not None and user[1].casefold() in kept:
            return m[0]
        return f"&lt;{m[1]}&gt;"

    return _SLACK.sub(defuse, text)


def discord(text: str) -> str:
    """``text`` with ``@everyone`` and ``@here`` defused (``allowed_mentions`` stops the ping; this the look)."""
    return _DISCORD_BROADCAST.sub(lambda m: f"@{ZWSP}{m[1]}", text)


def matrix(text: str) -> str:
    """``text`` with ``@room`` defused (clients that ignore ``m.mentions`` would ping the whole room)."""
    return _MATRIX_ROOM.sub(f"@{ZWSP}room", text)
