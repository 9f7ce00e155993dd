"""The email adapter: a support desk's mailbox read by IMAP, each ticket answered once by SMTP.

Settings: ``[bots.settings]`` with ``platform = "email"``; each key is a field of ``EmailPlatform.Settings``.

Ids: the sender id is the bot's address (domain lower-cased: RFC 5321 leaves the local part to the server). A
parent id is a ``Message-ID`` exactly as the mail serves it, normalised only as RFC 5322 allows (folding
whitespace and comments around ``<id-left@id-right>`` removed, case kept). With ``answer = "thread_root"`` (the
default) the parent is the thread's root: the first id of ``References`` (else ``In-Reply-To``, else the mail's
own ``Message-ID``), so a thread gets one answer, not one per message; ``answer = "message"`` answers each mail.
The mail actually answered rides in ``Parent.extra`` (its ``Message-ID``, ``References``, reply address).

Discovery: the folder is opened read-only (``EXAMINE``), so replyd never sets ``\\Seen`` and never reads it: the
cursor is ``<UIDVALIDITY>:<last UID>`` (a new UIDVALIDITY starts over from UID 1; the guard's key makes the re-read
harmless). ``stream`` holds IMAP IDLE open for push (``replyd.streams.StreamRunner``); the inbox poll is the backstop.

Loop policy (RFC 3834): a mail with ``Auto-Submitted`` other than ``no``, ``Precedence: bulk|junk|list``, a
``List-Id``, a null return path, a robot sender (mailer-daemon, postmaster, noreply, ``owner-*``, ``*-request``),
or the bot's own address is never offered.

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
"""

from __future__ import annotations

import email.policy
import email.utils
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
from replyd.errors import DefinitelyNotSent, MaybeSent, RateLimited, Rejected
from replyd.platforms.base import (
    Identity, OwnReply, Page, Parent, Pending, PlatformSettings, ReadBack, Sent, Text, Texts, Token,
    default_provider_key, register_platform,
)

_ROBOT_LOCALS = {"mailer-daemon", "postmaster", "noreply", "no-reply", "donotreply", "do-not-reply", "bounce",
                 "bounces"}
_MSGID = re.compile(r"<([^<>]+)>")
_KEY_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TEXT_LIMIT = 20_000  # characters of a mail's body offered to the responder


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
    if f"{local}@{domain.lower()}" == me or sender.lower() in {a.lower() for a in also_me}:
        return "own"
    return None


