"""The claim's two guarantees, each shown deterministically on the real databases.

Atomic: a rival commits the key between this claimer's read and its write (two stores, two connections,
interleaved at exactly that point, not a race left to chance): exactly one wins, on SQLite and PostgreSQL.
Durable: on PostgreSQL a trigger deferred to commit time records each transaction's ``synchronous_commit``;
the transaction that commits an ``open`` row through ``Guard.post`` must not be the relaxed kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from replyd import store as st
from replyd.guard import Guard, Status
from replyd.platforms.memory import MemoryPlatform
from replyd.store import Key, Store


def _new(clock, owner: str) -> dict:
    """The values of a fresh open row claimed by ``owner``."""
    return {"state": st.OPEN, "attempt": 1, "created_at": clock.now(), "updated_at": clock.now(), "owner": owner}


def test_claim_is_atomic_when_a_rival_commits_between_read_and_write(store_url, clock, monkeypatch):
    """B reads the key as free, then A claims and commits it, then B writes: one winner, its row, one claimed event."""
    a, b = Store.open(store_url, clock=clock), Store.open(store_url, clock=clock)
    key = Key("p", "s", "contested")
    won: dict[str, bool] = {}
    real_peek = b._peek_with  # the row read a claim decides on; the rival commits right after it

    def read_then_rival_commits(fairy, k):
        """B's read of the row, then A's whole claim, committed, before B goes on."""
        row = real_peek(fairy, k)
        if "A" not in won:
            won["A"] = a.claim(key, _new(clock, "A"), lambda r: None, {"kind": "claimed", "owner": "A"}).won
        return row

    monkeypatch.setattr(b, "_peek_with", read_then_rival_commits)
    try:
        won["B"] = b.claim(key, _new(clock, "B"), lambda r: None, {"kind": "claimed", "owner": "B"}).won
        if "A" not in won:  # B never read before writing (PostgreSQL inserts first): A comes second
            won["A"] = a.claim(key, _new(clock, "A"), lambda r: None, {"kind": "claimed", "owner": "A"}).won
        winners = [who for who, w in won.items() if w]
        assert len(winners) == 1, won
        row = a.get(key)
        assert row is not None and row.owner == winners[0] and row.state == st.OPEN
        claimed = [e.owner for e in a.history(key) if e.kind == "claimed"]
        assert claimed == winners, claimed
    finally:
        a.dispose()
        b.dispose()


COMMIT_MODES = """
CREATE TABLE commit_modes (kind TEXT, state TEXT, mode TEXT);
CREATE FUNCTION note_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO commit_modes VALUES (NEW.kind, NEW.state, current_setting('synchronous_commit'));
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER note_commit_mode AFTER INSERT ON events
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION note_commit_mode();
"""


@contextmanager
def commit_modes(pg_url: str) -> Iterator[Callable[[], list[tuple[str, str | None, str]]]]:
    """An emptied log whose events record their transaction's synchronous_commit; yields a reader of them."""
    eng = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.exec_driver_sql("TRUNCATE replies, events, cursors")
        c.exec_driver_sql(COMMIT_MODES)

    def modes() -> list[tuple[str, str | None, str]]:
        with eng.connect() as c:
            return [tuple(r) for r in c.exec_driver_sql("SELECT kind, state, mode FROM commit_modes")]

    try:
        yield modes
    finally:
        with eng.connect() as c:
            c.exec_driver_sql("DROP TRIGGER IF EXISTS note_commit_mode ON events; DROP FUNCTION IF EXISTS "
                              "note_commit_mode(); DROP TABLE IF EXISTS commit_modes")
        eng.dispose()


def test_postgres_claim_commits_synchronously_through_the_guard(pg_url, clock):
    """Every transaction that commits an open row via Guard.post (text and responder) keeps synchronous_commit on."""
    with commit_modes(pg_url) as read_modes:
        eng = sa.create_engine(pg_url)
        with eng.connect() as c:
            default = c.exec_driver_sql("SHOW synchronous_commit").scalar()
        eng.dispose()
        store = Store.open(pg_url, clock=clock)
        try:
            assert default != "off", "the server itself commits asynchronously: this test cannot tell"
            plat = MemoryPlatform(clock=clock)
            g = Guard(store, plat, plat.whoami(), clock=clock)
            assert g.post(plat.add_parent("text"), "a reply").status is Status.POSTED
            assert g.post(plat.add_parent("composed"), lambda p: "composed reply").status is Status.POSTED
            store.record(Key("p", "s", "probe"), "probe", owner="t")  # a relaxed write: the trigger must see "off"
            modes = read_modes()
            assert ("probe", None, "off") in modes, modes
            opened = [(k, m) for k, s, m in modes if s == st.OPEN]
            assert len(opened) >= 2, modes  # both parents' open rows were seen committing
            assert all(m == default for _, m in opened), f"an open row committed relaxed: {modes}"
        finally:
            store.dispose()
