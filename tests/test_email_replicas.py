"""Email end to end: two `replyd run` replicas on PostgreSQL answering a support desk on a real Postfix and Dovecot.

Mails from several senders (some follow-ups in threads, some auto-replies and bulk mail that must get none),
IDLE push with the poll as backstop, every fifth send's ``250`` lost, one replica SIGKILLed while its send
waits for the ``250`` (and started again), every IMAP connection cut mid-run (IDLE included). Replies are
counted in the senders' Maildirs on Dovecot's disk.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.mail_proxy import CutProxy, SmtpFaultProxy
from tests.mail_server import MailServer, person_mail
from tests.slack_scenario import Replica

ROOT = Path(__file__).resolve().parents[1]


def _config(path: Path, mail: MailServer, bot: str, store_url: str, smtp_port: int, imap_port: int) -> Path:
    path.write_text(f"""
[guard]
send_timeout_s = 8.0

[sweep]
interval_s = 0.5

[log]
level = "info"
format = "json"

[store]
url = "{store_url}"

[[bots]]
name = "desk"
platform = "email"

[bots.settings]
address = "{bot}"
password_env = "EMAIL_PASSWORD"
imap_host = "127.0.0.1"
imap_port = {imap_port}
imap_tls = "none"
smtp_host = "127.0.0.1"
smtp_port = {smtp_port}
smtp_tls = "none"
smtp_auth = false
listing_delay_s = 1.5
timeout_s = 6.0
loop_max_answers = 1000  # each sender opens ten tickets in a minute here: no loop

[bots.push]
kind = "imap_idle"

[bots.pollers]
inbox_interval_s = 3.0
refind_interval_s = 3.0
refind_lookback_s = 600.0
jitter_s = 0.2

[bots.responder]
kind = "template"
template = "Thanks, we have your ticket."
""")
    os.chmod(path, 0o600)
    return path


MAILS, SENDERS = 200, 20  # a support desk's scale, not a toy's: 200 mails from 20 senders


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_lost_250s_sigkill_and_idle_cut_answer_each_ticket_once(mail_server: MailServer, pg_url: str,
                                                                             tmp_path: Path) -> None:
    """200 mails from 20 senders (a sixth follow-ups to the desk's reply, a sixth auto or bulk): each thread answered
    once on the server, no answer to any auto-submitted or bulk mail, with lost 250s, a SIGKILL mid-send and an IDLE cut."""
    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, listing_lag, listing_delay, replicas, bot_leases")
    eng.dispose()
    bot = mail_server.add_user("desk")
    senders = [mail_server.add_user(f"s{i}") for i in range(SENDERS)]
    smtp = {r: SmtpFaultProxy(mail_server.smtp_port) for r in "ab"}
    imap = {r: CutProxy(mail_server.imap_port) for r in "ab"}
    smtp["a"].add("hold")  # replica a's first send: queued, its 250 held while a is SIGKILLed
    for r in "ab":
        for _ in range(MAILS // 6):
            for f in ("lost", "pass", "pass", "pass", "pass"):  # a fifth of the sends lose their 250
                smtp[r].add(f)
    env = {**os.environ, "EMAIL_PASSWORD": mail_server.password, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "replyd", "run", "--grace-s", "3", "--config"]
    replicas = {r: Replica(r, [*argv, str(_config(tmp_path / f"{r}.toml", mail_server, bot, pg_url, smtp[r].port,
                                                  imap[r].port))], env, tmp_path / f"{r}.log") for r in "ab"}
    killed: list[str] = []

    def killer() -> None:
        if smtp["a"].holding.wait(60):
            replicas["a"].kill()
            killed.append("a: mid-send")
            replicas["a"].start()

    roots: dict[str, tuple[str, set[str]]] = {}  # root id -> (sender, ids of its thread)
    ineligible: list[tuple[str, str]] = []
    follow_ups: list[str] = []  # roots a customer answered the desk's reply in
    try:
        for r in replicas.values():
            r.start()
        threading.Thread(target=killer, daemon=True).start()
        end = time.monotonic() + 60  # both logged in with IDLE open (a replica's start takes seconds on a busy box)
        while time.monotonic() < end and not all(
                "replyd.streams.connecting" in (tmp_path / f"{r}.log").read_text(errors="replace") for r in "ab"):
            time.sleep(0.2)
        time.sleep(1.0)
        for i in range(MAILS):
            sender = senders[i % SENDERS]
            if i % 6 == 5:  # a sixth auto-replies and bulk mail
                kind = ({"Auto_Submitted": "auto-replied"}, {"Precedence": "bulk"}, {"List_Id": "<l.example>"})[i % 3]
                msg = person_mail(sender, bot, f"no answer {i}", **kind)
                ineligible.append((sender, str(msg["Message-ID"])))
            elif i % 6 == 4 and roots:  # a sixth answer the desk's reply in an earlier thread of the same sender
                root = next((k for k, (s, _ids) in roots.items() if s == sender), None)
                reply = None if root is None else next(
                    (str(m["Message-ID"]) for m in mail_server.messages(sender) if bot in str(m.get("From", ""))
                     and str(m.get("In-Reply-To", "")).strip() in roots[root][1]), None)
                if root is None or reply is None:  # no answer to follow up yet: a new ticket
                    msg = person_mail(sender, bot, f"ticket {i}")
                    roots[str(msg["Message-ID"])] = (sender, {str(msg["Message-ID"])})
                else:
                    msg = person_mail(sender, bot, f"Re: ticket {i}", In_Reply_To=reply, References=f"{root} {reply}")
                    roots[root][1].add(str(msg["Message-ID"]))
                    follow_ups.append(root)
            else:
                msg = person_mail(sender, bot, f"ticket {i}")
                roots[str(msg["Message-ID"])] = (sender, {str(msg["Message-ID"])})
            mail_server.deliver(msg)
            if i == MAILS // 2:
                cut = sum(p.cut() for p in imap.values())  # every IMAP connection, IDLE included, cut by the network
                assert cut >= 2, "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-3000:] for r in "ab")
            time.sleep(0.05)

        def answered() -> dict[str, int]:
            out = {}
            for root, (sender, ids) in roots.items():
                out[root] = sum(1 for m in mail_server.messages(sender)
                                if bot in str(m.get("From", "")) and str(m.get("In-Reply-To", "")).strip() in ids)
            return out

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and min(answered().values()) < 1:
            time.sleep(0.5)
        time.sleep(6.0)  # sweeps after the listing delay; a duplicate would land in this window
        counts = answered()
    finally:
        for r in replicas.values():
            r.stop()
        for p in (*smtp.values(), *imap.values()):
            p.close()
    logs = "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-2000:] for r in "ab")
    assert killed == ["a: mid-send"], logs
    assert sum(1 for r in "ab" for f in smtp[r].met if f == "lost") >= 4, [smtp[r].met for r in "ab"]
    wrong = {k: n for k, n in counts.items() if n != 1}
    assert not wrong, (wrong, logs)
    assert len(follow_ups) >= 5, follow_ups  # follow-ups to the desk's replies were among the mails
    to_ineligible = [mid for sender, mid in ineligible for m in mail_server.messages(sender)
                     if str(m.get("In-Reply-To", "")).strip() == mid]
    assert not to_ineligible
