"""Plain-text output shared by cfp's summaries: byte counts and aligned tables."""


def format_bytes(n):
    """'512 B', '1.5 KiB', '17.3 MiB', ..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_table(rows):
    """Rows of strings (the first one the header) as left-aligned columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
