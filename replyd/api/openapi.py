"""The routes the API serves, and its OpenAPI 3.1 document generated from them and the body models."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from replyd.api.gate import OPENABLE_ROUTES
from replyd.api.models import (RESPONSES, Confirmed, ConfirmIn, Error, Health, Outcome, PostOutcome, Ready, Rearmed,
                               RearmedMany, RearmIn,
                               ReplyHistory, ReplyIn, StatusSummary)

HEADERS = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}},
    "WWW-Authenticate": {"description": "The auth challenge.", "schema": {"type": "string"}},
}
PARAMETERS = {
    "platform": "A bot's name, or its platform instance when that contains no '/'.",
    "parent_id": "The parent id exactly as stored (percent-encode '/').",
    "bot": "The bot the webhook is for.",
}
SECURITY_SCHEMES = {
    "bearerAuth": {"type": "http", "scheme": "bearer",
                   "description": "The token in the environment variable named by api.token_env."},
    "basicAuth": {"type": "http", "scheme": "basic",
                  "description": "Reads only: any user name, the token as password (for browsers)."},
}


@dataclass(frozen=True)
class Answer:
    """One documented status of a route: a body model, or a media type whose body is text (or any JSON object)."""

    description: str
    body: type[BaseModel] | str = Error
    headers: tuple[str, ...] = ()  # names in HEADERS

    def document(self) -> dict[str, Any]:
        """This answer as an OpenAPI response object."""
        if isinstance(self.body, str):
            schema = {"type": "object"} if self.body == "application/json" else {"type": "string"}
            out: dict[str, Any] = {"description": self.description, "content": {self.body: {"schema": schema}}}
        else:
            out = {"description": self.description, "content": {"application/json": {"schema": {
                "$ref": f"#/components/schemas/{self.body.__name__}"}}}}
        if self.headers:
            out["headers"] = {h: HEADERS[h] for h in self.headers}
        return out


@dataclass(frozen=True)
class Op:
    """One route: where, which ``Api`` method serves it, who may call it, and what it answers."""

    method: str
    path: str  # Starlette's form: ``{parent_id:path}`` matches ids with '/'
    handler: str
    operation_id: str | None  # None: served, not in the document (webhooks are the platforms' contract, not ours)
    summary: str
    access: Literal["write", "read", "open"]  # open: no token ever; read/write: see gate.Gate
    answers: dict[int, Answer] = field(default_factory=dict)
    request: type[BaseModel] | None = None

    @property
    def doc_path(self) -> str:
        """The path as OpenAPI writes it (no converters)."""
        return re.sub(r"\{(\w+):\w+\}", r"{\1}", self.path)


UNAUTHORIZED = Answer("Missing or invalid credentials.", headers=("WWW-Authenticate",))
WRITES_DISABLED = Answer("Writes are disabled: no API token is configured.")
NO_ROW = Answer("Unknown bot/platform, or no row for this parent.")
STORE_DOWN = Answer("The store is unavailable.", headers=("Retry-After",))
TEXT = "text/plain"
HTML = "text/html"

# In matching order: the rearm route before the row route, whose parent id may contain "/" (Bluesky URIs).
ROUTES: tuple[Op, ...] = (
    Op("POST", "/v1/replies", "post_reply", "postReply",
       "Resolve the parent through the adapter and post the reply at most once.", "write", {
           200: Answer("Already answered: reply_id is the existing reply; nothing sent.", PostOutcome),
           201: Answer("Posted by this call: reply_id is the new reply.", PostOutcome),
           202: Answer("In flight or uncertain: another call holds the key, or this send may have landed; the sweep "
                       "decides. Do not retry with other text.", PostOutcome),
           400: Answer("The body is not valid JSON."),
           403: WRITES_DISABLED,
           404: Answer("Unknown bot/platform, or the platform does not know the parent; nothing sent."),
           409: Answer("Rejected by the platform, given up, or declined: terminal until an operator rearms the key "
                       "(or an ambiguous platform instance: Error).", Outcome),
           413: Answer("The body is too large."),
           415: Answer("The body is not application/json."),
           422: Answer("The body is not a valid request; field names the first bad field."),
           429: Answer("Not sent: the platform rate-limits (or the key backs off); retry after Retry-After.", Outcome,
                       ("Retry-After",)),
           502: Answer("The parent could not be resolved through the platform; nothing sent."),
           503: Answer("Not sent: the store is unavailable or busy (Error body), the daemon is shutting down, or the "
                       "platform refused before acting.", Outcome, ("Retry-After",)),
       }, request=ReplyIn),
    Op("POST", "/v1/hooks/{bot}", "hook", None, "A signed webhook delivery.", "open"),
    Op("GET", "/v1/hooks/{bot}", "hook_challenge", None, "A webhook verification handshake (Meta's hub.challenge).",
       "open"),
    Op("POST", "/v1/replies/{platform}/{parent_id:path}/rearm", "rearm", "rearmReply",
       "Operator: move a rejected, gave_up or declined key to released (event rearmed).", "write", {
           200: Answer("Rearmed: the next post may claim the key.", Rearmed),
           403: WRITES_DISABLED,
           404: NO_ROW,
           409: Answer("The key is not in a rearmable state (state says which it is in)."),
           503: STORE_DOWN,
       }),
    Op("POST", "/v1/replies/{platform}/{parent_id:path}/confirm", "confirm", "confirmReply",
       "Operator: mark an unconfirmed key answered (closed, event confirmed): its reply was seen on the platform.",
       "write", {
           200: Answer("Confirmed: the key is closed and will not be answered again.", Confirmed),
           400: Answer("The body is not valid JSON."),
           403: WRITES_DISABLED,
           404: NO_ROW,
           409: Answer("The key is not unconfirmed (state says which it is in)."),
           413: Answer("The body is too large."),
           415: Answer("The body is not application/json."),
           422: Answer("The body is not a valid request; field names the first bad field."),
           503: STORE_DOWN,
       }, request=ConfirmIn),
    Op("POST", "/v1/rearm", "rearm_many", "rearmMany",
       "Operator: move every row in a terminal state (changed since a time, of one bot or all) to released.", "write", {
           200: Answer("What matched, each row, and what was rearmed (nothing on a dry run).", RearmedMany),
           400: Answer("The body is not valid JSON."),
           403: WRITES_DISABLED,
           404: Answer("No logged-in bot has this name or platform instance."),
           409: Answer("The platform instance names several bots: use the bot name."),
           413: Answer("The body is too large."),
           415: Answer("The body is not application/json."),
           422: Answer("The body is not a valid request; field names the first bad field."),
           503: STORE_DOWN,
       }, request=RearmIn),
    Op("GET", "/v1/replies/{platform}/{parent_id:path}", "get_reply", "getReply",
       "A key's row and its whole history.", "read", {
           200: Answer("The row and its events, oldest first.", ReplyHistory),
           404: NO_ROW,
           409: Answer("The platform instance names several bots: use the bot name."),
           503: STORE_DOWN,
       }),
    Op("GET", "/v1/status", "status", "getStatus", "Row counts, oldest open rows, recent events and bots.", "read", {
        200: Answer("The summary.", StatusSummary),
        503: Answer("The store is unavailable (store.up is false).", StatusSummary),
    }),
    Op("GET", "/healthz", "healthz", "healthz", "Liveness.", "open",
       {200: Answer("The process serves requests.", Health)}),
    Op("GET", "/readyz", "readyz", "readyz", "Readiness: store reachable, every bot started, no write breaker open, no path failing or stale.", "read",
       {200: Answer("Ready.", Ready), 503: Answer("Not ready; the body says why.", Ready)}),
    Op("GET", "/metrics", "metrics", "metrics", "Prometheus metrics.", "read",
       {200: Answer("Prometheus text exposition.", TEXT)}),
    Op("GET", "/", "page", "statusPage", "The read-only status page (refreshes itself).", "read", {
        200: Answer("HTML.", HTML),
        503: Answer("HTML; the store is unavailable.", HTML),
    }),
    # The page's forms: HTML in, a redirect out; a browser's surface, not part of the JSON contract.
    Op("POST", "/page/actions", "page_action", None, "The status page's rearm and confirm forms.", "write"),
    Op("GET", "/openapi.json", "openapi", "openapi", "This document.", "read",
       {200: Answer("OpenAPI 3.1.", "application/json")}),
)


class _Schemas(GenerateJsonSchema):
    """pydantic's JSON Schema without a title on every property (the names say it), and open response objects."""

    def model_schema(self, schema: Any) -> Any:
        """A model's schema; a body's ``extra="forbid"`` guards the handlers, it does not close the contract."""
        out = super().model_schema(schema)
        if out.get("additionalProperties") is False:
            del out["additionalProperties"]
        return out

    def field_title_should_be_set(self, schema: Any) -> bool:
        """Never: a property's name is its title."""
        return False


