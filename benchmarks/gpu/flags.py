"""Engine speed flags measured against the old path in one run (issue 47, item 7).

Each flag is an ``EngineArgs`` field that another change adds (``fused_layer_kernels``,
``lora_live_work``); the kit must run before it lands, so a flag is looked up in
``dataclasses.fields(EngineArgs)``, and one that is not there is reported as
"flag absent". The old path is the engine with every present flag off, given
explicitly (a flag's default may change); each flag is then measured alone on.
"""

from __future__ import annotations

import dataclasses


def present(names) -> dict[str, bool]:
    """{flag: whether EngineArgs has a boolean field of that name}."""
    from lorapool.engine.config import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    return {name: name in fields for name in names}


def old_path(names) -> dict[str, bool]:
    """The options of the old path: every present flag off."""
    return {name: False for name, ok in present(names).items() if ok}
