"""Quantized checkpoint tensors into the layers of quant.py.

A fused projection (q|k|v, gate|up) arrives as one group of tensors per
part; each part is read in its own format's layout and the parts are joined
along the output features. AWQ and GPTQ both become kernels/int4.py's
layout: 4-bit values packed along the input features, one scale and one
zero point per group and output feature.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from headrace.checkpoint import ConfigError
from headrace.checkpoint.gguf import Blocks
from headrace.checkpoint.quant_config import QuantConfig
from headrace.executor.models.quant import Fp8Linear, GGUFLinear, Int4Linear
from headrace.kernels.fp8 import FP8, quantize_rows
from headrace.kernels.gguf import pack_gguf
from headrace.kernels.int4 import pack_int4, unpack_int4

# Tensors each format stores for one projection (beside an optional bias):
# those it must have, and those it may.
_REQUIRED = {
    "fp8": ("weight", "weight_scale"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales"),
    "gguf": ("weight",),
}
_OPTIONAL = {"fp8": ("input_scale",), "awq": (), "gptq": ("g_idx",), "gguf": ()}
# AWQ's GEMM packing: column j of each run of 8 output features sits at bits 4 * _AWQ_SLOT[j].
_AWQ_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)


def is_quantized(quant: QuantConfig, suffix: str, tensor) -> bool:
    """Whether a projection's checkpoint tensor goes into its quantized layer:
    one of the format's own (and not, say, a bias or a float weight left
    unquantized), or for fp8 at load, the float weight."""
    if not quant.in_checkpoint:
        return suffix == "weight"
    if quant.method == "gguf":  # float parts too: they join a fused projection's quantized ones
        return suffix == "weight"
    if quant.method == "fp8" and suffix == "weight":
        return tensor.dtype == FP8
    return suffix in _REQUIRED[quant.method] + _OPTIONAL[quant.method]


def build_layer(quant: QuantConfig, name: str, parts: list[dict], linear: nn.Linear,
                dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The quantized layer for projection `name` from its parts' tensors (CPU), on device."""
    if not quant.in_checkpoint:
        return _fp8_at_load(parts, linear, dtype, device)
    for i, part in enumerate(parts):
        lacking = [s for s in _REQUIRED[quant.method] if s not in part]
        if lacking:
            raise ConfigError(f"{quant.method} checkpoint: {name} (part {i}) lacks {lacking}")
    build = {"fp8": _fp8, "awq": _int4, "gptq": _int4, "gguf": _gguf}[quant.method]
    try:
        return build(quant, parts, linear, dtype, device)
    except ValueError as e:
        raise ConfigError(f"{quant.method} checkpoint: {name}: {e}") from None


def _fp8(quant, parts, linear, dtype, device) -> Fp8Linear:
    weights, scales, inputs = [], [], []
    for part in parts:
        w, s = part["weight"], part["weight_scale"].float()
        if s.numel() not in (1, w.shape[0]):
            raise ValueError(f"weight_scale has {s.numel()} values for {w.shape[0]} output rows "
                             f"(one per tensor or one per row)")
        weights.append(w)
        scales.append(s.reshape(-1, 1).expand(w.shape[0], 1))  # a tensor's scale, repeated per row
        if quant.static_input_scale:
            if "input_scale" not in part:
                raise ValueError("activation_scheme is 'static' but input_scale is missing")
            inputs.append(part["input_scale"].float().reshape(()))
    weight = torch.cat(weights)
    _check_shape("weight", weight.shape, (linear.out_features, linear.in_features))
    # One static scale for the fused input: the largest of the parts' (none clips).
    input_scale = torch.stack(inputs).max().to(device) if inputs else None
    return Fp8Linear(weight.to(device), torch.cat(scales).contiguous().to(device), linear.bias, input_scale)


def _fp8_at_load(parts, linear, dtype, device) -> Fp8Linear:
    """A float checkpoint's weight, its parts joined, in the model dtype on the device, quantized per row."""
    weight = torch.cat([p["weight"] for p in parts])  # the parts' shapes checked as they were read
    assert weight.shape == (linear.out_features, linear.in_features)
    return Fp8Linear(*quantize_by_rows(weight.to(device, dtype)), linear.bias)


