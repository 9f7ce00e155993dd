"""Structural rules (on the AST): one choke point for sends in any form, schema migrations match the models."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

import replyd
from replyd.store import Store
from replyd.store.schema import METADATA

PKG = Path(replyd.__file__).parent
THE_GUARD = PKG / "guard.py"
# The faces of the one state machine (replyd.core): each one's driver runs the core's Send effect, nothing else does.
THE_FACES = {THE_GUARD, PKG / "aio.py"}
# Ways to name an attribute by a string: a "send" given to any of these reaches a platform's send.
BY_NAME = {"getattr", "hasattr", "attrgetter", "methodcaller", "__getattribute__", "getattr_static", "__getattr__"}
# getattr with a computed name could compute "send": each one outside the guard is listed with why it cannot.
DYNAMIC_GETATTR_OK = {
    ("__init__.py", "getattr(importlib.import_module(module), name)"): "lazy re-export of replyd's own names",
    ("store/__init__.py", "getattr(importlib.import_module(module), name)"): "lazy re-export of the store's names",
    ("log.py", "getattr(logging, level.upper())"): "a logging level constant",
    ("core.py", "getattr(parent, n)"): "a Parent's dataclass fields (snapshot_json)",
    ("metrics.py", "getattr(res, name, 0)"): "a SweepResult counter",
    ("responders/template.py", "getattr(parent, f)"): "template fields of a Parent (_FIELDS)",
    ("demo.py", "getattr(self.pollers, p)"): "the demo's poller method names (inbox, search, refind)",
    ("sweep.py", "getattr(self, name)"): "SweepResult counters",
    ("integrations/hermes.py", "getattr(self._real, name)"):
        "hermes' client proxies: every name but the guarded create call goes to the real client",
    ("integrations/hermes.py", "getattr(entry, f.name)"): "the fields of hermes' platform registry entry",
    ("sweep.py", "getattr(other, name)"): "SweepResult counters",
    ("sim/world.py", "getattr(Knobs, name)"): "the sim's knob defaults",
    ("sim/__main__.py", "getattr(args, f.name)"): "the sim's parsed arguments",
    ("api/app.py", "getattr(self, op.handler)"): "the API's handler names in api.openapi.ROUTES",
    ("cli/common.py", "getattr(self._console, name)"): "the CLI's rich Console, made on first use",
    ("sim/discord.py", "getattr(self.world, lost_count)"): "the Discord fake's lost-answer counters",
    ("sim/telegram.py", "getattr(self, f'_m_{method}', None)"): "the Bot API fake's method handlers",
}
# A ``.send`` that is no platform's send, each listed with why: (module, the attribute expression).
NOT_A_PLATFORM_SEND = {
    ("integrations/hermes.py", "adapter.send"):
        "hermes' own adapter method, wrapped so its final answer goes through the guard",
    ("platforms/slack.py", "ws.send"): "Socket Mode's envelope ack on the adapter's own WebSocket, never a reply",
    ("platforms/discord.py", "ws.send"): "Gateway frames (identify, resume, heartbeats) on the adapter's own WebSocket",
    ("core.py", "self.steps.send"): "the generator protocol: an effect's result handed back to the decision",
    ("platforms/_http.py", "self._steps.send"): "the generator protocol: a response handed back to a request's steps",
    ("platforms/_http.py", "client.send"): "an httpx client's send of the request the sync driver built first",
    ("platforms/_http.py", "aclient.send"): "an httpx client's send of the request the async driver built first",
    ("store/base.py", "steps.send"): "the generator protocol: a statement's rows handed back to the store's steps",
    ("store/aiopg.py", "steps.send"): "the generator protocol: a statement's rows handed back to the store's steps",
}


def _call_name(func: ast.expr) -> str:
    """The called function's last name (``getattr``, ``operator.attrgetter`` -> ``attrgetter``)."""
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def send_references(source: str, module: str = "<snippet>") -> list[str]:
    """Every way a module refers to something's ``send``: ``x.send`` (called, stored or aliased),
    ``getattr(x, "send")`` and the other by-name lookups, ``x.__dict__["send"]``, ``from m import send``,
    and any ``getattr`` whose name is computed (unless listed in ``DYNAMIC_GETATTR_OK``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr == "send":
            if (module, ast.unparse(node)) not in NOT_A_PLATFORM_SEND:
                found.append(f"{module}:{line}: attribute .send")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "send":
            found.append(f"{module}:{line}: subscript ['send']")
        elif isinstance(node, (ast.ImportFrom, ast.Import)) and any(a.name.split(".")[-1] == "send" for a in node.names):
            found.append(f"{module}:{line}: import of send")
        elif isinstance(node, ast.Call) and _call_name(node.func) in BY_NAME:
            names = [a for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if any(a.value == "send" for a in names):
                found.append(f"{module}:{line}: {_call_name(node.func)}(..., 'send')")
            elif _call_name(node.func) == "getattr" and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                if (module, ast.unparse(node)) not in DYNAMIC_GETATTR_OK:
                    found.append(f"{module}:{line}: getattr with a computed name: {ast.unparse(node)}")
    return found


def test_only_the_guard_refers_to_a_platform_send():
    """No module of replyd but the guard's two faces (guard.py, aio.py: the drivers of replyd.core's Send effect)
    refers to a send in any form (AST): every reply leaves through the core's ``send_steps``."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path not in THE_FACES:
            offenders += send_references(path.read_text(), str(path.relative_to(PKG)))
    assert offenders == [], "platform sends outside the guard:\n" + "\n".join(offenders)
    for face in THE_FACES:
        assert send_references(face.read_text()), f"{face.name}: a face of the guard must run the core's send"


