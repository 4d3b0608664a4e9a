"""The Ray cluster replicas run on: a private local one started here, or an existing one joined by address.

Ray is an optional extra (`pip install conveyor[ray]`), imported only when data_parallel_size > 1.

Token authentication (on by default since Ray 2.5x) stays on: a local cluster started here gets the token
Ray generates (saved to ~/.ray/auth_token); joining a cluster with `ray_address` needs that cluster's token
in RAY_AUTH_TOKEN or ~/.ray/auth_token, as for any Ray driver. Conveyor never turns authentication off.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

from conveyor.errors import ConfigError

logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 128 * 2**20
"""Object store of a cluster started here: only control messages (strings, ints) pass through Ray."""


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "data_parallel_size > 1 runs replicas on Ray, which is not installed; install it with "
            "`pip install 'conveyor[ray]'` (or use data_parallel_size=1)"
        ) from None
    return ray


class RayCluster:
    """Connected on construction; close() shuts Ray down only when this object started the cluster."""

    def __init__(self, address: str | None, cpus_needed: int) -> None:
        ray = import_ray()
        self.ray = ray
        self.started_here = False
        if ray.is_initialized():  # a caller's own Ray session: use it, leave it running
            logger.info("data parallelism: using the Ray session this process already has")
            return
        if address is not None:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
            logger.info("data parallelism: joined the Ray cluster at %s", address)
        else:
            cpus = max(os.cpu_count() or 1, cpus_needed)  # logical CPUs: one per rank, even past the cores
            ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES, log_to_driver=True)
            self.started_here = True
            logger.info("data parallelism: started a local Ray cluster (%d logical CPUs)", cpus)
        available = ray.cluster_resources().get("CPU", 0)
        if available < cpus_needed:
            self.close()
            raise ConfigError(
                f"the Ray cluster has {available:g} CPUs, but data_parallel_size x "
                f"tensor_parallel_size needs {cpus_needed} (one per rank); add nodes with "
                f"`ray start --address=<head>` or ask for fewer replicas"
            )

    def close(self) -> None:
        if self.started_here and self.ray.is_initialized():
            self.ray.shutdown()  # ends the gcs_server, raylet and worker processes this process started
