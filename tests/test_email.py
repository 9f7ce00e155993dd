"""The email adapter on a real Postfix and Dovecot: loop policy, cursors without \\Seen, a lost 250, IDLE, the naive side.

Replies are counted in the recipients' Maildirs on the server (``MailServer.replies_to``), never from replyd.
"""

from __future__ import annotations

import email
import smtplib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import make_msgid
from pathlib import Path
from typing import Any

import httpx
import pytest
from imapclient import IMAPClient

from replyd.clock import FakeClock, SystemClock
from replyd.errors import MaybeSent
from replyd.guard import Guard, Status
from replyd.platforms.base import Platform, make_platform
from replyd.platforms.email import loop_reason, msgids, normalise_msgid
from replyd.store import Store
from replyd.streams import StreamRunner
from replyd.sweep import Bot, Sweeper
from tests.fakes_forum import fresh_store, store_template  # noqa: F401  (a migrated SQLite template per module)
from tests.mail_proxy import CutProxy, SmtpFaultProxy
from tests.mail_server import MailServer, person_mail


@dataclass
class Desk:
    """A bot's mailbox, a customer's, the proxies in front of the servers, and the adapter through them."""

    mail: MailServer
    bot: str
    customer: str
    smtp: SmtpFaultProxy
    imap: CutProxy
    clock: FakeClock

    def adapter(self, **extra: Any) -> Platform:
        """The bot's adapter through the proxies."""
        settings = self.mail.settings(self.bot, smtp_port=self.smtp.port, imap_port=self.imap.port,
                                      listing_delay_s=1.0, **extra)
        return make_platform("email", settings, http=httpx.Client(trust_env=False), clock=self.clock)

    def ask(self, subject: str, *, sender: str | None = None, **headers: str) -> str:
        """``sender`` (the customer) mails the bot; return the mail's Message-ID once it is in the bot's Maildir."""
        msg = person_mail(sender or self.customer, self.bot, subject, f"{subject}: how do widgets work?", **headers)
        self.mail.deliver(msg)
        mid = str(msg["Message-ID"])
        self.mail.wait_for(self.bot, lambda ms: mid in {str(m.get("Message-ID")) for m in ms})
        return mid


@pytest.fixture
def desk(mail_server: MailServer) -> Iterator[Desk]:
    """A fresh bot and customer on the session's servers, with proxies of their own."""
    d = Desk(mail_server, mail_server.add_user("bot"), mail_server.add_user("cust"),
             SmtpFaultProxy(mail_server.smtp_port), CutProxy(mail_server.imap_port), FakeClock(SystemClock().now()))
    yield d
    d.smtp.close()
    d.imap.close()


def _guard(adapter: Platform, store: Store, clock: FakeClock) -> Guard:
    return Guard(store, adapter, adapter.whoami(), clock=clock, send_timeout_s=10.0)


def _sweep(adapter: Platform, guard: Guard, store: Store, clock: FakeClock) -> Any:
    """One sweep pass after the send deadline and the listing delay; the Bcc copy is given a moment to arrive."""
    clock.advance(10.0 + adapter.listing_delay_s + 60)
    time.sleep(adapter.listing_delay_s)
    return Sweeper(store, [Bot(adapter, guard.identity)], clock=clock).run_once()


def test_message_ids_are_normalised_only_as_rfc5322_allows() -> None:
    """Folding whitespace and comments around a msg-id go; brackets and case stay; References keep their order."""
    assert normalise_msgid(" (a comment)\r\n <AbC.1@Host.Example> ") == "<AbC.1@Host.Example>"
    assert normalise_msgid("no brackets") is None
    assert msgids("<a@x>\r\n\t<b@y> (c)") == ["<a@x>", "<b@y>"]


