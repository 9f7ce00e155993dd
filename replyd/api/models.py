"""The API's request and response bodies as pydantic models: handlers build them, the OpenAPI document shows them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, RootModel, create_model

from replyd import library
from replyd import store as st
from replyd import guard
from replyd.guard import Status

NO_NUL = r"^[^\u0000]*$"  # PostgreSQL text cannot hold NUL; refuse it at the door, not as a 503
MAX_PARENT_ID = 1024  # the replies.parent_id column


def _enum(values: tuple[str, ...], description: str | None = None) -> Any:
    """A string field documented as one of ``values`` (not validated: the store is the authority on its states)."""
    return Field(description=description, json_schema_extra={"enum": list(values)})


class ReplyIn(BaseModel):
    """The body of ``POST /v1/replies``."""

    model_config = ConfigDict(extra="forbid", strict=True, title="ReplyRequest")

    platform: str = Field(min_length=1, max_length=255, pattern=NO_NUL,
                          description="A configured bot's name, or its platform instance (the first part of the key).")
    parent_id: str = Field(min_length=1, max_length=MAX_PARENT_ID, pattern=NO_NUL,
                           description="The parent's id as the platform serves it, or a URL the adapter resolves.")
    text: str = Field(min_length=1, max_length=10_000, pattern=r"\S",
                      description="The reply. Never part of the key and never compared.")
    path: str = Field("api", min_length=1, max_length=64, pattern=NO_NUL,
                      description="The discovery path recorded on the row (default: api).")


class Body(BaseModel):
    """A response body built by a handler: a key the model does not name is a bug, refused loudly."""

    model_config = ConfigDict(extra="forbid")


class Error(Body):
    """Every refusal: a stable code, words for people, and the field at fault."""

    model_config = ConfigDict(extra="allow")  # a few refusals add context (rearm's ``state``)

    error: str = Field(description="A stable code, e.g. invalid_body, unknown_parent.")
    detail: str = Field(description="What went wrong, for people.")
    field: str | None = Field(description="The request field at fault, when one is.")


class PartOutcome(BaseModel):
    """One part of an answer sent in several parts."""

    part: int = Field(description="The part's number, from 1.")
    state: str | None = Field(description="Its own row's state (closed: landed); null: not claimed yet.")
    reply_id: str | None


class PostOutcome(Body):
    """What ``POST /v1/replies`` did: the guard's outcome for the key."""

    status: Status
    bot: str
    platform: str = Field(description="The platform instance (first part of the key).")
    sender_id: str
    parent_id: str = Field(description="The parent id as served (after resolving).")
    state: str | None
    attempt: int
    reply_id: str | None
    detail: str
    retry_after_s: float | None
    parts: list[PartOutcome] = Field(default_factory=list, description=(
        "An answer longer than one post, sent in parts: every part in order, with its row's state (null: not "
        "claimed yet) and reply id; the parts whose state is closed landed. Empty for an answer in one post."))

    @classmethod
    def of(cls, out: guard.Outcome, bot: str) -> PostOutcome:
        """The body for one guard outcome."""
        return cls(status=out.status, bot=bot, platform=out.key.platform, sender_id=out.key.sender_id,
                   parent_id=out.key.parent_id, state=out.state, attempt=out.attempt, reply_id=out.reply_id,
                   detail=out.detail, retry_after_s=out.retry_after_s,
                   parts=[PartOutcome(part=p.part, state=p.state, reply_id=p.reply_id) for p in out.parts])


class Outcome(RootModel[PostOutcome | Error]):
    """A status whose body is either the guard's outcome or a refusal."""


def _columns(table: str, name: str, doc: str, *, skip: frozenset[str] = frozenset(),
             **override: Any) -> type[BaseModel]:
    """A model serving a store table's columns (but ``skip``; ``override`` retypes or adds), other keys ignored."""
    fields: dict[str, Any] = {n: f for n, f in st.record_fields(table).items() if n not in skip}
    return create_model(name, __doc__=doc, __config__=ConfigDict(extra="ignore"), **{**fields, **override})


