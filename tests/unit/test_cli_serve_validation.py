"""`pdserve serve` refuses bad input before any worker starts, with a message naming the flag or spec field.

LocalDeployment is replaced by a fake that records it was entered: entering it is the point where real
vLLM workers would start, so every refusal below asserts it was never reached.
"""

import json

import pytest
from typer.testing import CliRunner

import runtime.server.launch as launch
from runtime.cli import app

runner = CliRunner()


class _Started(Exception):
    pass


@pytest.fixture
def started(monkeypatch):
    """What the fake LocalDeployment saw; key 'entered' appears when workers would have started."""
    seen = {}

    class FakeDeployment:
        def __init__(self, spec, model_path, **kw):
            seen.update(spec=spec, model_path=model_path, **kw)

        def __enter__(self):
            seen["entered"] = True
            raise _Started()

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(launch, "LocalDeployment", FakeDeployment)
    return seen


def _model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


def _spec_file(tmp_path, doc):
    p = tmp_path / "spec.json"
    p.write_text(json.dumps(doc))
    return p


def _serve(tmp_path, *args):
    return runner.invoke(app, ["serve", *args, "--state-dir", str(tmp_path)], env={"COLUMNS": "200"})


def test_a_valid_spec_reaches_the_deployment(tmp_path, started):
    spec = _spec_file(tmp_path, {"model": {"name": "m", "path": str(_model_dir(tmp_path))}})
    res = _serve(tmp_path, "--spec", str(spec), "--port", "9090")
    assert isinstance(res.exception, _Started)  # the fake proves validation let it through
    assert started["runtime_port"] == 9090 and started["model_path"] == _model_dir(tmp_path)


def test_the_worker_logs_go_under_the_state_dir(tmp_path, started):
    res = _serve(tmp_path, "--model-dir", str(_model_dir(tmp_path)))
    assert isinstance(res.exception, _Started)
    assert started["log_dir"] == tmp_path / "logs"  # not the checkout's .pdserve/logs


@pytest.mark.parametrize("port", ["0", "-1", "65536", "70000"])
def test_a_port_outside_1_to_65535_is_refused(tmp_path, started, port):
    res = _serve(tmp_path, "--model-dir", str(_model_dir(tmp_path)), "--port", port)
    assert res.exit_code == 2 and "--port" in res.output
    assert "entered" not in started


@pytest.mark.parametrize("make,why", [(lambda t: t / "nope", "not a folder"),
                                      (lambda t: t, "no config.json"),
                                      (lambda t: _model_dir(t) / "config.json", "not a folder")])
def test_a_model_dir_that_is_not_a_model_folder_is_refused(tmp_path, started, make, why):
    res = _serve(tmp_path, "--model-dir", str(make(tmp_path)))
    assert res.exit_code == 2 and "--model-dir" in res.output and why in res.output, res.output
    assert "entered" not in started


def test_a_spec_without_model_path_needs_model_dir(tmp_path, started):
    spec = _spec_file(tmp_path, {"model": {"name": "m"}})  # what `tune --out` writes for a bare config.json
    res = _serve(tmp_path, "--spec", str(spec))
    assert res.exit_code == 2 and "model.path is empty" in res.output and "--model-dir" in res.output, res.output
    assert "entered" not in started


def test_a_spec_without_model_path_serves_the_model_dir(tmp_path, started):
    spec = _spec_file(tmp_path, {"model": {"name": "m"}})
    res = _serve(tmp_path, "--spec", str(spec), "--model-dir", str(_model_dir(tmp_path)))
    assert isinstance(res.exception, _Started) and started["model_path"] == _model_dir(tmp_path)


def test_a_spec_model_path_without_config_json_is_refused(tmp_path, started):
    spec = _spec_file(tmp_path, {"model": {"name": "m", "path": str(tmp_path)}})
    res = _serve(tmp_path, "--spec", str(spec))
    assert res.exit_code == 2 and "model.path" in res.output and "no config.json" in res.output, res.output
    assert "entered" not in started


