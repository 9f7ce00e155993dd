"""An answer in several parts: the split by a platform's post limit, and each part's key.

A composed answer longer than one post is cut here, once, before anything is sent; the parts are stored with the
parent's row (``Store.answer``) and each is sent under its own key, derived from the parent's: the parent id as
served plus the part number (``part_id``). One key shared by every part is the bug this guards against: the
second part's claim would find the first part's closed row and never be sent.

The split never cuts inside a word or a URL when it can avoid it: it cuts after a paragraph, else after a
sentence, else at a space, and only a word longer than a whole post is cut inside (at a grapheme boundary).
Lengths are counted in the platform's unit: graphemes (Bluesky counts them), UTF-16 code units (Telegram counts
them: an emoji outside the Basic Multilingual Plane is two) or code points (Mastodon, Discord and most others). Graphemes are segmented by an approximation of Unicode's extended grapheme clusters
(combining marks, ZWJ sequences, variation selectors, emoji modifiers, flag pairs, CR LF) that joins only where
the standard joins: it never counts fewer graphemes than the platform does, so a part it accepts is never too long.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

from replyd.store.model import PART_PATH as PART_PATH  # a part row's path: re-find offers its answer, not it

Unit = Literal["graphemes", "chars", "utf16"]

# The part key's suffix: ``<parent id as served>#part<k>``; parent ids never end like this on any platform served.
PART_SEP = "#part"
MAX_PARTS = 50  # an answer longer than this many posts is refused (a runaway responder, not an answer)

_URL = re.compile(r"\S*://\S+|www\.\S+")


@dataclass(frozen=True)
class Limit:
    """How long one post may be on a platform: ``size`` in ``unit``; ``marker``: number the parts "(1/3)"."""

    size: int
    unit: Unit = "chars"
    marker: bool = False

    def __post_init__(self) -> None:
        if self.size < 20:
            raise ValueError(f"post limit: {self.size} {self.unit} is too short to split an answer into")


def part_id(parent_id: str, k: int) -> str:
    """The parent id of part ``k`` (1-based) of the answer to ``parent_id``: its own key in the answered-log."""
    return f"{parent_id}{PART_SEP}{k}"


def _joins(prev: str, ch: str, ri_run: int) -> bool:
    """Whether ``ch`` continues the grapheme that ends with ``prev`` (``ri_run``: regional indicators before)."""
    o = ord(ch)
    if prev == "\r" and ch == "\n":
        return True
    if prev == "\u200d":  # ZWJ: an emoji sequence goes on
        return True
    if o == 0x200D or 0xFE00 <= o <= 0xFE0F or 0x1F3FB <= o <= 0x1F3FF or 0xE0020 <= o <= 0xE007F:
        return True  # ZWJ, variation selectors, skin tone modifiers, tag characters
    if 0x1F1E6 <= o <= 0x1F1FF:  # a flag is a pair of regional indicators
        return ri_run % 2 == 1
    return unicodedata.category(ch) in ("Mn", "Me", "Mc")


def graphemes(text: str) -> list[str]:
    """``text`` cut into (approximate extended) grapheme clusters."""
    out: list[str] = []
    ri_run = 0
    for ch in text:
        if out and _joins(out[-1][-1], ch, ri_run):
            out[-1] += ch
        else:
            out.append(ch)
        ri_run = ri_run + 1 if 0x1F1E6 <= ord(ch) <= 0x1F1FF else 0
    return out


def length(text: str, unit: Unit) -> int:
    """``text``'s length in ``unit``."""
    if unit == "graphemes":
        return len(graphemes(text))
    if unit == "utf16":
        return len(text.encode("utf-16-le")) // 2
    return len(text)


def _units(text: str, unit: Unit) -> list[str]:
    """``text`` as the units a split counts, each a piece of the text. In UTF-16 a code point beyond the Basic
    Multilingual Plane is two units: an empty unit before it stands for its first, so a part never ends between
    the two (``_cut_at`` never cuts right after an empty unit) and every part's count is its real UTF-16 length."""
    if unit == "graphemes":
        return graphemes(text)
    if unit == "utf16":
        out: list[str] = []
        for ch in text:
            if ord(ch) > 0xFFFF:
                out.append("")
            out.append(ch)
        return out
    return list(text)


def _cut_at(units: list[str], size: int) -> int:
    """Where to end the next part of ``units`` (at most ``size`` of them): the best boundary in reach."""
    if len(units) <= size:
        return len(units)
    window = "".join(units[:size + 1])
    starts = [0]
    for u in units[:size + 1]:
        starts.append(starts[-1] + len(u))
    # Character offsets the window may end at (the next unit starts there), best kind first.
    protected = [(m.start(), m.end()) for m in _URL.finditer("".join(units))]

    def ok(at: int) -> bool:
        return at > 0 and not any(s < at < e for s, e in protected)

    index: dict[int, int] = {}
    for i, at in enumerate(starts):
        index.setdefault(at, i)  # an empty unit (UTF-16's first half) shares its offset: cut before it, never after
    for pattern in (r"\n\s*\n", r"(?<=[.!?…。！？])\s+", r"\n", r"\s+"):
        ends = [index[m.start()] for m in re.finditer(pattern, window) if ok(m.start()) and m.start() in index]
        ends = [i for i in ends if i <= size]
        # A paragraph or sentence break in the first third would make a stub of a part: try a finer kind.
        good = [i for i in ends if i >= size // 3] if pattern != r"\s+" else ends
        if good:
            return good[-1]
    # A URL longer than a post, or one word: cut inside it, at a grapheme boundary (never between UTF-16 halves).
    return size - 1 if units[size - 1] == "" else size


def split(text: str, limit: Limit) -> list[str]:
    """``text`` as the parts of one answer, each within ``limit``; one part if it fits.

    Whitespace at a cut is dropped (it would start or end a post); the text of each part is otherwise the
    answer's own, in order. With ``limit.marker`` each part ends " (k/n)", counted in its length.
    """
    text = text.strip()
    if length(text, limit.unit) <= limit.size:
        return [text]
    n_guess = 1
    while True:
        # The marker's length depends on the number of parts: split again until it is stable.
        reserve = len(f" ({n_guess}/{n_guess})") if limit.marker else 0
        parts = _split(text, limit.size - reserve, limit.unit)
        if not limit.marker or len(str(len(parts))) <= len(str(n_guess)):
            break
        n_guess = len(parts)
    if len(parts) > MAX_PARTS:
        raise ValueError(f"answer: {len(parts)} parts of {limit.size} {limit.unit} (at most {MAX_PARTS})")
    if limit.marker and len(parts) > 1:
        parts = [f"{p} ({k}/{len(parts)})" for k, p in enumerate(parts, 1)]
    return parts


def _split(text: str, size: int, unit: Unit) -> list[str]:
    units = _units(text, unit)
    parts: list[str] = []
    while units:
        # Leading whitespace would open a post with a blank: drop it.
        while units and units[0].isspace():
            units.pop(0)
        if not units:
            break
        end = _cut_at(units, size)
        part = "".join(units[:end]).rstrip()
        if part:
            parts.append(part)
        units = units[end:]
    return parts


def head(text: str, size: int, unit: Unit) -> tuple[str, str]:
    """The first part of ``text`` longer than ``size`` and the rest after it: how a streamed answer freezes a
    part once more text than one post has come. The cut looks only at the first ``size + 1`` units, so more
    text arriving later never moves it (``split`` cuts the same way)."""
    units = _units(text, unit)
    while units and units[0].isspace():
        units.pop(0)
    end = _cut_at(units, size)
    return "".join(units[:end]).rstrip(), "".join(units[end:])
