"""A job record with a test's changes: the one helper behind the named bad-field cases."""

from __future__ import annotations


def changed(job: dict, **changes) -> dict:
    """A copy of ``job`` (and of its ``sampling_params``) with ``changes`` set: a key with
    the ``sp_`` prefix sets that sampling parameter (``sp_seed="abc"``), any other key the
    job's own field (``prompt_token_ids=[1, -3]``)."""
    out = {**job, "sampling_params": dict(job["sampling_params"])}
    for key, value in changes.items():
        if key.startswith("sp_"):
            out["sampling_params"][key[3:]] = value
        else:
            out[key] = value
    return out
