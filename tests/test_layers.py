"""The package's layers (docs/architecture.md): what each may import, read
from the code's own imports (deferred ones included), and what importing or
running each part actually loads, in fresh interpreters."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cores import start_core, stop

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the headrace package

# layer -> the layers it may import. A layer is a top-level folder or module.
# "" is the package's own __init__, which imports its names lazily (by string).
ALLOWED = {
    "": set(),
    "envs": set(),
    "lifetime": set(),
    "checkpoint": {"envs"},
    "metrics": set(),
    "sampling_params": set(),
    "config": {"checkpoint"},
    "step": {"sampling_params"},
    "kernels": {"envs"},
    "executor": {"kernels", "checkpoint", "config", "sampling_params", "step", "envs"},
    "core": {"executor", "checkpoint", "config", "sampling_params", "step", "metrics", "envs", "lifetime"},
    "frontend": {"core", "checkpoint", "config", "sampling_params", "metrics", "envs", "lifetime"},
    "testing": {"envs"},
}
# What of the core a frontend may import: its messages, outputs and prompt
# checks; and its server, only where a frontend runs a core in its own
# process (LLM, `headrace core`), inside the function that does.
FRONTEND_CORE = {"headrace.core.protocol", "headrace.core.outputs", "headrace.core.request"}
FRONTEND_HOSTS_CORE = {"headrace.frontend.llm", "headrace.frontend.cli"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "benchmarks") or rel.parts[0].startswith("."):
            continue
        mods[".".join(("headrace", *rel.with_suffix("").parts)).removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, bool]]:
    """(headrace module, whether at the top level) for every import of a module, deferred ones included."""
    tree = ast.parse(MODULES[name].read_text())
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: relative import"
            # `from package import module` imports that module; `from module import name`, the module
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        found += [(t, id(node) in top) for t in targets if t in MODULES]
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles():
    graph = {m: {t for t, _ in _imports(m)} for m in MODULES}
    done, path = set(), []

    def visit(m: str) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_every_import_stays_in_its_layer():
    assert {_layer(m) for m in MODULES} <= set(ALLOWED), "a new layer: say what it may import"
    crossed = []
    for m in sorted(MODULES):
        for target, at_top in _imports(m):
            a, b = _layer(m), _layer(target)
            if a == b:
                continue
            ok = b in ALLOWED[a]
            if a == "frontend" and b == "core":
                ok = target in FRONTEND_CORE or (target == "headrace.core.server" and m in FRONTEND_HOSTS_CORE
                                                 and not at_top)
            if not ok:
                crossed.append(f"{m} imports {target}")
    assert not crossed, "layers crossed:\n" + "\n".join(crossed)


def _loaded(code: str, *args: str) -> set[str]:
    """The top-level packages and headrace layers a fresh interpreter has loaded after running code."""
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout.strip().splitlines()[-1])
    return {n.split(".")[0] for n in names} | {".".join(n.split(".")[:2]) for n in names if n.startswith("headrace.")}


DEVICE_CODE = {"torch", "triton", "headrace.executor", "headrace.kernels"}


@pytest.mark.parametrize("module", ["headrace.frontend.api.app", "headrace.frontend.api.server",
                                    "headrace.frontend.async_engine", "headrace.frontend.llm",
                                    "headrace.frontend.cli"])
def test_a_frontend_module_loads_no_device_code(module):
    assert not _loaded(f"import {module}") & (DEVICE_CODE | {"transformers"})


def test_the_package_names_load_no_device_code():
    assert not _loaded("from headrace import AsyncEngine, SamplingParams, RequestOutput, EngineArgs, LLM")\
        & (DEVICE_CODE | {"transformers"})


def test_kernels_load_no_engine():
    kernels = " ".join(f"import headrace.kernels.{p.stem};" for p in (ROOT / "kernels").glob("*.py"))
    loaded = _loaded(kernels)
    assert "triton" in loaded
    assert not loaded & {"headrace.core", "headrace.frontend", "headrace.executor", "headrace.checkpoint"}


def test_the_executor_loads_no_core_or_frontend():
    loaded = _loaded("import headrace.executor.model_runner, headrace.executor.workers")
    assert not loaded & {"headrace.core", "headrace.frontend", "headrace.metrics"}


def test_the_scheduler_and_the_checkpoint_layer_load_no_torch(checkpoint):
    loaded = _loaded("import sys; import headrace.core.scheduler; from headrace.checkpoint.config import ModelConfig; "
                     "ModelConfig.from_dir(sys.argv[1])", str(checkpoint("qwen3")))
    assert not loaded & (DEVICE_CODE | {"transformers", "headrace.frontend"})


def test_a_frontend_streaming_from_a_core_loads_no_torch(checkpoint, tmp_path):
    """A whole request through AsyncEngine.connect: the tokenizer, detokenizer
    and outputs, with the core in another process."""
    proc, address = start_core(checkpoint("llama"), f"ipc://{tmp_path}/core.sock", "--device", "cpu")
    try:
        code = """
import asyncio, sys
from headrace import AsyncEngine, SamplingParams

async def main():
    engine = AsyncEngine.connect(sys.argv[1])
    async with engine:
        out = [o async for o in engine.generate("The river", SamplingParams(max_tokens=4, logprobs=2))][-1]
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].logprobs[0], out
        assert engine.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True) == out.outputs[0].text

asyncio.run(main())
"""
        assert not _loaded(code, address) & (DEVICE_CODE | {"transformers"})
    finally:
        stop(proc)
