"""Network rules in one place: which hosts are loopback, when a token may travel in clear, how long it must be.

The API, MCP, the platforms, the responders and the config all ask these. The module imports only the
standard library and ``replyd.errors``, so any layer may use it.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from replyd.errors import ConfigError

# Characters: a token guarding a non-loopback bind must not be guessable (the API and MCP check it).
MIN_PUBLIC_TOKEN = 32

INSECURE_HTTP = "allow_insecure_http"  # the setting that lets a token travel over plain http:// to another host


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name or address is public."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def require_https(url: str, *, allowed: bool, where: str) -> None:
    """Refuse (ConfigError) ``http://`` to a non-loopback host unless ``allowed``: the token would travel in clear."""
    parts = urlsplit(url)
    if parts.scheme == "http" and not allowed and not is_loopback(parts.hostname or ""):
        raise ConfigError(f"{where}: http:// to {parts.hostname!r} would send credentials in clear text: "
                          f"use https://, or set {INSECURE_HTTP} = true if the network is trusted")
