"""replyd.log.Logger: a module's logger built once, yet following every change of structlog's configuration."""

from __future__ import annotations

import io
import json

import structlog
from structlog.testing import capture_logs

from replyd import log


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_a_logger_follows_a_new_level_and_a_new_stream() -> None:
    """The same module logger filters at the old level, then writes at the new one to the new stream."""
    lg = log.get_logger("replyd.test")
    first, second = io.StringIO(), io.StringIO()
    log.configure(fmt="json", level="warning", stream=first)
    lg.info("replyd.test.hidden", n=1)
    lg.warning("replyd.test.shown", n=2)
    log.configure(fmt="json", level="info", stream=second)
    lg.info("replyd.test.now_shown", n=3)
    assert [e["event"] for e in _lines(first)] == ["replyd.test.shown"]
    assert [(e["event"], e["n"]) for e in _lines(second)] == [("replyd.test.now_shown", 3)]


def test_capture_logs_sees_a_logger_used_before_it() -> None:
    """A logger that already logged (and so built its bound logger) is captured by a later capture_logs."""
    lg = log.get_logger("replyd.test")
    log.configure(fmt="json", level="info", stream=io.StringIO())
    lg.info("replyd.test.before")
    with capture_logs() as got:
        lg.info("replyd.test.during", bot="b1")
    assert [(e["event"], e["bot"]) for e in got] == [("replyd.test.during", "b1")]


def test_structlog_configured_directly_reaches_the_logger() -> None:
    """``structlog.configure`` called without replyd (a host application, the conftest's restore) is followed."""
    lg = log.get_logger("replyd.test")
    log.configure(fmt="json", level="info", stream=io.StringIO())
    lg.info("replyd.test.warm")
    seen: list[str] = []
    structlog.configure(processors=[lambda _l, _m, ev: seen.append(ev["event"]) or ev["event"]],
                        logger_factory=structlog.ReturnLoggerFactory(),
                        wrapper_class=structlog.make_filtering_bound_logger(0))
    lg.debug("replyd.test.direct")
    assert seen == ["replyd.test.direct"]


def test_bind_keeps_its_values() -> None:
    """``bind`` gives a logger whose events carry the bound values."""
    log.configure(fmt="json", level="info", stream=io.StringIO())
    with capture_logs() as got:
        log.get_logger("replyd.test").bind(bot="b2", platform="sim").error("replyd.test.bound")
    assert got == [{"event": "replyd.test.bound", "bot": "b2", "platform": "sim", "log_level": "error"}]


def test_a_configure_racing_with_a_build_is_followed_on_the_next_call(monkeypatch) -> None:
    """A configure() landing while a logger is being built (another thread's) is seen by the next call."""
    log.configure(fmt="json", level="info", stream=io.StringIO())
    real = structlog.get_logger

    class Racing:
        """structlog's proxy whose bind() builds on the old configuration, then another thread configures."""

        def __init__(self, name: str) -> None:
            self.proxy = real(name)

        def bind(self):
            built = self.proxy.bind()
            monkeypatch.setattr(structlog, "get_logger", real)
            log.configure(fmt="json", level="info", stream=io.StringIO())  # a new processor chain
            return built

    monkeypatch.setattr(structlog, "get_logger", Racing)
    lg = log.get_logger("replyd.test")
    lg.info("replyd.test.during_build")
    with capture_logs() as got:  # captures through the chain configured last
        lg.info("replyd.test.after")
    assert [e["event"] for e in got] == ["replyd.test.after"]


def test_a_level_that_filtered_debug_and_info_stops_filtering_them_when_it_changes() -> None:
    """The filtered-level shortcut follows the configuration: quiet at warning, debug and info written at debug,
    and written by a wrapper class that filters nothing (structlog's generic ``BoundLogger``)."""
    lg = log.get_logger("replyd.test")
    quiet, loud = io.StringIO(), io.StringIO()
    log.configure(fmt="json", level="warning", stream=quiet)
    lg.debug("replyd.test.d0")
    lg.info("replyd.test.i0")
    log.configure(fmt="json", level="debug", stream=loud)
    lg.debug("replyd.test.d1")
    lg.info("replyd.test.i1")
    assert _lines(quiet) == []
    assert [e["event"] for e in _lines(loud)] == ["replyd.test.d1", "replyd.test.i1"]
    log.configure(fmt="json", level="warning", stream=io.StringIO())
    lg.info("replyd.test.i2")  # quiet again, and built so
    seen: list[str] = []
    structlog.configure(processors=[lambda _l, _m, ev: seen.append(ev["event"]) or ev["event"]],
                        logger_factory=structlog.ReturnLoggerFactory(), wrapper_class=structlog.BoundLogger)
    lg.debug("replyd.test.d3")
    lg.info("replyd.test.i3")
    assert seen == ["replyd.test.d3", "replyd.test.i3"]