EVASIONS = {
    "call": "def f(platform, p):\n    return platform.send(p, 'x', provider_key='k')\n",
    "alias": "def f(platform, p):\n    post = platform.send\n    return post(p, 'x')\n",
    "unbound": "from replyd.platforms.mastodon import MastodonPlatform\nfn = MastodonPlatform.send\n",
    "getattr": "def f(platform, p):\n    fn = getattr(platform, 'send')\n    fn(p, 'x')\n",
    "getattr computed": "def f(platform, p):\n    fn = getattr(platform, 'se' + 'nd')\n    fn(p, 'x')\n",
    "attrgetter": "import operator\nfn = operator.attrgetter('send')\n",
    "methodcaller": "from operator import methodcaller\nfn = methodcaller('send', 1, 'x')\n",
    "dunder": "def f(platform):\n    return type(platform).__dict__['send']\n",
    "getattribute": "def f(platform):\n    return platform.__getattribute__('send')\n",
    "import": "from replyd.platforms.memory import send as post\n",
}


@pytest.mark.parametrize("how", sorted(EVASIONS))
def test_the_send_rule_catches_every_evasion(how):
    """Each way of reaching a send without writing ``.send(`` is caught; ordinary code is not."""
    assert send_references(EVASIONS[how])
    harmless = ("def f(platform, p, metrics):\n    metrics.error(platform, 'send', None)\n"
                "    return getattr(p, 'close', None), p.sender_id\n")
    assert send_references(harmless) == []


def test_adapters_do_not_post_through_the_guard():
    """Adapters never call the guard (a platform posting through replyd would loop)."""
    for path in (PKG / "platforms").glob("*.py"):
        assert "guard.post(" not in path.read_text(), path.name


def test_migrations_match_models(tmp_path):
    """The alembic migrations create exactly the schema the SQLModel tables describe."""
    url = f"sqlite:///{tmp_path / 'm.sqlite3'}"
    Store.open(url).dispose()
    eng = sa.create_engine(url)
    with eng.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), METADATA)
    eng.dispose()
    assert diff == [], diff


def test_migrations_match_models_on_postgres(pg_url):
    """Same check on PostgreSQL, whose types differ from SQLite's."""
    eng = sa.create_engine(pg_url)
    with eng.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), METADATA)
    eng.dispose()
    assert diff == [], diff


def test_the_origin_migration_keeps_rows_both_ways(tmp_path):
    """0009 adds replies.origin_id, NULL on the rows 0008 left (their author is their only sender); its downgrade
    drops the column and keeps the rows."""
    from alembic import command

    from replyd import migrate

    url = f"sqlite:///{tmp_path / 'm.sqlite3'}"
    eng = sa.create_engine(url)

    def to(revision: str, how: str = "upgrade") -> None:
        cfg = migrate._config()
        with eng.connect() as conn:
            cfg.attributes["connection"] = conn
            getattr(command, how)(cfg, revision)
            conn.commit()

    def columns() -> set[str]:
        return {c["name"] for c in sa.inspect(eng).get_columns("replies")}

    to("0008")
    with eng.begin() as conn:
        conn.exec_driver_sql("INSERT INTO replies (platform, sender_id, parent_id, state, attempt, created_at,"
                             " updated_at, path, snapshot, author_id) VALUES ('sim', 's', 'p1', 'closed', 1, 1.0, 1.0,"
                             " 'inbox', '{}', 'a@x.example')")
    to("0009")
    assert "origin_id" in columns()
    with eng.connect() as conn:
        assert conn.exec_driver_sql("SELECT author_id, origin_id FROM replies").all() == [("a@x.example", None)]
    to("0008", "downgrade")
    assert "origin_id" not in columns()
    with eng.connect() as conn:
        assert conn.exec_driver_sql("SELECT parent_id, author_id FROM replies").all() == [("p1", "a@x.example")]
    eng.dispose()
