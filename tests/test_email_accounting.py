"""The email desk's accounting on a real Postfix and Dovecot: every mail answered once or reported.

Poison mails (an encoded CR LF in From, a 1,000-deep multipart) never stop a path; a follow-up that names only
the desk's reply keys on that reply's ticket; other ids in References are a stranger's words; a mail without a
Message-ID is answered once; an encoded CR LF in the Subject is cleaned; the desk's address in capitals is the
desk. Replies are counted in the customers' Maildirs on the server.
"""

from __future__ import annotations

import json
import smtplib
import socket
import threading
import time
from email.utils import formatdate, make_msgid
from typing import Any

import httpx
import pytest
from imapclient import IMAPClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from replyd import metrics
from replyd.clock import FakeClock, SystemClock
from replyd.config import PollerConfig
from replyd.errors import Rejected
from replyd.guard import Guard, Status
from replyd.pipeline import Pipeline
from replyd.platforms.base import Parent, Platform, make_platform
from replyd.policy import Policy
from replyd.pollers import Pollers
from replyd.store import Store
from replyd.sweep import Bot, Sweeper
from tests.mail_server import MailServer, person_mail
from tests.test_email import Desk, desk  # noqa: F401  (the fixture)

POISON_REPLY_TO = (b"From: mallory@client.example\r\nReply-To: =?utf-8?q?M=0D=0A?= <m@client.example>\r\n"
                   b"Subject: hello\r\nMessage-ID: <poison-reply-to@client.example>\r\n\r\nhi\r\n")
POISON_FROM = (b"From: =?utf-8?q?Eve=0D=0ABcc:_all@replyd.test?= <eve@client.example>\r\n"
               b"Subject: hello\r\nMessage-ID: <poison-from@client.example>\r\n\r\nhi\r\n")


def _deep(n: int = 1000) -> bytes:
    """A mail nested ``n`` multiparts deep (about 66 kB): Python's parser runs out of recursion on it."""
    body = b"".join(b"Content-Type: multipart/mixed; boundary=b%d\r\n\r\n--b%d\r\n" % (i, i) for i in range(n))
    body += b"Content-Type: text/plain\r\n\r\nhi\r\n" + b"".join(b"--b%d--\r\n" % i for i in reversed(range(n)))
    return (b"From: deep@client.example\r\nSubject: deep\r\nMessage-ID: <poison-deep@client.example>\r\n"
            b"MIME-Version: 1.0\r\n" + body)


def _append(mail: MailServer, user: str, raw: bytes) -> None:
    """Put ``raw`` in ``user``'s INBOX as another MTA would have delivered it (Postfix refuses deep MIME and adds a
    Message-ID for a loopback client; an MX facing the Internet adds none)."""
    with IMAPClient("127.0.0.1", port=mail.imap_port, ssl=False) as c:
        c.login(user, mail.passwords[user])
        c.append("INBOX", raw)


def _ask(desk: Desk, subject: str) -> str:
    """``Desk.ask`` that waits by IMAP (the test's own Maildir reader cannot parse a poison mail either)."""
    msg = person_mail(desk.customer, desk.bot, subject, f"{subject}: how do widgets work?")
    desk.mail.deliver(msg)
    mid = str(msg["Message-ID"])
    with IMAPClient("127.0.0.1", port=desk.mail.imap_port, ssl=False) as c:
        c.login(desk.bot, desk.mail.passwords[desk.bot])
        end = time.monotonic() + 10
        while time.monotonic() < end:
            c.select_folder("INBOX", readonly=True)
            if c.search(["HEADER", "Message-ID", mid]):
                return mid
            time.sleep(0.05)
    raise AssertionError(f"{mid} never arrived")


def _smtp_raw(mail: MailServer, sender: str, to: str, raw: bytes) -> None:
    with smtplib.SMTP("127.0.0.1", mail.smtp_port, timeout=10) as smtp:
        smtp.sendmail(sender, [to], raw)


