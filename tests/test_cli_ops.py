"""The operator CLI on a live log: log, rearm, adopt and export against the sim.

Most calls run the Typer app in this process (a subprocess costs seconds of
imports each); one call per command runs ``python -m replyd`` for real, exit
codes and the error mapping of ``main`` included.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time

from typer.testing import CliRunner

from replyd.cli import app
from replyd.config import Config
from replyd.daemon import Daemon
from tests.api_harness import BOT, replyd_cli, running, sim_world, wait_visible, write_config


def cli(*args: str):
    """Run the replyd CLI in this process; returns Click's Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(app, list(args))


def _post(h, pid: str, text: str = "hi") -> int:
    with h.client() as c:
        return c.post("/v1/replies", json={"platform": "sim", "parent_id": pid, "text": text}).status_code


def test_log_filters_and_json(tmp_path, monkeypatch):
    """replyd log shows recent events newest first and filters by kind, state, platform and path."""
    with running(tmp_path, monkeypatch) as h:
        ok, bad = h.parent(), h.parent()
        assert _post(h, ok) == 201 and _post(h, bad, "x" * 600) == 409
        cfg = ["--config", str(h.config)]
        r = cli("log", *cfg, "--json")
        assert r.exit_code == 0, r.stderr
        evs = json.loads(r.stdout)
        assert [e["kind"] for e in evs] == ["rejected", "claimed", "closed", "claimed"]
        assert all(e["path"] == "api" for e in evs)
        only = json.loads(cli("log", *cfg, "--json", "--kind", "rejected").stdout)
        assert [(e["parent_id"], e["state"]) for e in only] == [(bad, "rejected")]
        assert [e["kind"] for e in json.loads(cli("log", *cfg, "--json", "--state", "closed").stdout)] == ["closed"]
        assert json.loads(cli("log", *cfg, "--json", "--path", "inbox").stdout) == []
        assert len(json.loads(cli("log", *cfg, "--json", "--platform", "127.0.0.1").stdout)) == 4
        assert len(json.loads(cli("log", *cfg, "--json", "--parent", ok, "--limit", "1").stdout)) == 1
        table = replyd_cli("log", *cfg)
        assert table.returncode == 0 and "recent events" in table.stdout and bad in table.stdout
        wrong = replyd_cli("log", *cfg, "--state", "nope")
        assert wrong.returncode == 2 and "--state" in wrong.stderr


def test_rearm_from_the_cli(tmp_path, monkeypatch):
    """replyd rearm releases a rejected key (event rearmed, by cli); the next post answers; a second rearm exits 1."""
    with running(tmp_path, monkeypatch) as h:
        pid = h.parent()
        assert _post(h, pid, "x" * 600) == 409
        cfg = ["--config", str(h.config)]
        r = replyd_cli("rearm", "sim", pid, *cfg, "--reason", "text was too long")
        assert r.returncode == 0, r.stderr
        assert "rearmed" in r.stdout and "released" in r.stdout
        again = cli("rearm", h.instance, pid, *cfg, "--json")
        assert again.exit_code == 1 and json.loads(again.stdout) == {
            "rearmed": False, "previous_state": "released", "state": "released"}
        assert cli("rearm", "sim", "no-such-parent", *cfg).exit_code == 1
        assert _post(h, pid, "short") == 201 and h.bot_replies(pid) == 1
        ev = json.loads(cli("log", *cfg, "--json", "--kind", "rearmed").stdout)
        assert ev[0]["detail"] == {"by": "cli", "from": "rejected", "reason": "text was too long"}


def test_adopt_records_old_replies_and_they_are_not_answered_again(tmp_path, monkeypatch):
    """A parent the bot answered before replyd existed is adopted closed; the daemon then answers only the new one."""
    with sim_world(monkeypatch, listing_delay_s=0.2) as (world, srv, bot):
        world.add_account("alice")
        old = world.post("alice", "@replybot answered long ago?")
        new = world.post("alice", "@replybot and this one?")
        mine = world.post(BOT, "@alice an answer from before replyd", in_reply_to_id=old.id)
        for s in (old, new, mine):
            wait_visible(world, s)
        db = tmp_path / "r.sqlite3"
        cfg = write_config(tmp_path / "c.toml", srv.base_url, db, api=False, pollers=True)
        env = {"SIM_TOKEN": os.environ["SIM_TOKEN"]}

        dry = cli("adopt", "--config", str(cfg), "--dry-run", "--json")
        assert dry.exit_code == 0, dry.stderr
        assert json.loads(dry.stdout)["sim"]["adopted"] == {old.id: mine.id}
        assert not db.exists() or "adopted" not in cli("log", "--config", str(cfg), "--json").stdout

        r = replyd_cli("adopt", "--config", str(cfg), "--json", env=env)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)["sim"]
        assert rep["adopted"] == {old.id: mine.id} and rep["unanswered"] == [new.id] and rep["unknown"] == []
        ex = json.loads(cli("explain", old.id, "--config", str(cfg), "--json").stdout)[0]
        assert ex["row"]["state"] == "closed" and ex["row"]["reply_id"] == mine.id and ex["row"]["path"] == "adopt"
        assert [e["kind"] for e in ex["events"]] == ["adopted"]
        again = cli("adopt", "--config", str(cfg), "--parent", old.id, "--json")
        assert again.exit_code == 0 and json.loads(again.stdout)["sim"]["tracked"] == [old.id]
        assert cli("adopt", "--config", str(cfg), "--parent", old.id).exit_code == 0  # the table renders

        d = Daemon(Config.load(cfg))
        d.start()
        try:
            end = time.monotonic() + 30
            while not world.replies_by(bot.id).get(new.id) and time.monotonic() < end:
                time.sleep(0.1)
            time.sleep(1.5)  # several more inbox and re-find rounds offer the old parent again
        finally:
            d.stop(grace_s=5)
        per = world.replies_by(bot.id)
        assert per.get(new.id) == 1 and per.get(old.id) == 1  # the old thread was not answered again
        assert world.report()["duplicates"] == 0


