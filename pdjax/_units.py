"""Human-readable renderings of sizes, FLOPs and times for tables."""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_count", "fmt_seconds"]


def fmt_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_count(n: float | None) -> str:
    """``2.5e9 -> '2.50 G'``; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(value) < 1000 or unit == "P":
            return f"{value:.0f}" if unit == "" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def fmt_seconds(s: float | None) -> str:
    """``0.0123 -> '12.30 ms'``; None -> '-'."""
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"
