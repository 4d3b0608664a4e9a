"""Whether async batching is on: 'auto' resolved against what the device offers."""

from __future__ import annotations

import logging

from conveyor.device import DeviceInfo, available_memory, detect_device
from conveyor.errors import ConfigError

__all__ = ["DeviceInfo", "available_memory", "detect_device", "resolve_async_batching"]

logger = logging.getLogger(__name__)


def resolve_async_batching(requested: bool | str, info: DeviceInfo) -> bool:
    """'auto' -> pipelined wherever the device supports it; True on a device that cannot -> a clear error."""
    kind = info.pipeline_kind
    if requested is True and kind is None:
        raise ConfigError(
            f"async_batching=True was requested, but device {info.device.type!r} ({info.name}) offers "
            f"no way to overlap host work with device compute (no CUDA streams, and the CPU host-thread "
            f"overlap only drives CPU tensors); use async_batching='auto' (falls back to the "
            f"synchronous path) or async_batching=False"
        )
    if requested == "auto":
        if kind is None:
            logger.info(
                "async batching: off on %s (no stream or host-thread overlap for this device); "
                "running the synchronous path",
                info.name,
            )
            return False
        logger.info("async batching: on, via %s", kind)
        return True
    return bool(requested)
