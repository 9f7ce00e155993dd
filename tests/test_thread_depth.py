"""``thread_depth``, the optional adapter method a ``max_depth`` policy calls: presence on every adapter, memory script."""

from __future__ import annotations

import inspect

import pytest

from replyd.errors import BadResponse, DefinitelyNotSent
from replyd.platforms.base import Parent, ThreadDepth, registered_kinds
from replyd.platforms.memory import MemoryPlatform


def test_every_builtin_adapter_offers_thread_depth() -> None:
    """Each registered adapter offers ThreadDepth (the isinstance check the policy makes): thread_depth(parent, limit)."""
    import replyd.platforms.base as platform_module

    registered_kinds()  # imports the built-in adapters
    kinds = dict(platform_module._REGISTRY)
    assert {"mastodon", "bluesky", "discourse", "github", "matrix", "memory"} <= set(kinds)
    for kind, cls in kinds.items():
        assert issubclass(cls, ThreadDepth), kind
        method = cls.thread_depth
        assert list(inspect.signature(method).parameters) == ["self", "parent", "limit"], kind
        assert (method.__doc__ or "").strip(), kind


def test_memory_scripted_depth() -> None:
    """The memory platform answers extra["depth"], else the parent's thread_depth, and counts the calls."""
    p = MemoryPlatform()
    scripted = p.add_parent("p1", extra={"depth": 7})
    plain = p.add_parent("p2", thread_depth=1)
    assert p.thread_depth(scripted, 3) == 7
    assert p.thread_depth(plain, 3) == 1
    assert p.thread_depth(Parent.from_snapshot(scripted.snapshot()), 3) == 7  # survives a snapshot
    assert p.depth_calls == 3


def test_memory_scripted_failures_and_bad_depths() -> None:
    """depth_failures makes the next calls raise DefinitelyNotSent; a non-integer scripted depth is BadResponse."""
    p = MemoryPlatform()
    p.depth_failures = 2
    parent = p.add_parent("p1", extra={"depth": 2})
    for _ in range(2):
        with pytest.raises(DefinitelyNotSent):
            p.thread_depth(parent, 3)
    assert p.thread_depth(parent, 3) == 2
    for bad in ("2", -1, True, None):
        with pytest.raises(BadResponse):
            p.thread_depth(Parent(id="x", author_id="y", extra={"depth": bad}), 3)


def test_email_depth_is_the_references_count_capped() -> None:
    """Email: the answered mail's References entries are its ancestors (no request), capped at limit + 1."""
    from replyd.platforms.email import EmailPlatform

    def mail(refs: list[str]) -> Parent:
        return Parent(id="<root@x>", author_id="a@x", author_handle="a@x", text="", extra={"references": refs})

    assert EmailPlatform.thread_depth(None, mail([]), 5) == 0  # type: ignore[arg-type]  # uses no state
    assert EmailPlatform.thread_depth(None, mail(["<a@x>", "<b@x>", "<c@x>"]), 5) == 3  # type: ignore[arg-type]
    assert EmailPlatform.thread_depth(None, mail(["<a@x>", "<b@x>", "<c@x>"]), 1) == 2  # type: ignore[arg-type]
