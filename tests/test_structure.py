"""Structural rules: one choke point for sends, schema migrations match the models."""

from __future__ import annotations

import ast
from pathlib import Path

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import replyd
from replyd.store import SQLModel, Store

PKG = Path(replyd.__file__).parent
# Adapters define send; the sim implements the platform side. Neither posts through an adapter.
DEFINERS = {PKG / "guard.py"}
EXEMPT_DIRS = {PKG / "platforms", PKG / "sim"}


def _platform_send_calls(path: Path) -> list[int]:
    """Return line numbers of `<something>.send(...)` calls in a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "send"
    ]


def test_only_the_guard_calls_a_platform_send():
    """No module of replyd outside guard.py calls `.send(`: every reply leaves through Guard.post."""
    offenders = {}
    for path in PKG.rglob("*.py"):
        if path in DEFINERS or any(d in path.parents for d in EXEMPT_DIRS):
            continue
        lines = _platform_send_calls(path)
        if lines:
            offenders[str(path.relative_to(PKG))] = lines
    assert offenders == {}, f"platform sends outside the guard: {offenders}"
    assert _platform_send_calls(PKG / "guard.py"), "the guard must be the one caller of send"


def test_adapters_do_not_call_each_others_send():
    """Adapters never call another adapter's send (only their own HTTP client)."""
    for path in (PKG / "platforms").glob("*.py"):
        src = path.read_text()
        assert "platform.send(" not in src and "guard.post(" not in src, path.name


def test_migrations_match_models(tmp_path):
    """The alembic migrations create exactly the schema the SQLModel tables describe."""
    store = Store.open(f"sqlite:///{tmp_path / 'm.sqlite3'}")
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    store.dispose()
    assert diff == [], diff


def test_migrations_match_models_on_postgres(pg_url):
    """Same check on PostgreSQL, whose types differ from SQLite's."""
    eng = sa.create_engine(pg_url)
    with eng.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    eng.dispose()
    assert diff == [], diff
