"""`python -m runtime.server` argument validation: a bad value is refused at parse time with argparse's one-line
error (exit 2), naming the flag, never a traceback later.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.server.__main__ import parse_args

BASE = ["--model-name", "m", "--decode-url", "http://127.0.0.1:1"]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flag,value", [
    ("--planner-interval-s", "nan"), ("--planner-interval-s", "inf"), ("--planner-interval-s", "0"),
    ("--planner-interval-s", "-2"), ("--planner-max-workers", "0"), ("--planner-max-workers", "-3"),
    ("--timeout-s", "-1"), ("--timeout-s", "0"), ("--timeout-s", "nan"), ("--http-port", "70000"),
    ("--http-port", "0"), ("--block-size", "0"), ("--block-size", "x"), ("--prefill-timeout-s", "-5"),
    ("--prefill-nudge-after-s", "inf"), ("--kv-lease-s", "5"), ("--kv-lease-s", "30.5"),
    ("--max-body-bytes", "1023"), ("--max-body-bytes", "64MiB"), ("--shutdown-grace-s", "-1"),
    ("--shutdown-grace-s", "inf"), ("--shutdown-delay-s", "nan"), ("--shutdown-delay-s", "-0.5"),
])
def test_bad_values_are_refused_at_parse_time_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*BASE, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m runtime.server: error: argument " + flag) and value in err


def test_good_values_parse_to_numbers():
    a = parse_args([*BASE, "--planner-interval-s", "2.5", "--planner-max-workers", "1", "--timeout-s", "30",
                    "--http-port", "65535", "--block-size", "32", "--prefill-timeout-s", "5"])
    assert (a.planner_interval_s, a.planner_max_workers, a.timeout_s, a.http_port, a.block_size,
            a.prefill_timeout_s) == (2.5, 1, 30.0, 65535, 32, 5.0)
    assert a.prefill_nudge_after_s is None
    assert a.max_body_bytes is None  # the edge's own default (runtime.server.edge.DEFAULT_MAX_BODY_BYTES)
    assert parse_args([*BASE, "--max-body-bytes", "1048576"]).max_body_bytes == 1048576


def test_the_shutdown_drain_defaults_to_a_long_stream_and_takes_zero():
    a = parse_args(BASE)
    assert (a.shutdown_grace_s, a.shutdown_delay_s) == (900.0, 0.0)
    app = pytest.importorskip("runtime.server.app")
    assert a.shutdown_grace_s == app.DEFAULT_SHUTDOWN_GRACE_S  # the flag's default is serve()'s
    a = parse_args([*BASE, "--shutdown-grace-s", "0", "--shutdown-delay-s", "5"])
    assert (a.shutdown_grace_s, a.shutdown_delay_s) == (0.0, 5.0)


@pytest.mark.parametrize("flag", ["--prefill-deployment", "--decode-deployment"])
@pytest.mark.parametrize("planner", ["off", "dry-run", "local"])
def test_deployments_without_the_kubernetes_planner_are_refused(flag, planner, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*BASE, "--planner", planner, flag, "m-workers"])
    assert exc.value.code == 2
    assert "only by --planner kubernetes" in capsys.readouterr().err
    a = parse_args([*BASE, "--planner", "kubernetes", "--prefill-deployment", "p", "--decode-deployment", "d"])
    assert (a.prefill_deployment, a.decode_deployment) == ("p", "d")


def test_the_command_line_prints_one_error_line_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "runtime.server", *BASE, "--planner-max-workers", "0"],
                       capture_output=True, text=True, cwd=REPO, timeout=60, env={"PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("python -m runtime.server: error: argument --planner-max-workers: "
                                                 "must be >= 1, got 0")


def test_kubernetes_discovery_refuses_the_local_planner(capsys):
    k8s = ["--model-name", "m", "--discovery", "kubernetes", "--prefill-service", "p", "--decode-service", "d"]
    with pytest.raises(SystemExit) as exc:
        parse_args([*k8s, "--planner", "local", "--model-dir", "/m"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--planner local" in err and "--discovery kubernetes" in err
    for planner in ("off", "dry-run"):  # the others stay accepted
        assert parse_args([*k8s, "--planner", planner]).planner == planner
    a = parse_args([*k8s, "--planner", "kubernetes", "--prefill-deployment", "p", "--decode-deployment", "d"])
    assert a.planner == "kubernetes"
    assert parse_args([*BASE, "--planner", "local"]).discovery == "static"


def test_prefill_priority_defaults_to_the_router_spec_and_a_contradiction_is_refused(tmp_path):
    from runtime.server.__main__ import main

    assert parse_args(BASE).prefill_priority is None  # resolved in main: the spec's with --router kv, else fcfs
    assert parse_args([*BASE, "--prefill-priority", "length"]).prefill_priority == "length"
    kv = [*BASE, "--router", "kv", "--tokenizer-dir", str(tmp_path), "--router-spec", '{"prefill_priority": "fcfs"}']
    with pytest.raises(SystemExit, match=r"--prefill-priority 'length' contradicts the --router-spec's "
                                         r"prefill_priority 'fcfs'"):
        main([*kv, "--prefill-priority", "length"])


@pytest.mark.parametrize("router", [[], ["--router", "kv"]])
def test_the_router_specs_migration_limit_reaches_the_runtime_with_either_router(router, tmp_path, monkeypatch):
    pytest.importorskip("kserve")
    import runtime.server.app as app
    from runtime.server.__main__ import main

    served = {}
    monkeypatch.setattr(app, "serve", lambda name, **kw: served.update(kw))
    monkeypatch.setattr(sys, "argv", ["runtime.server"])  # main hides its flags from KServe's parser there
    main([*BASE, *router, "--tokenizer-dir", str(tmp_path), "--router-spec", '{"migration_limit": 3}'])
    assert served["migration_limit"] == 3
    assert (served["router_spec"] is not None) is bool(router)
    with pytest.raises(SystemExit, match="--router-spec"):  # checked with the fixed router too
        main([*BASE, "--router-spec", '{"migration_limit": -1}'])


def test_a_local_planners_deployment_spec_must_agree_with_the_runtimes_prefill_priority(tmp_path):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec
    from runtime.server.__main__ import planner_settings, resolve_prefill_priority

    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load")).model_dump_json()
    local = [*BASE, "--planner", "local", "--model-dir", str(tmp_path), "--deployment-spec", spec]
    a = parse_args(local)
    assert resolve_prefill_priority(a, None, planner_settings(a)) == "length"  # its workers schedule by priority
    a = parse_args([*local, "--prefill-priority", "fcfs"])
    with pytest.raises(SystemExit, match=r"--prefill-priority 'fcfs' contradicts the --deployment-spec's "
                                         r"router.prefill_priority 'length'"):
        resolve_prefill_priority(a, None, planner_settings(a))
    assert resolve_prefill_priority(parse_args(BASE), None, None) == "fcfs"


def test_the_kv_lease_flag_is_whole_seconds_and_optional():
    assert parse_args(BASE).kv_lease_s is None
    assert parse_args([*BASE, "--kv-lease-s", "45"]).kv_lease_s == 45


def test_the_model_bounds_decode_legs_by_the_lease_it_is_given():
    pytest.importorskip("kserve")
    from prometheus_client import CollectorRegistry

    from runtime.server.app import build_model

    model = build_model("m", prefill_urls=[], decode_urls=["http://127.0.0.1:1"], registry=CollectorRegistry(),
                        kv_lease_s=45)
    assert model.kv_lease_s == 45
    assert build_model("m", prefill_urls=[], decode_urls=["http://127.0.0.1:1"],
                       registry=CollectorRegistry()).kv_lease_s == 30


def test_leader_election_needs_a_planner_and_a_lease(tmp_path, capsys):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec
    from runtime.server.__main__ import planner_settings

    kv = ["--router", "kv", "--tokenizer-dir", str(tmp_path)]
    for argv, msg in (([*BASE, "--leader-election", "file"], "it needs --planner"),
                      ([*BASE, *kv, "--planner", "dry-run", "--leader-election", "kubernetes"], "needs --leader-lease"),
                      # without the share the leader would plan for its own requests alone
                      ([*BASE, "--planner", "dry-run", "--leader-election", "file"], "use --router kv"),
                      ([*BASE, *kv, "--planner", "dry-run", "--leader-election", "file", "--no-engine-load"],
                       "no --no-engine-load")):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    spec = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load")).model_dump_json()
    dry = [*BASE, *kv, "--planner", "dry-run", "--deployment-spec", spec]
    assert planner_settings(parse_args(dry))["leader_election"] is None
    a = parse_args([*dry, "--leader-election", "file", "--leader-lease-file", str(tmp_path / "l.json")])
    assert planner_settings(a)["leader_election"] == {"kind": "file", "lock_file": tmp_path / "l.json"}
    a = parse_args([*dry, "--leader-election", "kubernetes", "--leader-lease", "m-planner-leader"])
    assert planner_settings(a)["leader_election"] == {"kind": "kubernetes", "lease_name": "m-planner-leader"}


def test_the_deployment_spec_is_json_text_or_the_path_of_a_file_holding_it(tmp_path):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec
    from runtime.server.__main__ import deployment_settings

    text = DeploymentSpec(model=ModelRef(name="m"), planner=PlannerSpec(mode="load", gpu_budget=7)).model_dump_json()
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(text)
    for value in (text, str(spec_file)):
        spec, _ = deployment_settings(parse_args([*BASE, "--deployment-spec", value]))
        assert spec.planner.gpu_budget == 7
    missing = tmp_path / "none.json"
    with pytest.raises(SystemExit) as e:
        deployment_settings(parse_args([*BASE, "--deployment-spec", str(missing)]))
    assert str(e.value).startswith(f"--deployment-spec {missing}: neither DeploymentSpec JSON text")
    assert "input_value" not in str(e.value)
    spec_file.write_text('{"model": {"name": "m"}, "planner": {"gpu_budget": -1}}')
    with pytest.raises(SystemExit) as e:
        deployment_settings(parse_args([*BASE, "--deployment-spec", str(spec_file)]))
    assert str(e.value).startswith(f"--deployment-spec {spec_file}: not a valid DeploymentSpec: planner.gpu_budget: ")
    assert "\n" not in str(e.value)