def _body_text(msg: EmailMessage) -> str:
    try:
        part = msg.get_body(("plain",))
        text = part.get_content() if part is not None else ""
    except (LookupError, ValueError, AttributeError):
        text = ""
    return str(text)[:_TEXT_LIMIT]


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
        also_me: Texts = []  # other addresses of the bot (aliases): never answered
        listing_delay_s: float = Field(30.0, ge=0)  # the Bcc copy's delivery delay
        timeout_s: float = Field(30.0, gt=0, le=600)
        max_fetch: int = Field(200, ge=1, le=10_000)  # mails read per poll
        idle_renew_s: float = Field(600.0, gt=0, le=1740)  # RFC 2177: re-issue IDLE before 29 minutes
        tempfail_wait_s: float = Field(30.0, ge=0)  # the wait after a 4xx (SMTP gives none)

    def __init__(self, settings: Settings, *, clock: Clock) -> None:
        self.s = settings
        self.clock = clock
        self.me = settings.address
        self.instance = settings.instance or f"email:{settings.address}"
        self.listing_delay_s = settings.listing_delay_s
        self._login = settings.username or settings.address
        self.log = structlog.get_logger("replyd.email").bind(platform=self.instance)
        self._identity: Identity | None = None

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
        except Exception:  # noqa: BLE001 - the connection is done with either way
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
        try:
            data = c.fetch(list(uids), ["BODY.PEEK[]", "INTERNALDATE"])
        except (OSError, IMAPClientError) as exc:
            self._imap_error("fetch", exc)
        out: list[Parent] = []
        seen: set[str] = set()
        for uid in sorted(data):
            raw = data[uid].get(b"BODY[]")
            if not isinstance(raw, bytes):
                continue
            parent = self._parent(raw, uid, uidvalidity, data[uid].get(b"INTERNALDATE"))
            if parent is not None and parent.id not in seen:
                seen.add(parent.id)
                out.append(parent)
        return out

    def _parent(self, raw: bytes, uid: int, uidvalidity: int, internal: Any) -> Parent | None:
        msg = BytesParser(policy=email.policy.default).parsebytes(raw)
        mid = normalise_msgid(msg.get("Message-ID"))
        if mid is None:
            self.log.info("replyd.email.skipped", uid=uid, reason="no_message_id")
            return None
        why = loop_reason(msg, self.me, self.s.also_me)  # type: ignore[arg-type]
        if why:
            self.log.info("replyd.email.skipped", uid=uid, message_id=mid, reason=why)
            return None
        refs = msgids(msg.get("References"))
        irt = msgids(msg.get("In-Reply-To"))
        root = mid
        if self.s.answer == "thread_root":
            root = (refs or irt or [mid])[0]
        name, sender = email.utils.parseaddr(str(msg.get("From", "")))
        local, _, domain = sender.rpartition("@")
        _rn, reply_to = email.utils.parseaddr(str(msg.get("Reply-To", "")))
        created = internal.timestamp() if isinstance(internal, datetime) else None
        return Parent(
            id=root, author_id=f"{local}@{domain.lower()}", author_handle=name or sender,
            text=_body_text(msg), created_at=created, thread_depth=len(refs),
            extra={"message_id": mid, "references": refs or irt, "reply_to": reply_to or sender,
                   "subject": str(msg.get("Subject", "")), "uid": uid, "uidvalidity": uidvalidity,
                   "folder": self.s.folder})

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

    def reply_message_id(self, provider_key: str) -> str:
        """The reply's Message-ID for ``provider_key``: the same on every attempt."""
        key = provider_key if _KEY_SAFE.match(provider_key) else default_provider_key(self.instance, self.me,
                                                                                      provider_key)
        return f"<replyd.{key}@{self.me.rpartition('@')[2]}>"

    def compose(self, parent: Parent, text: str, *, provider_key: str) -> EmailMessage:
        """The reply mail (headers per RFC 5322 and RFC 3834)."""
        x = parent.extra
        mid = str(x.get("message_id") or parent.id)
        subject = str(x.get("subject", ""))
        msg = EmailMessage()
        msg["From"] = self.me
        msg["To"] = str(x.get("reply_to") or parent.author_id)
        msg["Subject"] = subject if subject.lower().startswith("re:") else f"Re: {subject}".strip()
        msg["Date"] = email.utils.formatdate(self.clock.now())
        msg["Message-ID"] = self.reply_message_id(provider_key)
        msg["In-Reply-To"] = mid
        refs = [r for r in x.get("references") or [] if isinstance(r, str)]
        msg["References"] = " ".join([*refs, mid][-20:])
        msg["Auto-Submitted"] = "auto-replied"
        msg.set_content(text)
        return msg

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
        msg = self.compose(parent, text, provider_key=provider_key)
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
            code, resp = smtp.data(msg.as_bytes())  # returns the final reply; it raises only for the DATA command
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
                key = p.provider_key or default_provider_key(self.instance, sender_id, p.parent.id)
                mid = self.reply_message_id(key)
                try:
                    uids = c.search(["HEADER", "Message-ID", mid])
                    dates = c.fetch(list(uids), ["INTERNALDATE"]) if uids else {}
                except (OSError, IMAPClientError) as exc:
                    self.log.warning("replyd.email.read_back_failed", parent_id=p.parent.id,
                                     problem=self._clean(str(exc)))
                    break  # the connection is gone: what is left stays unchecked
                rb.checked.add(p.parent.id)
                if uids:
                    first = min(dates) if dates else None
                    when = dates.get(first, {}).get(b"INTERNALDATE") if first is not None else None
                    rb.found[p.parent.id] = [OwnReply(mid, p.parent.id,
                                                      when.timestamp() if isinstance(when, datetime) else None)]
        finally:
            self._bye(c)
        return rb

    def read_parents(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """``ParentReplies``: the read-back is already one look per parent (its reply's Message-ID), no feed walk."""
        return self.read_back(pending, sender_id=sender_id)

    def delete(self, reply_id: str) -> None:
        """A sent mail cannot be taken back: Rejected, always."""
        raise Rejected("email cannot be unsent: the reply is in the recipient's mailbox")

    def close(self) -> None:
        """Nothing held: every call opens and closes its own connection."""

