"""Text safe for a terminal: stored values (a stranger's ids, paths, text) never act on the screen.

Stdlib only: the CLI's read commands print through it without importing the logging stack.
"""

from __future__ import annotations

import re

# What a terminal could act on: C0 controls (newline included: a value never spans lines), DEL, C1 controls
# (0x9b is a one-byte CSI), and the bidi overrides, isolates and marks and the line/paragraph separators that
# reorder or break what is shown.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def shown(value: object) -> str:
    """``value`` as text safe for a terminal: each control character written as a visible escape."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", str(value))
