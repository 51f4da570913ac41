"""Mooncake trace parsing, arrival scaling and the infinite-cache oracle."""

import json

import pytest

from runtime.sim.trace import TraceError, oracle_hit_rate, parse_mooncake, scale_arrivals


def _line(ts, isl, osl, ids):
    return json.dumps({"timestamp": ts, "input_length": isl, "output_length": osl, "hash_ids": ids})


def test_parses_and_sorts_by_arrival_in_seconds():
    reqs = parse_mooncake([_line(2000, 1024, 5, [0, 1]), "", _line(500, 600, 3, [0, 2])])
    assert [r.arrival_s for r in reqs] == [0.5, 2.0]
    assert reqs[0].hash_ids == (0, 2) and reqs[0].input_tokens == 600 and reqs[0].output_tokens == 3


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{bad", "line 1: not JSON"),
        (json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1}), r"line 1: missing key\(s\) hash_ids"),
        (_line(-1, 1, 1, []), "'timestamp'"),
        (_line(0, 0, 1, []), "'input_length'"),
        (_line(0, 1, 1, ["a"]), "'hash_ids'"),
        (_line(10**400, 1, 1, []), "'timestamp'"),  # beyond float range: not an OverflowError
    ],
)
def test_malformed_lines_name_the_line_and_key(line, needle):
    with pytest.raises(TraceError, match=needle):
        parse_mooncake([line])


def test_oracle_counts_blocks_seen_earlier():
    reqs = parse_mooncake([_line(0, 1, 1, [0, 1, 2]), _line(1, 1, 1, [0, 1, 3]), _line(2, 1, 1, [4])])
    assert oracle_hit_rate(reqs) == pytest.approx(2 / 7)


def test_scaling_multiplies_arrivals_and_rejects_non_positive_factors():
    reqs = parse_mooncake([_line(1000, 1, 1, [0]), _line(3000, 1, 1, [1])])
    assert [r.arrival_s for r in scale_arrivals(reqs, 0.5)] == [0.5, 1.5]
    with pytest.raises(ValueError, match="factor"):
        scale_arrivals(reqs, 0)


_RAW = '{{"timestamp": {ts}, "input_length": {isl}, "output_length": {osl}, "hash_ids": {ids}}}'


@pytest.mark.parametrize(
    "line, needle",
    [
        # json.loads accepts bare NaN/Infinity: they must not reach the sort or the replay clock.
        (_RAW.format(ts="NaN", isl=10, osl=5, ids="[1]"), "line 1: 'timestamp' must be a finite"),
        (_RAW.format(ts="Infinity", isl=10, osl=5, ids="[1]"), "line 1: 'timestamp' must be a finite"),
        (_RAW.format(ts="-Infinity", isl=10, osl=5, ids="[1]"), "line 1: 'timestamp'"),
        # bool is an int subclass in Python but not a number in a trace.
        (_RAW.format(ts="true", isl=10, osl=5, ids="[1]"), "line 1: 'timestamp'"),
        (_RAW.format(ts=0, isl="true", osl=5, ids="[1]"), "line 1: 'input_length'"),
        (_RAW.format(ts=0, isl=10, osl="false", ids="[1]"), "line 1: 'output_length'"),
        (_RAW.format(ts=0, isl=10, osl=5, ids="[true]"), "line 1: 'hash_ids'"),
    ],
)
def test_non_finite_and_boolean_values_are_refused_naming_line_and_key(line, needle):
    with pytest.raises(TraceError, match=needle):
        parse_mooncake([line])


def test_bad_value_on_a_later_line_names_that_line():
    with pytest.raises(TraceError, match="line 2: 'timestamp'"):
        parse_mooncake([_line(0, 1, 1, [0]), _RAW.format(ts="NaN", isl=1, osl=1, ids="[0]")])


def test_byte_order_mark_on_the_first_line_is_ignored():
    reqs = parse_mooncake(["\ufeff" + _line(1000, 10, 5, [1])])
    assert [(r.arrival_s, r.input_tokens) for r in reqs] == [(1.0, 10)]


@pytest.mark.parametrize("factor", [float("inf"), float("nan"), -1.0, True])
def test_scaling_refuses_non_finite_and_non_number_factors(factor):
    reqs = parse_mooncake([_line(0, 1, 1, [0]), _line(1000, 1, 1, [1])])
    with pytest.raises(ValueError, match="finite number > 0"):
        scale_arrivals(reqs, factor)


@pytest.mark.parametrize("line, needle", [("[1, 2]", "expected a JSON object, got list"), ("{bad", "not JSON"),
                                          ('{"timestamp": 0}', "missing key(s) input_length, output_length")])
def test_the_simulator_and_the_tuner_decode_json_lines_alike_naming_the_file(line, needle):
    """One line decoder (runtime.traces.formats.json_records) serves both readers of a Mooncake trace."""
    from runtime.traces.formats import parse_jsonl

    for parse in (lambda ls: parse_mooncake(ls, "t.jsonl"), lambda ls: parse_jsonl(ls, "t.jsonl")):
        with pytest.raises(TraceError) as e:
            parse([_line(0, 1, 1, [0]), line])
        assert str(e.value).startswith("t.jsonl:2: ") and needle in str(e.value)


def test_a_byte_order_mark_is_dropped_by_both_readers():
    from runtime.traces.formats import parse_jsonl

    assert list(parse_jsonl(["\ufeff" + _line(1000, 10, 5, [1])], "t.jsonl").isl_tokens) == [10]
