"""In-memory state of the simulated platform: accounts, statuses, notifications, knobs.

Everything the HTTP layer serves lives here behind one lock, so tests can
drive the world in-process (``World.post``, ``World.configure``) while the
server answers real HTTP requests from other threads. Time comes from an
injected clock so listing delays can be tested with ``FakeClock``.

The report is the platform's own count of what landed; it is the ground truth
replyd is measured against and never reads replyd's log.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, fields
from typing import Any

from replyd.clock import Clock, SystemClock
from replyd.log import get_logger
from replyd.sim.model import (  # noqa: F401  (re-exported: importers name them from the world)
    _MENTION_RE, _WORDS, CREATE_FAULTS, FIRST_ID, IDEMPOTENCY_TTL_S, READ_FAULTS, VISIBILITIES, Account,
    Knobs, Notification, SimError, Status, paginate,
)

log = get_logger("replyd.sim")


class Traffic:
    """A background thread that posts generated parents at a steady rate; see ``World.start_traffic``."""

    def __init__(self, world: World, interval_s: float, total: int | None, duration_s: float | None, kw: dict[str, Any]) -> None:
        self._world = world
        self._interval = interval_s
        self._total = total
        self._duration = duration_s
        self._kw = kw
        self._stop = threading.Event()
        self.posted: list[str] = []
        self._thread = threading.Thread(target=self._run, name="replyd-sim-traffic", daemon=True)

    def _run(self) -> None:
        # Real time on purpose: traffic paces a live demo, the world clock may be fake.
        deadline = None if self._duration is None else time.monotonic() + self._duration
        while not self._stop.is_set():
            if self._total is not None and len(self.posted) >= self._total:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                self.posted.extend(s.id for s in self._world.generate(1, **self._kw))
            except Exception as exc:  # a reset may remove the users mid-run
                log.warning("replyd.sim.traffic_failed", error=repr(exc))
                break
            self._stop.wait(self._interval)

    def start(self) -> Traffic:
        """Start posting in the background."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop posting and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait until the traffic ends by itself (``total`` or ``duration_s`` reached)."""
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the thread is still posting."""
        return self._thread.is_alive()


class World:
    """All state of the simulated platform, thread-safe behind one re-entrant lock."""

    def __init__(self, clock: Clock | None = None, *, seed: int = 0, base_url: str = "http://127.0.0.1", **knobs: Any) -> None:
        self.clock: Clock = clock or SystemClock()
        self.base_url = base_url.rstrip("/")
        # Public so the HTTP layer can render a response from one consistent snapshot.
        self.lock = threading.RLock()
        self._traffic: list[Traffic] = []
        # Told of each new mention notification, under the lock (the webhook sender queues a delivery).
        self._listeners: list[Callable[[Notification], None]] = []
        self.accounts: dict[str, Account] = {}
        self._clear(seed)
        self.configure(**knobs)

    # ----- lifecycle -------------------------------------------------------------

    def _clear(self, seed: int) -> None:
        self.seed = seed
        # Separate streams so that reads cannot shift which create gets a fault.
        self._id_rng = random.Random(f"{seed}:ids")
        self._create_rng = random.Random(f"{seed}:creates")
        self._read_rng = random.Random(f"{seed}:reads")
        self._gen_rng = random.Random(f"{seed}:traffic")
        self._last_id = FIRST_ID
        self._last_notification_id = 0
        self.knobs = Knobs()
        self.statuses: dict[str, Status] = {}
        self.notifications: list[Notification] = []
        # The notification stream: cut_streams() ends every open stream and refuses new ones for a while.
        self.stream_generation = 0
        self.stream_refused_until = 0.0
        self.streams_served = 0
        self._by_account: dict[str, list[str]] = {}
        self._children: dict[str, list[str]] = {}
        self._idem: dict[tuple[str, str], tuple[str, float]] = {}
        self._create_queue: deque[str] = deque()
        self._edit_queue: deque[str] = deque()
        self.edits_attempted = 0
        self._read_queue: deque[str] = deque()
        self.creates_attempted = 0
        self.faults_injected: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (account id, method, handler) -> calls
        self._rate_windows: dict[tuple[str, int], int] = {}
        self.outages: list[tuple[float, float]] = []  # (start, end) of each error_500_for_s window

    def reset(self, *, seed: int | None = None, keep_accounts: bool = True) -> None:
        """Forget statuses, notifications, counters, fault queues and knobs; reseed the RNGs.

        Accounts (and their tokens) survive unless ``keep_accounts`` is false,
        because a running replyd is configured with a token.
        """
        self.stop_traffic()
        with self.lock:
            accounts = self.accounts if keep_accounts else {}
            self._clear(self.seed if seed is None else seed)
            self.accounts = accounts
            if keep_accounts:
                # Keep account ids ahead of the restarted sequence so ids stay unique.
                self._last_id = max([self._last_id, *(int(a) for a in accounts)])
        log.info("replyd.sim.reset", keep_accounts=keep_accounts)

    def configure(self, **knobs: Any) -> dict[str, Any]:
        """Set knobs by name (see ``Knobs``); unknown names raise ``ValueError``. Returns all knobs."""
        names = {f.name: f for f in fields(Knobs)}
        with self.lock:
            for name, value in knobs.items():
                if name not in names:
                    raise ValueError(f"unknown sim knob {name!r} (known: {', '.join(sorted(names))})")
                default = getattr(Knobs, name)
                if isinstance(default, bool):
                    value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
                else:
                    value = type(default)(value)
                    if value < 0 or (name.endswith("_rate") and value > 1):
                        raise ValueError(f"sim knob {name} out of range: {value!r}")
                setattr(self.knobs, name, value)
                if name == "error_500_for_s":
                    self._start_outage(value)
            return asdict(self.knobs)

    def _start_outage(self, seconds: float) -> None:
        """Every create fails with 500 from now for ``seconds`` (0: end the running outage now)."""
        now = self.clock.now()
        if self.outages and self.outages[-1][1] > now:
            self.outages[-1] = (self.outages[-1][0], now)  # a new setting replaces the running window
        if seconds > 0:
            self.outages.append((now, now + seconds))
        log.info("replyd.sim.outage", seconds=seconds)

    def in_outage(self, at: float | None = None) -> bool:
        """True while an ``error_500_for_s`` window covers ``at`` (default: now)."""
        t = self.clock.now() if at is None else at
        with self.lock:
            return any(start <= t < end for start, end in self.outages)

    def queue_faults(self, next_creates: Iterable[str] = (), next_readbacks: Iterable[str] = (),
                     next_edits: Iterable[str] = ()) -> dict[str, list[str]]:
        """Append deterministic faults: one per ``POST /api/v1/statuses``, one per read-back request, one per
        edit (``PUT /api/v1/statuses/:id``, the create faults' kinds)."""
        creates, reads, edits = list(next_creates), list(next_readbacks), list(next_edits)
        for kind, allowed in ([(k, CREATE_FAULTS) for k in creates + edits] + [(k, READ_FAULTS) for k in reads]):
            if kind not in allowed:
                raise ValueError(f"unknown fault {kind!r} (known: {', '.join(allowed)})")
        with self.lock:
            self._create_queue.extend(creates)
            self._read_queue.extend(reads)
            self._edit_queue.extend(edits)
            return {"next_creates": list(self._create_queue), "next_readbacks": list(self._read_queue),
                    "next_edits": list(self._edit_queue)}

    def next_edit_fault(self) -> str:
        """Count an edit attempt and pick its fault: the queue first, then ``lost_edit_rate`` (lost_drop)."""
        with self.lock:
            self.edits_attempted += 1
            if self._edit_queue:
                return self._edit_queue.popleft()
            if self.knobs.lost_edit_rate and self._create_rng.random() < self.knobs.lost_edit_rate:
                return "lost_drop"
            return "ok"

    # ----- ids and accounts --------------------------------------------------------

    def _next_id(self) -> str:
        # Gaps between ids keep clients from assuming id + 1 arithmetic.
        self._last_id += self._id_rng.randint(1, 4096)
        return str(self._last_id)

    def add_account(self, username: str, bot: bool = False, token: str | None = None, display_name: str = "") -> Account:
        """Create an account; the token defaults to ``sim-token-<username>``."""
        if not re.fullmatch(r"[A-Za-z0-9_]{1,30}", username):
            raise ValueError(f"invalid username {username!r}")
        with self.lock:
            if self.find_account(username) is not None:
                raise ValueError(f"username {username!r} is taken")
            token = token or f"sim-token-{username}"
            if any(a.token == token for a in self.accounts.values()):
                raise ValueError("token already in use")
            acc = Account(self._next_id(), username, token, bot, display_name, self.clock.now())
            self.accounts[acc.id] = acc
            return acc

    def find_account(self, ref: str | Account) -> Account | None:
        """Return the account with this id or (case-insensitive) username, or None."""
        if isinstance(ref, Account):
            return ref
        with self.lock:
            if ref in self.accounts:
                return self.accounts[ref]
            low = ref.lstrip("@").lower()
            return next((a for a in self.accounts.values() if a.username.lower() == low), None)

    def account(self, ref: str | Account) -> Account:
        """Like ``find_account`` but raise ``KeyError`` when unknown."""
        acc = self.find_account(ref)
        if acc is None:
            raise KeyError(f"no sim account {ref!r}")
        return acc

    def account_for_token(self, token: str) -> Account | None:
        """Return the account owning a bearer token, or None."""
        with self.lock:
            return next((a for a in self.accounts.values() if a.token == token), None)

    # ----- writes ----------------------------------------------------------------------

    def post(
        self,
        account: str | Account,
        text: str,
        in_reply_to_id: str | None = None,
        mention: Iterable[str | Account] = (),
        visibility: str = "public",
    ) -> Status:
        """Create a status as a simulated user (no faults, no idempotency); ``mention`` prefixes @names."""
        acc = self.account(account)
        names = [self.account(m).username for m in mention]
        prefix = " ".join(f"@{n}" for n in names if f"@{n}".lower() not in text.lower())
        status, _ = self.create_status(
            acc, {"status": f"{prefix} {text}".strip(), "in_reply_to_id": in_reply_to_id, "visibility": visibility}
        )
        return status

    def create_status(
        self, acc: Account, params: dict[str, Any], idempotency_key: str | None = None, *, via_api: bool = False
    ) -> tuple[Status, bool]:
        """Validate and create a status; return it and whether it is new (False: idempotent replay).

        Raises ``SimError`` (422 blank/too long/bad visibility, 404 unknown parent).
        """
        text = str(params.get("status") or "")
        reply_to = params.get("in_reply_to_id")
        reply_to = str(reply_to) if reply_to not in (None, "") else None
        visibility = str(params.get("visibility") or "public")
        with self.lock:
            now = self.clock.now()
            # Mastodon checks the key before validating, so a replay never re-validates.
            if idempotency_key and self.knobs.idempotency:
                hit = self._idem.get((acc.id, idempotency_key))
                if hit and now - hit[1] < IDEMPOTENCY_TTL_S and hit[0] in self.statuses:
                    return self.statuses[hit[0]], False
            if not text.strip():
                raise SimError(422, "Validation failed: Text can't be blank")
            if len(text) > self.knobs.max_characters:
                raise SimError(422, f"Validation failed: Text character limit of {self.knobs.max_characters} exceeded")
            if visibility not in VISIBILITIES:
                raise SimError(422, "Validation failed: Visibility is not included in the list")
            parent = self.statuses.get(reply_to) if reply_to else None
            if reply_to and (parent is None or parent.deleted_at is not None):
                raise SimError(404, "The post you are trying to reply to does not appear to exist.")
            mention_ids: list[str] = []
            for name in _MENTION_RE.findall(text):
                m = self.find_account(name)
                if m is not None and m.id not in mention_ids:
                    mention_ids.append(m.id)
            status = Status(
                id=self._next_id(),
                account_id=acc.id,
                text=text,
                created_at=now,
                visible_at=now + self.knobs.listing_delay_s,
                in_reply_to_id=reply_to,
                in_reply_to_account_id=parent.account_id if parent else None,
                visibility=visibility,
                mention_ids=mention_ids,
                spoiler_text=str(params.get("spoiler_text") or ""),
                sensitive=str(params.get("sensitive", "")).lower() in ("1", "true"),
                language=str(params.get("language") or "en"),
                via_api=via_api,
                idempotency_key=idempotency_key,
            )
            self.statuses[status.id] = status
            self._by_account.setdefault(acc.id, []).append(status.id)
            if reply_to:
                self._children.setdefault(reply_to, []).append(status.id)
            for mid in mention_ids:
                if mid != acc.id:
                    self._last_notification_id += 1
                    note = Notification(str(self._last_notification_id), mid, acc.id, status.id, now, status.visible_at)
                    self.notifications.append(note)
                    for listener in self._listeners:
                        listener(note)
            if idempotency_key and self.knobs.idempotency:
                self._idem[(acc.id, idempotency_key)] = (status.id, now)
            return status, True

    def edit_status(self, acc: Account, status_id: str, params: dict[str, Any]) -> Status:
        """Edit one of ``acc``'s statuses as Mastodon's ``PUT /api/v1/statuses/:id`` does: the new text replaces
        the old (same id, same place in its thread, ``edited_at`` set); 404 when missing or not its own, 422 when
        blank or too long. An edit is never a new status: the report's counts do not move."""
        text = str(params.get("status") or "")
        with self.lock:
            st = self.statuses.get(status_id)
            if st is None or st.deleted_at is not None or st.account_id != acc.id:
                raise SimError(404, "Record not found")
            if not text.strip():
                raise SimError(422, "Validation failed: Text can't be blank")
            if len(text) > self.knobs.max_characters:
                raise SimError(422, f"Validation failed: Text character limit of {self.knobs.max_characters} exceeded")
            st.text, st.edited_at, st.edits = text, self.clock.now(), st.edits + 1
            return st

    def delete(self, account: str | Account, status_id: str) -> Status:
        """Delete one of ``account``'s statuses; ``SimError(404)`` when missing or not its own."""
        acc = self.account(account)
        with self.lock:
            st = self.statuses.get(status_id)
            if st is None or st.deleted_at is not None or st.account_id != acc.id:
                raise SimError(404, "Not Found")
            st.deleted_at = self.clock.now()
            return st

    # ----- reads (visibility and listing delay applied) ---------------------------------

    def can_see(self, st: Status, viewer_id: str | None) -> bool:
        """Whether ``viewer_id`` may read ``st`` now: not deleted, past its listing delay, audience ok."""
        if st.deleted_at is not None or self.clock.now() < st.visible_at:
            return False
        if st.visibility in ("public", "unlisted"):
            return True
        return viewer_id is not None and (viewer_id == st.account_id or viewer_id in st.mention_ids)

    def get_status(self, status_id: str, viewer_id: str | None) -> Status:
        """Return a readable status or raise ``SimError(404)``."""
        with self.lock:
            st = self.statuses.get(status_id)
            if st is None or not self.can_see(st, viewer_id):
                raise SimError(404, "Not Found")
            return st

    def context(self, status_id: str, viewer_id: str | None) -> tuple[list[Status], list[Status]]:
        """Return (ancestors oldest first, descendants in thread order) that the viewer can read."""
        with self.lock:
            st = self.get_status(status_id, viewer_id)
            ancestors: list[Status] = []
            cur = st
            while cur.in_reply_to_id and cur.in_reply_to_id in self.statuses:
                cur = self.statuses[cur.in_reply_to_id]
                if self.can_see(cur, viewer_id):
                    ancestors.append(cur)
            ancestors.reverse()
            descendants: list[Status] = []
            stack = list(reversed(self._children.get(st.id, [])))
            while stack:
                cur = self.statuses[stack.pop()]
                if self.can_see(cur, viewer_id):
                    descendants.append(cur)
                stack.extend(reversed(self._children.get(cur.id, [])))
            return ancestors, descendants

    def account_statuses(self, account_id: str, viewer_id: str | None, *, exclude_replies: bool = False) -> list[Status]:
        """Return the account's readable statuses, newest first."""
        with self.lock:
            if account_id not in self.accounts:
                raise SimError(404, "Not Found")
            out = [self.statuses[i] for i in reversed(self._by_account.get(account_id, []))]
            return [
                s for s in out
                if self.can_see(s, viewer_id)
                and not (exclude_replies and s.in_reply_to_id and s.in_reply_to_account_id != account_id)
            ]

    def cut_streams(self, refuse_s: float = 0.0) -> None:
        """Close every open notification stream; refuse new ones for ``refuse_s`` seconds (a streaming outage)."""
        with self.lock:
            self.stream_generation += 1
            self.stream_refused_until = self.clock.now() + refuse_s
            self.faults_injected["stream_cut"] += 1

    def subscribe(self, listener: Callable[[Notification], None]) -> None:
        """Call ``listener`` with each new mention notification (under the world's lock: it must only queue)."""
        with self.lock:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[Notification], None]) -> None:
        """Stop calling ``listener``."""
        with self.lock:
            self._listeners = [fn for fn in self._listeners if fn != listener]  # a bound method is new each time

    def notifications_for(self, account_id: str) -> list[Notification]:
        """Return the account's readable mention notifications, newest first."""
        with self.lock:
            return [
                n for n in reversed(self.notifications)
                if n.account_id == account_id and self.can_see(self.statuses[n.status_id], account_id)
            ]

    def search_statuses(self, q: str, viewer_id: str | None) -> list[Status]:
        """Return readable statuses whose text contains ``q`` (case-insensitive), newest first."""
        needle = q.lower()
        with self.lock:
            return [
                s for s in reversed(self.statuses.values())
                if needle in s.text.lower() and self.can_see(s, viewer_id)
            ]

    def resolve_url(self, url: str, viewer_id: str | None) -> Status | None:
        """Return the readable sim status that ``url`` (its url or uri, any host) names, or None."""
        m = re.match(
            r"^https?://[^/]+/(?:@[A-Za-z0-9_]+|ap/users/\d+/statuses|users/[A-Za-z0-9_]+/statuses)/(\d+)/?$", url
        )
        if not m:
            return None
        try:
            return self.get_status(m.group(1), viewer_id)
        except SimError:
            return None

    def replies_count(self, status_id: str) -> int:
        """Number of existing replies to a status (counted at once, like Mastodon's counter)."""
        with self.lock:
            return sum(1 for c in self._children.get(status_id, []) if self.statuses[c].deleted_at is None)

    def statuses_count(self, account_id: str) -> int:
        """Number of existing statuses by an account."""
        with self.lock:
            return sum(1 for i in self._by_account.get(account_id, []) if self.statuses[i].deleted_at is None)

    def last_status_at(self, account_id: str) -> float | None:
        """Creation time of the account's newest existing status."""
        with self.lock:
            live = [self.statuses[i] for i in self._by_account.get(account_id, []) if self.statuses[i].deleted_at is None]
            return live[-1].created_at if live else None

    # ----- faults and rate limits ---------------------------------------------------------

    def next_create_fault(self) -> str:
        """Count a create attempt and pick its fault: the queue first, then the seeded rates."""
        with self.lock:
            self.creates_attempted += 1
            if self._create_queue:
                return self._create_queue.popleft()
            if self.in_outage():
                return "error_500_before"
            k = self.knobs
            # One draw per create keeps the fault sequence a function of the seed alone.
            u = self._create_rng.random()
            for kind, rate in (
                ("error_500_before", k.error_500_before_rate),
                ("rate_limit_429", k.rate_limit_rate),
                ("lost_504", k.lost_504_rate),
                ("lost_drop", k.lost_drop_rate),
            ):
                if u < rate:
                    return kind
                u -= rate
            return "ok"

    def next_read_fault(self) -> str:
        """Pick the fault for one read-back request (account statuses, context)."""
        with self.lock:
            if self._read_queue:
                return self._read_queue.popleft()
            return "error_502" if self._read_rng.random() < self.knobs.readback_error_rate else "ok"

    def record_fault(self, kind: str) -> None:
        """Count a fault that was actually applied."""
        with self.lock:
            self.faults_injected[kind] += 1
        log.info("replyd.sim.injected", fault=kind)

    def rate_limit_hit(self, token: str, limit: int, window_s: int) -> tuple[int, float]:
        """Count a request against ``token``'s window; return (remaining, reset epoch)."""
        now = self.clock.now()
        window = int(now // window_s)
        with self.lock:
            used = self._rate_windows.get((token, window), 0) + 1
            self._rate_windows[(token, window)] = used
            if len(self._rate_windows) > 10_000:  # old windows are never read again
                self._rate_windows = {k: v for k, v in self._rate_windows.items() if k[1] >= window}
            return max(0, limit - used), float((window + 1) * window_s)

    # ----- measurement -----------------------------------------------------------------------

    def replies_by(self, account_id: str) -> dict[str, int]:
        """Existing replies per parent id written by ``account_id``."""
        with self.lock:
            out: Counter[str] = Counter()
            for i in self._by_account.get(account_id, []):
                s = self.statuses[i]
                if s.in_reply_to_id and s.deleted_at is None:
                    out[s.in_reply_to_id] += 1
            return dict(out)

    def count_request(self, account_id: str, method: str, handler: str) -> None:
        """Count one authenticated API request (the HTTP layer calls this)."""
        with self.lock:
            self.requests[(account_id, method, handler)] += 1

    def reads(self, account_id: str | None = None) -> dict[str, int]:
        """GET requests per handler (``notifications``, ``search``, ...), of one account or all."""
        with self.lock:
            out: Counter[str] = Counter()
            for (acc, method, handler), n in self.requests.items():
                if method == "GET" and (account_id is None or acc == account_id):
                    out[handler] += n
            return dict(out)

    def duplicates(self, account_id: str | None = None) -> int:
        """Sum over (parent, account) of existing replies beyond the first (one account or all)."""
        parents = self.report()["parents"]
        return sum(
            max(0, n - 1)
            for per in parents.values()
            for acc, n in per.items()
            if account_id is None or acc == account_id
        )

    def report(self) -> dict[str, Any]:
        """Platform-side counts: replies per parent and account, duplicates, attempts, faults."""
        with self.lock:
            parents: dict[str, dict[str, int]] = {}
            deleted = 0
            for s in self.statuses.values():
                if not s.in_reply_to_id:
                    continue
                if s.deleted_at is not None:
                    deleted += 1
                    continue
                per = parents.setdefault(s.in_reply_to_id, {})
                per[s.account_id] = per.get(s.account_id, 0) + 1
            return {
                "parents": parents,
                "replies_total": sum(sum(p.values()) for p in parents.values()),
                "duplicates": sum(max(0, n - 1) for p in parents.values() for n in p.values()),
                "deleted_replies": deleted,
                "statuses_total": len(self.statuses),
                "creates_attempted": self.creates_attempted,
                "edits_attempted": self.edits_attempted,
                "edits": sum(s.edits for s in self.statuses.values()),
                "faults_injected": dict(self.faults_injected),
                "outages": [list(w) for w in self.outages],
            }

    # ----- traffic ------------------------------------------------------------------------------

    def generate(
        self,
        n: int,
        *,
        target: str | Sequence[str] | None = None,
        mention_fraction: float = 1.0,
        question_fraction: float = 0.5,
        query_word: str | None = None,
        query_fraction: float = 1.0,
        users: int = 3,
    ) -> list[Status]:
        """Post ``n`` parents by users ``user1..userN`` (created on demand), deterministic per seed.

        A post mentions the target (default: every bot account) with
        probability ``mention_fraction``, ends with a question with
        ``question_fraction`` and contains ``query_word`` with ``query_fraction``.
        """
        out = []
        with self.lock:
            if target is None:
                targets = [a.username for a in self.accounts.values() if a.bot]
            else:
                targets = [target] if isinstance(target, str) else list(target)
            for _ in range(n):
                rng = self._gen_rng
                user = f"user{rng.randint(1, max(1, users))}"
                if self.find_account(user) is None:
                    self.add_account(user)
                words = rng.sample(_WORDS, 3)
                text = f"thinking about {words[0]}, {words[1]} and {words[2]}"
                if query_word and rng.random() < query_fraction:
                    text += f" #{query_word}" if rng.random() < 0.5 else f" {query_word}"
                text += "?" if rng.random() < question_fraction else "."
                mention = targets if targets and rng.random() < mention_fraction else []
                out.append(self.post(user, text, mention=mention))
        return out

    def start_traffic(
        self,
        rate_per_s: float,
        *,
        total: int | None = None,
        duration_s: float | None = None,
        **generate_kw: Any,
    ) -> Traffic:
        """Post parents in a background thread at ``rate_per_s`` until ``total`` posts or ``duration_s``.

        ``generate_kw`` are ``generate``'s options (target, mention_fraction,
        question_fraction, query_word, query_fraction, users).
        """
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be > 0")
        traffic = Traffic(self, 1.0 / rate_per_s, total, duration_s, generate_kw)
        with self.lock:
            self._traffic = [t for t in self._traffic if t.running]
            self._traffic.append(traffic)
        log.info("replyd.sim.traffic_started", rate_per_s=rate_per_s, total=total, duration_s=duration_s)
        return traffic.start()

    def stop_traffic(self) -> None:
        """Stop every traffic thread this world started."""
        with self.lock:
            running, self._traffic = self._traffic, []
        for t in running:
            t.stop()
