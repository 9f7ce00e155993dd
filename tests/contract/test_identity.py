"""Adapter contract: who the bot is, resolving references to served parents, and settings errors."""

from __future__ import annotations

import httpx
import pytest
from structlog.testing import capture_logs

from replyd.clock import FakeClock
from replyd.errors import ConfigError, DefinitelyNotSent, PlatformError
from replyd.platforms.base import Platform, make_platform, registered_kinds
from tests.contract.harnesses import Harness, tag


def test_whoami_is_the_platform_stable_id(harness: Harness) -> None:
    """whoami's sender id is the bot's id exactly as the platform serves it, the same on every call."""
    adapter = harness.adapter()
    assert isinstance(adapter, Platform)
    first = adapter.whoami()
    assert first.sender_id == harness.bot_id()
    assert harness.adapter().whoami() == first


def test_made_by_kind_with_no_secret_in_repr(harness: Harness) -> None:
    """The adapter is registered under its kind, built by make_platform, and its repr shows no secret."""
    assert harness.kind in registered_kinds()
    adapter = harness.adapter()
    assert adapter.kind == harness.kind
    for value in harness.settings().values():
        if isinstance(value, str) and len(value) >= 8 and "://" not in value and ":" not in value[:10]:
            assert value not in repr(adapter)


def test_whoami_unreachable_is_definitely_not_sent(harness: Harness) -> None:
    """Asking who the bot is of a server that refuses connections is DefinitelyNotSent (retried later)."""
    with pytest.raises(DefinitelyNotSent):
        harness.unreachable().whoami()


def test_resolve_every_reference_gives_the_served_parent(harness: Harness) -> None:
    """Each reference form the platform has (URL, served id, short form) resolves to one parent in served form."""
    adapter = harness.adapter()
    post = harness.post(f"{tag()} please help")
    for ref in post.refs:
        parent = harness.eventually(lambda ref=ref: adapter.resolve(ref), lambda p: p.id == post.id)
        assert (parent.id, parent.author_id) == (post.id, post.author_id), ref
        assert isinstance(parent.id, str)


def test_bad_settings_name_the_key(harness: Harness) -> None:
    """Every bad setting is one ConfigError line naming ``<kind> setting '<key>'``; no secret is echoed."""
    assert harness.bad_settings, "a harness lists at least one bad setting"
    with httpx.Client(trust_env=False) as http:
        for settings, key in harness.bad_settings:
            with pytest.raises(ConfigError) as err:
                make_platform(harness.kind, settings, http=http, clock=FakeClock())
            message = str(err.value)
            assert f"{harness.kind} setting '{key}'" in message, (settings, message)
            assert "\n" not in message
            assert "SECRET" not in message, message


def test_secret_never_in_errors_logs_or_repr(harness: Harness) -> None:
    """No error, log line or repr carries the bot's credential, even when the server echoes it back."""
    secret = harness.secret()
    adapter = harness.adapter()
    parent = harness.parent(adapter)
    key = harness.provider_key(adapter, parent.id)
    errors: list[PlatformError] = []
    with capture_logs() as logs:
        for status in (422, 500, 429, 401):
            harness.echo_secret(status)
            try:
                adapter.send(parent, "hi", provider_key=key)
            except PlatformError as exc:
                errors.append(exc)
            else:  # only a 401 may be retried to success (Bluesky refreshes its session, then sends)
                assert status == 401, f"a {status} answer was taken for a created reply"
            harness.clock.advance(120)  # past any wait the 429 set
        harness.fail_next_send("lost")
        try:
            adapter.send(parent, "hi", provider_key=key)
        except PlatformError as exc:
            errors.append(exc)
        with pytest.raises(PlatformError) as err:
            harness.unreachable().send(parent, "hi", provider_key=key)
        errors.append(err.value)
        harness.echo_secret(401, every_request=True)
        with pytest.raises(PlatformError) as err:
            harness.adapter().whoami()
        errors.append(err.value)
    for e in errors:
        assert secret not in str(e) and secret not in repr(e) and secret not in e.detail, e
        # A chained httpx exception would drag frames holding raw header bytes into tracebacks.
        assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), e
    assert secret not in repr(adapter)
    # The objects a log line or a debugger might print (auth, settings, clients) mask it; a bare str field
    # holding the credential for the next request is not printed by anything.
    assert all(secret not in repr(v) for v in vars(adapter).values() if not isinstance(v, str))
    assert logs and secret not in repr(logs)
