"""Argument checks shared by the typed configs of `cast_core`, with messages that name the field.

`require_positive` and `require_count` raise ValueError "<Owner>.<field> must be ...; got
<value>", with an optional hint on what to set; bools are not counts.
"""

from __future__ import annotations

import math


def require_positive(owner: str, name: str, value: float, fix: str | None = None) -> None:
    """value must be a finite int or float > 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        tail = f"; {fix}" if fix else ""
        raise ValueError(f"{owner}.{name} must be a finite number > 0; got {value!r}{tail}")


def require_count(owner: str, name: str, value: int, meaning: str | None = None) -> None:
    """value must be an int >= 1 (not a bool); `meaning` is shown after the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        note = f" ({meaning})" if meaning else ""
        raise ValueError(f"{owner}.{name} must be an int >= 1{note}; got {value!r}")
