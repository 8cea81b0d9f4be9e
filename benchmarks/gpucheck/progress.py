"""The GPU check's progress lines and its count of XLA compilations."""

from __future__ import annotations

import sys
import time
from typing import Any

import jax


class Log:
    """Timestamped progress lines on stderr, so a run that is cut short shows where."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed:7.1f} s] {message}", file=sys.stderr, flush=True)


class CompileCounter:
    """Counts XLA compilations and persistent-cache hits (``jax.monitoring`` events).

    Compilation dominates this check's wall time on a GPU; the counts say where it went,
    and a compilation inside a timed round would void that round.
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1
            self.compile_seconds += duration

    def _on_event(self, event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)

    def snapshot(self) -> tuple[int, float, int]:
        return self.compiles, self.compile_seconds, self.cache_hits

    def since(self, before: tuple[int, float, int]) -> dict[str, Any]:
        """Compilations (backend compiles, cache hits included), their seconds, and how
        many were persistent-cache hits, since ``before``."""
        c, s, h = self.snapshot()
        return {
            "compiles": c - before[0],
            "compile_seconds": s - before[1],
            "cache_hits": h - before[2],
        }
