"""GGUF checkpoints: one file with the config (metadata), the tokenizer and
the weights, often quantized.

The metadata becomes a transformers-style config dict (ModelConfig reads it
like a config.json); tensors are renamed to transformers' names and
dequantized (gguf_quants.py), undoing the row permutation llama.cpp applies
to Llama's q and k projections. The tokenizer is converted by transformers
from the same file (tokenizer.py).
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from headrace.checkpoint import ConfigError, gguf_quants

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# GGUF tensor name (after "blk.N.") -> transformers name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_FLOAT_TYPES = ("F32", "F16", "BF16")  # tensor types stored as plain floats, not blocks
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


class GGUFFile:
    """The metadata and tensor directory of a GGUF file (versions 2 and 3);
    tensor data is read through a memory map when asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._pos = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"{self.path} is not a readable GGUF file: {e}") from None

    def _parse(self) -> None:
        if bytes(self._data[:4]) != _MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        self.tensors: dict[str, tuple[int, tuple[int, ...], int]] = {}  # name -> (ggml type, shape, offset)
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            ggml_type, offset = self._scalar("<I"), self._scalar("<Q")
            self.tensors[name] = (ggml_type, tuple(reversed(dims)), offset)  # numpy order: last dim contiguous
        align = int(self.metadata.get("general.alignment", 32))
        self._start = -(-self._pos // align) * align

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        s = bytes(self._data[self._pos : self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, n = self._scalar("<I"), self._scalar("<Q")
            if item in _SCALARS:  # read the whole array at once
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self._data, dtype, n, self._pos)
                self._pos += n * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {kind}")

    def blocks(self, name: str) -> Blocks | None:
        """A quantized 2-D tensor's raw blocks, one row per output row; None for a float tensor."""
        ggml_type, shape, offset = self.tensors[name]
        type_name = gguf_quants.GGML_TYPES.get(ggml_type, str(ggml_type))
        if len(shape) != 2 or type_name in _FLOAT_TYPES:
            return None
        start = self._start + offset
        try:
            size = gguf_quants.nbytes(ggml_type, shape[0] * shape[1])
        except ValueError as e:
            raise ConfigError(f"{self.path}: tensor {name}: {e}") from None
        return Blocks(type_name, np.asarray(self._data[start : start + size]).reshape(shape[0], -1), tuple(shape))

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, in numpy order (for a weight: [out, in])."""
        ggml_type, shape, offset = self.tensors[name]
        n = int(np.prod(shape, dtype=np.int64))
        start = self._start + offset
        try:
            raw = self._data[start : start + gguf_quants.nbytes(ggml_type, n)]
            return gguf_quants.dequantize(raw, ggml_type, shape)
        except ValueError as e:
            raise ConfigError(f"{self.path}: tensor {name}: {e}") from None


def hf_config(f: GGUFFile) -> dict:
    """The transformers-style config of a GGUF file's model."""
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ConfigError(f"{f.path}: GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHS)}")

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in f.tensors:
        raise ConfigError(f"{f.path}: GGUF rope scaling ({scaling!r}, rope_freqs) is not supported")
    if get("attention.sliding_window") or get("expert_count"):
        raise ConfigError(f"{f.path}: sliding-window attention and mixture-of-experts GGUF models are not supported")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    cfg = {
        "model_type": arch, "architectures": [_ARCHS[arch]],
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or (hidden // heads if hidden and heads else None),
        "vocab_size": vocab, "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0), "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "dtype": "float32",  # dequantized; on a GPU float32 runs as bfloat16 (EngineArgs.dtype)
    }
    return {k: v for k, v in cfg.items() if v is not None}


@dataclass(frozen=True)
class Blocks:
    """A quantized weight as its file holds it: each row a run of `type_name` blocks."""

    type_name: str  # Q4_0, Q4_K, ...
    raw: np.ndarray  # [rows, bytes per row] uint8
    shape: tuple[int, int]  # [out, in] elements


def quantized_types(f: GGUFFile) -> set[str]:
    """The block formats the file's layer weights are stored in (empty: all floats)."""
    names = {gguf_quants.GGML_TYPES.get(t, str(t)) for n, (t, shape, _) in f.tensors.items()
             if n.startswith("blk.") and len(shape) == 2}
    return names - set(_FLOAT_TYPES)


def hf_tensors(f: GGUFFile, cfg: dict, packed: bool = False) -> Iterator[tuple[str, np.ndarray | Blocks]]:
    """(transformers name, float32 array) for every tensor of the file; with
    packed, the layers' quantized weights come as their Blocks instead."""
    llama = cfg["model_type"] == "llama"
    for name in f.tensors:
        stem, _, kind = name.rpartition(".")  # kind: weight or bias
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            if part not in _LAYER_NAMES:
                raise ConfigError(f"{f.path}: GGUF tensor {name} has no place in the {cfg['model_type']} model")
            hf = f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        elif stem in _TOP_NAMES:
            hf, part = f"{_TOP_NAMES[stem]}.{kind}", stem
        else:
            raise ConfigError(f"{f.path}: GGUF tensor {name} has no place in the {cfg['model_type']} model")
        tensor = f.blocks(name) if packed and stem.startswith("blk.") else None
        tensor = f.tensor(name) if tensor is None else tensor
        if llama and part in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if part == "attn_q" else cfg["num_key_value_heads"]
            if isinstance(tensor, Blocks):
                tensor = replace(tensor, raw=_unpermute(tensor.raw, heads))
            else:
                tensor = _unpermute(tensor, heads)
        yield hf, tensor


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of each head's rows of a q or k projection
    (it interleaves the two rotary halves): rows [heads, dim/2, 2] back to
    [heads, 2, dim/2]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
