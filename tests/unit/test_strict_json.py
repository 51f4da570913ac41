"""runtime.strict_json: JSON with only the numbers RFC 8259 can carry."""

import json
import math

import pytest

from runtime import strict_json


@pytest.mark.parametrize("text, shown, path", [
    ('{"t": NaN}', "NaN is not a number in JSON", "t"),
    ('[Infinity]', "Infinity is not a number in JSON", "[0]"),
    ('{"a": {"b": -Infinity}}', "-Infinity is not a number in JSON", "a.b"),
    ('{"t": 1e400}', "1e400 is beyond the range of a double", "t"),
    ('[-2.5e309]', "-2.5e309 is beyond the range of a double", "[0]"),
])
def test_values_json_cannot_carry_are_refused_by_name_and_place(text, shown, path):
    with pytest.raises(strict_json.JsonNumberError, match=shown) as e:
        strict_json.loads(text)
    assert e.value.path == path
    read = json.loads(text)  # what Python's own json takes silently: a value that is not finite
    while isinstance(read, (dict, list)):
        read = next(iter(read.values())) if isinstance(read, dict) else read[0]
    assert not math.isfinite(read)


@pytest.mark.parametrize("text, path", [
    ('{"m": [{"x": 1.5}, {"y": [2, NaN]}], "z": NaN}', "m[1].y[1]"),  # the first in document order
    ('{"logit_bias": {"5": -1e400}}', "logit_bias.5"),
    ('Infinity', ""),  # the whole document
])
def test_the_error_says_where_the_first_such_value_stands(text, path):
    with pytest.raises(strict_json.JsonNumberError) as e:
        strict_json.loads(text)
    assert e.value.path == path


def test_ordinary_json_reads_as_json_does_and_not_json_is_a_decode_error():
    text = '{"a": [1, 2.5, -0.0, 1e308, 123456789012345678901234567890], "s": "x\\u00e9", "n": null}'
    assert strict_json.loads(text) == json.loads(text)
    assert strict_json.loads(text.encode()) == json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        strict_json.loads("{not json")
    assert issubclass(strict_json.JsonNumberError, ValueError)
