"""A real Postfix and a real Dovecot for the email tests, started once per test session (per xdist worker).

``mail_server`` (session scope) writes throw-away configs into a temporary directory: Dovecot (``dovecot -F -c``)
serves IMAP and LMTP on free 127.0.0.1 ports from a static userdb (every address of the domain exists, one password), each mailbox a
Maildir under the directory; Postfix (``master -d -c``) accepts SMTP on a free 127.0.0.1 port from the loopback network and hands
every recipient of the virtual domain ``replyd.test`` to Dovecot over LMTP. Users are added by the tests
(``add_user``), each with a name no other test uses.

Replies are counted on the server side: :meth:`MailServer.messages` reads a user's Maildir files from disk.

:class:`SmtpFaultProxy` sits between an adapter and Postfix to lose the ``250`` after DATA (the message is
queued, the answer never arrives), cut the connection before the end of the data reaches Postfix (nothing
queued), answer with a refusal or a temporary failure, or garble the answer. :class:`CutProxy` sits in front
of IMAP so a test can cut every connection (an IDLE cut by the network).

When the binaries are missing, or not running as root (Postfix's master needs it), the tests skip locally with
the reason and FAIL when ``CI=true``.
"""

from __future__ import annotations

import email
import email.policy
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DOMAIN = "replyd.test"
DOVECOT = "/usr/sbin/dovecot"
POSTFIX_MASTER = "/usr/lib/postfix/sbin/master"
START_TIMEOUT_S = 20.0
MAIL_USER = "nobody"  # the uid every Maildir belongs to (Dovecot refuses root for mail)


def free_port() -> int:
    """A port nothing listens on right now (the servers take a port number, not port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {START_TIMEOUT_S}s: {_tail(log)}")


def _tail(path: Path) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-5:])
    except OSError:
        return "(no log)"


@dataclass
class MailServer:
    """The running pair: ports, the users' passwords, their Maildirs on disk."""

    directory: Path
    imap_port: int
    smtp_port: int
    lmtp_port: int
    password: str = field(repr=False, default="")  # every user's (a static passdb: a user exists once mailed)
    passwords: dict[str, str] = field(default_factory=dict, repr=False)
    startup_s: float = 0.0
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_user(self, prefix: str = "u") -> str:
        """Create a mailbox with a name no other test uses; return its address (its IMAP login)."""
        address = f"{prefix}-{uuid.uuid4().hex[:8]}@{DOMAIN}"
        with self._lock:
            self.passwords[address] = self.password
        return address

    def home(self, address: str) -> Path:
        """The user's home directory (the Maildir is ``Maildir`` in it)."""
        return self.directory / "mail" / address

    def messages(self, address: str) -> list[EmailMessage]:
        """Every message in the user's Maildir (INBOX and folders, new and cur), read from disk."""
        out = []
        for path in sorted((self.home(address) / "Maildir").glob("**/[nc][eu][wr]/*")):
            try:
                out.append(email.message_from_bytes(path.read_bytes(), policy=email.policy.default))
            except FileNotFoundError:  # moved new/ -> cur/ by Dovecot between glob and read
                continue
        return out  # type: ignore[return-value]

    def replies_to(self, address: str, parent_id: str, *, sender: str | None = None) -> list[EmailMessage]:
        """The messages in ``address``'s mailbox whose In-Reply-To is ``parent_id`` (from ``sender`` when given)."""
        return [m for m in self.messages(address) if str(m.get("In-Reply-To", "")).strip() == parent_id
                and (sender is None or sender in str(m.get("From", "")))]

    def settled_replies(self, address: str, parent_id: str, *, sender: str | None = None,
                        still_s: float = 0.6, timeout_s: float = 5.0) -> list[EmailMessage]:
        """``replies_to`` once its count has not changed for ``still_s`` (a reply accepted is delivered over LMTP
        a moment later), or at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while True:
            got = self.replies_to(address, parent_id, sender=sender)
            now = time.monotonic()
            if len(got) != last:
                last, since = len(got), now
            elif now - since >= still_s or now > deadline:
                return got
            time.sleep(0.05)

    def wait_for(self, address: str, ok, timeout_s: float = 10.0) -> list[EmailMessage]:
        """Read ``address``'s mailbox until ``ok(messages)`` or ``timeout_s``; return the last read."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.messages(address)
            if ok(got) or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def deliver(self, msg: EmailMessage) -> None:
        """Hand ``msg`` to Postfix by SMTP, as a person's mail client would."""
        import smtplib

        with smtplib.SMTP("127.0.0.1", self.smtp_port, timeout=10) as smtp:
            smtp.send_message(msg)

    def settings(self, address: str, **extra: object) -> dict[str, object]:
        """Email adapter settings for the bot ``address`` on this server (plain IMAP and SMTP on loopback)."""
        return {"address": address, "username": address, "password": self.passwords[address],
                "imap_host": "127.0.0.1", "imap_port": self.imap_port, "imap_tls": "none",
                "smtp_host": "127.0.0.1", "smtp_port": self.smtp_port, "smtp_tls": "none", "smtp_auth": False,
                "listing_delay_s": 2.0, **extra}