@pytest.mark.parametrize("headers,sender,reason", [
    ({"Auto_Submitted": "auto-replied"}, None, "auto_submitted"),
    ({"Auto_Submitted": "auto-generated (vacation)"}, None, "auto_submitted"),
    ({"Precedence": "bulk"}, None, "precedence"),
    ({"Precedence": "list"}, None, "precedence"),
    ({"List_Id": "<news.example.org>"}, None, "list"),
    ({}, "MAILER-DAEMON@example.org", "robot_sender"),
    ({}, "noreply@example.org", "robot_sender"),
    ({}, "postmaster@example.org", "robot_sender"),
    ({}, "bot@example.org", "own"),
])
def test_loop_policy_refuses_what_rfc3834_says_not_to_answer(headers: dict[str, str], sender: str | None,
                                                             reason: str) -> None:
    """Auto-Submitted other than no, Precedence bulk/junk/list, List-Id, robot senders and the bot itself: no answer."""
    msg = person_mail(sender or "alice@example.org", "bot@example.org", "hi", **headers)
    assert loop_reason(msg, "bot@example.org") == reason
    assert loop_reason(person_mail("alice@example.org", "bot@example.org", "hi", Auto_Submitted="no"),
                       "bot@example.org") is None


def test_inbox_offers_human_mail_only_and_one_parent_per_thread(desk: Desk) -> None:
    """On the server: auto-replies, bulk and list mail come marked refused, each its own row (the policy skips
    them with that reason); a follow-up to the desk's reply keys on the reply's ticket."""
    root = desk.ask("first question")
    ooo = desk.ask("out of office", Auto_Submitted="auto-replied")
    desk.ask("newsletter", Precedence="bulk")
    desk.ask("digest", List_Id="<list.example.org>")
    adapter = desk.adapter()
    parent = next(p for p in adapter.inbox(None).parents if "refused" not in p.extra)
    reply = adapter.send(parent, "here is how", provider_key=adapter.provider_key(desk.bot, root)).reply_id  # type: ignore[attr-defined]
    desk.mail.wait_for(desk.bot, lambda ms: reply in {str(m.get("Message-ID")) for m in ms})  # the desk's copy
    follow = desk.ask("Re: first question", In_Reply_To=reply, References=f"{root} {reply}")
    page = adapter.inbox(None)
    assert [p.id for p in page.parents if "refused" not in p.extra] == [root]
    assert [p.extra.get("refused") for p in page.parents][1:] == ["auto_reply", "bulk_mail", "bulk_mail"]
    assert page.parents[1].id == ooo  # keyed on itself, never on a thread's root
    assert page.parents[0].extra["message_id"] == root  # the follow-up was read and keyed on the root
    per_message = desk.adapter(answer="message").inbox(None)
    assert [p.id for p in per_message.parents if "refused" not in p.extra] == [root, follow]


def test_seen_set_by_a_person_does_not_hide_a_ticket_and_replyd_sets_no_flag(desk: Desk) -> None:
    """An agent reading the mail in a client (\\Seen set) does not hide it; polling and answering change no flag."""
    mid = desk.ask("read by a person first")
    with IMAPClient("127.0.0.1", port=desk.mail.imap_port, ssl=False) as c:
        c.login(desk.bot, desk.mail.passwords[desk.bot])
        c.select_folder("INBOX")
        c.add_flags(c.search(["ALL"]), [b"\\Seen"])
    adapter = desk.adapter()
    page = adapter.inbox(None)
    assert [p.id for p in page.parents] == [mid]
    adapter.send(page.parents[0], "here is how", provider_key="k-seen")
    desk.ask("a second one, unread")
    with IMAPClient("127.0.0.1", port=desk.mail.imap_port, ssl=False) as c:
        c.login(desk.bot, desk.mail.passwords[desk.bot])
        c.select_folder("INBOX", readonly=True)
        flags = c.get_flags(c.search(["ALL"]))
    assert [b"\\Seen" in f for _, f in sorted(flags.items())][-1] is False  # replyd read it and left it unread
    assert [p.id for p in adapter.inbox(page.cursor).parents] != []


def test_a_mail_replyd_polled_and_answered_stays_unread(desk: Desk) -> None:
    """replyd opens the folder read-only and peeks: a mail it polled and answered keeps no \\Seen flag."""
    desk.ask("unread until a person reads it")
    adapter = desk.adapter()
    page = adapter.inbox(None)
    assert len(page.parents) == 1
    adapter.send(page.parents[0], "here is how", provider_key="k-unread")
    with IMAPClient("127.0.0.1", port=desk.mail.imap_port, ssl=False) as c:
        c.login(desk.bot, desk.mail.passwords[desk.bot])
        c.select_folder("INBOX", readonly=True)
        flags = c.get_flags(c.search(["ALL"]))
    assert flags and not any(b"\\Seen" in f for f in flags.values()), flags


