"""The WhatsApp adapter: a Cloud API business phone number answering the messages customers send it.

Settings (``[bots.settings]`` with ``platform = "whatsapp"``):

=======================  ====================================================================
``token``                required; a system-user access token (``token_env = "WHATSAPP_TOKEN"``)
``phone_number_id``      required; the business phone number's id (digits, as Meta serves it)
``api_url``              the Graph API root (default ``https://graph.facebook.com``)
``api_version``          the Graph API version in every path (default ``v21.0``)
``timeout_s``            per request
``instance``             the answered-log instance (default ``whatsapp``)
=======================  ====================================================================

Ids: the sender id is the phone-number-id (``GET /{phone-number-id}`` confirms it and gives the display
number as the handle); a parent id is the inbound message id (``wamid.…``) exactly as the webhook serves
it, its author the customer's ``wa_id``, its place the phone-number-id. A reply is ``POST
/{version}/{phone-number-id}/messages`` with ``messaging_product: whatsapp``, ``to`` (the wa_id), ``type:
text``, ``context.message_id`` (the parent) and ``biz_opaque_callback_data`` = ``replyd:1:<provider
key>:<parent id>``, which Meta returns untouched in the ``statuses`` webhooks of that message, so a
``sent``/``delivered``/``read`` status proves a send whose answer was lost (``replyd.hooks``).

The guarantee class: **no read-back** (``NoReadBack``). The Cloud API takes no idempotency key and has no
call listing the messages a business sent, so a send whose answer was lost ends ``unconfirmed``, never
retried on its own, until its status callback confirms it or an operator resolves it.

Discovery: webhooks only (``[bots.push] kind = "whatsapp"``: the ``hub.challenge`` handshake with the
verify token, ``X-Hub-Signature-256`` of the raw body with the app secret); ``inbox`` asks nothing.

Error mapping (Graph errors ``{"error": {"message", "type", "code", "error_data": {"details"}, "fbtrace_id"}}``;
replyd branches on ``code``, as Meta recommends, never on the message)::

    what happened                                          send               reads
    -----------------------------------------------------  -----------------  -----------------
    connect refused, DNS, connect timeout                  DefinitelyNotSent  DefinitelyNotSent
    read timeout, reset, lost response                     MaybeSent          DefinitelyNotSent
    131047 re-engagement (outside the 24-hour window)      Rejected (why)     Rejected
    130429 throughput, 131056 pair rate, 80007 WABA        RateLimited        RateLimited
    rate limit, 4 app rate limit
    190 / 0 / HTTP 401 (token expired or revoked)          DefinitelyNotSent  DefinitelyNotSent
    10, 200-299 / HTTP 403 (permission)                    DefinitelyNotSent  DefinitelyNotSent
    other 4xx (100 invalid parameter, 131026, 131051…)     Rejected           Rejected
    5xx (1, 2, 131000, 131016…), a 2xx without messages    MaybeSent          DefinitelyNotSent / BadResponse
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import httpx
from pydantic import Field

from replyd.errors import BadResponse, DefinitelyNotSent, MaybeSent, PlatformError, RateLimited, Rejected
from replyd.platforms import _http
from replyd.platforms.base import Identity, Page, Parent, Pending, ReadBack, Receipt, Sent, Token, register_platform

NO_READ_BACK = ("the Cloud API lets a business send but not list the messages it sent, and /messages takes no "
                "idempotency key: a send whose answer was lost can only be confirmed by its status webhook")
WINDOW = 131047
RATE_LIMITS = {130429: 1.0, 131056: 6.0, 80007: 60.0, 4: 60.0}  # code -> seconds to wait when no header says
AUTH = (0, 190)
CALLBACK = "replyd:1:"  # biz_opaque_callback_data prefix: replyd:1:<provider key>:<parent id>
_DIGITS = re.compile(r"^[0-9]{1,30}$")
_WAMID = re.compile(r"^[A-Za-z0-9._=+/:-]{1,200}$")
_SKIP_TYPES = frozenset({"reaction", "system", "unsupported", "ephemeral", "request_welcome"})
_TEXT = re.compile(r"[^\x20-\x7e]")


def _wamid(msg: Any) -> str | None:
    """A message's id when it is one (for the report of a message that cannot be read)."""
    wamid = msg.get("id") if isinstance(msg, dict) else None
    return wamid if isinstance(wamid, str) and _WAMID.match(wamid) else None


