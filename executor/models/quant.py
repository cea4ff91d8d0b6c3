"""Quantized linear layers, and which quantization an engine runs.

The decoder's projections (q|k|v, o, gate|up, down) become one of these;
embeddings, norms and the LM head stay in the model dtype. Each layer calls
a kernels/ launcher on a GPU and its dequantizing torch reference elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headrace.checkpoint import ConfigError
from headrace.checkpoint.config import ModelConfig
from headrace.checkpoint.quant_config import QuantConfig
from headrace.kernels import dispatch
from headrace.kernels.gguf import PackedGGUF

# The projections each decoder layer holds.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _flat(linear):
    """forward for a layer whose kernel takes [tokens, in_features]."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = linear(self, x.reshape(-1, shape[-1]))
        return y.reshape(*shape[:-1], y.shape[-1])
    return forward


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in FP8 E4M3, one scale per output channel; x is
    quantized per token as it comes, or by the checkpoint's static input_scale."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)  # [out, 1] float32
        self.register_buffer("input_scale", input_scale)  # [] float32, or None: per token
        self.bias = bias

    @_flat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale)


class Int4Linear(nn.Module):
    """y = x W^T + b with W as 4-bit integers (AWQ and GPTQ, repacked at load):
    W[n, k] = (q - zero) * scale of k's group (kernels/int4.py's layout)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, perm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [in / 8, out] int32
        self.register_buffer("scales", scales)  # [in / group_size, out]
        self.register_buffer("zeros", zeros)  # [in / group_size, out], integers 0..16
        # input feature -> position in the packed order (GPTQ's desc_act), or None
        self.register_buffer("perm", perm)  # [in] int64
        self.group_size = group_size
        self.bias = bias

    @_flat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return dispatch.int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)


class GGUFLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks, as the file holds them. A fused
    projection whose parts differ in format (another block format, or floats)
    runs one matmul per run of parts."""

    def __init__(self, parts: list[PackedGGUF | torch.Tensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = parts  # each [rows, in]: packed blocks, or a float weight
        self.bias = bias

    @_flat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1 and isinstance(self.parts[0], PackedGGUF):
            return dispatch.gguf_linear(x, self.parts[0], self.bias)
        y = torch.cat([dispatch.gguf_linear(x, p, None) if isinstance(p, PackedGGUF) else F.linear(x, p)
                       for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


def resolve_quantization(asked: str | None, dequantize_gguf: bool, cfg: ModelConfig, device: torch.device,
                         dtype: torch.dtype, tp_size: int) -> QuantConfig | None:
    """The quantization an engine runs: the user's choice against what the
    checkpoint holds and what the device can do, refused with the reason."""
    held, where = cfg.quant, cfg.path
    if dequantize_gguf and (held is None or held.method != "gguf"):
        raise ConfigError(f"dequantize_gguf applies to a GGUF file with quantized weights; {where} is not one")
    if held is not None and held.method == "gguf":
        if asked not in (None, "gguf"):
            raise ConfigError(f"quantization={asked!r}: {where} is a GGUF file of quantized blocks; "
                              f"use quantization='gguf' (or None), or dequantize_gguf=True")
        if dequantize_gguf and asked == "gguf":
            raise ConfigError("quantization='gguf' keeps a GGUF file's blocks packed; dequantize_gguf=True asks "
                              "the opposite: set one")
        if dequantize_gguf or (asked is None and device.type != "cuda"):
            return None  # dequantized at load (the default on the CPU)
    elif held is not None:
        if asked not in (None, held.method):
            raise ConfigError(f"quantization={asked!r}: the checkpoint {where} holds {held.method} weights "
                              f"(its quantization_config)")
    elif asked in ("awq", "gptq", "gguf"):
        raise ConfigError(f"quantization={asked!r}: the checkpoint {where} holds no {asked} weights "
                          f"({'not a GGUF file' if asked == 'gguf' else 'no quantization_config'}); "
                          f"only 'fp8' quantizes a float checkpoint at load")
    elif asked == "fp8":
        held = QuantConfig("fp8", bits=8, in_checkpoint=False)
    if held is None:
        return None
    if held.in_checkpoint and tp_size > 1:
        raise ConfigError(f"{held.method} checkpoints run on one GPU; tensor_parallel_size={tp_size} is not "
                          f"supported with them")
    if held.method == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(f"fp8 needs FP8 tensor cores (compute capability 8.9 or newer); "
                              f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"fp8 on a GPU computes in bfloat16 or float16, not {dtype}; set dtype='bfloat16'")
    return held

