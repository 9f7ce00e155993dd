"""Secrets never leak: a full daemon run with known secrets, then grep everything it wrote.

The daemon (a real ``python -m replyd run`` process, no API, two bots whose webhook and
openai responders meet endpoints that quote the request headers back in errors) answers the sim
under faults (lost responses, 5xx, 429, failed read-backs) with a token given
through ``token_env`` and a literal secret written into the config; then the
CLI's outputs (``status``, ``explain``, ``check``, ``sweep``, ``config check``,
a failing start) are captured. None of the stderr/stdout, the SQLite database
bytes (main file and WAL), the events' details or the exception strings may
contain a secret. The adapter is also pointed at a server that echoes the
Authorization header back in its error bodies.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from replyd.clock import FakeClock, SystemClock
from replyd.errors import ReplydError, StoreError
from replyd.platforms.base import Parent, Pending
from replyd.platforms.mastodon import MastodonPlatform
from replyd.sim import SimServer, World
from replyd.store import Store
from tests.fixtures_server import (  # noqa: F401  (pytest fixtures by name)
    FixtureServer,
    Recorded,
    Reply,
    fixture_server,
    fixture_server_session,
    http_client,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tok-LEAKCHECK-7f3a9c1e5b2d8e4f6a0c"
LITERAL = "lit-LEAKCHECK-a1b2c3d4e5f6a7b8c9d0"
PG_PASSWORD = "pw-LEAKCHECK-0d9c8b7a6f5e"
TOKEN2 = "tok-LEAKCHECK-2e8d1c0b9a7f6e5d4c3b"
OPENAI_KEY = "sk-LEAKCHECK-9e8d7c6b5a4f3e2d1c0b"
SECRETS = (TOKEN, LITERAL, PG_PASSWORD, TOKEN2, OPENAI_KEY)
BOT = "leakbot"
BOT2 = "leakbot2"


class Hostile(BaseHTTPRequestHandler):
    """A webhook and an OpenAI-compatible endpoint that echo every header back in their errors, every other call."""

    calls = {"hook": 0, "chat": 0}

    def log_message(self, *a):
        """Keep test output quiet."""

    def do_POST(self):
        """POST /hook or /v1/chat/completions: a reply, or an error body quoting the request's headers."""
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        kind = "hook" if self.path == "/hook" else "chat"
        Hostile.calls[kind] += 1
        if Hostile.calls[kind] % 2 == 0:
            echo = json.dumps({"error": {"message": f"refused: {dict(self.headers)} {body[:200]!r}"}}).encode()
            self.send_response(500 if kind == "hook" else 401)
        elif kind == "hook":
            echo = json.dumps({"text": "thanks from the hook"}).encode()
            self.send_response(200)
        else:
            echo = json.dumps({"choices": [{"message": {"content": "thanks from the model"}, "finish_reason": "stop"}]}).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(echo)))
        self.end_headers()
        self.wfile.write(echo)


def leaks(blob: bytes | str) -> list[str]:
    """The secrets found in ``blob`` (also URL- and JSON-escaped forms)."""
    data = blob if isinstance(blob, bytes) else blob.encode("utf-8", "replace")
    return [s for s in SECRETS if s.encode() in data]


def write_config(path: Path, base_url: str, db: Path, hostile: str) -> Path:
    path.write_text(f"""
[store]
url = "sqlite:///{db}"

[log]
format = "json"
level = "debug"

[guard]
send_timeout_s = 2.0
responder_backoff_s = 0.5   # the hostile endpoints fail every other call: retry soon

[sweep]
interval_s = 0.3
retry_s = 0.3

[[bots]]
name = "leak"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "LEAK_TOKEN"
listing_delay_s = 0.4
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.3
search_interval_s = 0.5
search_queries = ["help"]
refind_interval_s = 0.6
jitter_s = 0

[bots.responder]
kind = "webhook"
url = "{hostile}/hook"
hmac_secret = "{LITERAL}"   # a literal secret in the file: masked, and the file's mode is checked
retries = 0
timeout_s = 3

[[bots]]
name = "leak2"
platform = "mastodon"

[bots.settings]
base_url = "{base_url}"
token_env = "LEAK_TOKEN2"
listing_delay_s = 0.4
timeout_s = 2.0

[bots.pollers]
inbox_interval_s = 0.3
search_interval_s = 0
refind_interval_s = 0.6
jitter_s = 0

[bots.responder]
kind = "openai"
base_url = "{hostile}/v1"
model = "leak-test"
api_key_env = "LEAK_OPENAI_KEY"
retries = 0
timeout_s = 3
""")
    os.chmod(path, 0o600)
    return path


