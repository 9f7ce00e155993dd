"""``python -m replyd.sim``: run the simulated platform standalone.

Prints ``SIM_URL=http://127.0.0.1:PORT`` on stdout once it accepts requests,
then serves until SIGTERM or SIGINT. Logs go to stderr so stdout stays a
clean channel for that line. Example::

    python -m replyd.sim --port 0 --seed 7 --listing-delay-s 2 \\
        --account replybot:secret:bot --account alice --traffic-rate 2 --query-word help
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Sequence

import structlog

from replyd.clock import Clock, FakeClock, OffsetClock, SystemClock
from replyd.sim.server import SimServer
from replyd.sim.world import Knobs, World


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; every ``Knobs`` field is a ``--flag``."""
    p = argparse.ArgumentParser(prog="python -m replyd.sim", description="Simulated Mastodon platform")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fake-clock", type=float, default=None, metavar="EPOCH",
                   help="run on a fake clock starting at EPOCH, moved by POST /_sim/clock")
    p.add_argument("--clock-offset-s", type=float, default=0.0, metavar="SECONDS",
                   help="the platform's clock runs this far ahead of this machine's (negative: behind)")
    p.add_argument("--account", action="append", default=[], metavar="NAME[:TOKEN][:bot]",
                   help="create an account (repeatable); token defaults to sim-token-NAME")
    for f in dataclasses.fields(Knobs):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    t = p.add_argument_group("traffic")
    t.add_argument("--traffic-rate", type=float, default=0.0, help="parents per second (0: none)")
    t.add_argument("--traffic-total", type=int, default=None)
    t.add_argument("--traffic-duration-s", type=float, default=None)
    t.add_argument("--users", type=int, default=3)
    t.add_argument("--target", default=None, help="username to mention (default: all bot accounts)")
    t.add_argument("--mention-fraction", type=float, default=1.0)
    t.add_argument("--question-fraction", type=float, default=0.5)
    t.add_argument("--query-word", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run until signalled; return the exit code."""
    args = parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    clock: Clock = FakeClock(args.fake_clock) if args.fake_clock is not None else SystemClock()
    if args.clock_offset_s:
        clock = OffsetClock(clock, args.clock_offset_s)
    knobs = {f.name: getattr(args, f.name) for f in dataclasses.fields(Knobs)}
    world = World(clock, seed=args.seed, **knobs)
    for spec in args.account:
        name, *rest = spec.split(":")
        bot = "bot" in rest
        token = next((r for r in rest if r != "bot" and r), None)
        world.add_account(name, bot=bot, token=token)
    server = SimServer(world, host=args.host, port=args.port).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"SIM_URL={server.base_url}", flush=True)
    if args.traffic_rate > 0:
        world.start_traffic(
            args.traffic_rate,
            total=args.traffic_total,
            duration_s=args.traffic_duration_s,
            target=args.target,
            mention_fraction=args.mention_fraction,
            question_fraction=args.question_fraction,
            query_word=args.query_word,
            users=args.users,
        )
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
