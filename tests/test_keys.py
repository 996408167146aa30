"""Pure logic of idempotency keys: parsing, scope, fingerprint."""

import pytest

from oncely.api.keys import parse_key
from oncely.errors import KeyMalformed, KeyMissing
from oncely.identity import Scope, canonical_json, fingerprint

KEY = "order-2026-11-30-0001"


def test_bare_and_quoted_forms_are_the_same_key():
    assert parse_key([KEY]) == parse_key([f'"{KEY}"']) == KEY


def test_quoted_form_unescapes_quote_and_backslash():
    assert parse_key(['"abc\\"def\\\\ghijklmnop"']) == 'abc"def\\ghijklmnop'


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ([], KeyMissing),
        (["short"], KeyMalformed),
        (["x" * 256], KeyMalformed),
        (["abcdefghijklmnop\x01"], KeyMalformed),
        (["abcdefghijklmnopé"], KeyMalformed),
        ([KEY, KEY], KeyMalformed),
        ([f"{KEY}, {KEY}"], KeyMalformed),
        (['"unterminated-key-value'], KeyMalformed),
        (['"bad\\escape-in-this-key"'], KeyMalformed),
    ],
)
def test_bad_keys_are_refused(values, error):
    with pytest.raises(error):
        parse_key(values)


def test_length_bounds_are_inclusive():
    assert parse_key(["x" * 16]) == "x" * 16
    assert parse_key(["x" * 255]) == "x" * 255


def test_scope_parts_cannot_collide_by_concatenation():
    a = Scope(tenant="ab", method="POST", route="/c", key=KEY)
    b = Scope(tenant="a", method="POST", route="b/c", key=KEY)
    assert a.text != b.text
    assert a.digest != b.digest
    assert a.job_id != b.job_id


def test_job_id_is_deterministic_per_scope():
    scope = Scope(tenant="acme", method="post", route="/v1/summaries", key=KEY)
    again = Scope(tenant="acme", method="POST", route="/v1/summaries", key=KEY)
    assert scope.job_id == again.job_id
    other = Scope(tenant="globex", method="POST", route="/v1/summaries", key=KEY)
    assert other.job_id != scope.job_id


def test_fingerprint_ignores_key_order_but_not_array_order():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": [1, 2]}) != fingerprint({"a": [2, 1]})
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()
