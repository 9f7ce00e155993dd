"""The commands that run something until stopped: the daemon, the demo, the MCP server."""

from __future__ import annotations

from typing import Annotated

import typer

from replyd.cli.common import ConfigOpt, JsonOpt, _load, err, preflight
from replyd.errors import ConfigError


def run(config: ConfigOpt = None, grace_s: Annotated[float, typer.Option(help="Seconds to finish in-flight sends on stop.")] = 30.0) -> None:
    """Run the daemon: pollers, guard and sweep, until SIGTERM/SIGINT; SIGHUP re-reads the bots."""
    from replyd.config import Config
    from replyd.daemon import Daemon

    cfg = _load(config)
    preflight(cfg)  # the checks `replyd config check` makes: the same config passes both or neither

    def reread() -> Config:
        """The config file and the secrets it names, read again and checked as at start (SIGHUP)."""
        fresh = Config.load(config)
        preflight(fresh)
        return fresh

    daemon = Daemon(cfg)
    code = daemon.run_forever(grace_s, load=reread)
    if daemon.fatal is not None:
        err.print(f"replyd run: stopped: {daemon.fatal}")
    if daemon.grace_expired:
        _exit_now(code)
    raise typer.Exit(code)


def _exit_now(code: int) -> None:
    """Leave the process once the stop is done, without joining threads still in a job past the grace.

    The interpreter joins every thread pool's workers at exit, so a job stuck in a slow call (a responder, a
    hung request) would hold a stop bounded by the grace for as long as that call lasts. Everything durable
    is committed by now (each row's state is a transaction; an unfinished send's row is open for the sweep),
    so the process exits at once, its log flushed.
    """
    import logging
    import os
    import sys
    import threading

    import structlog

    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    structlog.get_logger("replyd.daemon").warning(
        "replyd.daemon.exit_forced", threads=left[:20], count=len(left),
        hint="jobs still running after the grace; their rows are left to the sweep")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def demo(
    as_json: JsonOpt = False,
    quick: Annotated[bool, typer.Option(help="Fewer parents per scenario.")] = False,
) -> None:
    """Run the simulated platform and show naive bots against replyd, scenario by scenario."""
    from replyd import demo as demo_mod

    raise typer.Exit(demo_mod.main(as_json=as_json, quick=quick))


def mcp(
    config: ConfigOpt = None,
    transport: Annotated[str, typer.Option(help="stdio (an agent host starts this process) or http (streamable HTTP).")] = "stdio",
    host: Annotated[str | None, typer.Option(help="HTTP: address to bind (default: mcp.host).")] = None,
    port: Annotated[int | None, typer.Option(min=0, max=65535, help="HTTP: port (default: mcp.port; 0: any free port).")] = None,
) -> None:
    """Serve the MCP tools (check_parent, begin_reply, finish_reply, reply_once, explain) for LLM agents."""
    try:
        from replyd import mcp as mcp_mod
    except ModuleNotFoundError as exc:
        raise ConfigError(f"replyd mcp needs the MCP SDK ({exc.name} is missing): pip install 'replyd[mcp]'") from None
    if transport not in ("stdio", "http"):
        raise ConfigError(f"--transport: unknown transport {transport!r} (use stdio or http)")
    cfg = _load(config)
    mc = cfg.mcp
    # Checked first: a missing token fails before any bot logs in.
    tokens = mcp_mod.http_scopes(cfg, host) if transport == "http" else {}
    service, close = mcp_mod.open_service(cfg)
    try:
        if transport == "stdio":
            mcp_mod.serve_stdio(service)
        else:
            mcp_mod.serve_http(service, host=host or mc.host, port=mc.port if port is None else port, path=mc.path,
                               tokens=tokens, names=mc.hosts, origins=mc.origins)
    finally:
        close()