def components() -> dict[str, Any]:
    """The schemas of every body the document names (and the ones they nest), as OpenAPI components."""
    _, defs = models_json_schema([(m, "serialization") for m in RESPONSES], schema_generator=_Schemas,
                                 ref_template="#/components/schemas/{model}")
    return defs["$defs"]


def operation(op: Op, *, auth: bool, open_routes: Sequence[str]) -> dict[str, Any]:
    """One route as an OpenAPI operation object."""
    # An empty requirement means no auth: every read without a configured token, and the opened probes.
    opened = op.access == "open" or (op.path.strip("/") in OPENABLE_ROUTES and op.path.strip("/") in open_routes)
    security = ([{}] if opened else [{"bearerAuth": []}] if op.access == "write"
                else [{"bearerAuth": []}, {"basicAuth": []}] if auth else [{}])
    answers = dict(op.answers)
    if op.access != "open":
        answers[401] = UNAUTHORIZED  # the gate's refusal, also on an opened probe when opening is undone
    doc: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary, "security": security}
    params = re.findall(r"\{(\w+)", op.path)
    if params:
        doc["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"},
                              "description": PARAMETERS[p]} for p in params]
    if op.request is not None:
        doc["requestBody"] = {"required": True,
                              "content": {"application/json": {"schema": op.request.model_json_schema()}}}
    doc["responses"] = {str(code): answers[code].document() for code in sorted(answers)}
    return doc


def openapi_document(*, auth: bool = True, open_routes: Sequence[str] = ()) -> dict[str, Any]:
    """Return the OpenAPI 3.1 document for an API with a token configured (``auth``) or not."""
    paths: dict[str, dict[str, Any]] = {}
    for op in ROUTES:
        if op.operation_id is not None:
            paths.setdefault(op.doc_path, {})[op.method.lower()] = operation(op, auth=auth, open_routes=open_routes)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "replyd",
            "version": "1",
            "description": "Post replies at most once per parent through replyd's guard; inspect and steer the "
                           "answered-log. Writes always need a bearer token.",
        },
        "paths": paths,
        "components": {"securitySchemes": SECURITY_SCHEMES, "schemas": components()},
    }
