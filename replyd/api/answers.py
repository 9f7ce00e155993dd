"""How the API answers: bodies from the models, the guard's outcome as a status, and the one error mapping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from replyd.api.models import Error, PostOutcome, Row
from replyd.errors import ContentionError, StoreError
from replyd.guard import Outcome, Status
from replyd.log import get_logger

log = get_logger("replyd.api")

NOT_SENT_RETRY_S = 5  # Retry-After when the platform refused before acting without saying when
STORE_BUSY_RETRY_S = 1  # another writer holds the key: it is done within a transaction

OUTCOME_CODES = {
    Status.POSTED: 201,
    Status.ALREADY_ANSWERED: 200,
    Status.IN_FLIGHT: 202,
    Status.UNCERTAIN: 202,
    Status.REJECTED: 409,
    Status.GAVE_UP: 409,
    Status.UNCONFIRMED: 409,
    Status.DECLINED: 409,
    Status.SKIPPED: 409,
    Status.DRY_RUN: 202,  # accepted and logged; nothing was sent (dry run)
}


def body(model: BaseModel, status: int = 200, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSON answer whose body is ``model``."""
    return JSONResponse(model.model_dump(mode="json"), status_code=status, headers=dict(headers or {}))


def error(code: int, err: str, detail: str, *, field: str | None = None,
          headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    """A refusal: HTTP ``code`` with the ``Error`` body (``err`` is its stable code)."""
    return body(Error(error=err, detail=detail, field=field, **extra), code, headers)


def retry_after(seconds: float | None) -> dict[str, str]:
    """The ``Retry-After`` header for a wait of ``seconds`` (at least 1; the default wait when unknown)."""
    return {"Retry-After": str(max(1, math.ceil(seconds or NOT_SENT_RETRY_S)))}


def outcome_response(out: Outcome, bot: str) -> JSONResponse:
    """Map a Guard outcome to its HTTP status and body."""
    answer = PostOutcome.of(out, bot)
    if out.status is Status.NOT_SENT:
        # Backing off or rate-limited has a time to wait; anything else is "unavailable, try again".
        return body(answer, 429 if out.retry_after_s else 503, retry_after(out.retry_after_s))
    return body(answer, OUTCOME_CODES[out.status])


def row_dict(row: Any) -> dict[str, Any]:
    """A store row as the API serves it (``Row``: without the parent snapshot, served separately as ``parent``)."""
    return Row.model_validate(row, from_attributes=True).model_dump(mode="json")


async def store_refused(request: Request, exc: Exception) -> Response:
    """The one mapping of a store failure, on every route: 503 with Retry-After; a write sent nothing."""
    done = "; nothing sent" if request.method == "POST" else ""
    if isinstance(exc, ContentionError):
        return error(503, "store_busy", f"{exc}{done}", headers=retry_after(STORE_BUSY_RETRY_S))
    return error(503, "store_unavailable", f"{exc}{done}", headers=retry_after(NOT_SENT_RETRY_S))


async def http_refused(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no route, wrong method) in the ``Error`` body."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error(exc.status_code, code, str(exc.detail), headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug: logged with its type, answered 500 without details."""
    log.error("replyd.api.failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}"[:300])
    return error(500, "internal_error", "internal error; see the daemon's log")


EXCEPTION_HANDLERS = {HTTPException: http_refused, StoreError: store_refused, ContentionError: store_refused,
                      Exception: internal_error}
