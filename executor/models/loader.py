"""Loading a checkpoint's safetensors (or GGUF file) into our model definitions on a device."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from headrace.checkpoint import ConfigError
from headrace.checkpoint.config import ModelConfig
from headrace.checkpoint.gguf import GGUFFile, hf_config, hf_tensors, is_gguf
from headrace.checkpoint.paths import weight_files
from headrace.executor.models.llama import LlamaForCausalLM
from headrace.executor.parallel import TPGroup

MODELS = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}
# Checkpoint tensors that carry nothing we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               tp: TPGroup = TPGroup()) -> torch.nn.Module:
    """The model with this rank's slice of every weight (all of them for one rank)."""
    with torch.device(device):
        model = MODELS[cfg.model_type](cfg, max_positions, tp)
    model = model.to(dtype).eval().requires_grad_(False)
    params = dict(model.named_parameters())
    loaded: dict[str, int] = {name: 0 for name in params}  # parameter -> elements written
    tensors = _gguf_tensors(cfg.path) if is_gguf(cfg.path) else _safetensors(Path(cfg.path))
    for ckpt_name, tensor in tensors:
        _load_tensor(model, params, loaded, ckpt_name, tensor)
    missing = [n for n, count in loaded.items() if count != params[n].numel()]
    if missing:
        raise ConfigError(f"checkpoint {cfg.path} lacks weights for: {missing[:8]}")
    return model


def _safetensors(path: Path):
    """(name, tensor) for every tensor of a checkpoint directory's safetensors files."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_tensors(path: str):
    """(transformers name, float32 tensor) for every tensor of a GGUF file, dequantized one by one."""
    f = GGUFFile(path)
    # A bar on a terminal only (disable=None): dequantizing takes seconds on a CPU.
    for name, array in tqdm(hf_tensors(f, hf_config(f)), total=len(f.tensors), desc="loading GGUF weights",
                            disable=None):
        yield name, torch.from_numpy(array)


def _load_tensor(model, params, loaded, ckpt_name: str, tensor: torch.Tensor) -> None:
    if ckpt_name.endswith(_IGNORED_SUFFIXES):
        return
    name = ckpt_name.removeprefix("model.")
    if name == "lm_head.weight" and model.lm_head is None:
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
    dst = param.data.narrow(0, offset, tensor.shape[0]) if target != name else param.data
    if dst.shape != tensor.shape:
        raise ConfigError(f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
    loaded[target] += tensor.numel()
