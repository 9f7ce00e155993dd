"""The answered-log's state machine in one table: which event moves a row from which states to which.

Rule 1: every write that changes a row's ``state`` must be an edge of ``TABLE``. The store checks each
one (``allowed``) before it runs the statement, and refuses any other with ``TransitionError``. So a new
transition written in code but not here fails the first test that takes it. ``NEW`` stands for "no row
yet": a claim or a found parent inserts the row.

Read the table as: event name -> (the states it leaves, the state it makes). A write that keeps the
row's state (a new deadline, a lease, an error) is no transition and needs no line here.
``docs/ARCHITECTURE.md`` draws the states from this table (``python -m replyd.transitions``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from replyd.store.model import (CLOSED, COMPOSING, DECLINED, GAVE_UP, NOT_LANDED, OPEN, PARTS, REJECTED, RELEASED,
                                SKIPPED, STATES, UNCONFIRMED)

NEW = "(new)"  # no row yet: the state a claim or a found parent starts from

# event -> (from states, to state). A row's own write of its state (a reclaim of an expired lease keeps
# ``composing``) is no edge.
TABLE: dict[str, tuple[frozenset[str], str]] = {
    # A path claims a parent: a new key, or a row that waits for it (held, proven lost, a composer's
    # expired lease). The responder composes next.
    "claim": (frozenset({NEW, RELEASED, NOT_LANDED}), COMPOSING),
    # A claim whose text is known already (the API, the library, a template) opens at once.
    "claim_open": (frozenset({NEW, RELEASED, NOT_LANDED, COMPOSING}), OPEN),
    # A found parent waits in a row: held by a cap, kept by a webhook, rearmed after a policy skip.
    "hold": (frozenset({NEW}), RELEASED),
    # The composed answer goes out: the row opens, durably, before the send.
    "open": (frozenset({COMPOSING}), OPEN),
    # A send tried again on a row the sweep judged (proven lost, or out of looks).
    "reopen": (frozenset({NOT_LANDED, GAVE_UP}), OPEN),
    # An answer in several parts: stored; each part is then a row of its own.
    "split": (frozenset({COMPOSING}), PARTS),
    # The reply is on the platform: the send's answer, a read-back, the last part, an operator's confirm,
    # or a late landing of an earlier attempt (a row judged or released since is reconciled).
    "close": (frozenset({OPEN, PARTS, NOT_LANDED, GAVE_UP, UNCONFIRMED, RELEASED}), CLOSED),
    # A reply made before replyd knew the parent (a new store adopts it).
    "adopt": (frozenset({NEW}), CLOSED),
    # The read-back proved the send did not land, or an outage excused an attempt.
    "not_landed": (frozenset({OPEN, GAVE_UP}), NOT_LANDED),
    # The parent goes back to waiting: nothing to say now, a send proven not sent, a capped parent.
    "release": (frozenset({COMPOSING, OPEN, NOT_LANDED, GAVE_UP}), RELEASED),
    # The platform refused the answer for good.
    "reject": (frozenset({OPEN, PARTS}), REJECTED),
    # The responder declined to answer.
    "decline": (frozenset({COMPOSING}), DECLINED),
    # Offered again, and the policy now rules the parent out for good (an answer in parts too).
    "skip": (frozenset({COMPOSING, RELEASED, NOT_LANDED, PARTS}), SKIPPED),
    # Out of looks: the sweep stops, a person decides. An answer in parts ends as its stopped part did.
    "give_up": (frozenset({OPEN, PARTS}), GAVE_UP),
    # A send that may have landed where nothing reads it back: a person settles it (a part's too).
    "unconfirm": (frozenset({OPEN, PARTS}), UNCONFIRMED),
    # An operator's rearm of a decided row: claimable again.
    "rearm": (frozenset({REJECTED, UNCONFIRMED, GAVE_UP, DECLINED, SKIPPED}), RELEASED),
}

EDGES: frozenset[tuple[str, str]] = frozenset((f, to) for froms, to in TABLE.values() for f in froms)


class TransitionError(RuntimeError):
    """A write would move a row along an edge ``TABLE`` does not list: a bug in replyd, never bad input.

    Not a ``ReplydError``: no handler of expected failures may take it for one.
    """


# Set only by ``planting``: a test that writes a row straight into a state no event makes. A process-wide
# count, not a context variable: the async face runs the write on a store thread of its own.
_planting = 0
_planting_lock = threading.Lock()


@contextmanager
def planting() -> Iterator[None]:
    """For test fixtures only: the writes in this block may set any state (a row planted as a scenario needs)."""
    global _planting
    with _planting_lock:
        _planting += 1
    try:
        yield
    finally:
        with _planting_lock:
            _planting -= 1


def allowed(states: Iterable[str | None], to: object) -> None:
    """Raise ``TransitionError`` unless every move from ``states`` to ``to`` is an edge of ``TABLE``.

    ``states`` holds the states the write expects (None or ``NEW``: no row yet). ``to`` is the written state;
    a write that sets no state (None) or keeps it is no transition.
    """
    if not isinstance(to, str):
        return
    if _planting:
        return
    for f in states:
        f = NEW if f is None else f
        if f != to and (f, to) not in EDGES:
            raise TransitionError(f"no transition from {f} to {to} in replyd.transitions.TABLE")


def diagram() -> str:
    """The table as Mermaid ``stateDiagram-v2`` text: one arrow per edge, labelled with its events."""
    labels: dict[tuple[str, str], list[str]] = {}
    for name, (froms, to) in TABLE.items():
        for f in sorted(froms):
            labels.setdefault((f, to), []).append(name)
    lines = ["stateDiagram-v2"]
    for (f, to), names in sorted(labels.items()):
        lines.append(f"    {'[*]' if f == NEW else f} --> {to}: {', '.join(names)}")
    return "\n".join(lines) + "\n"


assert set(s for froms, to in TABLE.values() for s in (*froms, to)) <= {NEW, *STATES}

if __name__ == "__main__":
    sys.stdout.write(diagram())
