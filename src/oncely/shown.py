"""Stored text made safe to show: every control character and every
invisible character that could reorder, hide or disguise text written as a
visible escape. The CLI prints through it (``oncely.cli.terminal``), the
console's pages render through it (``oncely.console``). No dependency, so
that both can use it without loading the other's libraries.
"""

from __future__ import annotations

import re
import unicodedata

# Characters never shown as they are: controls, and the invisible ones that
# reorder, hide or disguise text. By category: controls (Cc), format
# characters (Cf: bidi controls and marks, zero-width characters, the tag
# characters U+E0000-E007F), surrogates (Cs), line and paragraph separators
# (Zl, Zp). By name: variation selectors, the combining grapheme joiner, and
# the fillers and blanks that render as nothing.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_INVISIBLE = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f\uffa0"
    "\U000e0100-\U000e01ef]"
)
_PLAIN = re.compile(r"[\x20-\x7e\n\t]*")


def literal(value: object, *, keep: str = "") -> str:
    """``value`` as text, every control or invisible character escaped
    (those in ``keep`` aside: the console keeps line breaks in ``<pre>``)."""
    text = value if isinstance(value, str) else str(value)
    if _PLAIN.fullmatch(text) and not (set("\n\t") - set(keep)) & set(text):
        return text
    return "".join(_escape(c) if _hidden(c) and c not in keep else c for c in text)


def _hidden(char: str) -> bool:
    return unicodedata.category(char) in _HIDDEN_CATEGORIES or bool(_INVISIBLE.match(char))


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