def test_lost_250_is_found_by_the_sweep_and_never_sent_again(desk: Desk, store_template: Path,
                                                             tmp_path: Path) -> None:
    """Postfix queued the reply and its 250 was lost: the sweep finds the Bcc copy; one reply in the customer's box."""
    adapter = desk.adapter()
    store = fresh_store(store_template, tmp_path, desk.clock)
    guard = _guard(adapter, store, desk.clock)
    for i in range(3):
        desk.ask(f"ticket {i}")
    parents = adapter.inbox(None).parents
    assert len(parents) == 3
    for _ in parents[:2]:
        desk.smtp.add("lost")
    first = [guard.post(p, "here is how").status for p in parents]
    assert first == [Status.UNCERTAIN, Status.UNCERTAIN, Status.POSTED]
    res = _sweep(adapter, guard, store, desk.clock)
    assert res.closed == 2 and res.not_landed == 0, res
    again = [guard.post(p, "here is how").status for p in parents]
    assert again == [Status.ALREADY_ANSWERED] * 3
    counts = [len(desk.mail.settled_replies(desk.customer, p.id, sender=desk.bot)) for p in parents]
    assert counts == [1, 1, 1]
    store.dispose()


def test_two_bots_that_auto_reply_to_each_other_stop_after_one_exchange(mail_server: MailServer,
                                                                        store_template: Path,
                                                                        tmp_path: Path) -> None:
    """Bot A answers bot B's mail (Auto-Submitted: auto-replied); B reads it and answers nothing; A gets nothing new."""
    clock = FakeClock(SystemClock().now())
    a, b = mail_server.add_user("bota"), mail_server.add_user("botb")
    pa, pb = (make_platform("email", mail_server.settings(x), http=httpx.Client(), clock=clock) for x in (a, b))
    store = fresh_store(store_template, tmp_path, clock)
    ga, gb = _guard(pa, store, clock), _guard(pb, store, clock)
    first = person_mail(b, a, "hello from B")
    mail_server.deliver(first)
    mail_server.wait_for(a, lambda ms: len(ms) >= 1)
    cursors = {"a": None, "b": None}
    for _ in range(3):  # three rounds of each bot polling and answering what it finds
        for name, plat, guard in (("a", pa, ga), ("b", pb, gb)):
            page = plat.inbox(cursors[name])
            cursors[name] = page.cursor
            for p in page.parents:
                guard.post(p, f"auto-answer from {name}")
        time.sleep(0.5)
    from_a = [m for m in mail_server.messages(b) if a in str(m["From"])]
    from_b = [m for m in mail_server.messages(a) if b in str(m["From"])]
    assert len(from_a) == 1 and str(from_a[0]["Auto-Submitted"]) == "auto-replied"
    assert len(from_b) == 1  # B's first mail only: B never answered A's auto-reply
    store.dispose()


def test_idle_pushes_a_mail_and_survives_a_cut_connection(desk: Desk) -> None:
    """StreamRunner over IDLE: a mail is offered by push within seconds; after the network cuts IDLE, it reconnects."""
    adapter = desk.adapter()
    offered: list[str] = []
    catch_ups: list[int] = []

    class Out:
        status = Status.POSTED

    def offer(parent: Any, path: str) -> Any:
        offered.append(parent.id)
        return Out()

    runner = StreamRunner("email", adapter, offer, lambda: catch_ups.append(1), max_backoff_s=1.0)  # type: ignore[arg-type]
    runner.start()
    try:
        time.sleep(1.0)  # IDLE is open
        m1 = desk.ask("pushed one")
        _until(lambda: m1 in offered, 8, "the first mail by push")
        assert desk.imap.cut() >= 2
        _until(lambda: runner.connects >= 2, 8, "a reconnect after the cut")
        time.sleep(1.0)
        m2 = desk.ask("pushed two")
        _until(lambda: m2 in offered, 8, "the second mail by push after the reconnect")
        assert len(catch_ups) >= 2  # each (re)connect ran the inbox poll for what arrived while it was down
    finally:
        runner.stop(timeout_s=3)


