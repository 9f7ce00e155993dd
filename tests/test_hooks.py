"""Webhook discovery (GitHub): signed deliveries feed the one pipeline; redeliveries and replicas answer once.

Deliveries are built from GitHub's published example payloads (tests/fixtures/webhooks, octokit/webhooks,
MIT) with the issue object replaced by the fake GitHub's own REST form of a real issue it holds, signed
as GitHub signs them, and POSTed over real HTTP to the daemon's API. Replies are counted by the fake.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.config import Config
from replyd.daemon import Daemon
from replyd.hooks import sign, verify
from replyd.platforms.github import GitHubPlatform
from tests.fakes_forum import FakeGitHub, FakeHost
from tests.test_daemon import wait_until as _wait

ROOT = Path(__file__).resolve().parents[1]
PAYLOADS = Path(__file__).parent / "fixtures" / "webhooks" / "github"
SECRET = "whsec-0123456789abcdef-test-secret"


def payload(name: str) -> dict[str, Any]:
    """One of GitHub's example deliveries, as published."""
    return json.loads((PAYLOADS / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def host():
    """One fake-GitHub server for the module."""
    with FakeHost() as h:
        yield h


@pytest.fixture
def fake(host):
    """A fresh fake GitHub with acme/widgets and a human, installed on the shared server."""
    f = FakeGitHub(FakeClock(time.time()))
    f.add_repo("acme/widgets")
    host.fake = f
    yield f
    host.fake = None


def delivery(fake: FakeGitHub, event: str, issue, *, n: int = 0) -> tuple[dict[str, str], bytes]:
    """Headers and body of a signed delivery of ``event`` about ``issue`` (GitHub's example, our issue)."""
    body = copy.deepcopy(payload("issues.opened" if event == "issues" else "issue_comment.created"))
    body["issue"] = fake._issue_json(issue)
    raw = json.dumps(body).encode()
    return {"X-GitHub-Event": event, "X-GitHub-Delivery": f"d-{issue.id}-{n}", "X-Hub-Signature-256": sign(SECRET, raw),
            "Content-Type": "application/json"}, raw


# -- parsing and signatures ----------------------------------------------------------------------


def test_published_deliveries_parse_to_the_pollers_parent() -> None:
    """issues.opened and issue_comment.created name the issue (id as served, repo in extra); ping names none."""
    with httpx.Client() as http:
        plat = GitHubPlatform.from_settings({"token": "t", "api_url": "https://api.github.com"}, http=http,
                                            clock=FakeClock())
        opened = payload("issues.opened")
        [p] = plat.parse_webhook("issues", opened)
        assert p.id == str(opened["issue"]["id"]) and p.extra["number"] == opened["issue"]["number"]
        comment = payload("issue_comment.created")
        [q] = plat.parse_webhook("issue_comment", comment)
        assert (q.id, q.extra["owner"], q.extra["repo"]) == ("444500041", "Codertocat", "Hello-World")
        assert plat.parse_webhook("ping", payload("ping")) == "ping is not answered"
        edited = {**comment, "action": "edited"}
        assert plat.parse_webhook("issue_comment", edited) == "issue_comment.edited is not answered"


def test_signature_is_checked_on_the_exact_body() -> None:
    """The sha256 HMAC of the raw body under the secret, nothing else, verifies."""
    body = b'{"action":"opened"}'
    good = sign(SECRET, body)
    assert verify(SECRET, body, good)
    assert not verify(SECRET, body + b" ", good)  # same signature, other body
    assert not verify("another-secret-0123456789", body, good)
    assert not verify(SECRET, body, None) and not verify(SECRET, body, "") and not verify(SECRET, body, "sha1=abc")


# -- the daemon's receiver over HTTP ---------------------------------------------------------------


def _config(tmp_path: Path, host: FakeHost, store_url: str, *, port: int = 0, poll_s: float = 0) -> Path:
    cfg = tmp_path / "hooks.toml"
    cfg.write_text(f"""
[store]
url = "{store_url}"

[log]
format = "json"
level = "info"

[api]
enabled = true
port = {port}

[guard]
send_timeout_s = 5.0

[sweep]
interval_s = 0.5

[[bots]]
name = "gh"
platform = "github"

[bots.settings]
api_url = "{host.url}"
token_env = "GH_TEST_TOKEN"
notifications = false
repos = ["acme/widgets"]
listing_delay_s = 0.5

[bots.pollers]
inbox_interval_s = {poll_s}
refind_interval_s = 0

[bots.push]
kind = "github"
secret_env = "GH_HOOK_SECRET"

[bots.responder]
kind = "template"
""")
    os.chmod(cfg, 0o600)
    return cfg


@pytest.fixture
def env(monkeypatch):
    """The token and the webhook secret in the environment, as a deployment would set them."""
    monkeypatch.setenv("GH_TEST_TOKEN", FakeGitHub.TOKEN)
    monkeypatch.setenv("GH_HOOK_SECRET", SECRET)


def test_each_delivery_three_times_shuffled_answers_each_issue_once(fake, host, env, tmp_path) -> None:
    """Six issues, both event kinds, every delivery sent three times in random order, the backstop poll reading
    the same repository meanwhile: one comment per issue (a webhook's parent has the poller's key)."""
    alice = fake.add_user("alice")
    issues = [fake.open_issue(alice, "acme/widgets", f"Widget {i} broke", "help please") for i in range(6)]
    d = Daemon(Config.load(_config(tmp_path, host, f"sqlite:///{tmp_path / 'r.sqlite3'}", poll_s=0.2)))
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/gh"
        sends = [delivery(fake, "issues" if i % 2 else "issue_comment", issue, n=k)
                 for i, issue in enumerate(issues) for k in range(3)]
        random.Random(7).shuffle(sends)
        with httpx.Client(timeout=5.0) as http:
            codes = [http.post(url, headers=h, content=b).status_code for h, b in sends]
        assert codes == [202] * len(sends)
        assert _wait(lambda: all(fake.replies(i) for i in issues))
        time.sleep(1.0)  # every queued offer has run: nothing may answer again
    finally:
        d.stop(grace_s=5)
    assert [len(fake.replies(i)) for i in issues] == [1] * len(issues)
    assert fake.create_requests == len(issues)


def test_forged_unsigned_replayed_oversize_deliveries_post_nothing(fake, host, env, tmp_path, capfd) -> None:
    """Bad deliveries get 401 / 413 / 400 and post nothing; ping is accepted and ignored; the secret is never shown."""
    alice = fake.add_user("alice")
    issue = fake.open_issue(alice, "acme/widgets", "Widget broke", "help please")
    d = Daemon(Config.load(_config(tmp_path, host, f"sqlite:///{tmp_path / 'r.sqlite3'}")))
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/gh"
        headers, body = delivery(fake, "issues", issue)
        other = copy.deepcopy(json.loads(body))
        other["issue"]["title"] = "Something else entirely"
        forged = {**headers, "X-Hub-Signature-256": sign("not-the-secret-0123456789", body)}
        unsigned = {k: v for k, v in headers.items() if k != "X-Hub-Signature-256"}
        with httpx.Client(timeout=5.0) as http:
            bad = http.post(url, headers=forged, content=body)
            assert bad.status_code == 401
            assert http.post(url, headers=unsigned, content=body).status_code == 401
            replayed = http.post(url, headers=headers, content=json.dumps(other).encode())  # signature of another body
            assert replayed.status_code == 401 and replayed.json()["error"] == "bad_signature"
            big = b"{" + b" " * (2 * 1024 * 1024) + b"}"
            assert http.post(url, headers={**headers, "X-Hub-Signature-256": sign(SECRET, big)},
                             content=big).status_code == 413
            ping = json.dumps(payload("ping")).encode()
            r = http.post(url, headers={**headers, "X-GitHub-Event": "ping", "X-Hub-Signature-256": sign(SECRET, ping)},
                          content=ping)
            assert r.status_code == 202 and r.json() == {"accepted": 0, "ignored": "ping is not answered"}
            nobody = http.post(f"{d.api.url}/v1/hooks/nobody", headers=headers, content=body)
            assert (nobody.status_code, nobody.content) == (401, bad.content)  # unknown bot = bad signature
            garbage = b"not json"
            assert http.post(url, headers={**headers, "X-Hub-Signature-256": sign(SECRET, garbage)},
                             content=garbage).status_code == 400
        time.sleep(1.0)
    finally:
        d.stop(grace_s=5)
    assert fake.create_requests == 0 and not fake.replies(issue)
    out, err = capfd.readouterr()
    assert SECRET not in out + err
    assert "replyd.hooks.bad_signature" in out + err


# -- scope: only what the bot's pollers would find is offered ------------------------------------------


def scraped(api_url: str, name: str, **labels: str) -> float:
    """One sample of the daemon's GET /metrics (0 when the series is absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{api_url}/metrics", timeout=5.0).text
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def published(fake: FakeGitHub, name: str, issue, comment=None, *, n: int = 0) -> tuple[dict[str, str], bytes]:
    """A signed delivery of GitHub's published example ``name`` with the fake's issue (and comment) in it."""
    body = copy.deepcopy(payload(name))
    body["issue"] = fake._issue_json(issue)
    if comment is not None:
        body["comment"] = fake._comment_json(comment)
    raw = json.dumps(body).encode()
    return {"X-GitHub-Event": name.split(".", 1)[0], "X-GitHub-Delivery": f"s-{issue.id}-{n}",
            "X-Hub-Signature-256": sign(SECRET, raw), "Content-Type": "application/json"}, raw


def dropped_lines(text: str) -> list[dict[str, Any]]:
    """The ``replyd.hook.dropped`` events of a log, JSON or console (``key=value``) lines."""
    import re

    out = []
    for line in text.splitlines():
        if "replyd.hook.dropped" not in line:
            continue
        if line.lstrip().startswith("{"):
            out.append(json.loads(line))
        else:
            out.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return out


def test_an_org_or_app_webhook_for_unlisted_repositories_posts_nothing(fake, host, env, tmp_path, capfd) -> None:
    """An organisation's issues.opened and a GitHub App's issue_comment.created from a repository not in `repos`
    (and a comment on a closed listed issue) are acked 202, not answered on the platform, and dropped with a
    logged and counted reason; an issue of the listed repository is still answered (the hook works)."""
    alice = fake.add_user("alice")
    fake.add_repo("Codertocat/Hello-World")  # the published payloads' own repository, not in the bot's `repos`
    other = fake.open_issue(alice, "Codertocat/Hello-World", "Spelling error in the README file", "two t's")
    other_c = fake.comment(alice, other, "You are totally right! I'll get this fixed right away.")
    closed = fake.open_issue(alice, "acme/widgets", "Old widget", "fixed long ago")
    closed.state = "closed"
    closed_c = fake.comment(alice, closed, "still broken for me")
    mine = fake.open_issue(alice, "acme/widgets", "Widget broke", "help please")
    d = Daemon(Config.load(_config(tmp_path, host, f"sqlite:///{tmp_path / 'r.sqlite3'}")))
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/gh"
        before = {r: scraped(d.api.url, "replyd_webhook_dropped_total", platform="gh", reason=r)
                  for r in ("repo_not_listed", "issue_closed")}
        with httpx.Client(timeout=5.0) as http:
            answers = [http.post(url, headers=h, content=b) for h, b in (
                published(fake, "issues.opened.with-organization", other),
                published(fake, "issue_comment.created.with-installation", other, other_c),
                published(fake, "issue_comment.created", closed, closed_c))]
            ok = http.post(url, headers=(hb := published(fake, "issues.opened", mine))[0], content=hb[1])
        assert _wait(lambda: fake.replies(mine))
        time.sleep(1.0)  # every queued offer has run
        after = {r: scraped(d.api.url, "replyd_webhook_dropped_total", platform="gh", reason=r) for r in before}
    finally:
        d.stop(grace_s=5)
    # Counted on the platform first: nothing was commented outside the scope.
    assert fake.replies(other) == [] and fake.replies(closed) == [] and fake.create_requests == 1
    assert [(a.status_code, a.json()) for a in answers] == [
        (202, {"accepted": 0, "dropped": ["repo_not_listed"]}),
        (202, {"accepted": 0, "dropped": ["repo_not_listed"]}),
        (202, {"accepted": 0, "dropped": ["issue_closed"]})]
    assert ok.status_code == 202 and ok.json()["accepted"] == 1
    assert {r: after[r] - before[r] for r in before} == {"repo_not_listed": 2.0, "issue_closed": 1.0}
    out, err = capfd.readouterr()
    logged = dropped_lines(out + err)
    assert [(e["bot"], e["reason"], e["parent_id"]) for e in logged] == [
        ("gh", "repo_not_listed", str(other.id)), ("gh", "repo_not_listed", str(other.id)),
        ("gh", "issue_closed", str(closed.id))]
    assert all(e["platform"].startswith("github:") for e in logged)


def test_with_notifications_a_comment_must_mention_the_bot(fake, host, env, tmp_path, capfd) -> None:
    """With `notifications` on, a GitHub App's comment in an unlisted repository is answered only when it
    @mentions the bot (what the notifications poller would find): the unaddressed one is dropped, uncommented."""
    alice = fake.add_user("alice")
    fake.add_repo("Codertocat/Hello-World")
    quiet = fake.open_issue(alice, "Codertocat/Hello-World", "Spelling error", "two t's")
    quiet_c = fake.comment(alice, quiet, "You are totally right! I'll get this fixed right away.")
    asked = fake.open_issue(alice, "Codertocat/Hello-World", "Another typo", "in the docs")
    asked_c = fake.comment(alice, asked, f"@{fake.bot.username} can you fix this one too?")
    cfg = _config(tmp_path, host, f"sqlite:///{tmp_path / 'r.sqlite3'}")
    cfg.write_text(cfg.read_text().replace("notifications = false", "notifications = true"))
    d = Daemon(Config.load(cfg))
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/gh"
        with httpx.Client(timeout=5.0) as http:
            no = http.post(url, headers=(hb := published(fake, "issue_comment.created.with-installation", quiet,
                                                         quiet_c))[0], content=hb[1])
            yes = http.post(url, headers=(hb := published(fake, "issue_comment.created.with-installation", asked,
                                                          asked_c))[0], content=hb[1])
        assert _wait(lambda: fake.replies(asked))
        time.sleep(1.0)
    finally:
        d.stop(grace_s=5)
    assert fake.replies(quiet) == [] and len(fake.replies(asked)) == 1
    assert (no.status_code, no.json()) == (202, {"accepted": 0, "dropped": ["not_addressed"]})
    assert yes.status_code == 202 and yes.json()["accepted"] == 1
    out, err = capfd.readouterr()
    assert [(e["bot"], e["reason"]) for e in dropped_lines(out + err)] == [("gh", "not_addressed")]


def test_github_scope_rules_match_the_pollers() -> None:
    """Listed repositories match case-insensitively and only open issues; elsewhere, with notifications, a body
    mention or an assignment of the bot (by id) is in scope; a title mention, a longer name, the bot's own
    comment, an unwanted reason or notifications off are not."""
    from replyd.platforms.base import Identity

    with httpx.Client() as http:
        def plat(**kw: Any) -> GitHubPlatform:
            p = GitHubPlatform.from_settings({"token": "t", "repos": ["Codertocat/hello-world"], **kw}, http=http,
                                             clock=FakeClock())
            p._me = Identity("4100000001", "replyd-bot")  # what whoami caches at start
            return p

        def scope(p: GitHubPlatform, name: str, **edit: Any) -> str | None:
            body = copy.deepcopy(payload(name))
            for path, value in edit.items():
                obj = body
                *head, last = path.split("__")
                for k in head:
                    obj = obj[k]
                obj[last] = value
            event = name.split(".", 1)[0]
            [parent] = p.parse_webhook(event, body)
            return p.webhook_scope(event, body, parent)

        listed, elsewhere = plat(notifications=False), plat(repos=[], notifications=True)
        assert scope(listed, "issues.opened") is None  # Codertocat/Hello-World, folded
        assert scope(listed, "issue_comment.created") is None  # a new comment re-lists an open issue
        assert scope(listed, "issue_comment.created", issue__state="closed") == "issue_closed"
        assert scope(plat(repos=[], notifications=False), "issues.opened") == "repo_not_listed"
        assert scope(elsewhere, "issues.opened") == "not_addressed"
        assert scope(elsewhere, "issues.opened", issue__body="ping @Replyd-Bot please") is None
        assert scope(elsewhere, "issues.opened", issue__title="@replyd-bot", issue__body="") == "not_addressed"
        assert scope(elsewhere, "issues.opened", issue__body="@replyd-botter, mail x@replyd-bot") == "not_addressed"
        me = {"login": "replyd-bot", "id": 4100000001}
        assert scope(elsewhere, "issues.opened", issue__assignees=[me]) is None
        assert scope(plat(repos=[], notification_reasons=["mention"]), "issues.opened",
                     issue__assignees=[me]) == "not_addressed"
        assert scope(elsewhere, "issue_comment.created", comment__body="@replyd-bot look") is None
        assert scope(elsewhere, "issue_comment.created", comment__body="@replyd-bot look",
                     comment__user=me) == "not_addressed"  # its own comment notifies no one
        assert scope(elsewhere, "issue_comment.created", issue__body="@replyd-bot") == "not_addressed"


def test_push_without_the_api_or_the_secret_does_not_start(fake, host, env, tmp_path, monkeypatch) -> None:
    """A push bot needs the API to receive on and a secret of 16+ characters: one clear error, nothing started."""
    from replyd.errors import ConfigError

    cfg_path = _config(tmp_path, host, f"sqlite:///{tmp_path / 'r.sqlite3'}")
    monkeypatch.setenv("GH_HOOK_SECRET", "short")
    with pytest.raises(ConfigError, match="GH_HOOK_SECRET.*shorter than 16"):
        Daemon(Config.load(cfg_path)).start()
    monkeypatch.setenv("GH_HOOK_SECRET", SECRET)
    cfg_path.write_text(cfg_path.read_text().replace("enabled = true", "enabled = false"))
    with pytest.raises(ConfigError, match="push webhooks arrive through the API"):
        Daemon(Config.load(cfg_path)).start()


# -- two replicas on PostgreSQL, real processes ---------------------------------------------------

COUNTING_RESPONDER = """
import json, sys
p = json.load(sys.stdin)
with open(sys.argv[1], "a") as f:
    f.write(p["id"] + "\\n")
print("thanks, we are on it")
"""


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_every_delivery_three_times_one_reply_one_call(fake, host, env, tmp_path, pg_url) -> None:
    """Two `replyd run` processes on one PostgreSQL; every delivery sent 3× to random replicas: 1 reply, 1 call."""
    import sqlalchemy as sa

    eng = sa.create_engine(pg_url)
    with eng.begin() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors, replicas, bot_leases")
    eng.dispose()
    alice = fake.add_user("alice")
    issues = [fake.open_issue(alice, "acme/widgets", f"Widget {i} broke", "help please") for i in range(10)]
    calls, script = tmp_path / "calls.txt", tmp_path / "responder.py"
    script.write_text(COUNTING_RESPONDER)
    calls.touch()
    procs, ports = [], []
    for rid in ("a", "b"):
        port = _free_port()
        (tmp_path / rid).mkdir()
        cfg = _config(tmp_path / rid, host, pg_url, port=port)
        cfg.write_text(cfg.read_text().replace('kind = "template"', f'kind = "command"\ncommand = ["{sys.executable}", '
                                               f'"{script}", "{calls}"]'))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REPLYD_REPLICA_ID": rid}
        procs.append(subprocess.Popen([sys.executable, "-m", "replyd", "run", "--config", str(cfg), "--grace-s", "5"],
                                      env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=(tmp_path / f"{rid}.log").open("wb")))
        ports.append(port)
    try:
        with httpx.Client(timeout=5.0) as http:
            assert _wait(lambda: all(_up(http, p) for p in ports), 30), (tmp_path / "a.log").read_text()[-2000:]
            # Each replica reads its own replies back before it answers (adopting at start): until then a
            # delivery gets 503, which the platform retries. This test sends each delivery once per try.
            assert _wait(lambda: all(_ready(http, p) for p in ports), 60), (tmp_path / "a.log").read_text()[-2000:]
            sends = [delivery(fake, "issues" if i % 2 else "issue_comment", issue, n=k)
                     for i, issue in enumerate(issues) for k in range(3)]
            rng = random.Random(11)
            rng.shuffle(sends)
            codes = [http.post(f"http://127.0.0.1:{rng.choice(ports)}/v1/hooks/gh", headers=h, content=b).status_code
                     for h, b in sends]
        assert codes == [202] * len(sends)
        assert _wait(lambda: all(fake.replies(i) for i in issues), 30)
        time.sleep(1.5)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(20)
    assert [len(fake.replies(i)) for i in issues] == [1] * len(issues)
    made = Counter(calls.read_text().split())
    assert sorted(made) == sorted(str(i.id) for i in issues) and set(made.values()) == {1}, made


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(http: httpx.Client, port: int) -> bool:
    try:
        return http.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def _ready(http: httpx.Client, port: int) -> bool:
    try:
        return http.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
    except httpx.HTTPError:
        return False


# -- Discourse ------------------------------------------------------------------------------------


def _discourse() -> Any:
    """A Discourse adapter whose bot is ``replybot`` (id 7), as whoami would have found it."""
    from replyd.platforms.base import Identity
    from replyd.platforms.discourse import DiscoursePlatform

    plat = DiscoursePlatform.from_settings({"base_url": "https://forum.example", "api_key": "k" * 32,
                                            "api_username": "replybot"}, http=httpx.Client(), clock=FakeClock())
    plat._me = Identity("7", "replybot")  # what whoami caches at start
    return plat


def _post(**kw: Any) -> dict[str, Any]:
    """A recorded Discourse post (discourse_api, MIT: shared fixtures) with ``kw`` over it, as a webhook carries it."""
    from tests.fixtures_server import fixtures_dir

    post = json.loads((fixtures_dir("discourse") / "post_created.json").read_text())
    post.update(kw)
    return {"post": post}


def test_discourse_post_created_addressing_the_bot_is_a_parent() -> None:
    """A mention or a reply to the bot is the pollers' parent (post id as served); other posts are not answered."""
    plat = _discourse()
    [p] = plat.parse_webhook("post_created", _post(raw="hey @replybot, any idea?", user_id=12))
    assert (p.id, p.extra["topic_id"], p.extra["post_number"]) == ("29", 21, 1)
    reply = _post(raw="thanks", user_id=12, reply_to_post_number=3, reply_to_user={"username": "ReplyBot"})
    [q] = plat.parse_webhook("post_created", reply)
    assert q.id == "29"
    assert plat.webhook_scope("post_created", reply, q) is None and plat.webhook_scope("post_created", _post(
        raw="hey @replybot", user_id=12), p) is None
    other = _post(raw="hey @replybotter and @someone", user_id=12)
    [o] = plat.parse_webhook("post_created", other)  # a parent, outside the scope: dropped and counted
    assert plat.webhook_scope("post_created", other, o) == "not_addressed"
    for raw in ('[quote="replybot, post:3, topic:21"]\nyes\n[/quote]\nmore?',
                '[quote="Reply Bot, post:3, topic:21, username:replybot"]\nyes\n[/quote]'):
        quoted = _post(raw=raw, user_id=12)
        assert plat.webhook_scope("post_created", quoted, plat.parse_webhook("post_created", quoted)[0]) is None
    plat._types = frozenset({1})  # notification_types = ["mentioned"]: a reply or a quote notifies nothing wanted
    assert plat.webhook_scope("post_created", reply, q) == "not_addressed"
    assert plat.parse_webhook("post_created", _post(raw="@replybot note to self", user_id=7)) == "the bot's own post"
    assert plat.parse_webhook("topic_created", {"topic": {}}) == "topic_created is not answered"


def test_discourse_signature_header_is_the_one_checked() -> None:
    """A Discourse delivery is verified on X-Discourse-Event-Signature (sha256=, HMAC of the raw body)."""
    from replyd.guard import Outcome, Status
    from replyd.hooks import KINDS, Hook, Receiver
    from replyd.store import Key

    plat = _discourse()
    offered: list[str] = []
    def offer(parent, path):
        """The pipeline's offer, recorded; the answer a pipeline gives for a parent it declined."""
        offered.append(parent.id)
        return Outcome(Status.DECLINED, Key("d", "7", parent.id))

    rec = Receiver({"d": Hook("d", "discourse", SECRET, plat, offer)})
    body = json.dumps(_post(raw="@replybot help", user_id=12)).encode()
    head = {KINDS["discourse"].event: "post_created", KINDS["discourse"].delivery: "1"}
    assert rec.receive("d", {**head, "x-hub-signature-256": sign(SECRET, body)}, body).status == 401
    ok = rec.receive("d", {**head, KINDS["discourse"].signature: sign(SECRET, body)}, body)
    rec.close(wait=True)
    assert (ok.status, ok.body["parents"], offered) == (202, ["29"], ["29"])


def test_refused_deliveries_write_one_warning_a_minute_with_the_count_held_back() -> None:
    """Anyone can post forged deliveries: each is refused (and counted), but the log gets one line per event and
    minute, the next one carrying how many were held back."""
    from structlog.testing import capture_logs

    from replyd.hooks import Hook, Receiver

    clock = FakeClock()
    rec = Receiver({"d": Hook("d", "discourse", SECRET, _discourse(), lambda p, path: None)}, now=clock.now)
    with capture_logs() as logs:
        answers = [rec.receive(bot, {}, b"{}").status for bot in ("d", "nobody") for _ in range(50)]
        clock.advance(61)
        answers += [rec.receive("d", {}, b"{}").status, rec.receive(f"x{clock.now()}", {}, b"{}").status]
    rec.close(wait=True)
    assert answers == [401] * 102
    lines = [(e["event"], e.get("suppressed")) for e in logs if e["log_level"] == "warning"]
    assert lines == [("replyd.hooks.bad_signature", None), ("replyd.hooks.unknown_bot", None),
                     ("replyd.hooks.bad_signature", 49), ("replyd.hooks.unknown_bot", 49)]


def test_discourse_posts_that_notify_nobody_are_dropped_over_http(host, monkeypatch, tmp_path, capfd) -> None:
    """A Discourse webhook sends every post of the forum: over HTTP, correctly signed, a post that neither
    mentions, quotes nor replies to the bot is acked 202 and dropped (logged, counted), nothing is posted on it;
    a mention and a reply to the bot are answered once each."""
    from tests.fakes_forum import FakeDiscourse

    fake = FakeDiscourse(FakeClock(time.time()))
    host.fake = fake
    alice = fake.add_user("alice")
    chatter = fake.create_topic(alice, "Lunch", "anyone for lunch? (not for @replybotter)")
    asked = fake.create_topic(alice, "Help", "hey @replybot, any idea?")
    bot_post = fake.reply(fake.bot, asked.topic_id, "try turning it off and on")
    thanks = fake.reply(alice, asked.topic_id, "that worked", reply_to=bot_post.post_number)
    monkeypatch.setenv("DC_KEY", FakeDiscourse.API_KEY)
    monkeypatch.setenv("DC_HOOK_SECRET", SECRET)
    cfg = _config(tmp_path, host, f"sqlite:///{tmp_path / 'r.sqlite3'}")
    text = cfg.read_text()
    text = text[:text.index("[[bots]]")] + f"""[[bots]]
name = "dc"
platform = "discourse"

[bots.settings]
base_url = "{host.url}"
api_key_env = "DC_KEY"
api_username = "replybot"
listing_delay_s = 0.5

[bots.pollers]
inbox_interval_s = 0
refind_interval_s = 0

[bots.push]
kind = "discourse"
secret_env = "DC_HOOK_SECRET"

[bots.responder]
kind = "template"
"""
    cfg.write_text(text)
    d = Daemon(Config.load(cfg))
    d.start()
    try:
        url = f"{d.api.url}/v1/hooks/dc"
        before = scraped(d.api.url, "replyd_webhook_dropped_total", platform="dc", reason="not_addressed")
        with httpx.Client(timeout=5.0) as http:
            got = []
            for post in (chatter, asked, thanks):
                raw = json.dumps({"post": fake._post_json(post, raw=True)}).encode()
                got.append(http.post(url, content=raw, headers={
                    "X-Discourse-Event": "post_created", "X-Discourse-Event-Id": str(post.id),
                    "X-Discourse-Event-Signature": sign(SECRET, raw), "Content-Type": "application/json"}))
        assert [(r.status_code, r.json().get("dropped"), r.json()["accepted"]) for r in got] == [
            (202, ["not_addressed"], 0), (202, None, 1), (202, None, 1)]
        assert _wait(lambda: fake.replies(asked.id) and fake.replies(thanks.id))
        time.sleep(1.0)
        after = scraped(d.api.url, "replyd_webhook_dropped_total", platform="dc", reason="not_addressed")
    finally:
        d.stop(grace_s=5)
        host.fake = None
    assert [len(fake.replies(p.id)) for p in (chatter, asked, thanks)] == [0, 1, 1]
    assert after - before == 1
    out, err = capfd.readouterr()
    assert [(e["bot"], e["reason"], e["parent_id"]) for e in dropped_lines(out + err)] == [
        ("dc", "not_addressed", str(chatter.id))]


def test_an_api_without_hooks_answers_like_a_bad_signature(tmp_path) -> None:
    """POST /v1/hooks/<bot> of an API serving no webhooks at all: the same 401 and body as a forged delivery to a
    real bot, so the answer tells nothing of what is configured."""
    from replyd.api import Api, ApiServer
    from replyd.hooks import BAD_SIGNATURE
    from replyd.store import Store

    store = Store.open(f"sqlite:///{tmp_path / 'r.sqlite3'}")
    api = Api(store, {}, expected=[])
    try:
        with ApiServer(api.app) as srv, httpx.Client(base_url=srv.url, timeout=5.0) as c:
            r = c.post("/v1/hooks/gh", content=b"{}", headers={"X-Hub-Signature-256": sign(SECRET, b"{}")})
    finally:
        store.dispose()
    assert (r.status_code, r.json()) == (BAD_SIGNATURE.status, BAD_SIGNATURE.body)
