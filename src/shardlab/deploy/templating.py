"""A string.Template whose placeholders are `@name` / `@{name}`.

Shell scripts are full of `$VAR`, so the standard `$` delimiter would force escaping every
shell variable; `@` hardly appears in them (write `@@` for a literal `@`).
"""

from __future__ import annotations

import string


class ShellTemplate(string.Template):
    delimiter = "@"


def fill(template: str, **values: object) -> str:
    """Substitute every placeholder; a missing value is a bug in the renderer, so it raises."""
    return ShellTemplate(template).substitute({k: str(v) for k, v in values.items()})
