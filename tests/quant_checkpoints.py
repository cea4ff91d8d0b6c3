"""Quantized copies of the tiny test checkpoints, in each format's own packing.

quantize_checkpoint(src, dst, fmt, ...) rewrites every decoder projection of
a float checkpoint as an FP8, AWQ or GPTQ checkpoint would store it, writes
the quantization_config, and returns the dequantized weights: the state dict
transformers' model code runs as the reference. Written from the formats'
definitions, independently of the engine's loaders.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4i of a packed int32 hold column AWQ_ORDER[i] of its 8


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns held in int64 -> the int32 tensors the formats store."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_along_rows(q: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit -> int32 [rows / 8, cols]: row 8i + j at bits 4j of row i (GPTQ's qweight)."""
    q = q.long()
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for j in range(8):
        out |= q[j::8] << (4 * j)
    return _to_int32(out)


def pack_along_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, cols] 4-bit -> int32 [rows, cols / 8]: bits 4i of column c hold column 8c + order[i]."""
    q = q.long()
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= q[:, col::8] << (4 * i)
    return _to_int32(out)


def quantize_int4(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor, min_zero: int = 0):
    """w [out, in] float32 -> q [in, out] (0..15), scales [groups, out] fp16, zeros [groups, out] int.
    Input feature k belongs to group g_idx[k]; asymmetric groups span [min, max]."""
    n, k = w.shape
    groups = k // group
    wt = w.t()  # [in, out]
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = wt[g_idx == g]  # [group, out]
        if sym:
            scales[g] = (cols.abs().amax(0) / 7).clamp(min=1e-6)
            zeros[g] = 8
        else:
            lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / 15).clamp(min=1e-6)
            zeros[g] = (-lo / scales[g].half().float()).round().clamp(min_zero, 15).long()
    scales = scales.half()
    s, z = scales.float()[g_idx], zeros[g_idx]  # [in, out]
    q = (wt / s).round().long().add(z).clamp(0, 15)
    return q, scales, zeros


def dequantize_int4(q, scales, zeros, g_idx) -> torch.Tensor:
    """-> [out, in] float32: (q - zero) * scale of each input feature's group."""
    return ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()


def _fp8(w: torch.Tensor, per_tensor: bool):
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).clamp(min=1e-12).float()
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.reshape(()) if per_tensor else scale, q.float() * scale


def quantize_checkpoint(src: Path, dst: Path, fmt: str, group: int = 32, sym: bool = True, desc_act: bool = False,
                        static: bool = False, lm_head: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """dst: src with its projections in `fmt` ("fp8", "awq", "gptq"); with
    lm_head (GPTQ), the LM head too. Returns {weight name: dequantized float32
    weight}, plus for static FP8 {input name: input_scale}."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    (files,) = list(dst.glob("*.safetensors"))
    tensors = load_file(files)
    gen = torch.Generator().manual_seed(seed)
    deq, out, orders = {}, {}, {}
    for name, t in tensors.items():
        stem, _, suffix = name.rpartition(".")
        if suffix != "weight" or not (stem.endswith(PROJECTIONS) or lm_head and stem == "lm_head"):
            out[name] = t
            continue
        w = t.float()
        n, k = w.shape
        if fmt == "fp8":
            per_tensor = stem.endswith(("k_proj", "o_proj", "up_proj"))  # both kinds vLLM writes
            out[name], out[f"{stem}.weight_scale"], deq[name] = _fp8(w, per_tensor)
            if static:
                out[f"{stem}.input_scale"] = deq[f"{stem}.input_scale"] = torch.rand((), generator=gen) * 0.02 + 0.01
            continue
        size = k if group == -1 else group
        g_idx = torch.arange(k) // size
        if desc_act:
            # Groups in a random order of the input features, one order per
            # input: GPTQ orders by the input's statistics, so q, k and v
            # (and gate and up) share theirs.
            parent, _, proj = stem.rpartition(".")
            shared = parent + "." + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
            if shared not in orders:
                orders[shared] = torch.randperm(k, generator=gen)
            g_idx = g_idx[orders[shared]]
        # GPTQ stores zero - 1 in 4 bits, so its quantizers keep zero >= 1.
        q, scales, zeros = quantize_int4(w, size, sym, g_idx, min_zero=int(fmt == "gptq"))
        deq[name] = dequantize_int4(q, scales, zeros, g_idx)
        out[f"{stem}.scales"] = scales
        if fmt == "awq":
            out[f"{stem}.qweight"] = pack_along_cols(q, AWQ_ORDER)
            out[f"{stem}.qzeros"] = pack_along_cols(zeros, AWQ_ORDER)
        else:
            out[f"{stem}.qweight"] = pack_along_rows(q)
            out[f"{stem}.qzeros"] = pack_along_cols((zeros - 1) & 0xF)  # stored minus one
            out[f"{stem}.g_idx"] = g_idx.to(torch.int32)
    save_file(out, str(files), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "fp8": {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
                 "checkpoint_format": "gptq"},
    }[fmt]
    if lm_head:
        config["quantization_config"]["lm_head"] = True
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return deq
