"""A checkpoint's config (config.json, or a GGUF file's metadata) as a frozen ModelConfig.

Everything headrace does not implement is refused here with an error naming
the field, rather than silently run wrong.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from headrace.checkpoint import ConfigError
from headrace.checkpoint.gguf import GGUFFile, hf_config, quantized_types
from headrace.checkpoint.quant_config import QuantConfig, parse_quant_config

# model_type -> (architecture class name, q/k/v bias, per-head q/k RMSNorm)
SUPPORTED_MODELS = {
    "llama": ("LlamaForCausalLM", None, False),  # bias follows config.attention_bias
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", None, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class ModelConfig:
    path: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    max_position_embeddings: int
    checkpoint_dtype: str
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    bos_token_id: int | None = None
    quant: QuantConfig | None = None  # how the checkpoint's projections are stored, if not as floats

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """From a checkpoint directory's config.json, or a GGUF file's metadata."""
        path = Path(path)
        if path.suffix == ".gguf" and path.is_file():
            f = GGUFFile(path)
            cfg = cls.from_dict(hf_config(f), str(path))
            return replace(cfg, quant=QuantConfig("gguf") if quantized_types(f) else None)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} has no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path / 'config.json'} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path / 'config.json'} must hold a JSON object")
        gen = {}
        if (path / "generation_config.json").exists():
            try:
                gen = json.loads((path / "generation_config.json").read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path / 'generation_config.json'} is not valid JSON: {e}") from None
        return cls.from_dict(cfg, str(path), gen)

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "", generation_config: dict | None = None) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODELS:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; supported: {sorted(SUPPORTED_MODELS)}"
            )
        arch, qkv_bias, qk_norm = SUPPORTED_MODELS[model_type]
        archs = cfg.get("architectures") or [arch]
        if archs != [arch]:
            raise ConfigError(f"architectures={archs} is not supported for {model_type}; expected [{arch!r}]")
        _refuse(cfg, "hidden_act", lambda v: v in (None, "silu"), "only 'silu' is supported")
        _refuse(cfg, "use_sliding_window", lambda v: not v, "sliding-window attention is not supported")
        _refuse(cfg, "layer_types", lambda v: v is None or set(v) <= {"full_attention"},
                "only full attention layers are supported")
        _refuse(cfg, "mlp_bias", lambda v: model_type == "llama" or not v, "not supported for this model")
        _refuse(cfg, "partial_rotary_factor", lambda v: v in (None, 1, 1.0), "only full rotary is supported")
        _refuse(cfg, "pretraining_tp", lambda v: v in (None, 1), "only 1 is supported")

        hidden = _req(cfg, "hidden_size", int)
        num_heads = _req(cfg, "num_attention_heads", int)
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = cfg.get("head_dim") or hidden // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} in config.json is not supported; supported: {DTYPES}")

        eos: set[int] = set()
        for source in (cfg, generation_config or {}):
            ids = source.get("eos_token_id")
            eos.update([ids] if isinstance(ids, int) else (ids or []))
        return cls(
            path=path,
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=_req(cfg, "intermediate_size", int),
            num_layers=_req(cfg, "num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_req(cfg, "vocab_size", int),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if model_type != "qwen2" else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            rope=_rope(cfg),
            max_position_embeddings=_req(cfg, "max_position_embeddings", int),
            checkpoint_dtype=dtype,
            eos_token_ids=frozenset(eos),
            bos_token_id=cfg.get("bos_token_id"),
            quant=parse_quant_config(cfg.get("quantization_config")),
        )


def _req(cfg: dict, name: str, typ: type):
    v = cfg.get(name)
    if not isinstance(v, typ) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"config.json field {name}={v!r} is missing or not a positive {typ.__name__}")
    return v


def _refuse(cfg: dict, name: str, ok, why: str) -> None:
    if not ok(cfg.get(name)):
        raise ConfigError(f"config.json field {name}={cfg.get(name)!r} is not supported: {why}")


def _rope(cfg: dict) -> RopeConfig:
    """Rope settings from transformers 5's rope_parameters or the older
    rope_theta + rope_scaling pair."""
    params = dict(cfg.get("rope_parameters") or {})
    field_name = "rope_parameters"
    if cfg.get("rope_scaling"):
        scaling = dict(cfg["rope_scaling"])
        if "type" in scaling:  # the older spelling of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
        params = {**params, **scaling}
        field_name = "rope_scaling"
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json field {field_name}.rope_type={rope_type!r} is not supported; "
            f"supported: {SUPPORTED_ROPE_TYPES}"
        )
    extra = {}
    if rope_type in ("linear", "llama3"):
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or not factor >= 1.0 or math.isinf(factor):
            raise ConfigError(f"config.json field {field_name}.factor={factor!r} must be a number >= 1")
        extra["factor"] = float(factor)
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in params:
                raise ConfigError(f"config.json field {field_name}.{k} is required for llama3 rope")
            extra[k] = params[k]
    return RopeConfig(theta=float(theta), type=rope_type, **extra)
