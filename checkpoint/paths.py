"""Finding a checkpoint: a directory, a .gguf file, or a hub id already in the local cache."""
from __future__ import annotations

import json
from pathlib import Path

from headrace.checkpoint import ConfigError
from headrace.checkpoint.gguf import is_gguf


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
    """A checkpoint directory's safetensors files, as its index names them (or all of them)."""
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
