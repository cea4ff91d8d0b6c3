"""Facts about the device that launchers size their grids by."""
from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; off the GPU an H100's 132
    stand in, so the interpreter makes the choices the GPU would."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