def _until(cond: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _naive_responder(desk: Desk) -> None:
    """The common script: answer every UNSEEN mail, retry a failed send, then mark it \\Seen."""
    with IMAPClient("127.0.0.1", port=desk.imap.port, ssl=False) as c:
        c.login(desk.bot, desk.mail.passwords[desk.bot])
        c.select_folder("INBOX")
        for uid, data in c.fetch(c.search(["UNSEEN"]), ["BODY.PEEK[HEADER]"]).items():
            msg = email.message_from_bytes(data[b"BODY[HEADER]"])
            reply = person_mail(desk.bot, desk.customer, "Re: " + str(msg["Subject"]), "here is how",
                                In_Reply_To=str(msg["Message-ID"]))
            for _attempt in range(2):
                del reply["Message-ID"]
                reply["Message-ID"] = make_msgid(domain="naive.example")
                try:
                    with smtplib.SMTP("127.0.0.1", desk.smtp.port, timeout=10) as smtp:
                        smtp.send_message(reply)
                    break
                except (OSError, smtplib.SMTPException):
                    continue
            c.add_flags([uid], [b"\\Seen"])


def test_naive_side_resends_a_lost_250_and_replyd_does_not(desk: Desk, store_template: Path,
                                                           tmp_path: Path) -> None:
    """One run, two sides, the same two lost 250s in five tickets: the naive script duplicates both; replyd none."""
    mids = [desk.ask(f"naive ticket {i}") for i in range(5)]
    faults = ["lost", "pass", "pass", "lost", "pass"]  # the naive script's retry meets the "pass" after a "lost"
    for f in faults:
        desk.smtp.add(f)
    _naive_responder(desk)
    naive = [len(desk.mail.settled_replies(desk.customer, m, sender=desk.bot)) for m in mids]
    assert sorted(naive) == [1, 1, 1, 2, 2], naive

    desk.customer = desk.mail.add_user("cust2")
    desk.bot = desk.mail.add_user("bot2")
    mids = [desk.ask(f"replyd ticket {i}") for i in range(5)]
    adapter = desk.adapter()
    store = fresh_store(store_template, tmp_path, desk.clock)
    guard = _guard(adapter, store, desk.clock)
    for f in faults:
        desk.smtp.add(f)
    for _round in range(2):  # the daemon's rhythm: poll and post, sweep, poll and post again
        for p in adapter.inbox(None).parents:
            guard.post(p, "here is how")
        _sweep(adapter, guard, store, desk.clock)
    ours = [len(desk.mail.settled_replies(desk.customer, m, sender=desk.bot)) for m in mids]
    assert ours == [1] * 5, ours
    store.dispose()


def test_send_lost_250_is_maybe_sent_with_the_same_message_id_on_retry(desk: Desk) -> None:
    """The retry of an unclear send carries the first attempt's Message-ID (what the read-back searches for)."""
    adapter = desk.adapter()
    mid = desk.ask("retry me")
    parent = adapter.resolve(mid)
    desk.smtp.add("lost")
    with pytest.raises(MaybeSent):
        adapter.send(parent, "one", provider_key="k-retry")
    adapter.send(parent, "two", provider_key="k-retry")
    ids = {str(m["Message-ID"]) for m in desk.mail.settled_replies(desk.customer, mid, sender=desk.bot)}
    assert ids == {adapter.reply_message_id("k-retry")}  # type: ignore[attr-defined]


def test_stream_stops_when_asked(desk: Desk) -> None:
    """``stream`` returns within a couple of seconds of ``stop`` being set (IDLE is checked every second)."""
    adapter = desk.adapter()
    stop = threading.Event()
    done = threading.Event()

    def run() -> None:
        for _ in adapter.stream(stop):  # type: ignore[attr-defined]
            pass
        done.set()

    threading.Thread(target=run, daemon=True).start()
    time.sleep(0.5)
    stop.set()
    assert done.wait(4)
