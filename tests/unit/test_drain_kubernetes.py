"""Drain-safe scale-down on Kubernetes: the rendered worker pods, the preStop wait, the actuator's API calls.

No API server can run here: the actuator talks to a fake AppsV1Api/CoreV1Api that records its calls.

Specification:
* every worker pod (single-node, and a multi-node group's leader) has a preStop hook running
  `runtime.engines.drain_wait` with the drain cap, a prefill pod holding for its KV lease; its grace period
  is the cap plus vLLM's shutdown time; a headless follower has no hook;
* the preStop wait returns once the engine read no request for the hold time, or at the cap; an unreadable
  page counts as busy, and so does a NaN, infinite or negative gauge (NaN > 0 is False: it read as idle);
* lowering a pool annotates the least loaded pods (by the router's load of their IPs) with
  `controller.kubernetes.io/pod-deletion-cost` before the scale patch, and skips terminating pods; raising it
  annotates nothing.
"""

from __future__ import annotations

import datetime as dt
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace as NS

import pytest

from runtime.config import EngineSpec, PlannerSpec
from runtime.deploy.render import find
from runtime.engines.drain_wait import busy_requests, wait_drained
from runtime.engines.drain_wait import main as drain_wait_main
from runtime.planner.types import ScalingDecision
from runtime.router.load import WorkerLoad
from runtime.server.actuators import POD_DELETION_COST, REMOVAL_COST, KubernetesActuator
from tests.unit.test_deploy_render import NAME, make_spec, render


# ------------------------------------------------------------------------------------------ rendered pods
def _container(objs, role: str) -> tuple[dict, dict]:
    pod = find(objs, "Deployment", f"{NAME}-{role}")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_worker_pods_drain_in_prestop_within_a_grace_period_sized_to_the_cap():
    objs = render(make_spec(planner=PlannerSpec(mode="sla", drain_cap_s=300), engine=EngineSpec(kv_lease_s=45)))
    for role, hold in (("prefill", "45"), ("decode", "2")):
        pod, c = _container(objs, role)
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "runtime.engines.drain_wait"]
        assert "--cap-s=300" in cmd and f"--hold-s={hold}" in cmd
        assert any(a.startswith("--port=") for a in cmd)
        assert pod["terminationGracePeriodSeconds"] == 300 + 60  # the cap, then vLLM's own shutdown
    pod, c = _container(render(make_spec()), "prefill")
    assert "--hold-s=30.0" in c["lifecycle"]["preStop"]["exec"]["command"]  # vLLM's default lease
    assert pod["terminationGracePeriodSeconds"] == 120 + 60


def test_a_multi_node_group_drains_on_its_leader_only():
    from runtime.deploy.target import ClusterTarget
    from runtime.deploy.workers import worker_pod_spec

    def pod(rank):
        return worker_pod_spec(make_spec(), "decode", pvc_name="fsx", image="i", inst=None, efa=False,
                               target=ClusterTarget(), service_account="sa", rank=rank)

    leader, follower = pod("leader"), pod("follower")
    assert "lifecycle" in leader["containers"][0] and "lifecycle" not in follower["containers"][0]
    assert leader["terminationGracePeriodSeconds"] == follower["terminationGracePeriodSeconds"] == 180


# ------------------------------------------------------------------------------------------ preStop wait
class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, s: float) -> None:
        self.now_s += s


def test_the_prestop_wait_ends_after_the_hold_with_no_request_or_at_the_cap():
    clock = Clock()
    readings = iter([3, 1, 0, 0, None, 0, 0, 0, 0])  # an unreadable page restarts the hold
    assert wait_drained(lambda: next(readings), hold_s=2, cap_s=60, clock=clock, sleep=clock.sleep)
    assert clock.now_s == 7.0  # idle from t=5 (after the unreadable read at t=4), held 2 s
    clock = Clock()
    assert not wait_drained(lambda: 1, hold_s=2, cap_s=10, clock=clock, sleep=clock.sleep)
    assert clock.now_s == 10.0
    clock = Clock()
    assert wait_drained(lambda: 0, hold_s=0, cap_s=10, clock=clock, sleep=clock.sleep) and clock.now_s == 0
    with pytest.raises(ValueError):
        wait_drained(lambda: 0, hold_s=-1, cap_s=10)