def _work(desk: Desk, store: Store, clock: FakeClock) -> tuple[Platform, Guard, Pollers, list[str]]:
    """The daemon's pieces for the desk's bot: adapter, guard, pollers over a pipeline with a counting responder."""
    clock.set(SystemClock().now())
    adapter = desk.adapter(loop_max_answers=1000)  # one customer's ten tickets in a minute: no auto-reply loop
    guard = Guard(store, adapter, adapter.whoami(), clock=clock, send_timeout_s=10.0)
    calls: list[str] = []

    def respond(parent: Parent) -> str:
        calls.append(parent.id)
        return f"answer to {parent.extra.get('subject')}"

    pipe = Pipeline(guard, respond, Policy(), clock)
    return adapter, guard, Pollers(store, adapter, pipe, PollerConfig(refind_lookback_s=3600), clock), calls


def _skips(instance: str) -> float:
    """The ``replyd_policy_skips_total`` count of ``unreadable`` for ``instance`` on /metrics."""
    for fam in text_string_to_metric_families(generate_latest(metrics.registry()).decode()):
        for s in fam.samples:
            if s.name == "replyd_policy_skips_total" and s.labels.get("reason") == "unreadable" \
                    and s.labels.get("platform") == metrics.platform_label(instance):
                return s.value
    return 0.0


def _bot_replies(desk: Desk, customer: str) -> list[Any]:
    """The bot's replies in ``customer``'s Maildir, once their count settled."""
    desk.mail.settled_replies(customer, "-", sender=desk.bot)  # waits for LMTP to go quiet
    return [m for m in desk.mail.messages(customer) if desk.bot in str(m.get("From", ""))]


def test_poison_mails_are_reported_and_every_ticket_after_them_answered(desk: Desk, store: Store,
                                                                        clock: FakeClock) -> None:
    """An encoded CR LF in From or Reply-To, a 1,000-deep multipart, then 10 tickets: all 10 answered once, each poison
    mail a ``skipped`` event (reason ``unreadable``), a log line with its UID and a count on /metrics."""
    _smtp_raw(desk.mail, "eve@client.example", desk.bot, f"To: {desk.bot}\r\n".encode() + POISON_FROM)
    desk.mail.wait_for(desk.bot, lambda ms: len(ms) >= 1)
    _append(desk.mail, desk.bot, _deep())
    _append(desk.mail, desk.bot, POISON_REPLY_TO)
    mids = [_ask(desk, f"ticket {i}") for i in range(10)]
    adapter, guard, pollers, calls = _work(desk, store, clock)
    before = _skips(adapter.instance)
    with capture_logs() as logs:
        for _ in range(2):  # a second poll and a re-find read the poison mails again: still one answer each
            pollers.inbox()
        pollers.refind()
    counts = [len(desk.mail.settled_replies(desk.customer, m, sender=desk.bot)) for m in mids]
    assert counts == [1] * 10, counts
    assert len(calls) == 10  # the responder never saw a poison mail
    unreadable = [e for e in logs if e["event"] == "replyd.email.unreadable"]
    assert {e["uid"] for e in unreadable} == {1, 2, 3}, unreadable
    skipped = {e.parent_id for e in store.recent_events(200)
               if e.kind == "skipped" and json.loads(e.detail).get("reason") == "unreadable"}
    assert skipped == {e["parent_id"] for e in unreadable} and len(skipped) == 3
    assert _skips(adapter.instance) - before >= 3
    cursor = store.get_cursor(adapter.instance, guard.identity.sender_id, "inbox")
    assert cursor is not None and int(cursor.partition(":")[2]) >= 13  # past the poison mails and the tickets


def test_idle_and_refind_read_past_a_poison_mail(desk: Desk) -> None:
    """IDLE yields the ticket that arrives with a poison mail (the stream goes on); re-find reads past it too."""
    adapter = desk.adapter()
    stop = threading.Event()
    got: list[Parent] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            for p in adapter.stream(stop):  # type: ignore[attr-defined]
                got.append(p)
        except BaseException as exc:  # the test reports it
            failed.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        time.sleep(1.0)  # IDLE is open
        _append(desk.mail, desk.bot, _deep())
        mid = _ask(desk, "after the poison, by push")
        end = time.monotonic() + 10
        while mid not in {p.id for p in got} and not failed and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(5)
    assert not failed, failed
    assert mid in {p.id for p in got}
    assert [p.extra["unreadable"][:14] for p in got if "unreadable" in p.extra] == ["RecursionError"]
    found = adapter.refind(SystemClock().now() - 3600)
    assert [p.id for p in found if "unreadable" not in p.extra] == [mid]


