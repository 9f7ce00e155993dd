"""The API's ASGI app: one ``Api`` over the store and the daemon's guards, a handler per route of ``openapi.ROUTES``."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, quote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from replyd import library, metrics, statuspage
from replyd import store as st
from replyd.api.answers import EXCEPTION_HANDLERS, body, error, outcome_response, retry_after, row_dict
import replyd.api.pageform as pageform
from replyd.api.gate import Gate, HostCheck, open_paths
from replyd.api.models import (MAX_PARENT_ID, BotState, Confirmed, ConfirmIn, Event, Health, OpenRow, Ready, ReadyStore, Rearmed, RearmedMany,
                               RearmIn, RearmItem, ReplyHistory, ReplyIn, StateCount, StatusSummary, StoreInfo)
from replyd.api.openapi import ROUTES, openapi_document
from replyd.errors import PlatformError, RateLimited, Rejected, ReplydError
from replyd.guard import Guard
from replyd.hooks import BAD_SIGNATURE
from replyd.liveness import Liveness
from replyd.log import get_logger
from replyd.quiet import Quiet
from replyd.store import Reply, Store

if TYPE_CHECKING:
    from replyd.hooks import Receiver

log = get_logger("replyd.api")
M = TypeVar("M", bound=BaseModel)
PAGE_CHART_ROWS = 20_000  # answers read for the page's chart; past it the counts are a floor
PAGE_WAITING_ROWS = 20  # rows waiting for a decision the page lists (with their forms)
OPEN_METRICS_CACHE_S = 5.0  # how long an opened /metrics without the token shows the same row counts


class Api:
    """The ASGI app over one store and the daemon's guards (a live mapping: bots log in after start)."""

    def __init__(
        self,
        store: Store,
        guards: Mapping[str, Guard],
        *,
        expected: Sequence[str] | None = None,
        token: str | None = None,
        host: str = "127.0.0.1",
        hosts: Sequence[str] = (),
        open_routes: Sequence[str] = (),
        refresh_s: int = 5,
        max_body_bytes: int = 65_536,
        liveness: Liveness | None = None,
        hooks: Receiver | None = None,
        webhook_bots: Sequence[str] = (),
    ) -> None:
        self.store = store
        self.liveness = liveness
        self.hooks = hooks
        self.webhook_bots = frozenset(webhook_bots)  # configured push bots: 503 until they started, not 404
        self.guards = guards
        self.expected = list(expected) if expected is not None else None
        self.token = token or None
        # Both gates share one quiet log: a wrong token writes one warning a minute, whichever gate saw it.
        gate = {"token": self.token, "hosts": HostCheck(host, hosts), "open_paths": open_paths(open_routes),
                "quiet": Quiet(log)}
        # The same gate with nothing opened: whether an opened probe's caller showed the token (then: detail).
        self._token_gate = Gate(None, token=self.token, hosts=gate["hosts"], open_paths=frozenset(),
                                quiet=gate["quiet"])
        self.refresh_s = refresh_s
        self.max_body_bytes = max_body_bytes
        self.registry = metrics.registry(store, liveness)
        # An opened /metrics scraped without the token reads rows kept a few seconds: no store load on demand.
        self._open_registry = metrics.registry(store, liveness, store_cache_s=OPEN_METRICS_CACHE_S)
        self._openapi = openapi_document(auth=self.token is not None, open_routes=open_routes)
        routes = [Route(op.path, getattr(self, op.handler), methods=[op.method]) for op in ROUTES]
        self.app = Starlette(routes=routes, middleware=[Middleware(Gate, **gate)],
                             exception_handlers=dict(EXCEPTION_HANDLERS))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Serve one ASGI request."""
        await self.app(scope, receive, send)

    def _writes_disabled(self) -> Response | None:
        """A 403 when no token is configured (writes need one), else None."""
        if self.token is not None:
            return None
        return error(403, "writes_disabled",
                     "writes need an API token and none is configured: set api.token_env to the name of an "
                     "environment variable holding one, export it, and restart")

    # -- helpers ---------------------------------------------------------------------------------

    def _bot(self, ref: str) -> tuple[str, Guard] | Response:
        """Find a bot by name, else by platform instance (unique); a refusal when neither."""
        guard = self.guards.get(ref)
        if guard is not None:
            return ref, guard
        hits = [(n, g) for n, g in list(self.guards.items()) if g.platform.instance == ref]
        if len(hits) == 1:
            return hits[0]
        if hits:
            return error(409, "ambiguous_platform",
                         f"{len(hits)} bots post on this platform instance: name the bot instead", field="platform")
        known = ", ".join(sorted(self.guards)) or "none logged in yet"
        return error(404, "unknown_platform", f"no bot or platform instance named {ref!r} (bots: {known})",
                     field="platform")

    def _key_of(self, request: Request) -> tuple[str, Guard, st.Key] | Response:
        """The bot and key a ``/v1/replies/{platform}/{parent_id}`` path names; a refusal when it names none."""
        found = self._bot(request.path_params["platform"])
        if isinstance(found, Response):
            return found
        name, guard = found
        parent_id = request.path_params["parent_id"]
        if not _storable(parent_id):
            return error(404, "no_row", "no row for this parent", field="parent_id")
        return name, guard, guard.key(parent_id)

    async def _body(self, request: Request, limit: int | None = None) -> bytes | Response:
        """The request body up to ``limit`` bytes (default ``max_body_bytes``); a refusal past it or on a cut."""
        limit = self.max_body_bytes if limit is None else limit
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return error(413, "body_too_large", f"body larger than {limit} bytes", field="body")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return error(413, "body_too_large", f"body larger than {limit} bytes", field="body")
                chunks.append(chunk)
        except ClientDisconnect:
            # The client left mid-body: nothing was claimed or sent, and nobody reads this answer.
            return error(400, "client_disconnected", "the client closed the connection before the body ended",
                         field="body")
        return b"".join(chunks)

    async def _json(self, request: Request, model: type[M], shape: str) -> M | Response:
        """The request's JSON body validated as ``model``; a refusal naming the first bad field otherwise."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return error(415, "unsupported_media_type", "send the body as application/json", field="body")
        raw = await self._body(request)
        if isinstance(raw, Response):
            return raw
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, "invalid_json", f"body: not valid JSON ({exc})", field="body")
        except RecursionError:
            return error(400, "invalid_json", "body: JSON nested too deeply", field="body")
        if not isinstance(data, dict):
            return error(422, "invalid_body", f"body: must be {shape}", field="body")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            errs = exc.errors(include_url=False, include_input=False)
            first = ".".join(str(x) for x in errs[0]["loc"]) or "body"
            detail = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errs)
            return error(422, "invalid_body", detail, field=first)

    # -- writes ----------------------------------------------------------------------------------

    async def post_reply(self, request: Request) -> Response:
        """POST /v1/replies: resolve the parent and post through Guard.post, at most once."""
        if (deny := self._writes_disabled()) is not None:
            return deny
        req = await self._json(request, ReplyIn, "a JSON object with platform, parent_id and text")
        if isinstance(req, Response):
            return req
        found = self._bot(req.platform)
        if isinstance(found, Response):
            return found
        name, guard = found
        try:
            out = await run_in_threadpool(library.submit, guard, req.parent_id, req.text, path=req.path)
        except RateLimited as exc:
            return error(429, "platform_rate_limited", f"resolving the parent: {exc.detail}; nothing sent",
                         field="parent_id", headers=retry_after(exc.retry_after_s))
        except Rejected as exc:
            return error(404, "unknown_parent", f"the platform refused the parent: {exc.detail}; nothing sent",
                         field="parent_id")
        except PlatformError as exc:
            return error(502, "resolve_failed", f"could not resolve the parent: {exc.detail or type(exc).__name__}; "
                         "nothing sent", field="parent_id")
        log.info("replyd.api.replied", bot=name, parent_id=out.key.parent_id, status=out.status.value)
        return outcome_response(out, name)

    async def hook(self, request: Request) -> Response:
        """POST /v1/hooks/{bot}: a signed webhook delivery; parents are offered in the background."""
        if self.hooks is None:  # as for an unknown bot: before authentication nothing says which bots exist
            return JSONResponse(BAD_SIGNATURE.body, status_code=BAD_SIGNATURE.status)
        bot = request.path_params["bot"]
        raw = await self._body(request, self.hooks.max_body_bytes)
        if isinstance(raw, Response):
            return raw
        if bot in self.webhook_bots and bot not in self.hooks.hooks:
            # Configured, but its platform was not reached yet: a signed delivery gets a 5xx with Retry-After (the
            # platform redelivers); an unsigned one the 401 an unknown bot gets. Neither names the bot.
            if not self.hooks.signed_while_starting(bot, request.headers, raw):
                return JSONResponse(BAD_SIGNATURE.body, status_code=BAD_SIGNATURE.status)
            wait_s = self.liveness.retry_in_s(bot) if self.liveness is not None else None
            return error(503, "bot_starting", "the bot has not started yet (its platform was not reached); "
                         "deliver again later", headers=retry_after(min(60.0, (wait_s or 0) + 1)))
        answer = self.hooks.receive(bot, request.headers, raw)
        return JSONResponse(answer.body, status_code=answer.status)

    async def hook_challenge(self, request: Request) -> Response:
        """GET /v1/hooks/{bot}: a verification handshake; the challenge as text when the verify token is the hook's."""
        if self.hooks is None:
            from replyd.hooks import BAD_CHALLENGE
            return JSONResponse(BAD_CHALLENGE.body, status_code=BAD_CHALLENGE.status)
        answer = self.hooks.challenge(request.path_params["bot"], request.query_params)
        if answer.status == 200:
            return PlainTextResponse(answer.body["challenge"])
        return JSONResponse(answer.body, status_code=answer.status)

    async def rearm(self, request: Request) -> Response:
        """POST /v1/replies/{platform}/{parent_id}/rearm: an operator sends a terminal key back."""
        if (deny := self._writes_disabled()) is not None:
            return deny
        found = self._key_of(request)
        if isinstance(found, Response):
            return found
        name, guard, key = found
        res = await run_in_threadpool(library.rearm, self.store, key, by="api", owner=guard.owner)
        if res.row is None:
            return error(404, "no_row", f"no row for parent {key.parent_id!r} of bot {name!r} (ids are exact)",
                         field="parent_id")
        if not res.rearmed:
            return error(409, "not_rearmable",
                         f"the key is {res.previous}; only {', '.join(library.REARMABLE)} can be rearmed",
                         state=res.row.state)
        log.info("replyd.api.rearmed", bot=name, parent_id=key.parent_id, previous=res.previous)
        return body(Rearmed(rearmed=True, bot=name, previous_state=res.previous, row=row_dict(res.row)))

    async def confirm(self, request: Request) -> Response:
        """POST /v1/replies/{platform}/{parent_id}/confirm: an operator marks an unconfirmed key answered."""
        if (deny := self._writes_disabled()) is not None:
            return deny
        found = self._key_of(request)
        if isinstance(found, Response):
            return found
        name, guard, key = found
        req = await self._json(request, ConfirmIn, "a JSON object (reply_id, reason)")
        if isinstance(req, Response):
            return req
        res = await run_in_threadpool(library.confirm, self.store, key, by="api", reply_id=req.reply_id,
                                      reason=req.reason, owner=guard.owner)
        if res.row is None:
            return error(404, "no_row", f"no row for parent {key.parent_id!r} of bot {name!r} (ids are exact)",
                         field="parent_id")
        if not res.confirmed:
            return error(409, "not_unconfirmed", f"the key is {res.previous}; only an unconfirmed key can be confirmed",
                         state=res.row.state)
        log.info("replyd.api.confirmed", bot=name, parent_id=key.parent_id)
        return body(Confirmed(confirmed=True, bot=name, row=row_dict(res.row)))

    async def rearm_many(self, request: Request) -> Response:
        """POST /v1/rearm: an operator sends every row in a terminal state (since a time, one bot or all) back."""
        if (deny := self._writes_disabled()) is not None:
            return deny
        req = await self._json(request, RearmIn, "a JSON object (state, since, bot, dry_run, reason, limit)")
        if isinstance(req, Response):
            return req
        if req.bot is not None:
            found = self._bot(req.bot)
            if isinstance(found, Response):
                return found
            bots = [found]
        else:
            bots = sorted(self.guards.items())
        by_key = {(g.platform.instance, g.identity.sender_id): name for name, g in bots}
        owner = bots[0][1].owner if bots else None
        results = await run_in_threadpool(library.rearm_many, self.store, list(by_key), state=req.state,
                                          since=req.since, by="api", reason=req.reason, owner=owner,
                                          dry_run=req.dry_run, limit=req.limit)
        items = [RearmItem(bot=by_key[(r.key.platform, r.key.sender_id)], platform=r.key.platform,
                           sender_id=r.key.sender_id, parent_id=r.key.parent_id, previous_state=r.previous or "",
                           rearmed=r.rearmed, state=r.row.state if r.row else None) for r in results]
        done = sum(i.rearmed for i in items)
        log.info("replyd.api.rearmed_many", bot=req.bot or "*", platform=",".join(sorted({p for p, _ in by_key})),
                 state=req.state, matched=len(items), rearmed=done, dry_run=req.dry_run)
        return body(RearmedMany(dry_run=req.dry_run, state=req.state, since=req.since, matched=len(items),
                                rearmed=done, parents=items))

    # -- reads -----------------------------------------------------------------------------------

    async def get_reply(self, request: Request) -> Response:
        """GET /v1/replies/{platform}/{parent_id}: the key's row and its events in order."""
        found = self._key_of(request)
        if isinstance(found, Response):
            return found
        name, _, key = found

        def read() -> tuple[Reply | None, list[st.Event]]:
            """Read the row, and its history when there is one."""
            row = self.store.get(key)
            return row, (self.store.history(key) if row else [])

        row, history = await run_in_threadpool(read)
        if row is None:
            return error(404, "no_row", f"no row for parent {key.parent_id!r} of bot {name!r} (ids are exact)",
                         field="parent_id")
        try:
            parent = json.loads(row.snapshot or "{}")
        except (ValueError, RecursionError):
            parent = {}
        return body(ReplyHistory(
            bot=name, platform=key.platform, sender_id=key.sender_id, parent_id=key.parent_id, row=row_dict(row),
            parent=parent if isinstance(parent, dict) else {},
            events=[Event.model_validate({**e.model_dump(), "detail": _detail(e.detail), "path": row.path})
                    for e in history],
        ))

    def summary(self) -> dict[str, Any]:
        """Collect what the status page and ``/v1/status`` show (blocking: run in a thread)."""
        now = self.store.clock.now()
        store_info: dict[str, Any] = {"url": self.store.url, "up": True, "error": None}
        counts: list[StateCount] = []
        oldest: list[OpenRow] = []
        recent: list[Event] = []
        dups: dict[tuple[str, str], int] = {}
        try:
            raw = self.store.counts()
            counts = [StateCount(platform=p, state=s, rows=n) for (p, s), n in sorted(raw.items())]
            oldest = [OpenRow(platform=r.platform, sender_id=r.sender_id, parent_id=r.parent_id,
                              opened_at=r.opened_at, age_s=round(max(0.0, now - (r.opened_at or r.created_at)), 1),
                              attempt=r.attempt) for r in self.store.oldest_open(10)]
            recent = [Event.model_validate(e) for e in library.events(self.store, limit=30)]
            dups = self.store.duplicate_counts()
        except ReplydError as exc:
            store_info.update(up=False, error=str(exc))
        try:
            live = self.liveness.snapshot(self.store if store_info["up"] else None) if self.liveness else {}
        except ReplydError:
            live = self.liveness.snapshot() if self.liveness else {}
        return StatusSummary(
            generated_at=now,
            store=StoreInfo(**store_info),
            counts=counts,
            open_rows=sum(c.rows for c in counts if c.state == st.OPEN),
            oldest_open_age_s=oldest[0].age_s if oldest else 0.0,
            oldest_open=oldest,
            recent_events=recent,
            bots=self._bots_state(dups),
            liveness=live,
        ).model_dump(mode="json")

    def _bots_state(self, dups: dict[tuple[str, str], int] | None = None) -> dict[str, BotState]:
        """Every configured bot (then any other logged in): ready, platform instance and sender (and, given
        ``dups`` by platform and sender, the duplicates found)."""
        guards = dict(self.guards)
        names = self.expected if self.expected is not None else sorted(guards)
        out: dict[str, BotState] = {}
        for n in list(names) + [g for g in guards if g not in names]:
            g = guards.get(n)
            out[n] = BotState(ready=g is not None and g.claiming, platform=g.platform.instance if g else None,
                              sender_id=g.identity.sender_id if g else None,
                              listing=g.lag.view() if g else None,
                              duplicates=(dups or {}).get((g.platform.instance, g.identity.sender_id), 0) if g else 0)
        return out

    async def status(self, request: Request) -> Response:
        """GET /v1/status: counts, open rows, recent events, bots."""
        data = await run_in_threadpool(self.summary)
        return JSONResponse(data, status_code=200 if data["store"]["up"] else 503)

    def page_extras(self, now: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
        """The page's chart (last hour's answers) and the rows waiting for a decision; None for what failed."""
        chart: dict[str, Any] | None = None
        waiting: list[dict[str, Any]] | None = None
        try:
            limit = PAGE_CHART_ROWS
            answers = self.store.answers_since(now - statuspage.CHART_WINDOW_S, limit=limit)
            chart = statuspage.activity(answers, now, truncated=len(answers) >= limit)
            waiting = [r.model_dump() for r in self.store.decidable(st.DECIDABLE, limit=PAGE_WAITING_ROWS)]
        except ReplydError as exc:
            log.warning("replyd.page.store_failed", error=str(exc))
        return chart, waiting

    async def page(self, request: Request) -> Response:
        """GET /: the status page, with the forms of the rows waiting for a decision."""

        def collect() -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]] | None]:
            data = self.summary()
            return (data, *self.page_extras(data["generated_at"]))

        data, chart, waiting = await run_in_threadpool(collect)
        token, now = self.token, time.time()
        sign = None if token is None else (lambda a, b, p: pageform.form_token(token, a, b, p, now))
        q = request.query_params
        done = q.get("done", "")
        result = done if token is not None and done and pageform.result_ok(
            token, done, q.get("at", ""), q.get("sig", ""), now) else None
        return HTMLResponse(statuspage.render(data, refresh_s=self.refresh_s, chart=chart, waiting=waiting,
                                              form_token=sign, result=result),
                            status_code=200 if data["store"]["up"] else 503)

    async def page_action(self, request: Request) -> Response:
        """POST /page/actions: a rearm or confirm form from the page; a 303 back to it with a result line.

        The gate let a Basic login through; this checks Origin and the form's CSRF token before anything else.
        """
        if self.token is None:
            return _refuse(403, "actions need an API token: set api.token_env and restart")
        scheme = request.headers.get("authorization", "").strip().partition(" ")[0].lower()
        why = pageform.origin_problem(request.headers.get("origin"), request.headers.get("host"),
                                      basic=scheme == "basic")
        if why is not None:
            return _refuse(403, why)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/x-www-form-urlencoded":
            return _refuse(415, "send the form as application/x-www-form-urlencoded")
        raw = await self._body(request, pageform.MAX_FORM_BYTES)
        if isinstance(raw, Response):
            return _refuse(raw.status_code, "the form is too large or was cut off")
        try:
            form = parse_qs(raw.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(raw),
                            max_num_fields=8)
        except (UnicodeDecodeError, ValueError):
            return _refuse(400, "the form is not valid UTF-8 url-encoded fields")
        if any(len(v) != 1 for v in form.values()):
            return _refuse(400, "each form field must appear once")
        f = {k: v[0] for k, v in form.items()}
        action, bot, parent_id = f.get("action", ""), f.get("bot", ""), f.get("parent_id", "")
        if action not in pageform.ACTIONS:
            return _refuse(400, f"action must be one of {', '.join(pageform.ACTIONS)}")
        if not bot or not parent_id or not _storable(parent_id) or len(bot) > 255:
            return _refuse(400, "bot and parent_id are required (an id of at most "
                                f"{MAX_PARENT_ID} characters, no NUL)")
        if not pageform.form_token_ok(self.token, f.get("csrf", ""), action, bot, parent_id, time.time()):
            log.warning("replyd.page.form_refused", action=action, bot=bot, parent_id=parent_id,
                        csrf="missing" if not f.get("csrf") else "forged or expired")
            return _refuse(403, "missing, forged or expired form token: reload the status page and try again")
        guard = self.guards.get(bot)
        if guard is None:
            return _refuse(404, f"no running bot named {bot!r}")
        key = guard.key(parent_id)
        if action == "rearm":
            res = await run_in_threadpool(library.rearm, self.store, key, by="page", owner=guard.owner)
            done, row = res.rearmed, res.row
            line = (f"rearmed parent {parent_id} of bot {bot} (was {res.previous}): the next offer may answer it"
                    if done else f"not rearmed: parent {parent_id} of bot {bot} is {res.previous}; only "
                    f"{', '.join(library.REARMABLE)} can be rearmed")
        else:
            cres = await run_in_threadpool(library.confirm, self.store, key, by="page", owner=guard.owner)
            done, row = cres.confirmed, cres.row
            line = (f"confirmed parent {parent_id} of bot {bot}: closed, never answered again" if done
                    else f"not confirmed: parent {parent_id} of bot {bot} is {cres.previous}; only an "
                    "unconfirmed one can be confirmed")
        if row is None:
            return _refuse(404, f"no row for parent {parent_id!r} of bot {bot!r} (ids are exact)")
        log.info(f"replyd.page.{'rearmed' if action == 'rearm' else 'confirmed'}" if done else "replyd.page.not_done",
                 action=action, bot=bot, parent_id=parent_id, state=row.state)
        at = int(time.time())
        sig = pageform.result_sig(self.token, at, line)
        return RedirectResponse(f"/?done={quote(line, safe='')}&at={at}&sig={sig}", status_code=303)

    async def healthz(self, request: Request) -> Response:
        """GET /healthz: the process serves requests."""
        return body(Health(status="ok"))

    async def readyz(self, request: Request) -> Response:
        """GET /readyz: the store answers, every configured bot started (and still claiming), no write breaker is
        open and no path is failing or stale. Opened without the token (``api.open_routes``), only generic reasons."""
        detail = self.token is None or self._token_gate.admit(request) is None

        def check() -> Ready:
            """Ask the store one real query and look at every expected bot."""
            store_info: dict[str, Any] = {"up": True, "error": None}
            try:
                self.store.ping()
            except ReplydError as exc:
                # The error names the database's address: only for a caller who showed the token.
                store_info = {"up": False, "error": str(exc) if detail else "unavailable"}
            bots = {n: b.ready for n, b in self._bots_state().items()}
            reasons = [] if store_info["up"] else [f"store: {store_info['error']}"]
            starting = self.liveness.not_running() if self.liveness else set()
            # A bot still starting (or refused) is said by liveness, with its reason.
            reasons += [f"bot {n}: not logged in" for n, ok in bots.items() if not ok and n not in starting]
            reasons += self.liveness.problems(detail=detail) if self.liveness else []
            return Ready(ready=not reasons, reasons=reasons, store=ReadyStore(**store_info), bots=bots)

        data = await run_in_threadpool(check)
        return body(data, 200 if data.ready else 503)

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: Prometheus text exposition."""
        fresh = self.token is None or self._token_gate.admit(request) is None
        text = await run_in_threadpool(generate_latest, self.registry if fresh else self._open_registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json: this API's contract."""
        return JSONResponse(self._openapi)


def _refuse(status: int, detail: str) -> Response:
    """A page form's refusal: one line of text (the browser shows it as is)."""
    return PlainTextResponse(f"{status}: {detail}\n", status_code=status)


def _storable(parent_id: str) -> bool:
    """Whether an id could be stored at all (a NUL or an over-long id has no row by construction)."""
    return "\x00" not in parent_id and len(parent_id) <= MAX_PARENT_ID


def _detail(raw: str) -> Any:
    """An event's detail as JSON when it parses, else as stored."""
    try:
        return json.loads(raw or "{}")
    except (ValueError, RecursionError):
        return raw
