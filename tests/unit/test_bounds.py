"""lorapool.records.bounds: each alias is enforced by msgspec as it says, and ``explain`` and
``bounds_of`` read the same numbers (the oracle: msgspec's own decoding)."""

import math

import msgspec
import pytest

from lorapool.records import bounds


@pytest.mark.parametrize(
    "alias, good, bad",
    [
        (bounds.Count, [1, 2**40, 2**63 - 1], [0, -1, True, 1.0, "1", 2**63]),
        (bounds.TokenId, [0, bounds.INT32_MAX], [-1, bounds.INT32_MAX + 1, False]),
        (bounds.Seed, [bounds.SEED_MIN, bounds.SEED_MAX], [bounds.SEED_MIN - 1, 1.0]),
        (bounds.TopK, [-1, 0, 5], [-2]),  # 0 is the record's own check (top_k != 0)
        (bounds.AdapterId, [1, bounds.INT32_MAX], [0, 2**31]),
        (bounds.Temperature, [0, 0.0, 2.5, 1e300], [-0.1, math.inf, math.nan, True]),
        (bounds.TopP, [1, 1e-9], [0.0, 1.01, math.nan]),
        (bounds.Penalty, [-2, 2.0], [-2.01, 2.01, -math.inf]),
        (bounds.RepetitionPenalty, [1e-9, 3.0], [0.0, math.inf]),
        (bounds.RequestId, ["r", "x" * 256, "é✓"], ["", "x" * 257, "a{b", "a}", "a\x00"]),
        (bounds.LoraName, ["a", "x" * bounds.MAX_LORA_NAME], ["", "a\x00b", 1]),
        (bounds.StopStrings, [[], ["x"] * bounds.MAX_STOP], [[""], ["x"] * 65, "x"]),
    ],
)
def test_each_alias_keeps_what_it_says(alias, good, bad):
    for value in good:
        msgspec.convert(value, alias)
    for value in bad:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(value, alias)


def test_explain_names_the_bound_msgspec_enforces():
    assert bounds.explain(bounds.TokenId) == f"a token id (an integer in [0, {bounds.INT32_MAX}])"
    assert bounds.explain(bounds.Count) == f"an integer in [1, {bounds.INT64_MAX}]"
    assert bounds.explain(bounds.Seed) == f"an integer >= {bounds.SEED_MIN}"
    assert bounds.explain(bounds.TopP) == "a finite number in (0.0, 1.0]"
    assert bounds.explain(bounds.Temperature) == "a finite number >= 0.0"
    assert bounds.explain(bounds.RequestId) == (
        f"a non-empty string of at most {bounds.MAX_REQUEST_ID} characters without braces or NUL"
    )
    assert bounds.explain(int) == "an integer"


def test_bounds_of_gives_keyword_arguments_for_other_schemas():
    assert bounds.bounds_of(bounds.Penalty) == {"ge": -2.0, "le": 2.0}
    assert bounds.bounds_of(bounds.Temperature) == {"ge": 0.0}  # FINITE left out
    assert bounds.bounds_of(bounds.StopStrings) == {"max_length": bounds.MAX_STOP}
    assert bounds.explain(bounds.AdapterId) == f"an integer in [1, {bounds.INT32_MAX}]"
    assert bounds.bounds_of(str) == {}