def _dovecot_conf(d: Path, imap_port: int, lmtp_port: int, password: str) -> str:
    nobody = pwd.getpwnam(MAIL_USER)
    uid, gid = nobody.pw_uid, nobody.pw_gid
    return f"""
base_dir = {d}/dovecot-run
state_dir = {d}/dovecot-state
log_path = {d}/dovecot.log
protocols = imap lmtp
listen = 127.0.0.1
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
first_valid_uid = 1
mail_location = maildir:~/Maildir
mail_fsync = never
default_internal_user = dovecot
default_login_user = dovenull
passdb {{
  driver = static
  args = password={password}
}}
userdb {{
  driver = static
  args = uid={uid} gid={gid} home={d}/mail/%u
}}
service imap-login {{
  inet_listener imap {{
    address = 127.0.0.1
    port = {imap_port}
  }}
  inet_listener imaps {{
    port = 0
  }}
}}
service lmtp {{
  inet_listener lmtp {{
    address = 127.0.0.1
    port = {lmtp_port}
  }}
  unix_listener lmtp {{
    mode = 0600
  }}
}}
protocol lmtp {{
  postmaster_address = postmaster@{DOMAIN}
}}
"""


_MASTER_CF = """\
127.0.0.1:{smtp_port} inet n - n - - smtpd
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
smtp      unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
lmtp      unix  -       -       n       -       -       lmtp
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
"""


def _main_cf(d: Path, lmtp_port: int) -> str:
    return f"""
compatibility_level = 3.6
queue_directory = {d}/postfix-queue
data_directory = {d}/postfix-data
maillog_file = {d}/postfix.log
maillog_file_prefixes = {d}
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
myhostname = mail.{DOMAIN}
mydomain = {DOMAIN}
myorigin = {DOMAIN}
mydestination =
mynetworks = 127.0.0.0/8
alias_maps =
alias_database =
local_recipient_maps =
relayhost =
default_transport = error:this test server delivers only to {DOMAIN}
virtual_mailbox_domains = {DOMAIN}
virtual_transport = lmtp:inet:127.0.0.1:{lmtp_port}
smtpd_recipient_restrictions = permit_mynetworks, reject
smtpd_relay_restrictions = permit_mynetworks, reject
smtputf8_enable = no
biff = no
lmtp_destination_concurrency_limit = 20
smtpd_client_connection_count_limit = 0
smtpd_client_connection_rate_limit = 0
anvil_rate_time_unit = 60s
queue_run_delay = 1s
minimal_backoff_time = 1s
maximal_backoff_time = 2s
"""


def available() -> str | None:
    """None when the servers can run here; else why not."""
    if not os.path.exists(DOVECOT) or not os.path.exists(POSTFIX_MASTER):
        return "postfix and dovecot-imapd are not installed (apt-get install postfix dovecot-imapd dovecot-lmtpd)"
    if os.geteuid() != 0:
        return "the throw-away Postfix and Dovecot need root (Postfix's master runs as root)"
    return None