def test_a_spec_that_is_not_utf8_is_a_clear_error(tmp_path, started):
    p = tmp_path / "spec.json"
    p.write_bytes(b'{"model": {"name": "\xff\xfe"}}')
    res = _serve(tmp_path, "--spec", str(p))
    assert res.exit_code == 2 and "--spec" in res.output, (res.exit_code, repr(res.exception))
    assert "Traceback" not in res.output and "entered" not in started


@pytest.mark.parametrize("section,field,value,msg", [
    ("planner", "predictor", "bogus", "unknown planner.predictor"),
    ("model", "name", "", "model.name"),
    ("model", "name", "../m", "model.name"),
    ("decode", "replicas", 20, "decode"),
])
def test_spec_values_the_runtime_rejects_are_refused_when_read(tmp_path, started, section, field, value, msg):
    doc = {"model": {"name": "m", "path": str(_model_dir(tmp_path))}}
    doc.setdefault(section, {})[field] = value
    res = _serve(tmp_path, "--spec", str(_spec_file(tmp_path, doc)), "--planner", "dry-run")
    assert res.exit_code == 2 and msg in res.output, res.output
    assert "entered" not in started


def test_an_infinite_spec_value_is_refused_when_read(tmp_path, started):
    p = tmp_path / "spec.json"
    p.write_text('{"model": {"name": "m", "path": "%s"}, "router": {"approx_ttl_s": Infinity}}' % _model_dir(tmp_path))
    res = _serve(tmp_path, "--spec", str(p), "--router", "kv")
    assert res.exit_code == 2 and "router.approx_ttl_s" in res.output, res.output
    assert "entered" not in started


def test_the_traffic_log_reaches_the_deployment_and_a_folder_is_refused(tmp_path, started):
    log = tmp_path / "logs" / "traffic.jsonl"
    res = _serve(tmp_path, "--model-dir", str(_model_dir(tmp_path)), "--traffic-log", str(log), "--port", "9091")
    assert isinstance(res.exception, _Started) and started["traffic_log"] == log
    started.clear()
    res = _serve(tmp_path, "--model-dir", str(_model_dir(tmp_path)), "--traffic-log", str(tmp_path))
    assert res.exit_code == 2 and "--traffic-log" in res.output and "is a folder" in res.output
    assert "entered" not in started


def test_a_spec_is_served_with_its_own_router(tmp_path, started):
    spec = _spec_file(tmp_path, {"model": {"name": "m", "path": str(_model_dir(tmp_path))},
                                 "router": {"policy": "least_loaded"}})
    res = _serve(tmp_path, "--spec", str(spec))
    assert isinstance(res.exception, _Started), res.output
    # the kv mode passes the spec's whole router (its policy included) to the runtime
    assert started["router"] == "kv" and started["enable_kv_events"] is True
    assert started["spec"].router.policy == "least_loaded"


def test_without_a_spec_the_pairing_is_fixed_and_a_flag_overrides_the_spec(tmp_path, started):
    res = _serve(tmp_path, "--model-dir", str(_model_dir(tmp_path)))
    assert isinstance(res.exception, _Started) and started["router"] == "fixed"
    spec = _spec_file(tmp_path, {"model": {"name": "m", "path": str(_model_dir(tmp_path))}})
    res = _serve(tmp_path, "--spec", str(spec), "--router", "fixed")
    assert isinstance(res.exception, _Started) and started["router"] == "fixed"
    assert started["enable_kv_events"] is False


def test_a_spec_whose_planner_is_not_run_says_so(tmp_path, started):
    spec = _spec_file(tmp_path, {"model": {"name": "m", "path": str(_model_dir(tmp_path))},
                                 "planner": {"mode": "sla"}})
    res = _serve(tmp_path, "--spec", str(spec))
    assert isinstance(res.exception, _Started)
    assert "planner (mode sla) does not run" in res.output and "--planner" in res.output, res.output
    res = _serve(tmp_path, "--spec", str(spec), "--planner", "dry-run")
    assert "does not run" not in res.output and started["planner"] == "dry-run"
