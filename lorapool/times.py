"""Moments given by people: epoch seconds or ISO 8601, read the same everywhere.

The audit trail's time filters (``lorapool audit search --since``, the gateway's
``/v1/audit/*?since=``) take either form; a time without a zone is UTC.
"""

from datetime import datetime, timezone


def epoch_seconds(value: str) -> float:
    """Seconds since the epoch from ``"1764000000"`` or ``"2026-11-24T10:00"``.

    Raises ValueError for anything else."""
    try:
        return float(value)
    except ValueError:
        pass
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()
