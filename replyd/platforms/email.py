"""The email adapter: a support desk's mailbox read by IMAP, each ticket answered once by SMTP.

Settings: ``[bots.settings]`` with ``platform = "email"``; each key is a field of ``EmailPlatform.Settings``.

Ids: the sender id is the bot's address (domain lower-cased: RFC 5321 leaves the local part to the server). A
parent id is a ``Message-ID`` exactly as the mail serves it, normalised only as RFC 5322 allows (folding
whitespace and comments around ``<id-left@id-right>`` removed, case kept). With ``answer = "thread_root"`` (the
default) a mail that names one of the desk's own replies (``In-Reply-To`` or any ``References`` entry) belongs
to that reply's ticket; other ids are the sender's word, so the mail is its own ticket (``email_threads``).
``answer = "message"`` answers each mail. A mail without ``Message-ID`` is keyed on a digest of its content; a
mail the parser cannot read is offered marked ``unreadable`` (the policy skips it), so it never stops a path.
The mail actually answered rides in ``Parent.extra`` (its ``Message-ID``, ``References``, reply address).

Discovery: the folder is opened read-only (``EXAMINE``), so replyd never sets ``\\Seen`` and never reads it: the
cursor is ``<UIDVALIDITY>:<last UID>`` (a new UIDVALIDITY starts over from UID 1; the guard's key makes the re-read
harmless). ``stream`` holds IMAP IDLE open for push (``replyd.streams.StreamRunner``); the inbox poll is the backstop.

Loop policy (RFC 3834 and vendor markers, ``email_checks``): an auto-reply, bulk or list mail, a robot sender or
an ``X-Loop`` naming the desk is offered marked ``extra["refused"]``, which the policy skips with that reason; the
bot's own mail is never offered. The author is the From address (never the display name); the author id is
where the answer goes (``reply_to``: the From, or a checked Reply-To), so the caps count that mailbox; they count
the From too (``extra["from"]``, kept on the row as ``origin_id`` when it differs), so one sender is one sender.

Send and read-back: the reply carries ``In-Reply-To``, ``References``, ``Auto-Submitted: auto-replied`` and a
``Message-ID`` made from the guard's provider key (``<replyd.<key>@<bot's domain>>``: the same on every attempt).
The bot's own address is an extra envelope recipient (a Bcc the MTA delivers like the customer's copy), so the
server-accepted reply lands in the bot's mailbox whatever happens to replyd after the SMTP ``250``; read-back
searches ``copy_folder`` for that ``Message-ID``. ``listing_delay_s`` is that copy's delivery delay.

Error mapping at this boundary::

    what happened                                      send                         reads (IMAP)
    -------------------------------------------------  ---------------------------  -----------------
    connect refused, DNS, connect timeout, TLS fails   DefinitelyNotSent            DefinitelyNotSent
    AUTH refused (530, 535)                            DefinitelyNotSent            DefinitelyNotSent
    4xx before or after DATA (the server keeps none)   RateLimited (tempfail_wait_s)
    5xx before or after DATA                           Rejected
    connection lost, timeout or garbled reply in DATA  MaybeSent
    connection lost before DATA                        DefinitelyNotSent            DefinitelyNotSent
    the reply cannot be composed (before any connect)  Rejected
    a mail the parser cannot read                                                   a parent marked unreadable
"""

from __future__ import annotations

import email.policy
import email.utils
import hmac
import re
import smtplib
import ssl
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Annotated, Any, ClassVar, Literal, NoReturn, Self

import httpx
import structlog
from imapclient import IMAPClient
from imapclient.exceptions import IMAPClientError
from pydantic import AfterValidator, Field

from replyd.clock import Clock
from replyd.errors import DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.platforms import unreadable
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, PlatformSettings, ReadBack, Sent, Text, Texts, Token,
    default_provider_key, register_platform,
)
from replyd.platforms.email_threads import (
    TICKET_HEADER, clean_header, content_key, id_secret, own_id_key, own_key, raw_key,
)
from replyd.platforms.email_checks import (
    AUTO_REPLY, BULK_MAIL, ROBOT_SENDER, auto_marker, destination, header_address, is_desk_id,
    is_robot, one_address,
)

_ROBOT_LOCALS = {"mailer-daemon", "postmaster", "noreply", "no-reply", "donotreply", "do-not-reply", "bounce",
                 "bounces"}
