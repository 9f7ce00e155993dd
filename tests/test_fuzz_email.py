"""Fuzzing the email adapter on a real Dovecot: headers, encodings, MIME depth and size a stranger chooses.

Each example appends drawn mails (raw bytes, as a sender's MTA could hand them on) to a desk's INBOX by IMAP
and polls once, as the daemon does. What must hold:

- no exception but a ``ReplydError`` escapes the poll;
- the poll's peak RSS stays within its bound (``max_mail_bytes`` per mail, ``fetch_batch_bytes`` per FETCH);
- no answer goes to an address the policy refuses: the composed reply's To is the parent's author id (what
  the policy saw), one address, never the desk, never a robot; with ``reply_to = "from"`` it is the From;
  a denied address is skipped, and a mail marked refused is skipped and cannot be sent;
- a good ticket appended among the drawn mails (often beside a poison one: an encoded CR LF in From, a
  multipart 1,000 deep) is offered and answered through the guard: one reply in its sender's mailbox.
"""

from __future__ import annotations

import email.utils
import os
import re
import traceback
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as hs
from imapclient import IMAPClient

from replyd.clock import FakeClock
from replyd.errors import Rejected, ReplydError
from replyd.guard import Guard, Status
from replyd.platforms.base import Platform, make_platform
from replyd.platforms.email import EmailPlatform
from replyd.platforms.email_checks import is_robot, one_address
from replyd.policy import Policy
from replyd.store import Store
from tests.conftest import IN_CI
from tests.mail_server import DOMAIN, MailServer, person_mail

# No shrinking: each run appends to a real mailbox (a failure prints its draws whole).
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=IN_CI,
                phases=[Phase.explicit, Phase.reuse, Phase.generate])
# Mails the parser cannot read (a CR LF encoded in an address, a multipart hundreds deep) stop a poll until the
# adapter reads them as parents marked unreadable (``_readable``, the poison-mail change). Before it, they are
# not drawn on purpose, and an exception raised inside the standard parser is let pass.
POISON = hasattr(EmailPlatform, "_readable")
PEAK_MB = 50.0  # one poll's bound over its start (bench/email_memory.py measures the same on 200 x 25 MB)

VICTIM = f"victim@{DOMAIN}"
ADDRESSES = [f"alice@{DOMAIN}", f"Bob@{DOMAIN.upper()}", VICTIM, f"noreply@{DOMAIN}", f"mailer-daemon@{DOMAIN}",
             "carol@elsewhere.example", "owner-list@lists.example", f"x+tag@{DOMAIN}", "no-at-sign", "@",
             "a@b", '"quoted@name"@example.org', "\u00e9l\u00e8ve@exemple.fr", f"list-request@{DOMAIN}"]
NAMES = ["", VICTIM, f'"{VICTIM}"', "=?utf-8?b?dmljdGltQHJlcGx5ZC50ZXN0?=", "=?x-unknown?q?=FF=FE?=", "\u202eevil",
         "Name, With Comma", "a\tb", "\x1b[31mred", *(["=?utf-8?q?line=0D=0Abreak?="] if POISON else [])]
TEXTS = hs.sampled_from(["", " ", "=?utf-8?b?" + "QUFB" * 50 + "?=", "=?iso-8859-1?q?caf=E9?=", "=?broken", "?=",
                         "\u00ff\u00fe", "a" * 2000, "<a@b> <c@d>", "(comment) <id@x>", "\\", "\"", "<<>>", ";;",
                         "auto-replied", "no", "bulk", "auto_reply", "list", "All", "None", "<>"]) \
    | hs.text(max_size=40)
# Mails no parser reads whole, drawn beside the good ticket: an encoded CR LF in From, a multipart 1,000 deep.
POISONS = [
    b"From: =?utf-8?q?line=0D=0Abreak?= <poison@client.example>\r\nMessage-ID: <poison-from-%d@client.example>\r\n"
    b"Subject: help\r\nContent-Type: text/plain\r\n\r\nhelp\r\n",
    b"From: deep@client.example\r\nMessage-ID: <poison-deep-%d@client.example>\r\nSubject: help\r\n"
    + b"".join(b'Content-Type: multipart/mixed; boundary="d%d"\r\n\r\n--d%d\r\n' % (i, i) for i in range(1000))
    + b"Content-Type: text/plain\r\n\r\nhelp\r\n",
]
HEADERS = ["Auto-Submitted", "Precedence", "X-Autoreply", "X-Autorespond", "X-Auto-Response-Suppress", "List-Id",
           "List-Unsubscribe", "X-Loop", "Return-Path", "References", "In-Reply-To", "Subject", "Sender",
           "Content-Type", "Content-Transfer-Encoding", "MIME-Version", "Reply-To", "From", "Message-ID"]


@hs.composite
def address_field(draw: hs.DrawFn) -> str:
    """A From or Reply-To value: one or more addresses, display names that look like addresses, encodings."""
    parts = []
    for _ in range(draw(hs.integers(0, 3))):
        name, addr = draw(hs.sampled_from(NAMES)), draw(hs.sampled_from(ADDRESSES))
        parts.append(f"{name} <{addr}>" if name and draw(hs.booleans()) else addr)
    return ", ".join(parts) if parts else draw(TEXTS)