def cli(*args: str, env: dict[str, str]) -> str:
    p = subprocess.run([sys.executable, "-m", "replyd", *args], capture_output=True, env=env, cwd=ROOT, timeout=120)
    return p.stdout.decode("utf-8", "replace") + p.stderr.decode("utf-8", "replace")


@pytest.mark.slow
def test_full_run_writes_no_secret(tmp_path):
    """Daemon + CLI + database: platform tokens, responder keys and the literal secret appear nowhere."""
    world = World(SystemClock(), seed=5, listing_delay_s=0.2)
    world.add_account(BOT, bot=True, token=TOKEN)
    world.add_account(BOT2, bot=True, token=TOKEN2)
    hostile = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    hostile_url = f"http://127.0.0.1:{hostile.server_address[1]}"
    world.configure(lost_drop_rate=0.15, lost_504_rate=0.15, error_500_before_rate=0.1, rate_limit_rate=0.1,
                    readback_error_rate=0.3)
    db = tmp_path / "r.sqlite3"
    log = tmp_path / "daemon.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LEAK_TOKEN": TOKEN, "LEAK_TOKEN2": TOKEN2, "LEAK_OPENAI_KEY": OPENAI_KEY}
    with SimServer(world) as srv:
        cfg = write_config(tmp_path / "c.toml", srv.base_url, db, hostile_url)
        parents = [s.id for s in world.generate(12, target=[BOT, BOT2], query_word="help")]
        proc = subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                                stdout=subprocess.PIPE, stderr=log.open("wb"), env=env, cwd=ROOT)
        try:
            end = time.monotonic() + 40
            while time.monotonic() < end and min(sum(world.replies_by(world.account(b).id).values())
                                                 for b in (BOT, BOT2)) < len(parents):
                time.sleep(0.3)
            time.sleep(1.0)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        assert sum(world.faults_injected.values()) > 0, "the run met no fault: the error paths were not exercised"
        outputs = {
            "daemon stdout": out.decode("utf-8", "replace"),
            "daemon stderr": log.read_text(errors="replace"),
            "status": cli("status", "--config", str(cfg), "--json", env=env),
            "status table": cli("status", "--config", str(cfg), env=env),
            "explain": cli("explain", parents[0], "--config", str(cfg), "--json", env=env),
            "explain table": cli("explain", parents[1], "--config", str(cfg), env=env),
            "check": cli("check", parents[2], "--config", str(cfg), env=env),
            "sweep": cli("sweep", "--config", str(cfg), env=env),
            "config check": cli("config", "check", str(cfg), env=env),
        }
        # A start the platform refuses (the token is wrong, and the error is about it).
        world.accounts[world.account(BOT).id].token = "something-else-entirely"
        outputs["refused start"] = cli("run", "--config", str(cfg), "--grace-s", "1", env=env)
    hostile.shutdown()
    assert "replyd.guard.posted" in outputs["daemon stderr"]
    # Both responders met their hostile errors (which quoted the secrets back) and were retried.
    assert outputs["daemon stderr"].count("replyd.guard.responder_failed") >= 2 and min(Hostile.calls.values()) >= 2
    assert "maybe_sent" in outputs["daemon stderr"] or "readback_failed" in outputs["daemon stderr"]
    found = {name: leaks(text) for name, text in outputs.items() if leaks(text)}
    for f in sorted(tmp_path.iterdir()):
        if f.name.startswith("r.sqlite3"):
            if leaks(f.read_bytes()):
                found[f.name] = leaks(f.read_bytes())
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT * FROM events").fetchall() + con.execute("SELECT * FROM replies").fetchall()
    finally:
        con.close()
    if leaks(json.dumps(rows, default=str)):
        found["events/replies rows"] = leaks(json.dumps(rows, default=str))
    assert not found, found


def _echo(status: int, ctype: str = "application/json"):
    def handler(rec: Recorded) -> Reply:
        auth = rec.headers.get("authorization", "")
        if ctype == "text/html":
            return Reply(status=status, body=f"<html><body>denied for {auth}</body></html>", content_type=ctype)
        return Reply(status=status, body={"error": f"token {auth} refused", "message": auth})

    return handler


@pytest.mark.parametrize("status,ctype", [(401, "application/json"), (403, "application/json"), (422, "application/json"),
                                          (429, "application/json"), (500, "application/json"), (502, "text/html"),
                                          (404, "application/json")])
