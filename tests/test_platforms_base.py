"""The shared adapter base (``replyd.platforms._http.HttpPlatform``): read-back skeleton, secrets, settings errors."""

from __future__ import annotations

import httpx
import pytest

from replyd.clock import FakeClock
from replyd.errors import ConfigError, DefinitelyNotSent, RateLimited
from replyd.platforms import _http
from replyd.platforms.base import OwnReply, Parent, Pending, Token

SECRET = "tok-BASE-0123456789"


class Plain(_http.HttpPlatform):
    """The smallest HTTP adapter: a URL and a token, nothing platform-specific."""

    kind = "plain"

    class Settings(_http.HttpSettings):
        """A base URL and a token."""

        base_url: _http.Url
        token: Token


def make() -> Plain:
    """An adapter that never sends a request in these tests."""
    return Plain(base_url="https://plain.example/", token=SECRET, http=httpx.Client(), clock=FakeClock(1000.0))


def pending(*ids: str) -> list[Pending]:
    """Open rows for parents ``ids``, opened at 1000."""
    return [Pending(parent=Parent(id=i, author_id="a"), opened_at=1000.0) for i in ids]


def test_rate_limited_fallback_stops_the_rest_other_errors_skip_one() -> None:
    """A RateLimited fallback ends the pass (nothing after it is read); any other error skips only its parent."""
    p = make()
    asked: list[str] = []

    def fallback(pid: str, _: list[str], found: _http.Found) -> bool:
        asked.append(pid)
        if pid == "2":
            raise DefinitelyNotSent("read failed")
        if pid == "3":
            raise RateLimited("429", retry_after_s=5.0)
        return True

    rb = p._read_back(pending("1", "2", "3", "4"), feed=None, fallback=fallback)
    assert asked == ["1", "2", "3"]
    assert rb.checked == {"1"}


def test_found_replies_oldest_first_ties_by_id_order() -> None:
    """Replies found at the same time sort by id_order (shorter numeric id first), not by the raw string."""
    p = make()

    def feed(opened: dict[str, float], found: _http.Found) -> set[str]:
        for rid in ("10", "9", "100"):
            found.setdefault("1", {})[rid] = OwnReply(rid, "1", 1005.0)
        found["1"]["5"] = OwnReply("5", "1", 1006.0)
        return set(opened)

    rb = p._read_back(pending("1"), feed=feed, fallback=lambda *a: True)
    assert [r.reply_id for r in rb.found["1"]] == ["9", "10", "100", "5"]
    assert rb.checked == {"1"}


def test_secret_auth_sets_the_header_and_shows_nothing() -> None:
    """SecretAuth puts the token on the request; repr of the adapter and its auth never show it."""
    p = make()
    request = httpx.Request("GET", "https://plain.example/x")
    sent = next(p._auth.auth_flow(request))
    assert sent.headers["Authorization"] == f"Bearer {SECRET}"
    assert SECRET not in repr(p) + repr(p._auth) + repr(p.s)
    assert p._secrets() == (SECRET,)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"base_url": "https://x", "token": SECRET, "tokn": 1}, "plain setting 'tokn': unknown key (known: "),
        ({"base_url": "https://x", "token": SECRET + " x"}, "plain setting 'token': contains whitespace"),
        ({"base_url": "http://example.org", "token": SECRET}, "plain setting 'base_url': http:// to 'example.org'"),
        ({"base_url": "https://x", "token": SECRET, "timeout_s": "5"}, "plain setting 'timeout_s': "),
    ],
)
def test_settings_errors_are_one_line_naming_the_key(settings: dict[str, object], expected: str) -> None:
    """Each bad setting is one ConfigError line starting "<kind> setting '<key>'", never echoing the secret."""
    with pytest.raises(ConfigError) as err:
        Plain.from_settings(settings, http=httpx.Client(), clock=FakeClock())
    text = str(err.value)
    assert text.startswith(expected) and "\n" not in text and SECRET not in text
