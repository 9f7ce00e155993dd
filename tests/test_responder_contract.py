"""The responder contract, run over every kind: a reply, a decline, a timeout, a failure, bad settings, secrets.

Each kind meets a real backend (a child process, a local HTTP server, a
function) that answers, declines, stalls or fails on demand; every call goes
through ``ResponderRunner`` as the guard's does. A kind that cannot do one of
these (a template never fails) is left out of that test only. A new kind with
a settings model must be added to ``CASES`` (``test_every_kind_is_in_the_suite``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from structlog.testing import capture_logs

from replyd import log as rlog
from replyd.errors import ConfigError, ResponderError
from replyd.platforms.base import Parent
from replyd.responders import (
    CommandSettings,
    FunctionResponder,
    OpenAISettings,
    Responder,
    ResponderRunner,
    ResponderSettings,
    TemplateSettings,
    WebhookSettings,
    make_responder,
    responder_kinds,
)
from tests.fixtures_server import FixtureServer, Recorded, Reply, fixture_server, fixture_server_session  # noqa: F401

CHILD = str(Path(__file__).with_name("responder_child.py"))
PARENT = Parent(id="4711", author_id="42", author_handle="alice@example.social", text="Is the ferry running? ✓",
                url="https://example.social/@alice/4711")
REPLY = f"hi @{PARENT.author_handle}: {PARENT.text}"  # what every kind answers when asked for text
OWN_TIMEOUT_S = 1.5  # each kind's own timeout_s when it stalls (the runner's bound stays well above it)
COMPLETIONS = "/v1/chat/completions"


def secret_of(kind: str) -> str:
    """A secret only this kind's tests hold (so one kind's masking never hides another's leak)."""
    return f"LEAK-{kind}-5e1f0a9b7c3d2e8f"


@dataclass
class Built:
    """A responder wired to a backend doing one behaviour, and how many times that backend was reached."""

    responder: Responder
    calls: Callable[[], int]
    runner_timeout_s: float = 10.0
    secrets: list[str] = field(default_factory=list)  # secret values in play: none may show in an error or log


def _function(behaviour: str, server: FixtureServer, tmp: Path, env: pytest.MonkeyPatch) -> Built:
    """A library function: returns, declines, stalls (bounded by the runner) or raises quoting a secret."""
    calls: list[str] = []
    secret = secret_of("function")
    rlog.add_secret(secret)  # as the config loader registers every *_env value

    async def fn(parent: Parent) -> str | None:
        """Do ``behaviour`` for ``parent``."""
        calls.append(parent.id)
        if behaviour == "text":
            return f"hi @{parent.author_handle}: {parent.text}"
        if behaviour == "slow":
            await asyncio.sleep(30)
        if behaviour == "fail":
            raise RuntimeError(f"fatal: quota exhausted,\nkey {secret}")
        return None

    return Built(FunctionResponder(fn), lambda: len(calls), runner_timeout_s=OWN_TIMEOUT_S, secrets=[secret])


def _template(behaviour: str, server: FixtureServer, tmp: Path, env: pytest.MonkeyPatch) -> Built:
    """A template over the parent's fields (it can only answer)."""
    return Built(make_responder("template", {"template": "hi @{author_handle}: {text}"}), lambda: 1)


def _command(behaviour: str, server: FixtureServer, tmp: Path, env: pytest.MonkeyPatch) -> Built:
    """The test child program; a shell line in front counts each start, then becomes the child.

    Failing, the child quotes a secret it got through ``env_pass`` (never its argv, which the responder holds).
    """
    starts = tmp / "starts"
    secret = secret_of("command")
    rlog.add_secret(secret)  # as the config loader registers every *_env value
    env.setenv("CONTRACT_SECRET", secret)
    mode = {"text": ["greet"], "decline": ["write", ""], "slow": ["sleep", str(tmp / "pids")], "fail": ["fail", "3"]}
    quote = ' "fatal: quota exhausted,\nkey $CONTRACT_SECRET"' if behaviour == "fail" else ""
    argv = ["/bin/sh", "-c", f'echo . >> "$0"; exec "$@"{quote}', str(starts), sys.executable, "-I", CHILD,
            *mode[behaviour]]
    r = make_responder("command", {"command": argv, "env_pass": ["CONTRACT_SECRET"],
                                   "timeout_s": OWN_TIMEOUT_S if behaviour == "slow" else 20})
    return Built(r, lambda: len(starts.read_text().split()) if starts.exists() else 0, secrets=[secret])