def quantize_by_rows(x: torch.Tensor, elements: int = 2**24) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows a run of rows at a time (each row stands alone, so the
    result is the same), so that its float32 temporaries stay small beside x."""
    weight = torch.empty(x.shape, dtype=FP8, device=x.device)  # [rows, cols]
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)  # [rows, 1]
    step = max(1, elements // max(1, x.shape[1]))
    for start in range(0, x.shape[0], step):
        weight[start : start + step], scale[start : start + step] = quantize_rows(x[start : start + step])
    return weight, scale


def _int4(quant, parts, linear, dtype, device) -> Int4Linear:
    k = linear.in_features
    group = k if quant.group_size == -1 else quant.group_size
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    if group % 16 and group != k:
        raise ValueError(f"group size {group} is not supported: the int4 kernel takes groups of a multiple of "
                         f"16 input features, or one group per row")
    unpack = _awq_part if quant.method == "awq" else _gptq_part
    qs, zeros, scales, g_idx = zip(*(unpack(p, k, group) for p in parts))
    q, z, s = torch.cat(qs, dim=1), torch.cat(zeros, dim=1), torch.cat(scales, dim=1)  # [k | groups, out]
    _check_shape("weight", (q.shape[1], k), (linear.out_features, k))
    perm = None
    if g_idx[0] is not None:
        if any(not torch.equal(g, g_idx[0]) for g in g_idx):
            raise ValueError("the fused parts' g_idx differ")
        perm = _group_order(g_idx[0], group)
        if perm is not None:
            q = q.index_select(0, perm)
    return Int4Linear(pack_int4(q).to(device), s.to(dtype).to(device), z.to(dtype).to(device), group,
                      linear.bias, None if perm is None else perm.to(device))


def _awq_part(part: dict, k: int, group: int):
    """AWQ (GEMM): qweight [in, out / 8] and qzeros [in / group, out / 8], each int32
    packing 8 output features in _AWQ_SLOT order; scales [in / group, out]."""
    scales = part["scales"]
    out = scales.shape[1]
    _check_shape("qweight", part["qweight"].shape, (k, out // 8))
    _check_shape("qzeros", part["qzeros"].shape, (k // group, out // 8))
    _check_shape("scales", scales.shape, (k // group, out))
    q = _unpack_columns(part["qweight"], _AWQ_SLOT)
    return q, _unpack_columns(part["qzeros"], _AWQ_SLOT).float(), scales.float(), None


def _gptq_part(part: dict, k: int, group: int):
    """GPTQ: qweight [in / 8, out] packs 8 input features in order; qzeros
    [groups, out / 8] packs 8 output features in order, each stored minus one;
    scales [groups, out]; g_idx [in]: each input feature's group."""
    scales = part["scales"]
    out = scales.shape[1]
    _check_shape("qweight", part["qweight"].shape, (k // 8, out))
    _check_shape("qzeros", part["qzeros"].shape, (k // group, out // 8))
    _check_shape("scales", scales.shape, (k // group, out))
    g_idx = part.get("g_idx")
    if g_idx is not None:
        _check_shape("g_idx", g_idx.shape, (k,))
        g_idx = g_idx.long()
    zeros = _unpack_columns(part["qzeros"], tuple(range(8))).float() + 1
    return unpack_int4(part["qweight"]), zeros, scales.float(), g_idx


def _unpack_columns(packed: torch.Tensor, slots: tuple[int, ...]) -> torch.Tensor:
    """int32 [rows, cols / 8] -> uint8 [rows, cols]: column 8c + j from bits 4 * slots[j] of packed[:, c]."""
    shifts = torch.tensor(slots, dtype=torch.int32) * 4
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [rows, cols / 8, 8]
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def _group_order(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input features sorted by group (stable), so that each group's
    `group` features sit together as the kernel expects; None if already so."""
    k = g_idx.numel()
    contiguous = torch.arange(k) // group
    if torch.equal(g_idx, contiguous):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], contiguous):
        raise ValueError(f"g_idx does not give every group exactly {group} input features")
    return perm


def _gguf(quant, parts, linear, dtype, device) -> GGUFLinear:
    weights = [p["weight"] for p in parts]  # Blocks, or a float tensor
    rows = sum(w.shape[0] for w in weights)
    _check_shape("weight", (rows, weights[0].shape[1]), (linear.out_features, linear.in_features))
    # Consecutive parts of one format are joined row-wise (a row's blocks stand alone).
    runs: list[list] = []
    for w in weights:
        if runs and _kind(runs[-1][0]) == _kind(w):
            runs[-1].append(w)
        else:
            runs.append([w])
    packed = []
    for run in runs:
        if not isinstance(run[0], Blocks):
            packed.append(torch.cat(run).to(device, dtype))
            continue
        raw = torch.from_numpy(np.concatenate([b.raw for b in run]))
        shape = (sum(b.shape[0] for b in run), run[0].shape[1])
        packed.append(pack_gguf(run[0].type_name, raw, shape).to(device))
    return GGUFLinear(packed, linear.bias)


def _kind(weight) -> str:
    return weight.type_name if isinstance(weight, Blocks) else "float"


def _check_shape(what: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{what} has shape {tuple(got)}, expected {tuple(want)}")
