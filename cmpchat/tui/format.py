"""Short text forms of numbers for panels that must fit in few columns."""

from __future__ import annotations

from collections.abc import Sequence

_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int, *, top: float | None = None) -> str:
    """The last `width` values as block characters, scaled to `top` (default: their maximum); padded left."""
    recent = list(values)[-width:]
    if not recent:
        return " " * width
    peak = top if top is not None else max(recent)
    if peak <= 0:
        line = _BLOCKS[0] * len(recent)
    else:
        line = "".join(_BLOCKS[min(len(_BLOCKS) - 1, max(0, round(v / peak * (len(_BLOCKS) - 1))))] for v in recent)
    return line.rjust(width)


def count(n: int) -> str:
    """18204 -> "18,204"."""
    return f"{n:,}"


def short_count(n: int) -> str:
    """18204 -> "18K", 262144 -> "256K", 1048576 -> "1M": binary units, as context sizes are given."""
    if n >= 2**20:
        return f"{n / 2**20:.0f}M" if n % 2**20 == 0 else f"{n / 2**20:.1f}M"
    if n >= 1024:
        return f"{n / 1024:.0f}K" if n >= 10 * 1024 or n % 1024 == 0 else f"{n / 1024:.1f}K"
    return str(n)


def rate(tokens_per_second: float | None) -> str:
    """A speed in tok/s with sensible precision, or an en dash when unknown."""
    if tokens_per_second is None or tokens_per_second <= 0:
        return "–"
    if tokens_per_second >= 100:
        return f"{tokens_per_second:,.0f}"
    return f"{tokens_per_second:.1f}"


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 60:
        return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"
    minutes, rest = divmod(int(value), 60)
    return f"{minutes}m{rest:02d}s"


def gigabytes(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**30:.1f}"


def megabytes_per_second(bytes_per_second: float | None) -> str:
    """PCIe traffic as a bare MB/s figure for tight columns: "2.1", "0.3", "1843"."""
    if bytes_per_second is None:
        return "–"
    value = bytes_per_second / 2**20
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def file_size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
