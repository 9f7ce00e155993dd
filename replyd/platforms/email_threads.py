"""Which ticket a mail belongs to, and header values from a stranger made safe to send back.

The desk's own ids: every reply's ``Message-ID`` is ``<replyd.<key>@<desk's domain>>``, where ``key`` is an
HMAC of the ticket under a secret of the desk (``own_key``). A stranger can copy an id it received, but
cannot make one for another ticket. A mail that names one of those ids (``In-Reply-To`` or any ``References``
entry) belongs to that reply's ticket; every other id in its headers is ignored, so a mail is otherwise its
own ticket.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from email.message import Message

_OWN_ID = re.compile(r"^<replyd\.([0-9a-f]{40})@([^<>@\s]+)>$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")
HEADER_LIMIT = 250  # characters of a stranger's header value copied into a reply (a Subject)
TICKET_HEADER = "X-Replyd-Ticket"  # on every reply: the ticket it answers (checked against its HMAC id)


def id_secret(secret: str) -> bytes:
    """The HMAC key of the reply ids, derived from ``secret``: the adapter holds no copy of the secret itself."""
    return hashlib.sha256(b"replyd-email-ids\x1f" + secret.encode()).digest()


def own_key(secret: bytes, instance: str, sender_id: str, ticket: str) -> str:
    """The provider key of ``ticket``: an HMAC a stranger cannot compute (40 hex digits)."""
    raw = f"replyd-email\x1f{instance}\x1f{sender_id}\x1f{ticket}".encode()
    return hmac.new(secret, raw, hashlib.sha256).hexdigest()[:40]


def own_id_key(msgid: str, domain: str) -> str | None:
    """The key inside ``msgid`` when it has the form of the desk's reply ids on ``domain``, else None."""
    m = _OWN_ID.match(msgid)
    return m.group(1) if m and m.group(2).lower() == domain.lower() else None


def content_key(msg: Message, body: str) -> str:
    """A stable id for a mail without a ``Message-ID``: a digest of its From, Date, Subject and body."""
    parts = [str(msg.get(h, "")) for h in ("From", "Date", "Subject")]
    digest = hashlib.sha256("\x1f".join([*parts, hashlib.sha256(body.encode()).hexdigest()]).encode())
    return f"<{digest.hexdigest()[:40]}@content.replyd.invalid>"


def raw_key(raw: bytes) -> str:
    """A stable id for a mail replyd cannot read: a digest of its bytes as the server serves them."""
    return f"<{hashlib.sha256(raw).hexdigest()[:40]}@unreadable.replyd.invalid>"


def clean_header(value: str) -> str:
    """``value`` on one line: control characters (an encoded CR LF) become a space, at most HEADER_LIMIT."""
    return " ".join(_CONTROL.sub(" ", value).split())[:HEADER_LIMIT]
