"""Tables and byte counts, formatted in one place (the plan's text, its notes and warnings)."""

from __future__ import annotations

from collections.abc import Sequence

UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Lines of a table: every column but the last padded to its widest cell."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header) - 1)]
    return [("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in cells]


def byte_unit(nbytes: int) -> tuple[str, int]:
    """The largest binary unit (name, bytes) in which ``nbytes`` is at least 1 (bytes for 0)."""
    return next(((name, size) for name, size in UNITS if nbytes >= size), UNITS[-1])


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, and exactly."""
    unit, size = byte_unit(n)
    return f"{n / size:.2f} {unit} ({n:,} B)" if size > 1 else f"{n:,} B"