def test_echoed_token_never_reaches_errors_or_logs(status, ctype, fixture_server: FixtureServer,
                                                   http_client: httpx.Client) -> None:
    """A server that echoes the Authorization header in its errors: every exception and log line is clean."""
    for method, path in (("GET", "/api/v1/accounts/verify_credentials"), ("GET", "/api/v1/notifications"),
                         ("POST", "/api/v1/statuses"), ("GET", "/api/v1/accounts/1/statuses"),
                         ("GET", "/api/v1/statuses/5/context"), ("GET", "/api/v2/search"),
                         ("DELETE", "/api/v1/statuses/9")):
        fixture_server.route(method, path, _echo(status, ctype))
    plat = MastodonPlatform(base_url=fixture_server.url, token=TOKEN, http=http_client, clock=FakeClock(1.8e9))
    assert not leaks(repr(plat))
    parent = Parent(id="5", author_id="2", author_handle="a", extra={"acct": "a"})
    calls = [lambda: plat.whoami(), lambda: plat.inbox(None), lambda: plat.search("q", None), lambda: plat.refind(0),
             lambda: plat.send(parent, "hi", provider_key="k"), lambda: plat.delete("9"),
             lambda: plat.read_back([Pending(parent, 1.0e9)], sender_id="1")]
    texts = []
    with capture_logs() as logs:
        for call in calls:
            try:
                texts.append(repr(call()))
            except ReplydError as exc:
                texts += [str(exc), repr(exc), getattr(exc, "detail", ""), repr(exc.__cause__), repr(exc.__context__)]
    texts.append(json.dumps(logs, default=str))
    assert any("refused" in t or "HTTP" in t for t in texts), texts  # the server's errors were seen
    assert not leaks("\n".join(texts)), [t for t in texts if leaks(t)]


def test_store_errors_hide_the_database_password(tmp_path) -> None:
    """A PostgreSQL URL's password appears in no StoreError and no Store.url."""
    url = f"postgresql+psycopg://replyd:{PG_PASSWORD}@127.0.0.1:1/nope"
    with pytest.raises(StoreError) as ei:
        Store.open(url)
    assert not leaks(str(ei.value)) and not leaks(repr(ei.value))
    with pytest.raises(ReplydError) as ei2:
        Store.open(f"notadb://u:{PG_PASSWORD}@h/x")
    assert not leaks(str(ei2.value))


def test_cli_store_error_hides_password(tmp_path) -> None:
    """`replyd status` on an unreachable PostgreSQL URL with a password prints the error, not the password."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nurl = "postgresql+psycopg://replyd:{PG_PASSWORD}@127.0.0.1:1/nope"\n')
    os.chmod(cfg, 0o600)
    out = cli("status", "--config", str(cfg), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "StoreError" in out or "store" in out.lower(), out
    assert not leaks(out), out


INSECURE_CASES = [
    ("mastodon", "base_url", {"token": "tok-0123456789"}),
    ("discourse", "base_url", {"api_key": "k-0123456789", "api_username": "bot"}),
    ("github", "api_url", {"token": "ghp_0123456789abcdef", "repos": ["octo/repo"]}),
    ("bluesky", "service", {"identifier": "bot.bsky.test", "app_password": "abcd-efgh-ijkl-mnop"}),
    ("matrix", "base_url", {"token": "syt_0123456789abcdef"}),
]


@pytest.mark.parametrize("kind,key,settings", INSECURE_CASES, ids=[c[0] for c in INSECURE_CASES])
def test_plain_http_to_a_public_host_is_refused(kind, key, settings) -> None:
    """A platform URL with http:// to a non-loopback host is a ConfigError unless allow_insecure_http = true."""
    from replyd.errors import ConfigError
    from replyd.platforms.base import make_platform

    with httpx.Client() as http:
        def build(url: str, **extra) -> object:
            """Build the adapter for ``url`` (no request is made)."""
            return make_platform(kind, {**settings, key: url, **extra}, http=http, clock=FakeClock())

        with pytest.raises(ConfigError, match=rf"{kind} setting '{key}'.*allow_insecure_http"):
            build("http://social.example.org")
        with pytest.raises(ConfigError, match="allow_insecure_http"):
            build("http://10.0.0.5:8080", allow_insecure_http="yes")  # a flag, not a truthy string
        for ok in ("https://social.example.org", "http://127.0.0.1:3000", "http://localhost:3000", "http://[::1]:3000"):
            build(ok)
        build("http://social.example.org", allow_insecure_http=True)