def _webhook(behaviour: str, server: FixtureServer, tmp: Path, env: pytest.MonkeyPatch) -> Built:
    """A webhook on the local fixture server, signed, with a bearer header the server echoes when it fails."""
    secret, bearer = secret_of("webhook"), "hook-bearer-LEAK-99f0e1"

    def answer(rec: Recorded) -> Reply:
        """Answer as ``behaviour`` says, built from the parent the request carried."""
        doc = json.loads(rec.body)
        return {"text": Reply(body={"text": f"hi @{doc['author_handle']}: {doc['text']}"}),
                "decline": Reply(status=204),
                "slow": Reply(body={"text": "late"}, delay_s=6),
                "fail": Reply(status=500, body={"error": f"fatal: quota exhausted,\nkey {secret} "
                                                         f"for {rec.headers.get('authorization')}"})}[behaviour]

    server.route("POST", "/hook", answer)
    settings = {"url": f"{server.url}/hook", "hmac_secret": secret, "headers": {"Authorization": f"Bearer {bearer}"}}
    if behaviour == "slow":
        settings["timeout_s"] = OWN_TIMEOUT_S
    return Built(make_responder("webhook", settings), lambda: len(server.requests_to("POST", "/hook")),
                 secrets=[secret, bearer])


def _openai(behaviour: str, server: FixtureServer, tmp: Path, env: pytest.MonkeyPatch) -> Built:
    """A chat completions endpoint that answers with the user message it got (the prompt template's output)."""
    key = secret_of("openai")

    def answer(rec: Recorded) -> Reply:
        """Answer as ``behaviour`` says; a failure quotes the Authorization header, key included."""
        user = json.loads(rec.body)["messages"][1]["content"]
        content = {"text": user, "decline": None, "slow": "late"}.get(behaviour)
        if behaviour == "fail":
            return Reply(status=500, body={"error": {"message": f"fatal: quota exhausted,\nkey "
                                                                f"{rec.headers['authorization']}"}})
        return Reply(body={"choices": [{"message": {"role": "assistant", "content": content},
                                        "finish_reason": "stop"}]}, delay_s=6 if behaviour == "slow" else 0)

    server.route("POST", COMPLETIONS, answer)
    settings = {"base_url": f"{server.url}/v1", "model": "m", "api_key": key,
                "prompt_template": "hi @{author_handle}: {text}"}
    if behaviour == "slow":
        settings["timeout_s"] = OWN_TIMEOUT_S
    return Built(make_responder("openai", settings), lambda: len(server.requests_to("POST", COMPLETIONS)),
                 secrets=[key])


@dataclass
class Case:
    """One kind: how to build it per behaviour, what it can do, its settings model and settings that build."""

    build: Callable[[str, FixtureServer, Path, pytest.MonkeyPatch], Built]
    can: frozenset[str]  # of "decline", "slow", "fail" ("text" every kind can)
    model: type[ResponderSettings] | None = None  # None: not configurable (the function adapter)
    valid: dict[str, Any] = field(default_factory=dict)
    timeout_says: str = ""  # what its timeout error says besides the time


