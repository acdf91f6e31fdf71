"""Numbers as an operator reads them: ages, durations, rates and shares; "-" for unknown."""

from __future__ import annotations


def age(seconds: float | None) -> str:
    """The largest whole unit: 42s, 5m, 3h, 2d."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def duration(seconds: float | None) -> str:
    """H:MM:SS."""
    if seconds is None:
        return "-"
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def rate(v: float | None) -> str:
    """12.3k, 1.25M, 2.00G."""
    if v is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= size * 0.99995:
            return f"{v / size:.2f}{unit}" if unit != "k" else f"{v / size:.1f}{unit}"
    return f"{v:.0f}"


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
