"""Text a user supplied, made safe to show on a terminal through ``rich``.

A value like ``[/x]`` printed as markup is read as a closing tag (rich raises) and ``[link=...]`` as a
hyperlink; a control character can move the cursor or rewrite the screen, and an unpaired surrogate
(a file name that is not UTF-8) cannot be encoded at all. Every user-supplied value that reaches the
console goes through :func:`clean` (plain text) or :func:`esc` (inside markup).
"""

from __future__ import annotations

import re

from rich.markup import escape

# C0/C1 controls but newline (messages span lines; a tab would be expanded out of sight) and the
# bidirectional overrides that can make a terminal show text in another order than it is.
_UNSAFE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}"


def clean(value: object) -> str:
    """``value`` as text that is safe to show: control characters and unpaired surrogates as escapes."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return _UNSAFE.sub(_escape_char, text)


def esc(value: object) -> str:
    """``value`` cleaned and escaped for interpolation into rich markup."""
    return escape(clean(value))
