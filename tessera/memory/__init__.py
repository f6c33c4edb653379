"""Layer 3: memory. The memory report, the chunk store and host (offload) copies."""

from tessera.memory.host import copy_to_device_, host_copy, pins_for, wait_for_device
from tessera.memory.report import model_state_bytes, peak_rss_bytes, reset_peak_rss

__all__ = [
    "copy_to_device_",
    "host_copy",
    "model_state_bytes",
    "peak_rss_bytes",
    "pins_for",
    "reset_peak_rss",
    "wait_for_device",
]
