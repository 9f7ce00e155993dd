"""The sidecar HTTP API: agents in any language post through ``Guard.post``; operators look and steer.

Endpoints (the OpenAPI document at ``/openapi.json`` is the contract):

=======================================================  ==========================================
``POST /v1/replies``                                      resolve the parent, post at most once
``GET  /v1/replies/{platform}/{parent_id}``               a key's row and history
``POST /v1/replies/{platform}/{parent_id}/rearm``         rejected/gave_up/declined -> released
``GET  /v1/status``                                       counts, oldest open rows, recent events
``GET  /healthz`` ``/readyz`` ``/metrics`` ``/``          liveness, readiness, Prometheus, status page
=======================================================  ==========================================

Auth: with a token configured, every route but ``/healthz`` needs
``Authorization: Bearer <token>``; ``/readyz`` and ``/metrics`` can be opened
for probes and scrapers by ``api.open_routes``. Writes always need the token
(no configured token: writes are refused with 403, reads are open, and only a
loopback bind is allowed). A browser may send the token as a Basic password for
reads (the page asks for it), never for writes, so a cached Basic login cannot
be used for cross-site writes; a write must also be ``application/json``.
A non-loopback bind needs a token of at least ``MIN_PUBLIC_TOKEN`` characters.

Host: a request whose ``Host`` names neither an IP address, ``localhost``,
the bind address nor one of ``api.hosts`` is refused with 400 before anything
else, so a web page cannot read the API through DNS rebinding. Every answer
carries a Content-Security-Policy, ``X-Frame-Options: DENY`` and
``X-Content-Type-Options: nosniff``.

Nothing here posts by itself: every reply goes through ``library.submit``,
which resolves the parent through the adapter and calls ``Guard.post``.
"""

from __future__ import annotations

from dataclasses import dataclass

from replyd.api.answers import outcome_response, row_dict
from replyd.api.app import Api
from replyd.api.gate import MIN_PUBLIC_TOKEN, OPENABLE_ROUTES, HostCheck, check_bind, host_name
from replyd.api.models import ReplyIn
from replyd.api.openapi import openapi_document
from replyd.net import is_loopback
from replyd.serve import ThreadedServer

__all__ = ["MIN_PUBLIC_TOKEN", "OPENABLE_ROUTES", "Api", "ApiServer", "HostCheck", "ReplyIn", "check_bind",
           "host_name", "is_loopback", "openapi_document", "outcome_response", "row_dict"]


@dataclass(eq=False)
class ApiServer(ThreadedServer):
    """The API's server: ``serve.ThreadedServer`` named ``api`` (errors read ``api: cannot listen on ...``)."""

    name: str = "api"