def test_plain_http_to_a_public_openai_endpoint_is_refused() -> None:
    """The openai responder's base_url: http:// to a non-loopback host only with allow_insecure_http = true."""
    from replyd.errors import ConfigError
    from replyd.responders import make_responder

    base = {"model": "m", "api_key": "sk-0123456789"}
    with pytest.raises(ConfigError, match=r"responder.base_url.*allow_insecure_http"):
        make_responder("openai", {**base, "base_url": "http://llm.example.org/v1"})
    make_responder("openai", {**base, "base_url": "http://llm.example.org/v1", "allow_insecure_http": True})
    make_responder("openai", {**base, "base_url": "http://127.0.0.1:8000/v1"})
    make_responder("openai", {**base, "base_url": "https://llm.example.org/v1"})


def mode(path: Path) -> int:
    """The permission bits of ``path``."""
    return path.stat().st_mode & 0o777


def test_sqlite_store_is_owner_only(tmp_path, monkeypatch) -> None:
    """The default store's directory is 0700 and its database, WAL and SHM 0600 under a 022 umask; an existing
    0644 database is tightened to 0600."""
    from replyd.store import Key, Store

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    old = os.umask(0o022)
    try:
        clock = FakeClock()
        s = Store.open(None, clock=clock)
        new = {"state": "open", "attempt": 1, "created_at": clock.now(), "updated_at": clock.now(), "owner": "t"}
        assert s.claim(Key("p", "me", "1"), new, lambda r: None, {"kind": "claimed"}).won  # a write: WAL and SHM
        db = tmp_path / "state" / "replyd" / "replyd.sqlite3"
        assert mode(db.parent) == 0o700
        for f in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            assert f.exists() and mode(f) == 0o600, (f, oct(mode(f)))
        s.dispose()
        other = tmp_path / "loose" / "r.sqlite3"
        other.parent.mkdir()
        other.touch(mode=0o644)
        Store.open(f"sqlite:///{other}").dispose()
        assert mode(other) == 0o600
    finally:
        os.umask(old)