def start(directory: Path | None = None) -> MailServer:
    """Write the configs, start Dovecot and Postfix, wait for their ports; raise RuntimeError when they fail."""
    started = time.monotonic()
    d = directory or Path(tempfile.mkdtemp(prefix="replyd-mail-"))
    d.chmod(0o755)
    (d / "mail").mkdir()
    nobody = pwd.getpwnam(MAIL_USER)
    os.chown(d / "mail", nobody.pw_uid, nobody.pw_gid)
    password = f"pw-{uuid.uuid4().hex}"
    imap_port, smtp_port, lmtp_port = free_port(), free_port(), free_port()
    (d / "dovecot.conf").write_text(_dovecot_conf(d, imap_port, lmtp_port, password))
    pf = d / "postfix"
    pf.mkdir()
    (d / "postfix-queue").mkdir()  # root's; `postfix check` makes the queues inside it, owned by postfix
    (d / "postfix-data").mkdir()
    postfix = pwd.getpwnam("postfix")
    os.chown(d / "postfix-data", postfix.pw_uid, postfix.pw_gid)
    (pf / "main.cf").write_text(_main_cf(d, lmtp_port))
    (pf / "master.cf").write_text(_MASTER_CF.format(smtp_port=smtp_port))
    server = MailServer(d, imap_port, smtp_port, lmtp_port, password)
    env = {**os.environ, "MAIL_CONFIG": str(pf)}
    try:
        dovecot = subprocess.Popen([DOVECOT, "-F", "-c", str(d / "dovecot.conf")], stdout=subprocess.DEVNULL,
                                   stderr=open(d / "dovecot.stderr", "wb"), start_new_session=True)
        server.procs.append(dovecot)
        check = subprocess.run(["/usr/sbin/postfix", "-c", str(pf), "check"], env=env, capture_output=True,
                               text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"postfix check failed: {(check.stderr + check.stdout).strip()[:400]} ({d})")
        master = subprocess.Popen([POSTFIX_MASTER, "-d", "-c", str(pf)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(d / "postfix.stderr", "wb"), start_new_session=True)
        server.procs.append(master)
        _wait_port(imap_port, dovecot, "dovecot", d / "dovecot.log")
        _wait_port(lmtp_port, dovecot, "dovecot lmtp", d / "dovecot.log")
        _wait_port(smtp_port, master, "postfix", d / "postfix.stderr")
    except BaseException:
        stop(server, keep=True)  # the logs say why
        raise
    server.startup_s = time.monotonic() - started
    return server


def stop(server: MailServer, *, keep: bool = False) -> None:
    """Stop both servers (their process groups) and remove the directory."""
    for proc in reversed(server.procs):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)
    if not keep:
        shutil.rmtree(server.directory, ignore_errors=True)


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"mail servers unavailable under CI=true: {reason}", pytrace=False)
    pytest.skip(f"mail servers unavailable: {reason}")


@pytest.fixture(scope="session")
def mail_server() -> Iterator[MailServer]:
    """A running Postfix + Dovecot pair on free loopback ports; stopped at the end of the session."""
    why = available()
    if why:
        _unavailable(why)
    try:
        server = start()
    except RuntimeError as exc:
        _unavailable(str(exc).splitlines()[0][:500])
    print(f"\nmail: postfix+dovecot started in {server.startup_s:.1f}s (imap {server.imap_port}, "
          f"smtp {server.smtp_port}) in {server.directory}", file=sys.stderr)
    try:
        yield server
    finally:
        stop(server)


def person_mail(sender: str, to: str, subject: str, body: str = "help please", **headers: str) -> EmailMessage:
    """A mail as a person's client writes it: its own Message-ID, Date, and any extra headers."""
    from email.utils import formatdate, make_msgid

    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = to
    msg["Subject"] = subject
    msg["Date"] = formatdate(localtime=False)
    msg["Message-ID"] = headers.pop("Message_ID", None) or make_msgid(domain="client.example")
    for k, v in headers.items():
        msg[k.replace("_", "-")] = v
    msg.set_content(body)
    return msg