def test_a_follow_up_naming_only_the_desks_reply_gets_no_second_answer(desk: Desk, store: Store,
                                                                       clock: FakeClock) -> None:
    """A customer answers the desk's reply with In-Reply-To alone, then with References trimmed to it: both key
    on the first ticket, so the thread holds the desk's one reply."""
    root = desk.ask("my widget broke")
    adapter, guard, pollers, calls = _work(desk, store, clock)
    pollers.inbox()
    [reply] = desk.mail.settled_replies(desk.customer, root, sender=desk.bot)
    rid = str(reply["Message-ID"])
    desk.mail.wait_for(desk.bot, lambda ms: rid in {str(m.get("Message-ID")) for m in ms})  # the desk's copy
    desk.ask("Re: my widget broke", In_Reply_To=rid)
    desk.ask("Re: my widget broke", References=rid)
    desk.ask("Re: my widget broke", In_Reply_To=rid, References=f"<other@client.example> {rid}")
    pollers.inbox()
    pollers.refind()
    assert len(_bot_replies(desk, desk.customer)) == 1
    assert calls == [root]
    page = adapter.inbox(None).parents
    assert [p.id for p in page] == [root]  # every follow-up is the root's ticket


def test_two_customers_answering_one_mass_mail_are_two_tickets(desk: Desk, store: Store,
                                                               clock: FakeClock) -> None:
    """Two customers answer the same newsletter (its id in In-Reply-To and References): each gets one answer."""
    other = desk.mail.add_user("cust")
    news = make_msgid(domain="news.example")
    desk.ask("Re: our newsletter", In_Reply_To=news, References=news)
    desk.ask("Re: our newsletter", sender=other, In_Reply_To=news, References=news)
    _adapter, _guard, pollers, _calls = _work(desk, store, clock)
    pollers.inbox()
    assert [len(_bot_replies(desk, c)) for c in (desk.customer, other)] == [1, 1]


def test_a_stranger_naming_a_ticket_in_references_does_not_take_its_answer(desk: Desk, store: Store,
                                                                          clock: FakeClock) -> None:
    """A stranger who names another customer's Message-ID (or a forged desk id) in References is a ticket of its
    own: the customer whose ticket it named still gets the answer."""
    stranger = desk.mail.add_user("eve")
    victim = make_msgid(domain="client.example")
    fake = f"<replyd.{'0' * 40}@{desk.bot.rpartition('@')[2]}>"
    desk.ask("Re: widgets", sender=stranger, References=f"{victim} {fake}", In_Reply_To=fake)
    desk.ask("widgets", Message_ID=victim)
    _adapter, _guard, pollers, _calls = _work(desk, store, clock)
    pollers.inbox()
    assert len(desk.mail.settled_replies(desk.customer, victim, sender=desk.bot)) == 1
    assert len(_bot_replies(desk, stranger)) == 1


def test_forged_desk_ids_cost_a_few_lookups_once(desk: Desk) -> None:
    """A mail naming 30 forged ids of the desk's form costs at most 3 copy look-ups, and none on the next poll."""
    domain = desk.bot.rpartition("@")[2]
    forged = " ".join(f"<replyd.{i:040x}@{domain}>" for i in range(30))
    mid = desk.ask("forged ids", References=forged)
    adapter = desk.adapter()
    looked: list[str] = []
    real = adapter._copy_ticket  # type: ignore[attr-defined]

    def counting(rid: str, key: str) -> str | None:
        looked.append(rid)
        return real(rid, key)

    adapter._copy_ticket = counting  # type: ignore[attr-defined]
    assert [p.id for p in adapter.inbox(None).parents] == [mid]
    assert [p.id for p in adapter.inbox(None).parents] == [mid]
    assert len(looked) == 3, looked


