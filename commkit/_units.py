"""Times as people read them: one way of writing seconds for every module that prints one.

``commkit tune``'s log and reasons, the tracer's summary, the simulator's
summary and the cost model's tables all write a time through
:func:`format_seconds`.
"""

from __future__ import annotations

__all__ = ["format_seconds"]

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
