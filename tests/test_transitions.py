"""The state machine's one table (``replyd.transitions``): the store refuses every other state change.

The whole suite runs with the check on, so every compare-and-set replyd's code makes is one the table
allows. These tests show the check refuses an unlisted edge on each write path, on both stores, before
any statement runs; that code taking an edge missing from the table fails; and that the diagram in
``docs/ARCHITECTURE.md`` is the table's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from replyd import store as st
from replyd import transitions
from replyd.clock import FakeClock
from replyd.guard import Guard
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Key, Store
from replyd.transitions import NEW, TABLE, TransitionError, allowed, planting

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_names_only_states_and_every_state_is_reached() -> None:
    """Each edge joins two of the model's states (or a new key); every state but none is some edge's end."""
    ends = {to for _, to in TABLE.values()}
    starts = {f for froms, _ in TABLE.values() for f in froms}
    assert ends <= set(st.STATES) and starts <= {NEW, *st.STATES}
    assert ends == set(st.STATES), f"states no event makes: {set(st.STATES) - ends}"
    # A terminal state is left only by an operator's rearm (or a confirm / late close of a doubtful send).
    for name, (froms, _to) in TABLE.items():
        if froms & {st.REJECTED, st.DECLINED, st.SKIPPED}:
            assert name == "rearm", name


def test_allowed_refuses_an_unlisted_edge_and_passes_writes_that_keep_the_state() -> None:
    allowed([st.OPEN], st.CLOSED)
    allowed([st.COMPOSING], st.COMPOSING)  # a reclaim keeps the state: no edge needed
    allowed([st.OPEN], None)  # a new deadline, no state written
    with pytest.raises(TransitionError, match="from rejected to unconfirmed"):
        allowed([st.REJECTED], st.UNCONFIRMED)
    with pytest.raises(TransitionError, match=r"from \(new\) to gave_up"):
        allowed([None], st.GAVE_UP)
    with pytest.raises(TransitionError, match="from closed to open"):
        allowed([st.OPEN, st.CLOSED], st.OPEN)  # one state among several expected is enough to refuse
    with planting():
        allowed([st.REJECTED], st.UNCONFIRMED)


@pytest.fixture
def db(store_url: str) -> Store:
    s = Store.open(store_url, clock=FakeClock())
    yield s
    s.dispose()


def _planted(s: Store, key: Key, state: str) -> None:
    with planting():
        assert s.claim(key, {"state": state, "attempt": 1, "created_at": 1.0, "updated_at": 1.0},
                       lambda row: None, {"kind": "planted"}).won


@pytest.mark.parametrize("path", ["cas_event", "transaction", "close_many", "claim_page", "claim_new"])
def test_each_write_path_refuses_an_unlisted_edge_before_writing(db: Store, path: str) -> None:
    """Every way the store writes a state checks the table first: the row stays as it was, no event is added."""
    key = Key("memory:t", "bot", "p-1")
    _planted(db, key, st.REJECTED)
    before = [e.kind for e in db.history(key)]
    with pytest.raises(TransitionError):
        if path == "cas_event":
            db.cas_event(key, states=[st.REJECTED], attempt=1, values={"state": st.UNCONFIRMED},
                         event={"kind": "bogus"})
        elif path == "transaction":
            with db.transaction() as tx:
                tx.cas_event(key, states=[st.REJECTED], attempt=1, values={"state": st.UNCONFIRMED})
        elif path == "close_many":
            other = Key("memory:t", "bot", "p-2")
            _planted(db, other, st.REJECTED)
            db.close_many([(k, [st.REJECTED], 1, {"state": st.CLOSED, "reply_id": "r", "closed_at": 2.0},
                            {"kind": "closed"}) for k in (key, other)])
        elif path == "claim_page":
            db.claim_page([(key, {"state": st.OPEN, "attempt": 2}, {"kind": "claimed"}, ([st.REJECTED], 1, None))])
        else:
            db.claim_new([(Key("memory:t", "bot", "p-new"), {"state": st.GAVE_UP, "attempt": 1, "created_at": 1.0,
                                                            "updated_at": 1.0}, {"kind": "claimed"})])
    assert db.peek(key).state == st.REJECTED
    assert [e.kind for e in db.history(key)] == before
    assert db.peek(Key("memory:t", "bot", "p-new")) is None


def test_code_that_takes_an_edge_the_table_lacks_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Take ``open -> closed`` out of the table: the guard's first answer fails loudly, and nothing is sent twice."""
    edges = transitions.EDGES - {(st.OPEN, st.CLOSED)}
    monkeypatch.setattr(transitions, "EDGES", edges)
    s = Store.open(f"sqlite:///{tmp_path / 't.sqlite3'}", clock=FakeClock())
    plat = MemoryPlatform(instance="memory:t")
    g = Guard(s, plat, plat.whoami())
    try:
        with pytest.raises(TransitionError, match="from open to closed"):
            g.post(plat.add_parent("p-1"), "hello")
        monkeypatch.setattr(transitions, "EDGES", edges | {(st.OPEN, st.CLOSED)})
        assert g.post(plat.add_parent("p-2"), "hello").status.value == "posted"
    finally:
        s.dispose()


def test_architecture_draws_the_states_from_the_table() -> None:
    """docs/ARCHITECTURE.md holds ``python -m replyd.transitions``'s output as it is: it cannot drift."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert "```mermaid\n" + transitions.diagram() + "```" in doc, "run: python -m replyd.transitions"


def test_every_step_the_guard_model_allows_is_an_edge() -> None:
    """The model test's allowed history steps (drawn from events) are all edges of the table."""
    from tests.test_guard_model import ALLOWED

    steps = {(NEW if f is None else f, to) for f, tos in ALLOWED.items() for to in tos if f != to}
    assert steps <= transitions.EDGES, sorted(steps - transitions.EDGES)