def test_a_mail_without_message_id_is_answered_once(desk: Desk, store: Store, clock: FakeClock) -> None:
    """A mail with no Message-ID gets a key from its content: answered once over polls, a re-find and a sweep."""
    raw = (f"From: {desk.customer}\r\nTo: {desk.bot}\r\nSubject: no id here\r\nDate: {formatdate()}\r\n\r\n"
           "how do widgets work?\r\n").encode()
    _append(desk.mail, desk.bot, raw)
    adapter, guard, pollers, calls = _work(desk, store, clock)
    pollers.inbox()
    pollers.inbox()
    pollers.refind()
    clock.advance(10.0 + adapter.listing_delay_s + 60)
    time.sleep(adapter.listing_delay_s)
    Sweeper(store, [Bot(adapter, guard.identity)], clock=clock).run_once()
    pollers.refind()
    got = _bot_replies(desk, desk.customer)
    assert len(got) == 1 and str(got[0]["Subject"]) == "Re: no id here"
    assert len(calls) == 1


def test_an_encoded_crlf_in_the_subject_is_cleaned_and_answered_once(desk: Desk, store: Store,
                                                                     clock: FakeClock) -> None:
    """A Subject whose encoded word holds CR LF is answered once, on one line, with no header injected."""
    raw = (f"From: {desk.customer}\r\nTo: {desk.bot}\r\nSubject: =?utf-8?q?Hi=0D=0ABcc:_x@replyd.test?=\r\n"
           f"Message-ID: <crlf-subject@client.example>\r\nDate: {formatdate()}\r\n\r\nhelp\r\n").encode()
    _smtp_raw(desk.mail, desk.customer, desk.bot, raw)
    desk.mail.wait_for(desk.bot, lambda ms: len(ms) >= 1)
    _adapter, guard, pollers, _calls = _work(desk, store, clock)
    pollers.inbox()
    [reply] = desk.mail.settled_replies(desk.customer, "<crlf-subject@client.example>", sender=desk.bot)
    assert str(reply["Subject"]) == "Re: Hi Bcc: x@replyd.test" and reply["Bcc"] is None
    assert guard.check("<crlf-subject@client.example>").status is Status.ALREADY_ANSWERED


def test_a_reply_that_cannot_be_composed_is_rejected_before_any_connection(desk: Desk, store: Store,
                                                                          clock: FakeClock) -> None:
    """Compose raising (a header the cleaning missed) is Rejected for that parent before any SMTP connection: no
    uncertain send, so no not_landed cycle and no platform failure for the write breaker."""
    mid = desk.ask("compose me")
    listener = socket.create_server(("127.0.0.1", 0))  # the SMTP server this adapter would reach
    listener.setblocking(False)
    settings = desk.mail.settings(desk.bot, smtp_port=listener.getsockname()[1], listing_delay_s=1.0)
    adapter = make_platform("email", settings, http=httpx.Client(trust_env=False), clock=clock)
    guard = Guard(store, adapter, adapter.whoami(), clock=clock, send_timeout_s=10.0)
    parent = adapter.resolve(mid)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise ValueError("Header values may not contain linefeed or carriage return characters")

    adapter.compose = broken  # type: ignore[attr-defined]
    with pytest.raises(Rejected):
        adapter.send(parent, "x", provider_key="k-compose")
    assert guard.post(parent, "x").status is Status.REJECTED
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    listener.close()


def test_the_desks_address_in_capitals_is_the_desk(desk: Desk) -> None:
    """A mail from SUPPORT@ (the desk's address upper-cased, or an alias's) is the desk's own: never offered."""
    alias = "Help@Replyd.Test"
    desk.ask("from myself", sender=desk.bot.upper())
    desk.ask("from my alias", sender=alias.upper())
    mid = desk.ask("from a customer")
    assert [p.id for p in desk.adapter(also_me=[alias]).inbox(None).parents] == [mid]