_MSGID = re.compile(r"<([^<>]+)>")
_KEY_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TEXT_LIMIT = 20_000  # characters of a mail's body offered to the responder
_LOOKUPS = 3  # ids of the desk's form looked up per mail (a follow-up names its reply first or last)


def _address(value: str) -> str:
    value = value.strip()
    local, at, domain = value.rpartition("@")
    if not at or not local or not domain or any(c.isspace() or c in "<>,;" for c in value):
        raise ValueError("not an address of the form local@domain")
    return f"{local}@{domain.lower()}"


Address = Annotated[str, AfterValidator(_address)]


def normalise_msgid(raw: Any) -> str | None:
    """``raw`` (a Message-ID header) as ``<id-left@id-right>``: folding whitespace and comments gone, case kept."""
    if raw is None:
        return None
    text = re.sub(r"\([^()]*\)", "", " ".join(str(raw).split()))
    m = _MSGID.search(text)
    if not m:
        return None
    inner = "".join(m.group(1).split())  # obs-id-left/right may carry CFWS between the dots
    return f"<{inner}>" if inner else None


def msgids(raw: Any) -> list[str]:
    """Every ``<id>`` of a References or In-Reply-To header, in order."""
    if raw is None:
        return []
    text = re.sub(r"\([^()]*\)", "", " ".join(str(raw).split()))
    return [f"<{''.join(m.split())}>" for m in _MSGID.findall(text) if m.strip()]


def loop_reason(msg: EmailMessage, me: str, also_me: Sequence[str] = ()) -> str | None:
    """Why ``msg`` must not be answered (RFC 3834 and the bot's own mail), or None when it may be."""
    auto = str(msg.get("Auto-Submitted", "")).split(";")[0]
    auto = re.sub(r"\([^()]*\)", "", auto).strip().lower()
    if auto and auto != "no":
        return "auto_submitted"
    if str(msg.get("Precedence", "")).strip().lower() in ("bulk", "junk", "list"):
        return "precedence"
    if msg.get("List-Id") is not None:
        return "list"
    if str(msg.get("Return-Path", "x")).strip() == "<>":
        return "null_sender"
    _name, sender = email.utils.parseaddr(str(msg.get("From", "")))
    if not sender or "@" not in sender:
        return "no_sender"
    local, _, domain = sender.rpartition("@")
    local_l = local.lower()
    if local_l in _ROBOT_LOCALS or local_l.startswith("owner-") or local_l.endswith("-request"):
        return "robot_sender"
    if _is_me(sender, me, also_me):
        return "own"
    return None


def _is_me(sender: str, me: str, also_me: Sequence[str]) -> bool:
    """Whether ``sender`` is the desk or an alias, compared without case (SUPPORT@ is the desk too)."""
    return sender.casefold() in {a.casefold() for a in (me, *also_me)}


def _body_text(msg: EmailMessage) -> str:
    try:
        part = msg.get_body(("plain",))
        text = part.get_content() if part is not None else ""
    except (LookupError, ValueError, AttributeError):
        text = ""
    return str(text)[:_TEXT_LIMIT]


def _int(value: Any) -> int:
    try:
        return max(int(value), 0)
    except (TypeError, ValueError):
        return 0


def _batches(uids: list[int], sizes: dict[int, int], cap: int, budget: int) -> Iterator[list[int]]:
    """``uids`` in runs whose bytes (each mail's size, at most ``cap``) stay within ``budget`` (one mail at least)."""
    run: list[int] = []
    used = 0
    for uid in uids:
        size = min(sizes[uid], cap)
        if run and used + size > budget:
            yield run
            run, used = [], 0
        run.append(uid)
        used += size
    if run:
        yield run


# loop_reason's words as the policy's skip reasons (``Parent.extra["refused"]``, see replyd.policy).
_REFUSED = {"auto_submitted": AUTO_REPLY, "precedence": BULK_MAIL, "list": BULK_MAIL, "null_sender": AUTO_REPLY,
            "robot_sender": ROBOT_SENDER}


