"""What the consoles print, made safe to show: control characters as their pictures (`visible`).

    visible("a\x1b[2Jb")        # "a\u241b[2Jb": shown, not obeyed by the terminal
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

# Control characters in what the consoles print are shown, not obeyed. Prompts, generated text (a
# byte-fallback vocabulary decodes ESC as readily as a letter), paths and cell names come from users
# and models, and an escape sequence among them would recolour, retitle or clear the terminal that
# reads them. Each becomes its Unicode control picture (ESC -> U+241B), one character for one, so a
# styled span keeps its place; a C1 control (U+0080-U+009F, which some terminals obey too) becomes
# U+FFFD. Newlines and tabs lay text out and stay. Rich alone drops five controls (BEL, BS, VT, FF, CR)
# without a trace and passes the rest.
# So does a bidirectional embedding, override or isolate (U+202A-U+202E, U+2066-U+2069: the "Trojan
# Source" set), which reorders what a bidi-aware terminal shows after it ("price: \u202e0001$" shows
# "$1000"); right-to-left letters themselves stay, laid out by the terminal's own rules.
_SHOWN = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"} | {0x7F: 0x2421} | \
         {c: 0xFFFD for c in (*range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def visible(obj: Any) -> Any:
    """`obj` (a str, a `Text`, a `Table` of them; anything else as it is) with its control characters
    shown as pictures (`_SHOWN`)."""
    if isinstance(obj, str):
        return obj.translate(_SHOWN)
    if isinstance(obj, Text):
        shown = obj.plain.translate(_SHOWN)
        if shown == obj.plain:
            return obj
        obj = obj.copy()
        obj.plain = shown  # the same length: the spans keep their places
        return obj
    if isinstance(obj, Table):
        obj.title, obj.caption = visible(obj.title), visible(obj.caption)
        for column in obj.columns:
            column.header, column.footer = visible(column.header), visible(column.footer)
            column._cells = [visible(c) for c in column._cells]
    return obj


__all__ = ["visible"]