def callback_data(provider_key: str, parent_id: str) -> str:
    """The ``biz_opaque_callback_data`` of a reply: replyd's key and the parent (Meta allows 512 characters)."""
    return f"{CALLBACK}{provider_key}:{parent_id}"[:512]


def parse_callback(value: Any) -> tuple[str, str] | None:
    """(provider key, parent id) from a status's ``biz_opaque_callback_data``; None when it is not replyd's."""
    if not isinstance(value, str) or not value.startswith(CALLBACK):
        return None
    key, sep, parent = value[len(CALLBACK):].partition(":")
    if not sep or not key or not _WAMID.match(parent):
        return None
    return key, parent


@register_platform("whatsapp")
class WhatsAppPlatform(_http.StepSend, _http.HttpPlatform):
    """A WhatsApp Business phone number on the Cloud API as a replyd platform: inbound messages in, replies out."""

    kind: ClassVar[str] = "whatsapp"

    class Settings(_http.HttpSettings):
        """``[bots.settings]`` with ``platform = "whatsapp"`` (the table in the module docstring)."""

        URLS: ClassVar[tuple[str, ...]] = ("api_url",)
        token: Token
        phone_number_id: str = Field(pattern=r"^[0-9]{1,30}$")
        api_url: _http.Url = "https://graph.facebook.com"
        api_version: str = Field("v21.0", pattern=r"^v[0-9]{1,3}\.[0-9]{1,2}$")

    s: Settings

    def __init__(self, settings: Settings | None = None, /, *, http: httpx.Client, clock: Any, **kw: Any) -> None:
        super().__init__(settings, http=http, clock=clock, **kw)
        self.instance = self.s.instance or "whatsapp"

    @property
    def root(self) -> str:
        """The Graph API root with its version: ``<api_url>/<api_version>``."""
        return f"{str(self.s.api_url).rstrip('/')}/{self.s.api_version}"

    def no_read_back(self) -> str:
        """Why nothing the business sent can be listed here (``NoReadBack``)."""
        return NO_READ_BACK

    # --- errors ---------------------------------------------------------------------------------

    def _raise_for_status(self, resp: httpx.Response, *, what: str, bucket: str = "", acts: bool | None = None) -> None:
        """Map a non-2xx Graph answer by its error ``code`` (the module's table)."""
        status = resp.status_code
        if 200 <= status < 300:
            return
        data = _http.error_json(resp)
        err = data.get("error") if isinstance(data, dict) and isinstance(data.get("error"), dict) else {}
        code = err.get("code")
        code = int(code) if isinstance(code, int | str) and not isinstance(code, bool) and str(code).isdigit() \
            and str(code).isascii() else None
        message = err.get("message") if isinstance(err.get("message"), str) else ""
        details = (err.get("error_data") or {}).get("details") if isinstance(err.get("error_data"), dict) else None
        text = _TEXT.sub("?", (message + (f": {details}" if isinstance(details, str) else ""))[:200])
        detail = _http.redact(f"{what}: HTTP {status}" + (f" code {code}" if code is not None else "")
                              + (f" ({text})" if text else ""), self._secrets())
        acting = _http.is_acting(resp.request.method) if acts is None else acts
        if code in RATE_LIMITS or status == 429:
            wait = _http.retry_after_s(resp, self._clock.now())
            wait = wait if wait is not None else RATE_LIMITS.get(code or 0, 1.0)
            self.limits.block(bucket or self.BUCKET, wait)
            self.log.warning("replyd.whatsapp.rate_limited", what=what, code=code, wait_s=wait)
            raise RateLimited(detail, status=status, retry_after_s=wait)
        if code == WINDOW:
            raise Rejected(detail + " - outside the 24-hour customer service window: only a template message "
                           "can reach this customer now", status=status)
        if code in AUTH or status == 401:
            self.log.error("replyd.whatsapp.auth_failed", what=what, code=code)
            raise DefinitelyNotSent(detail, status=status)
        if status == 403 or (code is not None and (code == 10 or 200 <= code <= 299)):
            raise DefinitelyNotSent(detail, status=status)
        if 400 <= status < 500:
            raise Rejected(detail, status=status)
        raise (MaybeSent if acting else DefinitelyNotSent)(detail, status=status)

    # --- identity and parsing ------------------------------------------------------------------------

    def whoami(self) -> Identity:
        """``GET /{phone-number-id}``: the number's id (the sender half of the key) and its display number."""
        resp = self._call("GET", f"/{self.s.phone_number_id}", what="phone number",
                          params={"fields": "id,display_phone_number,verified_name"})
        body = _http.json_body(resp, "phone number", dict)
        pid = _http.field(body, "id", "phone number", str)
        if pid != self.s.phone_number_id:
            raise BadResponse(f"phone number: the API answered id {pid[:40]!r}, not the configured phone_number_id")
        display = body.get("display_phone_number") if isinstance(body.get("display_phone_number"), str) else ""
        self._me = Identity(sender_id=pid, handle=display or pid)
        self.log.info("replyd.whatsapp.identified", platform=self.instance, phone_number_id=pid, display=display)
        return self._me

    def _parent(self, msg: dict[str, Any], value: Mapping[str, Any]) -> Parent | str:
        """One ``value.messages[]`` item as a parent, or why it is none to answer (``BadResponse``: unreadable)."""
        wamid, sender = msg.get("id"), msg.get("from")
        if not isinstance(wamid, str) or not _WAMID.match(wamid) or not isinstance(sender, str) \
                or not _DIGITS.match(sender):
            raise BadResponse("webhook: message id or from missing or malformed")
        kind = msg.get("type") if isinstance(msg.get("type"), str) else ""
        if kind in _SKIP_TYPES:
            return "not_a_message"
        names = {c.get("wa_id"): (c.get("profile") or {}).get("name") for c in value.get("contacts") or []
                 if isinstance(c, dict) and isinstance(c.get("profile") or {}, dict)}
        text = ""
        inner = msg.get(kind) if kind else None
        if isinstance(inner, dict):
            text = inner.get("body") if isinstance(inner.get("body"), str) else str(inner.get("caption") or "")
        stamp = msg.get("timestamp")
        context = msg.get("context") if isinstance(msg.get("context"), dict) else {}
        extra: dict[str, Any] = {"wa_id": sender, "phone_number_id": self.s.phone_number_id, "type": kind,
                                 "addressed": True}
        if isinstance(context.get("id"), str):
            extra["reply_to"] = context["id"]
        name = names.get(sender)
        if isinstance(name, str):
            extra["author_name"] = name  # the profile name is the sender's pick: shown, never matched
        return Parent(id=wamid, author_id=sender, author_handle=sender,
                      text=text, created_at=float(stamp) if isinstance(stamp, str) and stamp.isdigit()
                      and stamp.isascii() else None, extra=extra)

    @staticmethod
    def _values(payload: Any) -> list[dict[str, Any]]:
        """Every ``entry[].changes[].value`` of a ``messages`` field in a delivery."""
        if not isinstance(payload, dict) or payload.get("object") != "whatsapp_business_account":
            return []
        out = []
        for entry in payload.get("entry") or []:
            for change in (entry.get("changes") or []) if isinstance(entry, dict) else []:
                if isinstance(change, dict) and change.get("field") == "messages" \
                        and isinstance(change.get("value"), dict):
                    out.append(change["value"])
        return out

    def _mine(self, value: Mapping[str, Any]) -> bool:
        """Whether a change is for this phone number (one app's webhook serves every number of the account)."""
        meta = value.get("metadata")
        return isinstance(meta, dict) and meta.get("phone_number_id") == self.s.phone_number_id

    # --- WebhookSource, WebhookReceipts ------------------------------------------------------------

    def parse_webhook(self, event: str, payload: Any) -> list[Parent] | str:
        """The parents of a delivery's ``value.messages[]`` (this number's), or why it names none."""
        values = self._values(payload)
        if not values:
            return "not_a_messages_change"
        parents: list[Parent] = []
        why = "statuses_only"
        for value in values:
            if not self._mine(value):
                why = "other_phone_number"
                continue
            messages = value.get("messages")
            for msg in messages if isinstance(messages, list) else []:
                # One message that cannot be read is reported and left out; the others of the delivery go on.
                found = self._read("webhook", msg, lambda m: self._parent(m, value), _wamid(msg))  # noqa: B023 - _read calls it at once
                if isinstance(found, Parent):
                    parents.append(found)
                else:
                    why = found or "unreadable"
        return parents or why

    def webhook_scope(self, event: str, payload: Any, parent: Parent) -> str | None:
        """Every parent ``parse_webhook`` returns was sent to this number (others were left out there)."""
        return None

    def webhook_receipts(self, payload: Any) -> list[Receipt]:
        """The ``value.statuses[]`` of this number in a delivery, with replyd's key read from the callback data."""
        out: list[Receipt] = []
        for value in self._values(payload):
            if not self._mine(value):
                continue
            for s in value.get("statuses") or []:
                if not isinstance(s, dict) or not isinstance(s.get("id"), str) or not isinstance(s.get("status"), str):
                    continue
                ours = parse_callback(s.get("biz_opaque_callback_data"))
                errors = [f"{e.get('code')} {_TEXT.sub('?', str(e.get('title') or e.get('message') or ''))[:120]}"
                          for e in s.get("errors") or [] if isinstance(e, dict)]
                out.append(Receipt(status=_TEXT.sub("?", s["status"][:20]), message_id=s["id"][:200],
                                   provider_key=ours[0] if ours else None, parent_id=ours[1] if ours else None,
                                   errors=errors))
        return out

    # --- discovery --------------------------------------------------------------------------------

    def inbox(self, cursor: str | None) -> Page:
        """Nothing to poll: the Cloud API delivers messages by webhook only."""
        return Page(parents=[], cursor=cursor)

    def search(self, query: str, cursor: str | None) -> Page:
        """A business cannot search WhatsApp: an empty page."""
        return Page(parents=[], cursor=cursor)

    def refind(self, since: float) -> list[Parent]:
        """Nothing to re-read: no call lists a chat's messages (webhooks are the only way in)."""
        return []

    def resolve(self, ref: str) -> Parent:
        """``"<wa_id>/<wamid>"`` as a parent: a reply needs the customer's number, which a wamid alone does not give."""
        wa_id, sep, wamid = ref.strip().partition("/")
        if not sep or not _DIGITS.match(wa_id) or not _WAMID.match(wamid):
            raise Rejected(f"whatsapp reference {ref[:80]!r}: expected '<wa_id>/<wamid>' (the customer's number "
                           "and the message id)")
        return Parent(id=wamid, author_id=wa_id, extra={"wa_id": wa_id, "phone_number_id": self.s.phone_number_id,
                                                        "addressed": True})

    def thread_depth(self, parent: Parent, limit: int) -> int:
        """1 when the parent quotes a message (``context.id``), else 0: the Cloud API shows one level and cannot
        read a message by id, so this is a lower bound (``max_depth`` stops a loop one level late)."""
        return min(1, limit + 1) if parent.extra.get("reply_to") is not None else 0

    # --- send, read-back, delete ------------------------------------------------------------------

    def _send_steps(self, parent: Parent, text: str, *, provider_key: str) -> _http.HttpSteps[Sent]:
        """``send`` / ``asend``: ``POST /{phone-number-id}/messages`` replying in context to the parent, replyd's key in the callback data."""
        wa_id = parent.extra.get("wa_id") if isinstance(parent.extra, dict) else None
        if not isinstance(wa_id, str) or not _DIGITS.match(wa_id):
            raise Rejected(f"whatsapp parent {parent.id[:80]!r}: no customer number (wa_id) to reply to")
        body = {"messaging_product": "whatsapp", "recipient_type": "individual", "to": wa_id, "type": "text",
                "context": {"message_id": parent.id}, "text": {"preview_url": False, "body": text},
                "biz_opaque_callback_data": callback_data(provider_key, parent.id)}
        return (yield from self._created_steps("POST", f"/{self.s.phone_number_id}/messages", parent, what="send",
                                               read=self._reply_id, json=body))

    @staticmethod
    def _reply_id(body: dict[str, Any]) -> Sent:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[0], dict) \
                or not isinstance(msgs[0].get("id"), str) or not msgs[0]["id"]:
            raise BadResponse("send: 2xx without messages[0].id")
        return Sent(reply_id=msgs[0]["id"])

    def _refused(self, exc: PlatformError) -> PlatformError:
        """A 131047 refusal is logged with its reason (the row's error says it too)."""
        if isinstance(exc, Rejected) and f"code {WINDOW}" in exc.detail:
            self.log.warning("replyd.whatsapp.window_closed", detail=exc.detail)
        return exc

    def read_back(self, pending: Sequence[Pending], *, sender_id: str) -> ReadBack:
        """Nothing can be read back on WhatsApp: nothing checked, so nothing is ever judged "not found"."""
        return ReadBack()

    def delete(self, reply_id: str) -> None:
        """The Cloud API cannot delete a message a business sent: refused, logged."""
        raise Rejected(f"whatsapp: a sent message cannot be deleted ({reply_id[:80]})")

    def addresses(self, parent: Parent, identity: Identity) -> bool:
        """Every inbound message is a direct message to the business number."""
        return parent.extra.get("addressed") is True