@hs.composite
def body(draw: hs.DrawFn, boundary: int = 0) -> bytes:
    """A MIME body: text in some encoding, or a multipart nested up to a drawn depth, maybe a big part."""
    depth = draw(hs.sampled_from([0, 0, 1, 2, 5, 30, *([300] if POISON else [])]))
    kind = draw(hs.sampled_from(["plain", "qp", "b64", "8bit", "big"]))
    leaf = {
        "plain": b"Content-Type: text/plain; charset=utf-8\r\n\r\nhow do widgets work?\r\n",
        "qp": b"Content-Type: text/plain; charset=x-unknown\r\nContent-Transfer-Encoding: quoted-printable\r\n\r\n"
              b"caf=E9 =\r\nsoft=ZZbreak\r\n",
        "b64": b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: base64\r\n\r\n!!notbase64==\r\n",
        "8bit": b"Content-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: 8bit\r\n\r\n\xff\xfe\x00\xc3(\r\n",
        "big": b"Content-Type: application/octet-stream\r\nContent-Transfer-Encoding: base64\r\n\r\n"
               + b"QUJD" * (draw(hs.integers(1, 4)) * 100_000) + b"\r\n",
    }[kind]
    for level in range(depth):
        b = f"b{boundary}-{level}".encode()
        leaf = (b'Content-Type: multipart/mixed; boundary="' + b + b'"\r\n\r\n--' + b + b"\r\n" + leaf
                + b"\r\n--" + b + (b"--\r\n" if draw(hs.booleans()) else b"\r\n"))
    return leaf


@hs.composite
def mail(draw: hs.DrawFn, n: int) -> bytes:
    """One raw mail: drawn headers (some repeated, some folded, some bare LF) and a drawn body."""
    lines = [f"From: {draw(address_field())}", f"Message-ID: <fuzz-{n}-{draw(hs.integers(0, 10**9))}@client.example>"]
    for _ in range(draw(hs.integers(0, 6))):
        name = draw(hs.sampled_from(HEADERS))
        value = draw(address_field()) if name in ("From", "Reply-To", "Sender") else draw(TEXTS)
        sep = draw(hs.sampled_from(["\r\n", "\r\n\t", "\n", "\r\n "]))
        lines.append(f"{name}: {value}".replace("\r", "").replace("\n", sep) if draw(hs.booleans())
                     else f"{name}: {value}".replace("\r", " ").replace("\n", " "))
    head = "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n"
    return head + draw(body(n))


class FuzzDesk:
    """One desk's mailbox and adapter; each example polls on from the last cursor. Its good tickets come from one
    customer and are answered through the guard (``guards``, one SQLite store)."""

    def __init__(self, mail: MailServer, store: Store) -> None:
        self.mail = mail
        self.bot = mail.add_user("fuzzdesk")
        self.customer = mail.add_user("customer")
        self.cursor: str | None = None
        self.adapters: dict[str, Platform] = {}
        self.store = store
        self.guards: dict[str, Guard] = {}
        self.tickets = 0

    def guard(self, mode: str) -> Guard:
        if mode not in self.guards:
            adapter = self.adapter(mode)
            self.guards[mode] = Guard(self.store, adapter, adapter.whoami(), send_timeout_s=10.0,
                                      watch_interval_s=None)
        return self.guards[mode]

    def ticket(self) -> tuple[str, bytes]:
        """A good ticket from the customer: its Message-ID and its bytes."""
        self.tickets += 1
        msg = person_mail(self.customer, self.bot, f"ticket {self.tickets}", "how do widgets work?")
        return str(msg["Message-ID"]), msg.as_bytes()

    def adapter(self, mode: str) -> Platform:
        if mode not in self.adapters:
            settings = {**self.mail.settings(self.bot), "reply_to": mode, "max_mail_bytes": 262_144,
                        "fetch_batch_bytes": 1_048_576}
            self.adapters[mode] = make_platform("email", settings, http=httpx.Client(), clock=FakeClock(0.0))
        return self.adapters[mode]

    def append(self, raws: list[bytes]) -> None:
        with IMAPClient("127.0.0.1", port=self.mail.imap_port, ssl=False) as c:
            c.login(self.bot, self.mail.passwords[self.bot])
            for raw in raws:
                c.append("INBOX", raw)


def _in_the_parser(exc: object) -> bool:
    """Whether ``exc`` was raised inside the standard library's email parser (a poison mail, see POISON)."""
    if not isinstance(exc, Exception):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}email{os.sep}" in frames[-1].filename and "replyd" not in frames[-1].filename