@register_platform("email")
class EmailPlatform:
    """A support-desk mailbox: IMAP in (read-only, UID cursors, IDLE), SMTP out, read-back by Message-ID."""

    kind: ClassVar[str]

    class Settings(PlatformSettings):
        """The email adapter's settings (the password from ``password_env``)."""

        address: Address  # the bot's address: the From of every reply and its Bcc copy's recipient
        username: Text | None = None  # the IMAP/SMTP login (default: address)
        password: Token  # an app password (password_env)
        imap_host: Text
        imap_port: int = Field(993, ge=1, le=65535)
        imap_tls: Literal["ssl", "starttls", "none"] = "ssl"
        smtp_host: Text
        smtp_port: int = Field(587, ge=1, le=65535)
        smtp_tls: Literal["ssl", "starttls", "none"] = "starttls"
        smtp_auth: bool = True  # AUTH with username/password (a loopback relay may need none)
        folder: Text = "INBOX"  # where tickets arrive
        copy_folder: Text = "INBOX"  # where the Bcc copy of each reply lands (a server-side filter may move it)
        answer: Literal["thread_root", "message"] = "thread_root"
        id_secret: Token | None = None  # the HMAC secret of the reply ids (id_secret_env; default: the password)
        also_me: Texts = []  # other addresses of the bot (aliases): never answered
        listing_delay_s: float = Field(30.0, ge=0)  # the Bcc copy's delivery delay
        timeout_s: float = Field(30.0, gt=0, le=600)
        max_fetch: int = Field(200, ge=1, le=10_000)  # mails read per poll
        idle_renew_s: float = Field(600.0, gt=0, le=1740)  # RFC 2177: re-issue IDLE before 29 minutes
        tempfail_wait_s: float = Field(30.0, ge=0)  # the wait after a 4xx (SMTP gives none)
        reply_to: Literal["from", "checked"] = "from"  # where an answer goes: the From, or a checked Reply-To
        reply_to_domains: Texts = []  # with "checked": domains a Reply-To may name besides the From's own
        max_mail_bytes: int = Field(1_000_000, ge=4096, le=100_000_000)  # bytes of one mail read; the rest cut
        fetch_batch_bytes: int = Field(4_000_000, ge=4096, le=200_000_000)  # bytes fetched per IMAP FETCH
        loop_max_answers: int = Field(5, ge=1)  # answers to one address within loop_window_s before it stops
        loop_window_s: float = Field(3600.0, gt=0)

    def __init__(self, settings: Settings, *, clock: Clock) -> None:
        self.s = settings
        self.clock = clock
        self.me = settings.address
        self.instance = settings.instance or f"email:{settings.address}"
        self.listing_delay_s = settings.listing_delay_s
        self._login = settings.username or settings.address
        self.log = structlog.get_logger("replyd.email").bind(platform=self.instance)
        self._identity: Identity | None = None
        self._secret = id_secret((settings.id_secret or settings.password).get_secret_value())
        self._tickets: dict[str, str] = {}  # reply key -> its ticket, as read from the desk's verified copy
        self._misses: dict[str, None] = {}  # reply keys no copy verified (forged, or the copy deleted)
        # (answers, window): the policy answers one address at most that often (``Policy.limit_reason``).
        self.loop_breaker = (settings.loop_max_answers, settings.loop_window_s)

    def __repr__(self) -> str:
        return f"EmailPlatform(folder={self.s.folder!r})"

    @classmethod
    def from_settings(cls, settings: Any, *, http: httpx.Client, clock: Clock) -> Self:
        """Validate ``settings`` (one-line ConfigError naming the key); the HTTP client is not used."""
        return cls(cls.Settings.load("email", settings), clock=clock)

    # --- the boundary -------------------------------------------------------------------------------

    def _clean(self, text: str) -> str:
        """``text`` with the password cut out (a server may echo what it was sent)."""
        return text.replace(self.s.password.get_secret_value(), "***")[:300]

    def _imap_error(self, what: str, exc: BaseException) -> NoReturn:
        raise DefinitelyNotSent(self._clean(f"imap {what}: {type(exc).__name__}: {exc}")) from None

    def _imap(self, folder: str) -> IMAPClient:
        """A logged-in IMAP connection with ``folder`` open read-only (EXAMINE: flags are never changed)."""
        try:
            context = ssl.create_default_context()
            c = IMAPClient(self.s.imap_host, port=self.s.imap_port, ssl=self.s.imap_tls == "ssl",
                           ssl_context=context, timeout=self.s.timeout_s)
            if self.s.imap_tls == "starttls":
                c.starttls(context)
            c.login(self._login, self.s.password.get_secret_value())
            c.select_folder(folder, readonly=True)
            return c
        except (OSError, IMAPClientError) as exc:
            self._imap_error("connect", exc)

    @staticmethod
    def _bye(c: IMAPClient) -> None:
        try:
            c.logout()
        except Exception:  # the connection is done with either way
            pass

    # --- discovery ------------------------------------------------------------------------------------

    def whoami(self) -> Identity:
        """The configured address, once the IMAP server has accepted the login."""
        if self._identity is None:
            self._bye(self._imap(self.s.folder))
            self._identity = Identity(sender_id=self.me, handle=self.me)
        return self._identity

    def _parents(self, c: IMAPClient, uids: Sequence[int], uidvalidity: int) -> list[Parent]:
        if not uids:
            return []
        out: list[Parent] = []
        seen: set[str] = set()
        for uid, raw, internal in self._mails(c, uids):
            parent = self._readable(raw, uid, uidvalidity, internal)
            if parent is not None and parent.id not in seen:
                seen.add(parent.id)
                out.append(parent)
        return out

    def _readable(self, raw: bytes, uid: int, uidvalidity: int, internal: Any) -> Parent | None:
        """``_parent``, or a parent marked unreadable (``_unreadable``): one bad mail never stops a path."""
        try:
            return self._parent(raw, uid, uidvalidity, internal)
        except PlatformError:
            raise  # the look-up of a reply's ticket failed: the page is read again
        except Exception as exc:  # a stranger's bytes: ValueError, RecursionError, anything
            return self._unreadable(raw, uid, uidvalidity, exc)

    def _unreadable(self, raw: bytes, uid: int, uidvalidity: int, exc: BaseException) -> Parent:
        """A mail replyd cannot read, as a parent the policy skips (``unreadable``): logged, counted, reported."""
        problem = clean_header(f"{type(exc).__name__}: {exc}")[:200]
        pid = raw_key(raw)
        self.log.warning("replyd.email.unreadable", uid=uid, uidvalidity=uidvalidity, parent_id=pid, problem=problem)
        unreadable.report(self.instance, "mail", pid, problem)  # counted, and an event `replyd status` counts
        return Parent(id=pid, author_id="", extra={"unreadable": problem, "uid": uid, "uidvalidity": uidvalidity,
                                                   "folder": self.s.folder})

    def _ticket_of(self, ids: Sequence[str]) -> str | None:
        """The ticket of the first of ``ids`` that is one of the desk's own replies, or None.

        At most ``_LOOKUPS`` ids of the desk's form are looked up per mail, and a key no copy verifies is
        remembered: a mail full of forged ids costs a few IMAP searches once, not one per id per poll."""
        domain = self.me.rpartition("@")[2]
        keyed = [(rid, key) for rid in ids if (key := own_id_key(rid, domain)) is not None]
        for rid, key in keyed[:_LOOKUPS]:
            if key in self._misses:
                continue
            if key not in self._tickets:
                ticket = self._copy_ticket(rid, key)
                memo: dict[str, Any] = self._tickets if ticket is not None else self._misses
                if len(memo) >= 10_000:
                    memo.clear()
                memo[key] = ticket
                if ticket is None:
                    continue
            return self._tickets[key]
        return None

    def _copy_ticket(self, rid: str, key: str) -> str | None:
        """The ticket named by the desk's copy of reply ``rid`` in ``copy_folder`` whose HMAC key is ``key``.

        A copy whose ticket does not give ``key`` is ignored: a stranger may send a mail with that Message-ID."""
        c = self._imap(self.s.copy_folder)
        try:
            try:
                uids = sorted(c.search(["HEADER", "Message-ID", rid]))[:20]
                data = c.fetch(uids, ["BODY.PEEK[HEADER]"]) if uids else {}
            except (OSError, IMAPClientError) as exc:
                self._imap_error("search", exc)
        finally:
            self._bye(c)
        for item in data.values():
            head = item.get(b"BODY[HEADER]")
            try:
                copy = BytesParser().parsebytes(head, headersonly=True) if isinstance(head, bytes) else None
                named = [*(copy.get_all(TICKET_HEADER) or []), copy.get("In-Reply-To"), copy.get("References")]
            except Exception:  # an unreadable copy names no ticket
                continue
            for ticket in msgids(" ".join(str(n) for n in named if n is not None)):
                if hmac.compare_digest(self.provider_key(self.me, ticket), key):
                    return ticket
        return None

    def _mails(self, c: IMAPClient, uids: Sequence[int]) -> Iterator[tuple[int, bytes, Any]]:
        """Each mail of ``uids`` as (uid, its first ``max_mail_bytes``, INTERNALDATE). Sizes are read first and
        the mails fetched in batches of about ``fetch_batch_bytes``: a poll's memory does not grow with them."""
        cap = self.s.max_mail_bytes
        try:
            sizes = {u: _int(d.get(b"RFC822.SIZE")) for u, d in c.fetch(list(uids), ["RFC822.SIZE"]).items()}
        except (OSError, IMAPClientError) as exc:
            self._imap_error("fetch", exc)
        for batch in _batches(sorted(sizes), sizes, cap, self.s.fetch_batch_bytes):
            try:
                data = c.fetch(batch, [f"BODY.PEEK[]<0.{cap}>", "INTERNALDATE"])
            except (OSError, IMAPClientError) as exc:
                self._imap_error("fetch", exc)
            for uid in sorted(data):
                raw = data[uid].pop(b"BODY[]<0>", None) or data[uid].pop(b"BODY[]", None)
                if not isinstance(raw, bytes):
                    continue
                if sizes[uid] > cap:
                    self.log.warning("replyd.email.mail_cut", uid=uid, size=sizes[uid], read=cap)
                yield uid, raw, data[uid].get(b"INTERNALDATE")
                del raw
            del data

    def _parent(self, raw: bytes, uid: int, uidvalidity: int, internal: Any) -> Parent | None:
        msg = BytesParser(policy=email.policy.default).parsebytes(raw)
        mid = normalise_msgid(msg.get("Message-ID"))
        why = loop_reason(msg, self.me, self.s.also_me)  # type: ignore[arg-type]
        who = None if why in ("own", "no_sender") else self._who(msg, uid, mid, why)
        if who is None:  # the desk's own mail, or no one address to answer: no row, a log line
            self.log.info("replyd.email.skipped", uid=uid, message_id=mid, reason=why or "no_sender")
            return None
        dest, sender, display, refused = who
        refs = msgids(msg.get("References"))
        irt = msgids(msg.get("In-Reply-To"))
        text = _body_text(msg)
        own = mid or content_key(msg, text)  # no Message-ID (an MX adds none): a key from its content
        if mid is None:
            self.log.info("replyd.email.no_message_id", uid=uid, parent_id=own)
        root = own
        if self.s.answer == "thread_root" and not refused:  # only an id the desk made names a thread; a refused
            root = self._ticket_of([*irt, *reversed(refs)]) or own  # mail is its own row
        created = internal.timestamp() if isinstance(internal, datetime) else None
        return Parent(
            id=root, author_id=dest, author_handle=sender,
            text=text, created_at=created, thread_depth=len(refs),
            extra={"message_id": mid, "references": refs or irt, "reply_to": dest, "from": sender,
                   "display_name": display, **({"refused": refused} if refused else {}),
                   "subject": str(msg.get("Subject", "")), "uid": uid, "uidvalidity": uidvalidity,
                   "folder": self.s.folder})

    def _who(self, msg: EmailMessage, uid: int, mid: str, why: str | None) -> tuple[str, str, str, str | None] | None:
        """(the answer's address, the From address, the display name, why the policy must refuse the mail or None);
        None when the From is not one address, or is the desk's. The display name never identifies anyone."""
        sender = header_address(msg, "From")
        desk = [self.me, *self.s.also_me]
        if sender is None or sender in {a.casefold() for a in desk}:
            return None
        refused = _REFUSED.get(why or "") or (ROBOT_SENDER if is_robot(sender) else None)
        if refused is None and (marker := auto_marker(msg, desk)):
            refused = marker[0]
            self.log.info("replyd.email.auto_mail", uid=uid, message_id=mid, reason=refused, header=marker[1])
        dest, note = destination(msg, sender, mode=self.s.reply_to, desk=desk, domains=self.s.reply_to_domains)
        if note:
            self.log.info("replyd.email.reply_to_ignored", uid=uid, message_id=mid, reason=note)
        name = email.utils.parseaddr(str(msg.get("From", "")))[0]
        return dest, sender, " ".join(name.split())[:200], refused

    def _page(self, criteria: list[Any], cursor: str | None) -> Page:
        c = self._imap(self.s.folder)
        try:
            uidvalidity = int(c.folder_status(self.s.folder, ["UIDVALIDITY"])[b"UIDVALIDITY"])
            last = 0
            if cursor:
                v, _, u = cursor.partition(":")
                if v == str(uidvalidity) and u.isdigit():
                    last = int(u)
                else:  # the folder was recreated: UIDs start over; the answered-log keeps the re-read harmless
                    self.log.warning("replyd.email.uidvalidity_changed", was=v, now=uidvalidity)
            try:
                uids = sorted(u for u in c.search(["UID", f"{last + 1}:*", *criteria]) if u > last)
            except (OSError, IMAPClientError) as exc:
                self._imap_error("search", exc)
            batch = uids[: self.s.max_fetch]
            parents = self._parents(c, batch, uidvalidity)
            return Page(parents, f"{uidvalidity}:{batch[-1] if batch else last}")
        finally:
            self._bye(c)

    def inbox(self, cursor: str | None) -> Page:
        """Mails in the folder after the cursor's UID (``<UIDVALIDITY>:<UID>``), loop mail left out."""
        return self._page([], cursor)

    def search(self, query: str, cursor: str | None) -> Page:
        """Mails in the folder whose text contains ``query`` (IMAP SEARCH TEXT), after the cursor's UID."""
        return self._page(["TEXT", query], cursor)

    def refind(self, since: float) -> list[Parent]:
        """Every mail of the folder that arrived (INTERNALDATE) since epoch ``since``, with no cursor."""
        c = self._imap(self.s.folder)
        try:
            uidvalidity = int(c.folder_status(self.s.folder, ["UIDVALIDITY"])[b"UIDVALIDITY"])
            day = (datetime.fromtimestamp(since, UTC) - timedelta(days=1)).date()
            try:
                uids = sorted(c.search(["SINCE", day]))[-self.s.max_fetch:]
            except (OSError, IMAPClientError) as exc:
                self._imap_error("search", exc)
            return [p for p in self._parents(c, uids, uidvalidity) if (p.created_at or since) >= since]
        finally:
            self._bye(c)

    def resolve(self, ref: str) -> Parent:
        """A ``Message-ID`` (with or without ``<>``, or a ``mid:`` URL) found in the folder."""
        text = ref.strip().removeprefix("mid:")
        mid = normalise_msgid(text if "<" in text else f"<{text}>")
        if mid is None:
            raise Rejected(f"email: {ref[:100]!r} is not a Message-ID")
        c = self._imap(self.s.folder)
        try:
            uidvalidity = int(c.folder_status(self.s.folder, ["UIDVALIDITY"])[b"UIDVALIDITY"])
            try:
                uids = sorted(c.search(["HEADER", "Message-ID", mid]))
            except (OSError, IMAPClientError) as exc:
                self._imap_error("search", exc)
            for p in self._parents(c, uids, uidvalidity):
                if p.extra["message_id"] == mid:
                    return p
            raise Rejected(f"email: no answerable mail with Message-ID {mid[:100]} in {self.s.folder}")
        finally:
            self._bye(c)

    def stream(self, stop: threading.Event) -> Iterator[Parent]:
        """Hold IMAP IDLE on the folder and yield the mails that arrive (new UIDs), until ``stop``."""
        c = self._imap(self.s.folder)
        try:
            status = c.folder_status(self.s.folder, ["UIDVALIDITY", "UIDNEXT"])
            uidvalidity, last = int(status[b"UIDVALIDITY"]), int(status[b"UIDNEXT"]) - 1
            while not stop.is_set():
                c.idle()
                news = False
                for _ in range(int(self.s.idle_renew_s)):
                    if stop.is_set():
                        break
                    if any(r[1] == b"EXISTS" for r in c.idle_check(timeout=1.0) if len(r) > 1):
                        news = True
                        break
                c.idle_done()
                if not news:
                    continue
                uids = sorted(u for u in c.search(["UID", f"{last + 1}:*"]) if u > last)
                if uids:
                    last = uids[-1]
                    yield from self._parents(c, uids, uidvalidity)
        except (OSError, IMAPClientError) as exc:
            self._imap_error("idle", exc)
        finally:
            self._bye(c)

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """``ThreadDepth``: the mails above the one answered, from its own ``References`` (RFC 5322 3.6.4), at
        most ``limit + 1``, no request; a client that trims the header makes it a lower bound."""
        refs = parent.extra.get("references") or []
        return min(len(refs) if isinstance(refs, list) else parent.thread_depth, limit + 1)

    # --- send ---------------------------------------------------------------------------------------

    def provider_key(self, sender_id: str, parent_id: str) -> str:
        """``ProviderKeys``: an HMAC of the ticket under ``id_secret``, so no stranger can forge a reply id."""
        return own_key(self._secret, self.instance, sender_id, parent_id)

    def reply_message_id(self, provider_key: str) -> str:
        """The reply's Message-ID for ``provider_key``: the same on every attempt."""
        key = provider_key if _KEY_SAFE.match(provider_key) else default_provider_key(self.instance, self.me,
                                                                                      provider_key)
        return f"<replyd.{key}@{self.me.rpartition('@')[2]}>"

    def is_own_id(self, mid: str) -> bool:
        """Whether ``mid`` has the form of this desk's reply ids (the one place that decides it)."""
        return is_desk_id(mid, self.me.rpartition("@")[2])

    def compose(self, parent: Parent, text: str, *, provider_key: str) -> EmailMessage:
        """The reply mail (headers per RFC 5322 and RFC 3834)."""
        x = parent.extra
        mid = normalise_msgid(x.get("message_id", parent.id))  # None: the mail had no Message-ID
        subject = clean_header(str(x.get("subject", "")))  # an encoded CR LF must not break the header
        msg = EmailMessage()
        msg["From"] = self.me
        msg["To"] = str(x.get("reply_to") or parent.author_id)
        msg["Subject"] = subject if subject.lower().startswith("re:") else f"Re: {subject}".strip()
        msg["Date"] = email.utils.formatdate(self.clock.now())
        msg["Message-ID"] = self.reply_message_id(provider_key)
        refs = [r for r in x.get("references") or [] if isinstance(r, str)] + ([mid] if mid else [])
        if mid:
            msg["In-Reply-To"] = mid
        if refs:
            msg["References"] = " ".join(refs[-20:])
        msg[TICKET_HEADER] = clean_header(parent.id)  # how a follow-up naming only this reply finds its ticket
        msg["Auto-Submitted"] = "auto-replied"
        msg.set_content(text)
        return msg

    def _composed(self, parent: Parent, text: str, provider_key: str) -> tuple[EmailMessage, bytes]:
        """The reply and its bytes; a failure here is before any connection: ``Rejected`` for this parent
        (no retry can make it, and it is no platform failure for the write breaker)."""
        try:
            msg = self.compose(parent, text, provider_key=provider_key)
            return msg, msg.as_bytes()
        except Exception as exc:  # a header built from a stranger's mail
            detail = self._clean(f"compose: {type(exc).__name__}: {exc}")
            self.log.warning("replyd.email.compose_failed", parent_id=parent.id, problem=detail)
            raise Rejected(detail) from None

    def _smtp_fail(self, stage: str, exc: BaseException) -> NoReturn:
        detail = self._clean(f"smtp {stage}: {type(exc).__name__}: {exc}")
        code = getattr(exc, "smtp_code", None)
        self.log.warning("replyd.email.send_failed", stage=stage, code=code, problem=detail)
        if isinstance(code, int) and code in (530, 534, 535, 538):
            raise DefinitelyNotSent(detail, status=code) from None
        if isinstance(code, int) and 400 <= code < 500:
            raise RateLimited(detail, status=code, retry_after_s=self.s.tempfail_wait_s) from None
        if isinstance(code, int) and 500 <= code < 600:
            raise Rejected(detail, status=code) from None
        if stage == "data":  # the end of the data may have reached the server: the reply may be queued
            raise MaybeSent(detail) from None
        raise DefinitelyNotSent(detail) from None

    def send(self, parent: Parent, text: str, *, provider_key: str) -> Sent:
        """Mail the reply to the ticket's sender with a Bcc to the bot itself; the reply id is its Message-ID."""
        if parent.extra.get("refused"):  # the policy skips these; a caller that bypassed it is stopped here
            raise Rejected(f"email: {parent.extra['refused']} mail is never answered")
        msg, data = self._composed(parent, text, provider_key)
        rcpt = [str(msg["To"]), self.me]
        stage = "connect"
        smtp: smtplib.SMTP | None = None
        try:
            if self.s.smtp_tls == "ssl":
                smtp = smtplib.SMTP_SSL(self.s.smtp_host, self.s.smtp_port, timeout=self.s.timeout_s,
                                        context=ssl.create_default_context())
            else:
                smtp = smtplib.SMTP(self.s.smtp_host, self.s.smtp_port, timeout=self.s.timeout_s)
            stage = "hello"
            smtp.ehlo()
            if self.s.smtp_tls == "starttls":
                smtp.starttls(context=ssl.create_default_context())
                smtp.ehlo()
            if self.s.smtp_auth:
                stage = "auth"
                smtp.login(self._login, self.s.password.get_secret_value())
            stage = "envelope"
            code, resp = smtp.mail(self.me)
            if code != 250:
                raise smtplib.SMTPSenderRefused(code, resp, self.me)
            for r in rcpt:
                code, resp = smtp.rcpt(r)
                if code not in (250, 251):
                    raise smtplib.SMTPRecipientsRefused({r: (code, resp)})
            stage = "data"
            code, resp = smtp.data(data)  # returns the final reply; it raises only for the DATA command
            if code != 250:
                raise smtplib.SMTPDataError(code, resp)
            stage = "done"
        except smtplib.SMTPRecipientsRefused as exc:
            code = next(iter(exc.recipients.values()))[0]
            err = smtplib.SMTPResponseException(code, b"recipient refused")
            self._smtp_fail("envelope", err)
        except (OSError, smtplib.SMTPException) as exc:
            self._smtp_fail(stage, exc)
        finally:
            if smtp is not None:
                try:
                    smtp.quit() if stage == "done" else smtp.close()
                except (OSError, smtplib.SMTPException):
                    pass
        reply_id = str(msg["Message-ID"])
        self.log.info("replyd.email.sent", parent_id=parent.id, reply_id=reply_id)
        return Sent(reply_id=reply_id)

    # --- read-back ----------------------------------------------------------------------------------

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Find each pending parent's reply by its Message-ID in ``copy_folder`` (where the Bcc copy lands)."""
        rb = ReadBack()
        if not pending:
            return rb
        c = self._imap(self.s.copy_folder)
        try:
            for p in pending:
                key = p.provider_key or self.provider_key(sender_id, p.parent.id)
                mid = self.reply_message_id(key)
                try:
                    uids = c.search(["HEADER", "Message-ID", mid])
                    dates = self._own_copies(c, uids, mid) if uids else {}
                except (OSError, IMAPClientError) as exc:
                    self.log.warning("replyd.email.read_back_failed", parent_id=p.parent.id,
                                     problem=self._clean(str(exc)))
                    break  # the connection is gone: what is left stays unchecked
                rb.checked.add(p.parent.id)
                if dates:
                    first = min(dates) if dates else None
                    when = dates.get(first, {}).get(b"INTERNALDATE") if first is not None else None
                    rb.found[p.parent.id] = [OwnReply(mid, p.parent.id,
                                                      when.timestamp() if isinstance(when, datetime) else None)]
        finally:
            self._bye(c)
        return rb

    def _own_copies(self, c: IMAPClient, uids: Sequence[int], mid: str) -> dict[int, Any]:
        """The mails of ``uids`` that are the desk's copy of reply ``mid``: that exact Message-ID, one the desk made,
        From the desk's address. Another mail that merely contains ``mid`` is not a proof of an answer."""
        fields = "BODY.PEEK[HEADER.FIELDS (MESSAGE-ID FROM)]"
        out: dict[int, Any] = {}
        for uid, d in c.fetch(list(uids), [fields, "INTERNALDATE"]).items():
            raw = d.get(b"BODY[HEADER.FIELDS (MESSAGE-ID FROM)]")
            head = BytesParser(policy=email.policy.compat32).parsebytes(raw if isinstance(raw, bytes) else b"",
                                                                         headersonly=True)
            if (normalise_msgid(head.get("Message-ID")) == mid and self.is_own_id(mid)
                    and one_address(head.get("From", "")) == self.me.casefold()):
                out[uid] = d
            else:
                self.log.warning("replyd.email.copy_refused", uid=uid, reply_id=mid, folder=self.s.copy_folder)
        return out

    def read_parents(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """``ParentReplies``: the read-back is already one look per parent (its reply's Message-ID), no feed walk."""
        return self.read_back(pending, sender_id=sender_id)

    def delete(self, reply_id: str) -> None:
        """A sent mail cannot be taken back: Rejected, always."""
        raise Rejected("email cannot be unsent: the reply is in the recipient's mailbox")

    def close(self) -> None:
        """Nothing held: every call opens and closes its own connection."""

