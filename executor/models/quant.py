"""Quantized linear layers, and which quantization an engine runs.

The decoder's projections (q|k|v, o, gate|up, down) become one of these;
norms stay in the model dtype, and so do the embedding table and the LM head
unless quantize_embeddings puts them in FP8 (Fp8Embedding and an Fp8Linear
head; tied, they share one table). Each layer calls a kernels/ launcher on a
GPU and its dequantizing torch reference elsewhere.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from headrace.checkpoint import ConfigError
from headrace.checkpoint.config import ModelConfig
from headrace.checkpoint.quant_config import QuantConfig
from headrace.config import EngineArgs
from headrace.kernels import fp8, gguf, int4
from headrace.kernels.gguf import PackedGGUF
from headrace.kernels.splitk import counters

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
    """y = x W^T + b with W in FP8 E4M3, one scale per output channel. Above
    kernels/fp8.py's FEW_ROWS rows on a GPU, and always in the reference, x is
    quantized per token as it comes, or by the checkpoint's static input_scale;
    fewer rows on a GPU multiply x as it is. project() and the MLP hand it the
    RMSNorm or the SiLU-and-mul before it, to fold into the quantization."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)  # [out, 1] float32
        self.register_buffer("input_scale", input_scale)  # [] float32, or None: per token
        # the few-rows kernel's split-K counters (kernels/splitk.py)
        self.register_buffer("counts", counters(fp8.few_rows_tiles(weight.shape[0]), weight.device), persistent=False)
        self.bias = bias

    @_flat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return fp8.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.input_scale, self.counts)
        return fp8.fp8_linear_ref(x, self.weight, self.weight_scale, self.bias, self.input_scale)

    def quantizes(self, x: torch.Tensor) -> bool:
        """Whether this layer would quantize x [tokens, in] per token on a GPU, in one pass over each
        row; then normed() and gated() make its input and quantize it in one launch."""
        return (x.is_cuda and x.dim() == 2 and x.shape[0] > fp8.FEW_ROWS and self.input_scale is None
                and self.weight.shape[1] <= fp8.ONE_PASS)

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(rms_norm(x + residual)), the next residual as prenorm gives it), where quantizes(x)."""
        x_q, x_scale, residual = fp8.rms_norm_quantize(x, norm_weight, eps, residual)
        return fp8.fp8_quantized_linear(x_q, x_scale, self.weight, self.weight_scale, self.bias, x.dtype,
                                        self.counts), residual

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)), where quantizes() holds for its rows."""
        x_q, x_scale = fp8.silu_and_mul_quantize(gate_up)
        return fp8.fp8_quantized_linear(x_q, x_scale, self.weight, self.weight_scale, self.bias, gate_up.dtype,
                                        self.counts)


class Fp8Embedding(nn.Module):
    """An embedding table in FP8 E4M3, one scale per row: the rows looked up
    are widened and scaled into the model dtype."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [rows, hidden] float8_e4m3fn (rows >= this rank's vocabulary)
        self.register_buffer("weight_scale", weight_scale)  # [rows, 1] float32
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        rows = self.weight.index_select(0, ids).float() * self.weight_scale.index_select(0, ids)
        return rows.to(self.dtype)


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
        self.register_buffer("counts", counters(int4.split_k_tiles(qweight.shape[1]), qweight.device),
                             persistent=False)  # split-K counters (kernels/splitk.py)
        self.group_size = group_size
        self.bias = bias

    def _packed_order(self, x: torch.Tensor) -> torch.Tensor:
        """x's input features in the packed weight's order (GPTQ's desc_act), or x."""
        return x if self.perm is None else x.index_select(-1, self.perm)

    @_flat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._packed_order(x)
        if x.is_cuda:
            return int4.int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias, self.counts)
        return int4.int4_linear_ref(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)

    def runs_gated(self, x: torch.Tensor) -> bool:
        """Whether forward_gated takes x [tokens, in] in one launch: one 16-bit row on a GPU, or int4.mma_rows."""
        return x.is_cuda and x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and (
            x.shape[0] == 1 or int4.mma_rows(x, self.qweight, self.group_size))

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(self(x)) where runs_gated(x), SiLU-and-mul in the projection kernel's epilogue (a gate|up
        projection: the first half of the outputs is the gate)."""
        return int4.gated_rows(self._packed_order(x).contiguous(), self.qweight, self.scales, self.zeros,
                               self.group_size, self.bias, self.counts)


class GGUFLinear(nn.Module):
    """y = x W^T + b with W in GGUF blocks, as the file holds them. A fused
    projection whose parts differ in format (another block format, or floats)
    runs one matmul per run of parts."""

    def __init__(self, parts: list[PackedGGUF | torch.Tensor], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = parts  # each [rows, in]: packed blocks, or a float weight
        rows = max(p.shape[0] for p in parts)
        device = parts[0].qs.device if isinstance(parts[0], PackedGGUF) else parts[0].device
        # split-K counters (kernels/splitk.py), shared by the parts: they run one after another
        self.register_buffer("counts", counters(gguf.split_k_tiles(rows), device), persistent=False)
        self.bias = bias

    @_flat
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1 and isinstance(self.parts[0], PackedGGUF):
            return self._blocks(x, self.parts[0], self.bias)
        y = torch.cat([self._blocks(x, p, None) if isinstance(p, PackedGGUF) else F.linear(x, p)
                       for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    def _blocks(self, x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:
            return gguf.gguf_linear(x, p, bias, self.counts)
        return gguf.gguf_linear_ref(x, p, bias)


def resolve_quantization(args: EngineArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                         tp_size: int) -> QuantConfig | None:
    """The quantization an engine runs: the user's choice against what the
    checkpoint holds and what the device can do, refused with the reason."""
    asked, dequantize_gguf, vocab = args.quantization, args.dequantize_gguf, args.quantize_embeddings
    held, where = cfg.quant, cfg.path
    if dequantize_gguf and (held is None or held.method != "gguf"):
        raise ConfigError(f"dequantize_gguf applies to a GGUF file with quantized weights; {where} is not one")
    if vocab and held is not None and held.method == "gguf":
        raise ConfigError(f"quantize_embeddings does not apply to a GGUF file of quantized blocks ({where}): the "
                          f"file decides its own tensor types, the embedding table's and LM head's included")
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
        if vocab:
            raise ConfigError(f"quantize_embeddings puts the embedding table and LM head in FP8 beside quantized "
                              f"projections, but {where} runs unquantized: set quantization='fp8' as well")
        return None
    if held.lm_head and cfg.tie_word_embeddings:
        raise ConfigError(f"{where}: quantization_config.lm_head is true, but the model ties its LM head to the "
                          f"embedding table (tie_word_embeddings), which a GPTQ checkpoint does not quantize")
    if held.in_checkpoint and tp_size > 1:
        raise ConfigError(f"{held.method} checkpoints run on one GPU; tensor_parallel_size={tp_size} is not "
                          f"supported with them")
    if (held.method == "fp8" or vocab) and device.type == "cuda":
        what = "fp8" if held.method == "fp8" else "quantize_embeddings (an FP8 table and LM head)"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(f"{what} needs FP8 tensor cores (compute capability 8.9 or newer); "
                              f"{torch.cuda.get_device_name(device)} has {'.'.join(map(str, capability))}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"{what} on a GPU computes in bfloat16 or float16, not {dtype}; set dtype='bfloat16'")
    return replace(held, embeddings=vocab)
