"""Finding a checkpoint and loading its safetensors (or GGUF file) into our model definitions."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from headrace.core.config import ConfigError, ModelConfig
from headrace.executor.models.gguf import GGUFFile, hf_config, hf_tensors, is_gguf
from headrace.executor.models.llama import LlamaForCausalLM
from headrace.executor.parallel import TPGroup

MODELS = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}
# Checkpoint tensors that carry nothing we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_model_path(model: str | Path) -> Path:
    """A local checkpoint directory or .gguf file, or a hub id found in the local hub cache (never downloaded)."""
    path = Path(model).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists():
        raise ConfigError(f"model={str(model)!r} is a file, but neither a checkpoint directory nor a .gguf file")
    if str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id=str(model), local_files_only=True))
        except Exception as e:  # huggingface_hub raises several kinds for a cache miss
            raise ConfigError(
                f"model={str(model)!r} is neither a local directory nor in the local Hugging Face "
                f"cache ({type(e).__name__}); headrace never downloads checkpoints"
            ) from None
    raise ConfigError(f"model={str(model)!r}: no such checkpoint directory")


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} holds no *.safetensors weights")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ConfigError(f"weight files named by the index are missing: {missing}")
    return files


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