EVERYTHING = frozenset({"decline", "slow", "fail"})
CASES = {
    "function": Case(_function, EVERYTHING, timeout_says="no answer within"),
    "template": Case(_template, frozenset(), TemplateSettings),
    "command": Case(_command, EVERYTHING, CommandSettings, {"command": [sys.executable]}, "(killed)"),
    "webhook": Case(_webhook, EVERYTHING, WebhookSettings, {"url": "https://example.com/hook"}, "not retried"),
    "openai": Case(_openai, EVERYTHING, OpenAISettings, {"base_url": "http://127.0.0.1:1/v1", "model": "m"},
                   "not retried"),
}
CONFIGURABLE = [k for k, c in CASES.items() if c.model is not None]


def able(behaviour: str) -> list[str]:
    """The kinds that can do ``behaviour``."""
    return [k for k, c in CASES.items() if behaviour in c.can]


def call(built: Built) -> str | None:
    """Call the responder once through a ResponderRunner, as the guard does, and close it."""
    runner = ResponderRunner(built.responder, timeout_s=built.runner_timeout_s, name=type(built.responder).__name__)
    try:
        return runner(PARENT)
    finally:
        runner.close()


def error_of(built: Built) -> str:
    """Call expecting a ResponderError; return its message, checked to be one line."""
    with pytest.raises(ResponderError) as ei:
        call(built)
    msg = str(ei.value)
    assert "\n" not in msg and 0 < len(msg) < 400, msg
    return msg


def setting_error(kind: str, settings: dict[str, Any]) -> str:
    """Build expecting a ConfigError; return its message, checked to be one line about the responder."""
    with pytest.raises(ConfigError) as ei:
        make_responder(kind, settings)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("responder"), msg
    return msg


def test_every_kind_is_in_the_suite():
    """Every kind with a settings model is registered and has a case here, with settings that build."""
    def kinds(cls: type[ResponderSettings]) -> set[str]:
        """The kinds replyd ships among ``cls``'s subclasses (a test's own kind is not one)."""
        own = {sub.kind for sub in cls.__subclasses__()
               if "kind" in sub.__dict__ and sub.__module__.startswith("replyd.responders.")}
        return own.union(*(kinds(sub) for sub in cls.__subclasses__()))

    assert kinds(ResponderSettings) == set(CONFIGURABLE)
    assert set(CONFIGURABLE) <= set(responder_kinds())
    for kind in CONFIGURABLE:
        assert make_responder(kind, CASES[kind].valid)


@pytest.fixture
def built_for(fixture_server: FixtureServer, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], Built]:
    """Build a kind wired to a backend doing a behaviour (this test's server routes, directory and environment)."""
    return lambda kind, behaviour: CASES[kind].build(behaviour, fixture_server, tmp_path, monkeypatch)


@pytest.mark.parametrize(("kind", "behaviour", "want"), [(k, "text", REPLY) for k in CASES]
                         + [(k, "decline", None) for k in able("decline")])
def test_returns_text_or_nothing(kind: str, behaviour: str, want: str | None, built_for: Callable[[str, str], Built]):
    """Asked for text, the reply built from the parent; a backend that declines, None (not an error); one call."""
    built = built_for(kind, behaviour)
    assert call(built) == want
    assert built.calls() == 1


@pytest.mark.parametrize("kind", able("slow"))
def test_times_out(kind: str, built_for: Callable[[str, str], Built]):
    """A stalled backend is a one-line ResponderError naming the bound; the backend was reached once, not retried."""
    built = built_for(kind, "slow")
    msg = error_of(built)
    assert f"{OWN_TIMEOUT_S:g} s" in msg and CASES[kind].timeout_says in msg, msg
    assert built.calls() == 1


@pytest.mark.parametrize("kind", able("fail"))
def test_fails_with_a_clear_one_line_error(kind: str, built_for: Callable[[str, str], Built]):
    """A failing backend (its error over two lines) is a one-line ResponderError naming the kind, in its words."""
    built = built_for(kind, "fail")
    msg = error_of(built)
    assert msg.lower().startswith(kind) or msg.startswith(type(built.responder).__name__), msg
    assert "quota exhausted" in msg
    assert built.calls() == 1


