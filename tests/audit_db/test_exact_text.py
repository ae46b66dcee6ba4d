"""The escaped text form: reversible for every string, and searchable."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorapool.audit_db.exact_text import ESC, MARK, EncodingError, decode, encode, needs_recheck

SPECIAL = st.sampled_from(["\0", ESC, MARK, "a", "0", "é", "\U0001f600"])
ANY_TEXT = st.text() | st.lists(SPECIAL).map("".join)


@given(ANY_TEXT)
def test_decode_inverts_encode_and_the_stored_form_has_no_nul(value):
    stored = encode(value)
    assert "\0" not in stored
    assert decode(stored) == value


@given(ANY_TEXT, ANY_TEXT)
def test_a_needle_without_special_characters_is_found_exactly(haystack, needle):
    if needs_recheck(needle):
        # a superset: every true match is found (the filter is finished in Python)
        if needle in haystack:
            assert encode(needle) in encode(haystack)
    else:
        assert (needle in haystack) == (encode(needle) in encode(haystack))


def test_known_forms():
    assert encode("a\0b") == f"a{ESC}{MARK}b"
    assert encode(ESC + MARK) == ESC + ESC + MARK + MARK
    assert encode("plain text") == "plain text"


@pytest.mark.parametrize("stored", [ESC, MARK, f"x{ESC}y", f"{MARK}a"])
def test_a_stored_form_no_encoder_makes_is_refused(stored):
    with pytest.raises(EncodingError):
        decode(stored)