Row = _columns("replies", "Row", "A key's row of the answered-log, without the parent snapshot (served as ``parent``).",
               skip=frozenset({"snapshot"}), state=(str, _enum(st.STATES)),
               attempt=(int, ...))  # required in the contract: every stored row has one (the column default is 1)
Event = _columns("events", "Event", "One transition of one key, with the discovery path stored on its row.",
                 id=(int, ...),
                 detail=(Any, Field(None, description="What the transition recorded (usually an object).")),
                 path=(str | None, Field(None, description="The discovery path stored on the key's row.")))


class ReplyHistory(Body):
    """``GET /v1/replies/{platform}/{parent_id}``: the row and its events, oldest first."""

    bot: str
    platform: str
    sender_id: str
    parent_id: str
    row: Row
    parent: dict[str, Any] = Field(description="The parent snapshot stored when claimed.")
    events: list[Event]


class Rearmed(Body):
    """A rearm that happened."""

    rearmed: Literal[True]
    bot: str
    previous_state: str = _enum(library.REARMABLE)
    row: Row


class Confirmed(Body):
    """An unconfirmed key marked answered by an operator (``closed``, event ``confirmed``)."""

    confirmed: Literal[True]
    bot: str
    row: Row


class ConfirmIn(BaseModel):
    """The body of ``POST /v1/replies/{platform}/{parent_id}/confirm``: the reply's id, when the operator knows it."""

    model_config = ConfigDict(extra="forbid", strict=True, title="ConfirmRequest")

    reply_id: str | None = Field(None, min_length=1, max_length=MAX_PARENT_ID, pattern=NO_NUL,
                                 description="The landed reply's id as the platform serves it (optional).")
    reason: str = Field("", max_length=500, pattern=NO_NUL, description="Why, recorded on the confirmed event.")


def _json_integer(value: Any) -> Any:
    """A JSON integer, written ``3`` or ``3.0`` (JSON Schema's integer is a number with no fraction)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class RearmIn(BaseModel):
    """The body of ``POST /v1/rearm``: which terminal rows to send back to claimable."""

    model_config = ConfigDict(extra="forbid", strict=True, title="RearmRequest")

    state: Literal[library.REARMABLE] = Field(  # type: ignore[valid-type]
        "gave_up", description="Rearm the rows in this terminal state.")
    since: float | None = Field(None, ge=0, allow_inf_nan=False,
                                description="Only rows that changed at or after this time (epoch seconds); "
                                            "default: any time.")
    bot: str | None = Field(None, min_length=1, max_length=255, pattern=NO_NUL,
                            description="Only this bot (name, or platform instance); default: every logged-in bot.")
    dry_run: bool = Field(False, description="List what would be rearmed; change nothing.")
    reason: str = Field("", max_length=500, pattern=NO_NUL, description="Why, recorded on every rearmed event.")
    limit: Annotated[int, BeforeValidator(_json_integer)] = Field(1000, ge=1, le=10_000,
                                                                  description="At most this many rows.")


class RearmItem(Body):
    """One row a bulk rearm matched."""

    bot: str
    platform: str
    sender_id: str
    parent_id: str
    previous_state: str = _enum(library.REARMABLE)
    rearmed: bool = Field(description="Rearmed by this call (false on a dry run, or when the row moved on since "
                                      "it was read).")
    state: str | None = Field(description="The row's state now.")


class RearmedMany(Body):
    """What ``POST /v1/rearm`` matched and did."""

    dry_run: bool
    state: str
    since: float | None
    matched: int = Field(description="Rows in the state (and window) found.")
    rearmed: int = Field(description="Rows this call rearmed (0 on a dry run).")
    parents: list[RearmItem]


class StoreInfo(Body):
    """Where the store is and whether it answered."""

    url: str
    up: bool
    error: str | None


class StateCount(Body):
    """How many rows of one platform instance are in one state."""

    platform: str
    state: str
    rows: int


class OpenRow(Body):
    """An open row, by age."""

    platform: str
    sender_id: str
    parent_id: str
    opened_at: float | None
    age_s: float
    attempt: int


class PathHealth(Body):
    """One discovery path of one bot: last success, failures, staleness."""

    interval_s: float
    last_ok: float | None
    age_s: float
    failures: int
    last_error: str | None
    last_error_at: float | None
    runs: int
    stale_after_s: float
    stale: bool
    running_s: float | None = Field(default=None, description="Seconds the run in flight has run (null: none is).")
    stuck: bool = Field(default=False, description="The run in flight has run past the interval + the request timeout.")
    overdue: bool = Field(default=False, description="No success for the interval + jitter + the request timeout while a "
                          "run is in flight or the last one failed.")
    failing: bool = Field(default=False, description="health.failures_not_ready runs in a row failed, stuck or overdue: "
                          "not ready.")
    words: str = Field(description="inbox: last ok 3 min ago, 7 failures in a row: HTTP 503")


class PlatformClockView(Body):
    """The platform's clock minus replyd's, measured from its responses."""

    offset_s: float | None = Field(description="Median offset of the recent samples; null before the first.")
    low_s: float | None = Field(description="The lowest offset a recent sample allows (read-back windows use it).")
    samples: int
    source: str | None = Field(description="created (own replies' created_at) or date (the Date header).")


class BotStart(Body):
    """Whether a bot started: ``starting`` (its platform not reached yet, retried), ``running`` or ``failed``."""

    state: Literal["starting", "running", "failed"]
    reason: str | None
    attempts: int
    since: float
    next_try_s: float | None
    words: str
    adopting: bool = Field(default=False, description="Reading its own replies back before any path runs.")


class Breaker(Body):
    """A bot's write breaker: open while sends fail as a platform-wide pattern (not ready)."""

    open: bool
    reason: str | None
    since: float | None


