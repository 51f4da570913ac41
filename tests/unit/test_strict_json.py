"""runtime.strict_json: JSON with only the numbers RFC 8259 can carry."""

import json
import math

import pytest

from runtime import strict_json


@pytest.mark.parametrize("text, shown", [
    ('{"t": NaN}', "NaN is not a number in JSON"),
    ('[Infinity]', "Infinity is not a number in JSON"),
    ('{"a": {"b": -Infinity}}', "-Infinity is not a number in JSON"),
    ('{"t": 1e400}', "1e400 is beyond the range of a double"),
    ('[-2.5e309]', "-2.5e309 is beyond the range of a double"),
])
def test_values_json_cannot_carry_are_refused_by_name(text, shown):
    with pytest.raises(strict_json.JsonNumberError, match=shown):
        strict_json.loads(text)
    read = json.loads(text)  # what Python's own json takes silently: a value that is not finite
    while isinstance(read, (dict, list)):
        read = next(iter(read.values())) if isinstance(read, dict) else read[0]
    assert not math.isfinite(read)


def test_ordinary_json_reads_as_json_does_and_not_json_is_a_decode_error():
    text = '{"a": [1, 2.5, -0.0, 1e308, 123456789012345678901234567890], "s": "x\\u00e9", "n": null}'
    assert strict_json.loads(text) == json.loads(text)
    assert strict_json.loads(text.encode()) == json.loads(text)
    with pytest.raises(json.JSONDecodeError):
        strict_json.loads("{not json")
    assert issubclass(strict_json.JsonNumberError, ValueError)
