"""Hypothesis strategies for what a hostile producer can put on the wire: any JSON."""

from hypothesis import strategies as st


def json_values(text_size: int = 20, width: int = 4, leaves: int = 12):
    """Any JSON value orjson can write (integers within 64 bits, no NaN or Inf)."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=text_size)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=width)
            | st.dictionaries(st.text(max_size=text_size // 2), inner, max_size=width)
        ),
        max_leaves=leaves,
    )
