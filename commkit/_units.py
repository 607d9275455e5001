"""Times and sizes as people read them: one way of writing seconds, and one of writing bytes, for every module.

``commkit tune``'s log and reasons, the tracer's summary, the simulator's
summary and the cost model's tables all write a time through
:func:`format_seconds`. ``commkit bench``'s progress, ``commkit tune``'s log
and reasons, the plots' labels and the benchmark report all write a number of
bytes through :func:`format_bytes`, each with the options of its own style.
"""

from __future__ import annotations

from .errors import InvalidArgument

__all__ = ["format_seconds", "format_bytes"]

# (multiplier, unit), largest unit first: a time is written in the first unit in which it is at least 1.
_UNITS = ((1.0, "s"), (1e3, "ms"), (1e6, "us"))


def format_seconds(seconds: float, digits: int = 3) -> str:
    """``seconds`` in s, ms, us or ns, whichever keeps it at 1 or more, to ``digits`` significant digits.

    ``format_seconds(2.5e-05)`` is ``'25 us'``, ``format_seconds(0.0123456, 4)``
    is ``'12.35 ms'``; zero is ``'0 s'``.
    """
    if seconds == 0:
        return "0 s"
    for scale, unit in _UNITS:
        if abs(seconds) >= 1 / scale:
            return f"{seconds * scale:.{digits}g} {unit}"
    return f"{seconds * 1e9:.{digits}g} ns"


# (bytes, unit, compact unit), largest first.
_BYTE_UNITS = ((1 << 30, "GiB", "G"), (1 << 20, "MiB", "M"), (1 << 10, "KiB", "K"))
_LARGEST = {"GiB": 0, "MiB": 1, "KiB": 2, "B": 3}


def format_bytes(nbytes, digits: int | None = None, *, exact_below: int = 0, compact: bool = False,
                 largest: str = "GiB", none: str | None = None) -> str:
    """``nbytes`` in binary units (B, KiB, MiB, GiB), exactly or to ``digits`` significant digits.

    Exact (``digits=None``, the default): the largest unit that divides
    ``nbytes``, else bytes: ``format_bytes(3 << 20)`` is ``'3 MiB'``,
    ``format_bytes(1536)`` is ``'1536 B'`` (a size that is not a whole number
    of a unit is never rounded).

    To ``digits`` significant digits: a size of at least ``exact_below`` bytes
    is written in the largest unit it reaches, ``format_bytes(1.5 * (1 << 20),
    3)`` is ``'1.5 MiB'`` (a whole number of the unit has no decimals); a size
    below ``exact_below`` is written exactly, as above. ``format_bytes(1536, 3,
    exact_below=10 << 10)`` is ``'1536 B'``: what a schedule moves is rarely a
    round number, and below 10 KiB rounding would hide it. A value that needs
    more than ``digits`` digits before the point (1000 KiB up to 1 MiB, with
    3 digits) is written as a whole number, ``'1020 KiB'``, not with an exponent.

    Args:
        nbytes: a number of bytes, at least 0: an int, or a float (a plot axis
            gives one; below 1 KiB, or in exact mode below the first unit that
            divides it, its whole part is written).
        digits: significant digits of a rounded size; None writes every size exactly.
        exact_below: with ``digits``, sizes below this many bytes are written exactly.
        compact: ``'1M'``, ``'64K'``, ``'1536'`` (the units ``commkit bench``
            reads back) instead of ``'1 MiB'``, ``'64 KiB'``, ``'1536 B'``.
        largest: the largest unit used, ``"GiB"``, ``"MiB"``, ``"KiB"`` or
            ``"B"``: with ``"MiB"``, 1 GiB is ``'1024 MiB'``.
        none: what ``None`` is written as (``commkit tune`` writes a limit that
            is not set as ``'no limit'``); None refuses ``None``.

    Returns:
        The size as text, such as ``'64 KiB'``.

    Raises:
        InvalidArgument: ``nbytes`` is None and no ``none`` text is given, or
            ``largest`` is not one of the units above.
    """
    if nbytes is None:
        if none is None:
            raise InvalidArgument("format_bytes: expected a number of bytes, got None.")
        return none
    if largest not in _LARGEST:
        raise InvalidArgument(f"format_bytes: expected largest in {list(_LARGEST)}, got {largest!r}.")
    for scale, unit, short in _BYTE_UNITS[_LARGEST[largest]:]:
        if nbytes < scale:
            continue
        suffix = short if compact else f" {unit}"
        if nbytes % scale == 0:
            return f"{int(nbytes // scale)}{suffix}"  # exact for a float too: the scales are powers of 2
        if digits is not None and nbytes >= exact_below:
            text = f"{nbytes / scale:.{digits}g}"
            if "e" in text:  # 1000 up to 1024 of a unit: more digits than asked, not an exponent
                text = f"{nbytes / scale:.0f}"
            return f"{text}{suffix}"
    return f"{int(nbytes)}" if compact else f"{int(nbytes)} B"
