"""ReplicaSet: the data-parallel replicas as Ray actors, each in its own placement group, and a watcher that
knows which of them can take requests right now.

    placement group i: bundle 0 {CPU: 1}  ── ReplicaServer actor (rank 0: scheduler, HTTP server)
                       bundle 1..N-1      ── reserved for its TP workers (spawned by the actor, same node)

The bundles are STRICT_PACK: the TP workers are the actor's child processes (the existing worker entry point
over a stdin pipe and gloo), so one replica's ranks share a node; different replicas may sit on different
nodes. An actor whose process dies is restarted by Ray (max_restarts=-1); the watcher sees its HTTP server
go silent, marks it down, and marks it up again once the new process answers /health.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from conveyor.config import EngineConfig
from conveyor.data_parallel.ray_cluster import RayCluster
from conveyor.data_parallel.replica import ReplicaServer
from conveyor.errors import ConfigError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""Longest the replicas may take to be placed and to load the model."""
WATCH_INTERVAL_S = 0.5
CONTROL_TIMEOUT_S = 30.0

PLAIN_TYPES = (str, int, float, bool, type(None))
"""What may cross a Ray call (Ray encodes these with msgpack; anything else it would pickle)."""


def control(ray: Any, ref: Any, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
    """The result of one control call, checked to be a plain value (no object Ray had to pickle)."""
    value = ray.get(ref, timeout=timeout_s)
    if not isinstance(value, PLAIN_TYPES):
        raise TypeError(f"a replica control call returned {type(value).__name__}; only plain values may cross Ray")
    return value


@dataclass
class Replica:
    index: int
    actor: Any
    placement: Any
    address: str | None = None
    """host:port of its HTTP server while it is known to be up."""
    healthy: bool = False
    pid: int | None = None
    """Its actor's process id (changes when Ray restarts it)."""
    restarts: int = 0
    """Times it came back after being down (Ray restarted its process)."""
    args: tuple[Any, ...] = ()
    """The actor's constructor arguments (plain values; Ray keeps them to restart it)."""
    pending: Any = field(default=None, repr=False)
    """An address() call in flight to a (re)starting actor."""


class ReplicaSet:
    """Start M replicas and wait until every one is ready; close() ends all of them (and Ray, if started here)."""

    def __init__(
        self,
        config: EngineConfig,
        app_factory: str,
        model_name: str,
        on_change: Callable[[int, bool], None] | None = None,
    ) -> None:
        """app_factory: the HTTP app each replica serves, as 'module:function' (see replica.py)."""
        tp, dp = config.tensor_parallel_size, config.data_parallel_size
        self.cluster = RayCluster(config.ray_address, cpus_needed=tp * dp)
        ray = self.ray = self.cluster.ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self.api_key = secrets.token_urlsafe(32)
        """Bearer key the replicas accept: only this front talks to them."""
        self.on_change = on_change
        self.replicas: list[Replica] = []
        self._stop = threading.Event()
        self._http = httpx.Client(timeout=2.0, headers={"Authorization": f"Bearer {self.api_key}"})
        replica_json = json.dumps(dataclasses.asdict(config.replace(data_parallel_size=1, ray_address=None)))
        host = "127.0.0.1" if self.cluster.started_here else "node"
        actor_class = ray.remote(ReplicaServer)
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if config.device == "cuda" else {})}
        try:
            for i in range(dp):
                group = placement_group(
                    [dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", name=f"conveyor-replica-{i}"
                )
                ray.get(group.ready(), timeout=START_TIMEOUT_S)
                args = (replica_json, i, app_factory, model_name, self.api_key, host)
                actor = actor_class.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=-1,
                    max_task_retries=0,
                    max_concurrency=4,  # status() answers while stop() or a slow start runs
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                ).remote(*args)
                self.replicas.append(Replica(i, actor, group, args=args))
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        self._watcher = threading.Thread(target=self._watch, name="conveyor-replica-watch", daemon=True)
        self._watcher.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(self.replicas)
        while waiting:
            for r in list(waiting):
                status = control(self.ray, r.actor.status.remote(), timeout_s=START_TIMEOUT_S)
                if status.startswith("failed"):
                    raise ConfigError(f"data-parallel replica {r.index} could not start the engine: {status[8:]}")
                if status == "ready":
                    r.address = control(self.ray, r.actor.address.remote())
                    r.pid = control(self.ray, r.actor.pid.remote())
                    r.healthy = True
                    waiting.remove(r)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"data-parallel replicas {[r.index for r in waiting]} were not ready after {START_TIMEOUT_S:.0f} s"
                )
            if waiting:
                time.sleep(0.2)
        logger.info(
            "data parallelism: %d replicas ready at %s",
            len(self.replicas),
            ", ".join(str(r.address) for r in self.replicas),
        )

    # ---- watching ---------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            for r in self.replicas:
                try:
                    self._check(r)
                except Exception as exc:  # the watcher must outlive any one odd answer
                    logger.warning("replica %d: health check failed: %s", r.index, exc)

    def _check(self, r: Replica) -> None:
        address = r.address
        if address is not None:
            try:
                up = self._http.get(f"http://{address}/health").status_code == 200
            except httpx.HTTPError:
                up = False
            if r.address != address:
                return  # marked down while we asked: that is newer news
            if not up:
                r.address = None  # its process may be gone: ask Ray for the (restarted) actor's address
            self._set_health(r, up)
            return
        if r.pending is None:
            r.pending = r.actor.address.remote()  # queued by Ray until the actor has restarted
        ready, _ = self.ray.wait([r.pending], timeout=0)
        if ready:
            ref, r.pending = r.pending, None
            try:
                r.address = control(self.ray, ref, timeout_s=1.0)
                r.pid = control(self.ray, r.actor.pid.remote(), timeout_s=5.0)
            except Exception as exc:  # died again while starting
                logger.info("replica %d: not back yet (%s)", r.index, type(exc).__name__)

    def _set_health(self, r: Replica, up: bool) -> None:
        if up == r.healthy:
            return
        r.healthy = up
        if up:
            r.restarts += 1
            logger.warning("replica %d is back at %s (restart %d)", r.index, r.address, r.restarts)
        else:
            logger.warning("replica %d is down; its requests go to the other replicas until Ray restarts it", r.index)
        if self.on_change is not None:
            self.on_change(r.index, up)

    def mark_down(self, index: int) -> None:
        """A request found the replica unreachable: stop routing to it before the next health check."""
        r = self.replicas[index]
        r.address = None
        self._set_health(r, False)

    @property
    def healthy(self) -> list[int]:
        return [r.index for r in self.replicas if r.healthy and r.address is not None]

    # ---- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop every replica (its engine and TP workers), remove the placement groups, and shut Ray down
        when this process started it. Safe to call twice."""
        self._stop.set()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.join(timeout=5)
        stops = []
        for r in self.replicas:
            try:
                stops.append(r.actor.stop.remote())
            except Exception:
                pass
        if stops:
            self.ray.wait(stops, num_returns=len(stops), timeout=20)
        for r in self.replicas:
            try:
                self.ray.kill(r.actor, no_restart=True)
            except Exception:
                pass
            try:
                self._remove_placement_group(r.placement)
            except Exception:
                pass
        self.replicas = []
        self._http.close()
        self.cluster.close()
