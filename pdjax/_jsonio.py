"""JSON files for pdjax's plain-data boxes (profiles, plans): atomic writes, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdjax.errors import PdjaxError

__all__ = ["parse_json", "write_atomic"]


def write_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename, so a crash never
    leaves a half-written file where a good one was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse_json(text: str, what: str, error: type[PdjaxError]) -> Any:
    """``json.loads`` that raises ``error`` naming ``what`` (e.g. "profile p.json")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} is not valid JSON: {e}") from e