def test_export_csv_and_json(tmp_path, monkeypatch):
    """replyd export writes the replies table and the events table as CSV or JSON, to stdout or a file."""
    with running(tmp_path, monkeypatch) as h:
        a, b = h.parent(), h.parent()
        assert _post(h, a) == 201 and _post(h, b, "x" * 600) == 409
        cfg = ["--config", str(h.config)]
        r = cli("export", *cfg)
        assert r.exit_code == 0, r.stderr
        rows = list(csv.DictReader(io.StringIO(r.stdout)))
        assert {(x["parent_id"], x["state"]) for x in rows} == {(a, "closed"), (b, "rejected")}
        assert {"platform", "sender_id", "parent_id", "state", "attempt", "reply_id", "path"} <= set(rows[0])
        ev = json.loads(cli("export", *cfg, "--table", "events", "--format", "json").stdout)
        assert [e["kind"] for e in ev] == ["claimed", "closed", "claimed", "rejected"]
        assert ev[1]["detail"]["reply_id"]
        out = tmp_path / "events.csv"
        w = replyd_cli("export", *cfg, "--table", "events", "-o", str(out))
        assert w.returncode == 0 and "wrote 4 events" in w.stderr
        back = list(csv.DictReader(out.open()))
        assert len(back) == 4 and json.loads(back[1]["detail"])["reply_id"] == ev[1]["detail"]["reply_id"]
        assert json.loads(cli("export", *cfg, "--format", "json", "--since", "9999999999").stdout) == []
        bad = replyd_cli("export", *cfg, "--table", "nope")
        assert bad.returncode == 2 and "--table" in bad.stderr


def test_rearm_by_bot_name_reads_the_store_alone(tmp_path, monkeypatch):
    """`replyd rearm sim PARENT` with the platform token unset: the config maps the name to the key, the store
    says which account; without a config the refusal says where the id's rows are instead of "no row"."""
    with running(tmp_path, monkeypatch) as h:
        pid = h.parent()
        assert _post(h, pid, "x" * 600) == 409
        monkeypatch.delenv("SIM_TOKEN")  # the daemon is logged in; the operator's shell has no platform secret
        alone = replyd_cli("rearm", "sim", pid, "--store", str(h.db), env={"REPLYD_CONFIG": ""})
        assert alone.returncode == 1, alone.stderr
        said = " ".join(alone.stderr.split())
        assert f"rows for this id: {h.instance} (sender {h.bot.id})" in said and "--config" in said, said
        r = replyd_cli("rearm", "sim", pid, env={"REPLYD_CONFIG": str(h.config)})
        assert r.returncode == 0 and "was rejected, now released" in r.stdout, r.stderr
        ev = json.loads(cli("log", "--config", str(h.config), "--json", "--kind", "rearmed").stdout)
        assert [(e["parent_id"], e["detail"]["by"]) for e in ev] == [(pid, "cli")]
        assert _post(h, pid, "short") == 201 and h.bot_replies(pid) == 1


def test_rearm_many_by_state_and_since(tmp_path, monkeypatch):
    """`rearm --state rejected --since T [--bot sim] [--dry-run]`: only rows of that state changed since T, each
    printed and counted; a dry run changes nothing; each rearm is an event; the rearmed parents are answered once."""
    with running(tmp_path, monkeypatch) as h:
        old = h.parent()
        assert _post(h, old, "x" * 600) == 409
        time.sleep(0.05)
        since = time.time()
        new = [h.parent(), h.parent()]
        assert all(_post(h, p, "x" * 600) == 409 for p in new)
        monkeypatch.delenv("SIM_TOKEN")
        cfg = ["--config", str(h.config)]
        none = cli("rearm", "--state", "gave_up", *cfg, "--json")
        assert none.exit_code == 0 and json.loads(none.stdout)["matched"] == 0, none.output
        window = cli("rearm", "--state", "rejected", "--since", "2h", "--dry-run", *cfg, "--json")
        assert sorted(p["parent_id"] for p in json.loads(window.stdout)["parents"]) == sorted([old, *new])
        dry = cli("rearm", "--state", "rejected", "--since", f"{since}", "--dry-run", *cfg, "--json")
        got = json.loads(dry.stdout)
        assert dry.exit_code == 0 and got["dry_run"] and got["rearmed"] == 0, dry.output
        assert sorted(p["parent_id"] for p in got["parents"]) == sorted(new)
        states = lambda: {p: h.daemon.store.find(p)[0].state for p in [old, *new]}  # noqa: E731
        assert set(states().values()) == {"rejected"}
        r = cli("rearm", "--state", "rejected", "--since", f"{since}", "--bot", "sim", "--reason", "outage", *cfg)
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        assert lines[-1].startswith("rearmed 2 of 2 rejected parent(s) changed since"), lines
        assert all(any(f" {p}: was rejected, rearmed" in ln for ln in lines) for p in new), lines
        assert states() == {old: "rejected", new[0]: "released", new[1]: "released"}
        ev = json.loads(cli("log", *cfg, "--json", "--kind", "rearmed").stdout)
        assert sorted(e["parent_id"] for e in ev) == sorted(new)
        assert all(e["detail"] == {"by": "cli", "from": "rejected", "reason": "outage"} for e in ev)
        assert all(_post(h, p, "short") == 201 and h.bot_replies(p) == 1 for p in new)
        both = cli("rearm", "sim", old, "--state", "rejected", *cfg)
        assert both.exit_code != 0 and "one form or the other" in str(both.exception or both.output)
