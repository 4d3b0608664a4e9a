"""What the device offers, detected once: its type, streams/events, and free memory.

Below both the model and the runtime layers (both read it); imports nothing of conveyor but errors."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from conveyor.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    has_streams: bool
    """CUDA streams and events exist (overlap via streams)."""
    name: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pipeline_kind(self) -> str | None:
        """How this device overlaps host and device work, or None when it cannot."""
        if self.is_cuda and self.has_streams:
            return "cuda streams and events"
        if self.device.type == "cpu":
            return "a host thread doing commit / schedule / prepare while the forward runs (torch releases the GIL)"
        return None


def detect_device(requested: str) -> DeviceInfo:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "use device='cpu' or device='auto'"
        )
    if requested in ("cuda", "auto") and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        return DeviceInfo(device, True, torch.cuda.get_device_name(device))
    return DeviceInfo(torch.device("cpu"), False, f"cpu ({torch.get_num_threads()} threads)")


def available_memory(info: DeviceInfo) -> int:
    """Bytes a KV cache could take now: free device memory on CUDA, MemAvailable on CPU."""
    if info.is_cuda:
        free, _total = torch.cuda.mem_get_info(info.device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