class BotLiveness(Body):
    """A bot's paths and whether any is stale."""

    paths: dict[str, PathHealth] = Field(description="inbox, search, refind and sweep, as scheduled.")
    stale: list[str]
    failing: list[str] = []
    oldest_due_open_age_s: float | None
    start: BotStart | None = None
    breaker: Breaker | None = None
    platform_clock: PlatformClockView | None = Field(
        default=None, description="The platform's clock as this daemon measures it (replyd.platforms._http.PlatformClock).")


class BotState(Body):
    """A configured bot: logged in and claiming, and as whom."""

    ready: bool
    platform: str | None
    sender_id: str | None
    listing: dict[str, Any] | None = Field(
        default=None, description="The listing delay: configured, in use (learned), observed lag (replyd.lag).")
    duplicates: int = Field(default=0, description="Own replies beyond the first found for one parent (the log's "
                            "duplicate_detected events).")


class StatusSummary(Body):
    """``GET /v1/status`` and the status page: counts, oldest open rows, recent events, bots."""

    generated_at: float
    store: StoreInfo
    counts: list[StateCount]
    open_rows: int
    oldest_open_age_s: float
    oldest_open: list[OpenRow]
    recent_events: list[Event]
    bots: dict[str, BotState]
    liveness: dict[str, BotLiveness] = {}


class Health(Body):
    """``GET /healthz``."""

    status: Literal["ok"]


class ReadyStore(Body):
    """Whether the store answered the readiness query."""

    up: bool
    error: str | None


class Ready(Body):
    """``GET /readyz``: ready, or the reasons it is not."""

    ready: bool
    reasons: list[str]
    store: ReadyStore
    bots: dict[str, bool]


# Every body the document names, in the order its components list them.
RESPONSES: tuple[type[BaseModel], ...] = (Error, Outcome, PostOutcome, Row, Event, ReplyHistory, Rearmed, Confirmed,
                                          RearmedMany, RearmItem, StatusSummary, BotState, BotLiveness, BotStart, Breaker, Health, Ready)
