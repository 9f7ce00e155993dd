#!/usr/bin/env python3
"""replyd's container health check, until the sidecar API serves ``/healthz``.

Healthy (exit 0): the config loads (with the environment variables it names),
the answered-log's database answers, and its schema is at the revision this
replyd needs. Unhealthy (exit 1) otherwise, with one line saying why.

It never writes: no migration, no SQLite file created, no WAL switch. When
the API issue lands, the Dockerfile's HEALTHCHECK and the Kubernetes probes
switch to ``GET /healthz`` and this file goes away.

    python deploy/healthcheck.py            # reads $REPLYD_CONFIG
    python deploy/healthcheck.py -c FILE
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def check(config: str | None) -> str:
    """Return a one-line description of a healthy store; raise on anything else."""
    import sqlalchemy as sa

    from replyd import migrate
    from replyd import store as st
    from replyd.config import Config

    cfg = Config.load(config)
    url = cfg.store.url or st.default_url()
    parsed = sa.engine.make_url(url)
    if parsed.drivername.startswith("sqlite"):
        path = Path(parsed.database or "")
        if not parsed.database or not path.is_file():
            raise RuntimeError(f"no answered-log at {path} yet (the daemon creates it at start)")
        engine = sa.create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
        try:
            current, head = migrate.revisions(engine)
        finally:
            engine.dispose()
    else:
        store = st.Store.open(url, migrate=None)  # reads the revision, writes nothing
        try:
            current, head = store.schema_revision()
        finally:
            store.dispose()
    if current != head:
        raise RuntimeError(f"schema at {current or 'nothing'}, this replyd needs {head}: run `replyd db upgrade`")
    return f"ok: {st.redact_url(url)} at revision {current}"


def main(argv: list[str] | None = None) -> int:
    """Print the verdict; return 0 when healthy, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=os.environ.get("REPLYD_CONFIG") or None)
    args = p.parse_args(argv)
    try:
        print(check(args.config))
        return 0
    except Exception as exc:  # any failure is "unhealthy"; say which
        from replyd.log import mask

        print(f"unhealthy: {type(exc).__name__}: {mask(str(exc)).splitlines()[0] if str(exc) else ''}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