@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_database_password_hidden_everywhere(where, pg_url, tmp_path, monkeypatch) -> None:
    """A PostgreSQL password in the URL (user info or ?password=) shows nowhere: Store.url, /v1/status, the page,
    `replyd db current`; and the log masker hides it."""
    import sqlalchemy as sa

    from replyd import log as rlog
    from replyd.api import Api, ApiServer

    base = sa.engine.make_url(pg_url)  # trust auth: the server ignores the password, so the store really opens
    url = (base.set(password=PG_PASSWORD) if where == "userinfo"
           else base.update_query_dict({"password": PG_PASSWORD})).render_as_string(hide_password=False)
    assert PG_PASSWORD in url
    s = Store.open(url)
    try:
        assert not leaks(s.url) and "***" in s.url
        assert rlog.mask(f"connecting with {PG_PASSWORD}") == "connecting with ***"
        api = Api(s, {}, expected=[], token="t" * 32)
        with ApiServer(api.app) as srv, httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer " + "t" * 32}) as c:
            status, page = c.get("/v1/status"), c.get("/")
        assert status.status_code == 200 and page.status_code == 200
        assert not leaks(status.text) and not leaks(page.text) and "***" in status.json()["store"]["url"]
    finally:
        s.dispose()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nurl = "{url}"\n')
    os.chmod(cfg, 0o600)
    out = cli("db", "current", "--config", str(cfg), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "revision" in out and not leaks(out), out


def test_resolved_secrets_are_hidden_in_the_config(tmp_path, monkeypatch, fixture_server: FixtureServer) -> None:
    """Tokens read through ``*_env`` (and one written in the file) are SecretStr in the loaded config: no repr, str or
    dump shows them, yet the adapters and the responder built from it use the values and the log masks them."""
    from replyd import log as rlog
    from replyd.config import Config
    from replyd.platforms.base import make_platform
    from replyd.responders import ResponderRunner, make_responder

    token, key, literal = "tok-HIDDEN-5e1f0a9b7c3d", "sk-HIDDEN-0123456789ab", "ghp_HIDDEN0123456789abcdef"
    monkeypatch.setenv("HIDDEN_TOKEN", token)
    monkeypatch.setenv("HIDDEN_KEY", key)
    monkeypatch.setenv("LLM_MODEL", "gpt-from-env")  # any key may be read through *_env: a plain string setting too
    path = tmp_path / "c.toml"
    path.write_text(f"""
[[bots]]
name = "m"
platform = "mastodon"
[bots.settings]
base_url = "https://mastodon.example"
token_env = "HIDDEN_TOKEN"
[bots.responder]
kind = "openai"
base_url = "{fixture_server.url}/v1"
model_env = "LLM_MODEL"
api_key_env = "HIDDEN_KEY"

[[bots]]
name = "g"
platform = "github"
[bots.settings]
token = "{literal}"
repos = ["o/r"]
""")
    path.chmod(0o600)
    cfg = Config.load(path)
    shown = [repr(cfg), str(cfg), repr(cfg.bots), cfg.model_dump_json(), repr(cfg.model_dump()),
             repr([b.responder.model_dump() for b in cfg.bots])]
    for secret in (token, key, literal):
        assert not [text for text in shown if secret in text], secret
        assert rlog.mask(f"a {secret} b") == "a *** b"  # still registered for masking
    with httpx.Client() as http:
        mastodon = make_platform("mastodon", cfg.bots[0].settings, http=http, clock=SystemClock())
        github = make_platform("github", cfg.bots[1].settings, http=http, clock=SystemClock())
    assert mastodon.s.token.get_secret_value() == token and github.s.token.get_secret_value() == literal
    completions = "/v1/chat/completions"
    fixture_server.route("POST", completions, Reply(body={"choices": [{"message": {"content": "ok"},
                                                                        "finish_reason": "stop"}]}))
    runner = ResponderRunner(make_responder("openai", cfg.bots[0].responder.model_dump(exclude={"kind"})))
    try:
        assert runner(Parent(id="1", author_id="2", text="q")) == "ok"
    finally:
        runner.close()
    [request] = fixture_server.requests_to("POST", completions)
    assert request.headers["authorization"] == f"Bearer {key}" and json.loads(request.body)["model"] == "gpt-from-env"


def test_export_file_is_owner_only(tmp_path, monkeypatch) -> None:
    """``replyd export -o FILE`` writes 0600 whatever the umask: a new file, and an existing 0644 one; stdout works."""
    from replyd.store import Key, Store

    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    clock = FakeClock()
    s = Store.open(None, clock=clock)
    new = {"state": "open", "attempt": 1, "created_at": clock.now(), "updated_at": clock.now(), "owner": "t"}
    assert s.claim(Key("p", "me", "1"), new, lambda r: None, {"kind": "claimed"}).won
    s.dispose()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(state)}
    fresh, loose = tmp_path / "fresh.csv", tmp_path / "loose.csv"
    loose.write_text("old\n")
    loose.chmod(0o644)
    for target in (fresh, loose):
        # umask 0: a file opened with the default mode would be 0666 (world-writable, too)
        p = subprocess.run([sys.executable, "-m", "replyd", "export", "-o", str(target)], capture_output=True,
                           env=env, cwd=ROOT, timeout=120, preexec_fn=lambda: os.umask(0))
        assert p.returncode == 0, p.stderr
        assert mode(target) == 0o600, (target, oct(mode(target)))
        assert target.read_text().splitlines()[1].startswith("p,me,1,")  # written in full: header, the row
    p = subprocess.run([sys.executable, "-m", "replyd", "export", "-o", "/dev/stdout"], capture_output=True, env=env,
                       cwd=ROOT, timeout=120)
    assert p.returncode == 0 and b"p,me,1," in p.stdout, p.stderr


def test_short_secrets_are_masked_too() -> None:
    """A secret under 6 characters is masked like any other; a secret inside a longer one does not split it."""
    from replyd import log as rlog

    rlog.add_secret("Zq5!x")
    rlog.add_secret("Zq5!x-and-more-LEAKCHECK")
    assert rlog.mask("pw=Zq5!x;") == "pw=***;"
    assert rlog.mask("key Zq5!x-and-more-LEAKCHECK end") == "key *** end"


def test_mask_finds_every_secret_among_a_thousand_longest_first(monkeypatch):
    """A thousand registered tokens (a daemon of a thousand bots): each is masked wherever it stands (start, end,
    back to back, inside a word), the longest where two start at one place, short ones too; other text is kept."""
    import random

    from replyd import log as rlog

    monkeypatch.setattr(rlog, "_SECRETS", set())
    monkeypatch.setattr(rlog, "_index", None)
    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
    tokens = ["".join(rng.choice(alphabet) for _ in range(rng.randint(8, 48))) for _ in range(1000)]
    for t in tokens + ["pw1", "tok-abc", "tok-abcdef"]:
        rlog.add_secret(t)
    a, b = tokens[3], tokens[999]
    assert rlog.mask(f"{a}{b} x{a}y Bearer {b}") == "****** x***y Bearer ***"
    assert rlog.mask("tok-abcdefg tok-abc pw1!") == "***g *** ***!"
    assert rlog.mask("nothing secret here, 12345") == "nothing secret here, 12345"
    for t in rng.sample(tokens, 50):
        assert t not in rlog.mask(f"GET /api?token={t}&x=1") and "***" in rlog.mask(t)