def test_busy_requests_counts_running_and_waiting():
    page = ('vllm:num_requests_running{model_name="m"} 2.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert busy_requests(page) == 3.0 and busy_requests("") == 0.0


@pytest.mark.parametrize("running", ["NaN", "+Inf", "-1"])
def test_a_gauge_no_engine_can_report_is_unreadable_so_the_pod_is_not_taken_for_drained(running):
    page = f'vllm:num_requests_running{{engine="0"}} {running}\nvllm:num_requests_waiting{{engine="0"}} 1\n'
    assert busy_requests(page) is None
    clock = Clock()
    assert not wait_drained(lambda: float(running), hold_s=2, cap_s=10, clock=clock, sleep=clock.sleep)
    assert clock.now_s == 10.0


def test_the_prestop_command_waits_out_a_nan_gauge_read_over_http(capsys):
    """`python -m runtime.engines.drain_wait` against a real /metrics page on 127.0.0.1 whose running gauge
    is NaN while a request waits: with no hold time and no cap, one read decides it, and it must be busy."""
    page = b'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting{engine="0"} 4\n'

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert drain_wait_main(["--port", str(server.server_address[1]), "--hold-s", "0", "--cap-s", "0"]) == 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert capsys.readouterr().out.strip() == "drain cap of 0 s reached"  # "drained" with 4 requests held


# ------------------------------------------------------------------------------------------ the actuator
class FakeApps:
    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas, self.calls = dict(replicas), []

    def read_namespaced_deployment_scale(self, name, namespace):
        self.calls.append(("read_scale", name))
        return NS(spec=NS(replicas=self.replicas[name]), status=NS(selector=f"app={name}"))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.calls.append(("patch_scale", name, body[0]["value"]))
        self.replicas[name] = body[0]["value"]


def _pod(name: str, ip: str, minute: int, annotations=None, deleting: bool = False):
    return NS(metadata=NS(name=name, annotations=annotations, creation_timestamp=dt.datetime(2026, 1, 1, 0, minute),
                          deletion_timestamp=dt.datetime(2026, 1, 1, 1) if deleting else None),
              status=NS(pod_ip=ip))


class FakeCore:
    def __init__(self, pods: dict[str, list], log: list) -> None:
        self.pods, self.calls = pods, log

    def list_namespaced_pod(self, namespace, label_selector):
        self.calls.append(("list_pods", label_selector))
        return NS(items=list(self.pods[label_selector]))

    def patch_namespaced_pod(self, name, namespace, body):
        self.calls.append(("patch_pod", name, body))


def test_a_scale_down_names_the_least_loaded_pods_before_lowering_replicas():
    apps = FakeApps({"m-prefill": 1, "m-decode": 4})
    pods = {"app=m-decode": [_pod("d-busy", "10.0.0.1", 1, {"x": "y"}), _pod("d-idle", "10.0.0.2", 2),
                             _pod("d-new", "10.0.0.3", 3, {"x": "y"}), _pod("d-gone", "10.0.0.4", 4, deleting=True)]}
    core = FakeCore(pods, apps.calls)
    loads = {"10.0.0.1": 5, "10.0.0.2": 0, "10.0.0.3": 1}
    act = KubernetesActuator(apps, namespace="llm", prefill_deployment="m-prefill", decode_deployment="m-decode",
                             core_api=core, load_of_ip=lambda ip: WorkerLoad(ip, "decode", num_requests=loads[ip]))
    act.apply(ScalingDecision(now_s=0, prefill_replicas=1, decode_replicas=2))
    patches = [c for c in apps.calls if c[0] == "patch_pod"]
    cost = str(REMOVAL_COST)
    assert patches == [
        ("patch_pod", "d-idle", [{"op": "add", "path": "/metadata/annotations", "value": {POD_DELETION_COST: cost}}]),
        ("patch_pod", "d-new", [{"op": "add", "path": "/metadata/annotations/controller.kubernetes.io~1pod-deletion-cost",
                                 "value": cost}]),
    ]
    order = [c[0] for c in apps.calls]
    assert order.index("patch_scale") > max(i for i, c in enumerate(order) if c == "patch_pod")  # named first
    assert apps.replicas == {"m-prefill": 1, "m-decode": 2}
    apps.calls.clear()
    act.apply(ScalingDecision(now_s=0, prefill_replicas=2, decode_replicas=2))  # a scale-up names no pod
    assert [c[0] for c in apps.calls if c[0] in ("list_pods", "patch_pod")] == []


def test_a_stale_removal_mark_is_taken_off_a_pod_that_is_not_named_again():
    # a scale-down whose scale PATCH failed left d-busy marked; it has become the busiest pod since
    apps = FakeApps({"m-prefill": 1, "m-decode": 3})
    cost = str(REMOVAL_COST)
    pods = {"app=m-decode": [_pod("d-busy", "10.0.0.1", 1, {POD_DELETION_COST: cost, "x": "y"}),
                             _pod("d-idle", "10.0.0.2", 2), _pod("d-some", "10.0.0.3", 3)]}
    core = FakeCore(pods, apps.calls)
    loads = {"10.0.0.1": 9, "10.0.0.2": 0, "10.0.0.3": 2}
    act = KubernetesActuator(apps, namespace="llm", prefill_deployment="m-prefill", decode_deployment="m-decode",
                             core_api=core, load_of_ip=lambda ip: WorkerLoad(ip, "decode", num_requests=loads[ip]))
    act.apply(ScalingDecision(now_s=0, prefill_replicas=1, decode_replicas=2))
    path = "/metadata/annotations/controller.kubernetes.io~1pod-deletion-cost"
    assert [c for c in apps.calls if c[0] == "patch_pod"] == [
        ("patch_pod", "d-busy", [{"op": "remove", "path": path}]),
        ("patch_pod", "d-idle", [{"op": "add", "path": "/metadata/annotations", "value": {POD_DELETION_COST: cost}}]),
    ]
    assert apps.replicas["m-decode"] == 2


def test_without_the_routers_view_the_newest_pods_are_named():
    apps = FakeApps({"m-prefill": 3, "m-decode": 1})
    core = FakeCore({"app=m-prefill": [_pod("p-new", "ip3", 9), _pod("p-old", "ip1", 1), _pod("p-mid", "ip2", 5)]},
                    apps.calls)
    act = KubernetesActuator(apps, namespace="llm", prefill_deployment="m-prefill", decode_deployment="m-decode",
                             core_api=core)
    act.apply(ScalingDecision(now_s=0, prefill_replicas=1, decode_replicas=1))
    assert [c[1] for c in apps.calls if c[0] == "patch_pod"] == ["p-new", "p-mid"]


def test_terminating_pods_count_as_draining_until_they_are_gone():
    apps = FakeApps({"m-prefill": 1, "m-decode": 2})
    pods = {"app=m-prefill": [_pod("p", "ip0", 1)],
            "app=m-decode": [_pod("d1", "ip1", 1), _pod("d2", "ip2", 2), _pod("d-old", "ip3", 0, deleting=True)]}
    core = FakeCore(pods, apps.calls)
    act = KubernetesActuator(apps, namespace="llm", prefill_deployment="m-prefill", decode_deployment="m-decode",
                             core_api=core)
    assert act.draining_counts() == (0, 1)
    pods["app=m-decode"].pop()  # its preStop drain ended, the pod is gone
    assert act.draining_counts() == (0, 0)
    no_core = KubernetesActuator(apps, namespace="llm", prefill_deployment="m-prefill", decode_deployment="m-decode")
    assert no_core.draining_counts() == (0, 0)
