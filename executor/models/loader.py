"""Loading a checkpoint's safetensors (or GGUF file) into our model definitions on a device."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tqdm import tqdm

from headrace.checkpoint import ConfigError
from headrace.checkpoint.config import ModelConfig
from headrace.checkpoint.gguf import Blocks, GGUFFile, hf_config, hf_tensors, is_gguf
from headrace.checkpoint.paths import weight_files
from headrace.checkpoint.quant_config import QuantConfig
from headrace.executor.models.llama import LlamaForCausalLM
from headrace.executor.models.quant import Fp8Embedding, Fp8Linear
from headrace.executor.models.quant_formats import build_layer, is_quantized, quantize_by_rows
from headrace.executor.parallel import TPGroup

MODELS = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}
# Checkpoint tensors that carry nothing we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               tp: TPGroup = TPGroup(), quant: QuantConfig | None = None) -> torch.nn.Module:
    """The model with this rank's slice of every weight (all of them for one
    rank), quantized as quant says. The weights that become quantized layers
    (the projections; with quant.embeddings the embedding table and LM head;
    a GPTQ checkpoint's LM head where it holds one quantized) are never
    allocated in the model dtype beside the others: they wait on the meta
    device. A quantized checkpoint's tensors are gathered per projection
    and built once all are read; a float weight quantized at load (fp8) is
    quantized as soon as all its parts are read, one at a time on the device."""
    wanted = {} if quant is None else {"projections": True, "embeddings": quant.embeddings, "lm_head": quant.lm_head}
    meta = tuple(role for role, on in wanted.items() if on)
    with torch.device(device), _default_dtype(dtype):  # no float32 copy of the model first
        model = MODELS[cfg.model_type](cfg, max_positions, tp, meta)
    model = model.eval().requires_grad_(False)
    params = dict(model.named_parameters())
    loaded: dict[str, int] = {name: 0 for name in params}  # parameter -> elements written
    if is_gguf(cfg.path):
        tensors = _gguf_tensors(cfg.path, packed=quant is not None and quant.in_checkpoint)
    else:
        tensors = _safetensors(Path(cfg.path))
    pending: dict[str, dict[int, dict]] = {}  # fused projection -> part -> suffix -> tensor
    for ckpt_name, tensor in tensors:
        name = ckpt_name.removeprefix("model.")
        stem, _, suffix = name.rpartition(".")
        if (quant is not None and (stem.endswith(_PARTS) or quant.lm_head and stem == "lm_head")
                and is_quantized(quant, suffix, tensor)):
            target, shard = _fused(model, stem)
            if not quant.in_checkpoint:
                tensor = _float_part(model, ckpt_name, target, shard, tensor)
            parts = pending.setdefault(target, {})
            parts.setdefault(shard, {})[suffix] = tensor
            if not quant.in_checkpoint and len(parts) == _num_parts(model, target):
                _replace(model, target, pending.pop(target), quant, dtype, device, loaded)  # all parts read
        elif quant is not None and quant.lm_head and name == "lm_head.weight":
            raise ConfigError(f"{cfg.path}: quantization_config.lm_head is true, but the checkpoint stores "
                              f"lm_head.weight unquantized")
        elif quant is not None and quant.embeddings and name in ("embed_tokens.weight", "lm_head.weight"):
            _quantize_vocab(model, name, tensor, dtype, device, loaded)
        else:
            _load_tensor(model, params, loaded, ckpt_name, tensor, device)
    for target, parts in pending.items():
        if quant.in_checkpoint:  # at load, only projections lacking a part are left: reported below
            _replace(model, target, parts, quant, dtype, device, loaded)
    missing = [n for n, count in loaded.items() if count != params[n].numel()]
    if missing:
        raise ConfigError(f"checkpoint {cfg.path} lacks weights for: {missing[:8]}")
    return model


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """torch's default dtype set to dtype within (it is process-wide: set only while a model is built)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


# Checkpoint names of the decoder's projections (our fused ones take several).
_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fused(model, stem: str) -> tuple[str, int]:
    """A checkpoint projection's module name -> (our module's name, its part index)."""
    for part, (fused, shard) in model.stacked_params.items():
        if stem.endswith(f".{part}"):
            return stem.removesuffix(part) + fused, shard
    return stem, 0


def _num_parts(model, target: str) -> int:
    """How many checkpoint projections make up our projection `target`."""
    attr = target.rpartition(".")[2]
    return sum(fused == attr for fused, _ in model.stacked_params.values()) or 1


def _float_part(model, ckpt_name: str, target: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a float projection part to be quantized at load, its shape checked."""
    tensor = model.tp_slice(ckpt_name.removeprefix("model."), tensor)
    linear = model.get_submodule(target)
    fused = _num_parts(model, target) > 1
    want = (model.shard_sizes(target.rpartition(".")[2])[shard] if fused else linear.out_features,
            linear.in_features)
    if tuple(tensor.shape) != want:
        raise ConfigError(f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, expected {want}")
    return tensor


def _replace(model, target: str, parts: dict[int, dict], quant: QuantConfig, dtype, device, loaded) -> None:
    parent_name, _, attr = target.rpartition(".")
    parent = model.get_submodule(parent_name)
    linear = getattr(parent, attr)  # its weight on the meta device, its bias loaded
    num_parts = _num_parts(model, target)
    if sorted(parts) != list(range(num_parts)):
        raise ConfigError(f"{quant.method} checkpoint: {target} has quantized tensors for parts {sorted(parts)} "
                          f"of {num_parts}: the others are missing or stored unquantized")
    setattr(parent, attr, build_layer(quant, target, [parts[i] for i in range(num_parts)], linear, dtype, device))
    loaded.pop(f"{target}.weight")


def _quantize_vocab(model, name: str, tensor: torch.Tensor, dtype, device, loaded) -> None:
    """The embedding table or the LM head in FP8 as soon as it is read; tied,
    the table's buffers serve as the LM head too."""
    tied = model.cfg.tie_word_embeddings
    if name == "lm_head.weight" and tied:
        return  # the checkpoint may carry a copy of the table
    attr = name.removesuffix(".weight")
    shape = getattr(model, attr).weight.shape
    tensor = model.tp_slice(name, tensor)
    if tensor.shape != shape:
        raise ConfigError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    pad = -shape[0] % 16  # zero rows: _scaled_mm takes a multiple of 16 output features (compute_logits cuts them)
    weight, scale = quantize_by_rows(F.pad(tensor, (0, 0, 0, pad)).to(device, dtype))
    if attr == "embed_tokens":
        model.embed_tokens = Fp8Embedding(weight, scale, dtype)
    if attr == "lm_head" or tied:
        model.lm_head = Fp8Linear(weight, scale, None)
    loaded.pop(name)


def _safetensors(path: Path):
    """(name, tensor) for every tensor of a checkpoint directory's safetensors files."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_tensors(path: str, packed: bool):
    """(transformers name, tensor) for every tensor of a GGUF file, dequantized
    one by one to float32; with packed, the layers' quantized weights stay Blocks."""
    f = GGUFFile(path)
    # A bar on a terminal only (disable=None): dequantizing takes seconds on a CPU.
    for name, array in tqdm(hf_tensors(f, hf_config(f), packed), total=len(f.tensors),
                            desc="loading GGUF weights", disable=None):
        yield name, array if isinstance(array, Blocks) else torch.from_numpy(array)


def _load_tensor(model, params, loaded, ckpt_name: str, tensor: torch.Tensor, device) -> None:
    if ckpt_name.endswith(_IGNORED_SUFFIXES):
        return
    name = ckpt_name.removeprefix("model.")
    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
        return  # tied embeddings: the checkpoint may carry a copy
    tensor = model.tp_slice(name, tensor)
    target, offset = name, 0
    for part, (fused, shard) in model.stacked_params.items():
        if f".{part}." in name:
            target = name.replace(f".{part}.", f".{fused}.")
            offset = sum(model.shard_sizes(fused)[:shard])
            break
    param = params.get(target)
    if param is None:
        raise ConfigError(f"checkpoint tensor {ckpt_name} has no place in the {model.cfg.model_type} model")
    if param.is_meta:  # a projection a quantized checkpoint stores unquantized: it stays a float layer
        param.data = torch.empty_like(param, device=device)
    dst = param.data.narrow(0, offset, tensor.shape[0]) if target != name else param.data
    if dst.shape != tensor.shape:
        raise ConfigError(f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
    loaded[target] += tensor.numel()
