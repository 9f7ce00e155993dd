"""The ``replyd`` command line: run, demo, status, explain, check, sweep, log, rearm, adopt, prune, export, db, config."""

from __future__ import annotations

import sys

from replyd.cli import admin, read, serve
from replyd.cli.common import EXIT_CODES, app, config_app, db_app, parse_time
from replyd.errors import ReplydError

__all__ = ["EXIT_CODES", "app", "main", "parse_time"]

# Registered here, in one place, so `replyd -h` lists the commands in this order.
app.command()(serve.run)
app.command()(serve.demo)
app.command()(serve.mcp)
app.command()(read.status)
app.command()(read.explain)
app.command()(read.check)
app.command()(admin.sweep)
app.command("log")(read.log_cmd)
app.command()(admin.rearm)
app.command()(admin.confirm)
app.command()(admin.adopt)
app.command()(admin.prune)
app.command()(read.export)
db_app.command("upgrade")(admin.db_upgrade)
db_app.command("current")(admin.db_current)
config_app.command("check")(admin.config_check)


def _fail(message: str, code: int = 2) -> None:
    """Print ``replyd: message`` as one plain line on stderr and exit with ``code``."""
    from replyd import log as rlog

    sys.stderr.write("replyd: " + " ".join(rlog.mask(message).split()) + "\n")
    sys.exit(code)


def main() -> None:
    """Entry point: an expected failure is one plain line on stderr and exit 2 (see ``EXIT_CODES``)."""
    try:
        app()
    except ReplydError as exc:
        _fail(str(exc))
    except OSError as exc:  # a file named on the command line cannot be read or written (export -o ...)
        _fail(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
    except KeyboardInterrupt:
        sys.exit(130)
