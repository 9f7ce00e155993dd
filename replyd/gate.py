"""The door of replyd's HTTP servers: which ``Host`` names and which bearer token a request must carry.

The Host rule stops DNS rebinding (a web page whose name resolves to this
machine talks to a local server as if same-origin): a request is served only
when its ``Host`` names the address the server is bound to, a name the
operator configured (``allowed_hosts``: what clients and proxies use), or, on
a loopback bind only, a loopback name (``localhost``, ``127.0.0.1``, ``::1``).
The port in the header is not compared: a proxy may forward another one.

``host_allowed`` and ``bearer_ok`` are plain functions so every server
(``replyd mcp``, the sidecar API) applies the same rule.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from replyd.errors import ConfigError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name or address is public."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _name(host: str) -> str:
    """Normalise a host name or address: lower case, no brackets, no trailing dot."""
    return host.strip().strip("[]").rstrip(".").lower()


def hostname(header: str) -> str:
    """Return the name part of a ``Host`` header value (``[::1]:8080`` -> ``::1``, ``a.b:443`` -> ``a.b``)."""
    h = header.strip()
    if h.startswith("["):
        return _name(h[1:].partition("]")[0])
    if h.count(":") == 1:
        h = h.partition(":")[0]
    return _name(h)


def allowed_hosts(bind: str, names: Iterable[str] = (), *, what: str = "allowed_hosts") -> frozenset[str]:
    """Return the Host names a server bound to ``bind`` accepts; ConfigError when none could match.

    A wildcard bind (``0.0.0.0``, ``::``) has no name of its own, so it needs
    configured ``names``; a loopback bind also accepts every loopback name.
    """
    out = {hostname(n) for n in names if n.strip()}
    bound = _name(bind)
    if bound in WILDCARDS:
        if not out:
            raise ConfigError(f"{what}: the server binds {bind or 'every address'!r}, which is no name a client "
                              "sends: list the names clients use to reach it (e.g. [\"replyd.internal\"])")
    else:
        out.add(bound)
    if is_loopback(bound):
        out |= LOOPBACK_NAMES
    return frozenset(out)


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """True when the ``Host`` header value names one of ``allowed`` (any port); a missing header is refused."""
    if not header:
        return False
    return hostname(header) in allowed


def bearer_ok(authorization: str | None, token: str) -> bool:
    """True when an ``Authorization`` header carries ``Bearer <token>`` (compared in constant time)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode())