def _rss(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def _poll_peak(adapter: Platform, cursor: str | None) -> tuple[Any, float]:
    """The page (or the exception) of one poll, and its peak RSS over its start in MB."""
    before = _rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the current RSS
    try:
        got: Any = adapter.inbox(cursor)
    except Exception as exc:  # judged by the caller
        got = exc
    return got, _rss("VmHWM:") - before


def _from_addresses(raw: str) -> set[str]:
    """What the author may be, read from the raw From by a second parser: its one ``<addr-spec>`` when it has
    one (a display name is never it), else any address the header lists."""
    angles = re.findall(r"<([^<>]*)>", raw)
    if len(angles) == 1:
        return {angles[0].strip().casefold()}
    return {a.casefold() for _n, a in email.utils.getaddresses([raw]) if a}


def _check_parent(desk: FuzzDesk, adapter: Platform, parent: Any, mode: str, raw_from: str | None) -> None:
    me = adapter.whoami()
    deny = Policy.build(deny_accounts=[VICTIM])
    refused = parent.extra.get("refused")
    if refused:
        assert Policy().reason_to_skip(parent, me, FakeClock(0.0)) == refused
        with pytest.raises(Rejected):
            adapter.send(parent, "no", provider_key="k-fuzz")
        return
    try:
        msg = adapter.compose(parent, "here is how", provider_key="k-fuzz")  # type: ignore[attr-defined]
    except ReplydError:
        return
    to = one_address(msg["To"])
    assert to is not None and to == parent.author_id, (msg["To"], parent.author_id)
    assert to != desk.bot.casefold() and not is_robot(to), to
    assert parent.author_handle in _from_addresses(raw_from or ""), (parent.author_handle, raw_from)
    if mode == "from":
        assert to == parent.author_handle
    else:
        assert to == parent.author_handle or to.rpartition("@")[2] == parent.author_handle.rpartition("@")[2]
    if deny.reason_to_skip(parent, me, FakeClock(0.0)) is None:
        assert to != VICTIM


@pytest.fixture(scope="module")
def fuzz_desk(mail_server: MailServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzDesk]:
    store = Store.open(f"sqlite:///{tmp_path_factory.mktemp('fuzz-email') / 'replyd.sqlite3'}")
    yield FuzzDesk(mail_server, store)
    store.dispose()


def _answered_once(desk: FuzzDesk, mode: str, parents: list[Any], message_id: str) -> None:
    """The good ticket is offered whole and answered through the guard: one reply in the customer's mailbox, and
    nothing more when it is offered again."""
    parent = next((p for p in parents if p.extra.get("message_id") == message_id), None)
    assert parent is not None and not parent.extra.get("unreadable") and not parent.extra.get("refused"), parent
    guard = desk.guard(mode)
    assert Policy().reason_to_skip(parent, guard.identity, FakeClock(0.0)) is None
    out = guard.post(parent, "here is how", path="inbox")
    assert out.status is Status.POSTED, out
    got = desk.mail.wait_for(desk.customer, lambda ms: any(str(m.get("In-Reply-To", "")).strip() == message_id
                                                           for m in ms))
    assert len([m for m in got if str(m.get("In-Reply-To", "")).strip() == message_id]) == 1
    assert guard.post(parent, "here is how", path="inbox").status is Status.ALREADY_ANSWERED


@FUZZ
@given(data=hs.data())
def test_a_poll_of_drawn_mails_raises_nothing_else_stays_bounded_and_answers_no_refused_address(
        fuzz_desk: FuzzDesk, data: hs.DataObject) -> None:
    """Drawn mails appended to the desk's INBOX with a good ticket among them, one poll: the four properties of
    this module hold."""
    raws = [data.draw(mail(i)) for i in range(data.draw(hs.integers(1, 3)))]
    mode = data.draw(hs.sampled_from(["from", "checked"]))
    good_id, good = fuzz_desk.ticket()
    poison = data.draw(hs.sampled_from([None, *POISONS]), label="poison")
    after = 0  # the ticket comes after the poison mail: what a poison stopping the batch would cost
    if poison is not None:
        after = data.draw(hs.integers(0, len(raws)), label="poison at")
        raws.insert(after, poison % fuzz_desk.tickets)
        after += 1
    at = data.draw(hs.integers(after, len(raws)), label="ticket at")
    fuzz_desk.append([*raws[:at], good, *raws[at:]])
    adapter = fuzz_desk.adapter(mode)
    got, peak = _poll_peak(adapter, fuzz_desk.cursor)
    if not POISON and _in_the_parser(got):
        return
    assert not isinstance(got, Exception), f"{type(got).__name__}: {got}"  # no mail stops the poll
    fuzz_desk.cursor = got.cursor
    assert peak <= PEAK_MB, peak
    froms = {}
    for raw in [*raws, good]:
        parsed = email.message_from_bytes(raw)
        froms[email.utils.unquote(str(parsed.get("Message-ID", "")))] = str(parsed.get("From", ""))
    for parent in got.parents:
        if parent.extra.get("unreadable"):
            continue
        raw_from = next((f for m, f in froms.items() if parent.extra.get("message_id") == f"<{m.strip('<>')}>"), None)
        _check_parent(fuzz_desk, adapter, parent, mode, raw_from)
    _answered_once(fuzz_desk, mode, got.parents, good_id)
