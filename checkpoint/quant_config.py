"""A checkpoint's quantization_config (config.json) as a frozen QuantConfig.

The formats read: "fp8" (E4M3 weights with weight_scale tensors, as vLLM
writes them), "awq" (4-bit, GEMM packing, zero points) and "gptq" (4-bit,
symmetric or not, with or without desc_act). Anything else is refused with
the field that says why.
"""
from __future__ import annotations

from dataclasses import dataclass

from headrace.checkpoint import ConfigError

# What EngineArgs.quantization may name: the three checkpoint formats, and
# "gguf" (a GGUF file's blocks kept packed). "fp8" also quantizes a float
# checkpoint at load.
METHODS = ("fp8", "awq", "gptq", "gguf")


@dataclass(frozen=True)
class QuantConfig:
    method: str  # one of METHODS
    bits: int = 16
    group_size: int = -1  # input features per scale (-1: one group per row)
    desc_act: bool = False  # gptq: groups follow g_idx, not the input order
    sym: bool = True  # gptq: zero point fixed at 8
    static_input_scale: bool = False  # fp8: activations scaled by the checkpoint's input_scale
    in_checkpoint: bool = True  # False: quantized from a float checkpoint at load
    embeddings: bool = False  # the embedding table and LM head in FP8 too (EngineArgs.quantize_embeddings)
    lm_head: bool = False  # gptq: the checkpoint holds the LM head quantized too (quantization_config.lm_head)

    def describe(self) -> str:
        """What is in force, for the startup log and /metrics."""
        vocab = ("embeddings fp8 (e4m3, per row)" if self.lm_head else
                 "embeddings and lm_head fp8 (e4m3, per row)")
        return self._projections() + (f"; {vocab}" if self.embeddings else "")

    def _projections(self) -> str:
        if self.method == "awq":
            return f"awq ({self.bits}-bit, group {self.group_size})"
        if self.method == "gptq":
            extra = ((", desc_act" if self.desc_act else "") + ("" if self.sym else ", asymmetric")
                     + (", lm_head too" if self.lm_head else ""))
            return f"gptq ({self.bits}-bit, group {self.group_size}{extra})"
        if self.method == "fp8":
            scales = "static" if self.static_input_scale else "per-token"
            source = "checkpoint" if self.in_checkpoint else "quantized at load"
            return f"fp8 (e4m3, {source}, {scales} activation scales)"
        return "gguf (packed blocks)"


def parse_quant_config(q) -> QuantConfig | None:
    """config.json's quantization_config, checked; None without one."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"config.json field quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if q.get("lm_head", False) is not False and method != "gptq":
        _refuse("lm_head", q["lm_head"], "only GPTQ checkpoints may hold a quantized LM head")
    if method == "fp8":
        return _fp8(q)
    if method in ("awq", "gptq"):
        return _int4(q, method)
    raise ConfigError(f"config.json field quantization_config.quant_method={method!r} is not supported; "
                      f"supported: 'fp8', 'awq', 'gptq'")


def _fp8(q: dict) -> QuantConfig:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        _refuse("activation_scheme", scheme, "'dynamic' or 'static'")
    if q.get("weight_block_size") is not None:
        _refuse("weight_block_size", q["weight_block_size"], "per-tensor or per-channel weight scales only")
    return QuantConfig("fp8", bits=8, static_input_scale=scheme == "static")


def _int4(q: dict, method: str) -> QuantConfig:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        _refuse("bits", bits, "only 4-bit weights")
    group = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group >= 8):
        _refuse("group_size", group, "a positive number of input features, or -1")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            _refuse("version", q.get("version"), "only AWQ's GEMM packing ('gemm')")
        if q.get("zero_point", True) is not True:
            _refuse("zero_point", q.get("zero_point"), "AWQ checkpoints with zero points only")
        if group == -1:
            _refuse("group_size", group, "AWQ stores one scale per group of input features")
        return QuantConfig("awq", bits=4, group_size=group, sym=False)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        _refuse("checkpoint_format", fmt, "only 'gptq' (zero points stored minus one)")
    for name in ("desc_act", "sym", "lm_head"):
        if not isinstance(q.get(name, name == "sym"), bool):
            _refuse(name, q.get(name), "true or false")
    return QuantConfig("gptq", bits=4, group_size=group, desc_act=q.get("desc_act", False), sym=q.get("sym", True),
                       lm_head=q.get("lm_head", False))


def _refuse(name: str, value, why: str) -> None:
    raise ConfigError(f"config.json field quantization_config.{name}={value!r} is not supported: {why}")
