"""Pytree path helpers shared across packages (imports nothing from pdjax)."""

from __future__ import annotations

from typing import Any

__all__ = ["key_str"]


def key_str(key: Any) -> str:
    """One key of a pytree path as text, as a ``tied=`` path names it: a ``DictKey``'s
    key, a ``SequenceKey``'s index, a ``GetAttrKey``'s name, anything else by ``str``."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