@pytest.mark.parametrize("kind", able("fail"))
def test_secrets_never_in_errors_or_logs(kind: str, built_for: Callable[[str, str], Built],
                                         fixture_server: FixtureServer, caplog: pytest.LogCaptureFixture):
    """A backend quoting the secrets back in its error: none reaches the error, the responder's repr or any log."""
    for name in ("", "httpx", "httpcore", "stamina"):
        caplog.set_level(logging.DEBUG, logger=name or None)
    with capture_logs() as logs:
        built = built_for(kind, "fail")
        msg = error_of(built)
    assert built.secrets
    sent = [json.dumps(r.headers) for r in fixture_server.requests]
    for secret in built.secrets:
        shown = (msg, repr(built.responder), repr(vars(built.responder)), json.dumps(logs, default=str), caplog.text)
        assert not [blob for blob in shown if secret in blob]
    if sent:  # an HTTP kind: the bearer did travel, to the server only
        assert any(s in h for s in built.secrets for h in sent)


@pytest.mark.parametrize("kind", CONFIGURABLE)
def test_unknown_setting_is_one_line_naming_kind_and_key(kind: str):
    """An unknown key names itself and the kind, and lists the known keys (or the one it is a misspelling of)."""
    msg = setting_error(kind, {**CASES[kind].valid, "bogus_key": 1})
    assert f"unknown setting(s) ['bogus_key'] for kind '{kind}' (known: " in msg and "timeout_s" in msg
    assert setting_error(kind, {**CASES[kind].valid, "timeout": 5}).endswith("(did you mean timeout_s?)")


@pytest.mark.parametrize(("kind", "key"), [(k, f) for k in CONFIGURABLE for f in CASES[k].model.model_fields])
def test_wrong_type_for_any_setting_names_the_key(kind: str, key: str):
    """A value of the wrong type for any setting is one line naming ``responder.<key>`` and the type it got."""
    msg = setting_error(kind, {**CASES[kind].valid, key: [{"x": 1}]})
    assert msg.startswith(f"responder.{key}") and "got" in msg, msg


@pytest.mark.parametrize(("kind", "key"), [(k, f) for k in CONFIGURABLE
                                           for f, info in CASES[k].model.model_fields.items() if info.is_required()])
def test_missing_required_setting_names_the_key(kind: str, key: str):
    """A required setting left out is one line ``responder.<key>: required``."""
    settings = {k: v for k, v in CASES[kind].valid.items() if k != key}
    assert setting_error(kind, settings).startswith(f"responder.{key}: required")


@pytest.mark.parametrize("kind", CONFIGURABLE)
@pytest.mark.parametrize("bad", [0, -1, 3601, True, "30", float("nan")], ids=repr)
def test_timeout_is_checked_for_every_kind(kind: str, bad: Any):
    """timeout_s is a number of seconds in (0, 3600] for every kind: not a string, not a bool."""
    assert setting_error(kind, {**CASES[kind].valid, "timeout_s": bad}).startswith("responder.timeout_s: ")


@pytest.mark.parametrize(("kind", "key"), [(k, f) for k in CONFIGURABLE
                                           for f, info in CASES[k].model.model_fields.items()
                                           if info.annotation in (SecretStr, SecretStr | None)])
def test_secret_settings_never_in_setting_errors(kind: str, key: str):
    """With a secret set, no setting error shows it: not its own wrong type, not another key's problem."""
    numeric = 98765432109876543210  # a secret written as a number (TOML without quotes)
    assert str(numeric) not in setting_error(kind, {**CASES[kind].valid, key: numeric})
    secret = secret_of(kind) + "-settings"
    for problem in ({"timeout_s": "x"}, {"bogus_key": 1}, {"timeout_s": 0}):
        assert secret not in setting_error(kind, {**CASES[kind].valid, key: secret, **problem})
