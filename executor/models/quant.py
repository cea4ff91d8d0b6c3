"""Quantized linear layers, swapped in for the model's projections after its weights are loaded."""
from __future__ import annotations

import torch
from torch import nn

from headrace.checkpoint import ConfigError
from headrace.kernels import dispatch
from headrace.kernels.fp8 import quantize_rows

# The projections each decoder layer holds; embeddings, norms and the LM head stay in the model dtype.
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in FP8 E4M3, one scale per output channel, and x
    quantized per token as it comes (kernels/fp8.py)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight, scale = quantize_rows(linear.weight.data)
        self.register_buffer("weight", weight)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale", scale)  # [out, 1] float32
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = dispatch.fp8_linear(x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


def check_quantization(name: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, naming why, a quantization this device or dtype cannot run."""
    if name is None:
        return
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError(f"quantization='fp8' needs FP8 tensor cores (compute capability 8.9 or newer); "
                              f"{torch.cuda.get_device_name(device)} has "
                              f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"quantization='fp8' on a GPU computes in bfloat16 or float16, not {dtype}; "
                              f"set dtype='bfloat16'")


def quantize_model(model: nn.Module, name: str | None) -> None:
    """Replace every decoder layer's projections by their quantized form (in place)."""
    if name is None:
        return
    for module in list(model.modules()):
        for attr in _PROJECTIONS:
            child = getattr(module, attr, None)
            if isinstance(child, nn.Linear):
                setattr(module, attr, Fp8Linear(child))
