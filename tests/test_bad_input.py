"""Bad input gets a clear exception and disturbs nothing else."""
from __future__ import annotations

import json
import shutil

import pytest

from headrace import LLM, ConfigError, SamplingParams, envs
from headrace.config import EngineArgs
from headrace.core.engine import EngineCore
from tests.conftest import assert_blocks_free


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), max_model_len=64)


def test_bad_prompts_reject_the_batch_and_leave_the_engine_working(llm):
    good = [[5, 6, 7], "hello"]
    sp = SamplingParams(temperature=0, max_tokens=4)
    expected = [o.outputs[0].token_ids for o in llm.generate(good, sp, use_tqdm=False)]
    vocab = llm.engine.model_config.vocab_size
    for bad, match in [
        ([5] * 64, "prompt 1 has 64 tokens, but max_model_len is 64"),
        ([], "prompt 1 is empty"),
        ("", "prompt 1 is empty"),
        ([5, vocab], "outside the vocabulary"),
        ([5, -1], "outside the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([good[0], bad, good[1]], sp, use_tqdm=False)
        assert_blocks_free(llm)
    with pytest.raises(TypeError, match="prompt 0 must be"):
        llm.generate([3.5], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(good, [sp] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(good, sp, use_tqdm=False)] == expected
    assert_blocks_free(llm)


def test_sampling_params_types():
    with pytest.raises(ValueError, match="temperature must be of type"):
        SamplingParams(temperature="hot")
    with pytest.raises(ValueError, match="max_tokens must be of type"):
        SamplingParams(max_tokens=1.5)
    with pytest.raises(ValueError, match="stop_token_ids must hold non-negative integer token ids"):
        SamplingParams(stop_token_ids=["a"])


def test_engine_args_are_validated(checkpoint):
    path = checkpoint("llama")
    for kwargs, match in [
        (dict(dtype="float8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(block_size=12), "block_size must be a power of two"),
        (dict(max_model_len=10**6), "exceeds the model's max_position_embeddings"),
        (dict(num_kv_blocks=2, max_model_len=64), "num_kv_blocks=2 cannot hold one sequence"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        (dict(device="cpu", gpu_memory_utilization=0.5), "gpu_memory_utilization applies to a GPU"),
        (dict(async_scheduling="no"), "async_scheduling must be True or False, got 'no'"),
        (dict(enforce_eager=1), "enforce_eager must be True or False"),
        (dict(enable_prefix_caching=None), "enable_prefix_caching must be True or False"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(path, **kwargs)
    with pytest.raises(TypeError, match="unknown arguments: \\['max_num_sequences'\\]"):
        LLM(path, max_num_sequences=4)


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="neither a local directory nor in the local Hugging Face cache"):
        LLM("no-such-org/no-such-model")
    with pytest.raises(ConfigError, match="has no config.json"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: c.update(model_type="mistral"), "model_type='mistral' is not supported"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
         "rope_parameters.rope_type='yarn' is not supported"),
        (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}),
         "rope_scaling.rope_type='dynamic' is not supported"),
        (lambda c: c.update(num_key_value_heads=3), "must be a multiple of num_key_value_heads=3"),
        (lambda c: c.pop("hidden_size"), "hidden_size=None is missing"),
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), "quantization_config"),
        (lambda c: c.update(architectures=["LlamaForSequenceClassification"]), "architectures"),
        (lambda c: c.update(dtype="int8"), "dtype='int8'"),
    ],
)
def test_unsupported_config_fields_are_named(checkpoint, tmp_path, change, match):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        LLM(str(path))


def test_broken_checkpoints(checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(str(path))
    shutil.rmtree(path)
    shutil.copytree(checkpoint("llama"), path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        LLM(str(path))


def test_missing_and_unexpected_weights(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), path)
    (weights_file,) = path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, weights_file)
    with pytest.raises(ConfigError, match="lacks weights for.*layers.1.mlp.gate_up_proj"):
        LLM(str(path))
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.gate_proj.weight"].clone()
    weights["model.layers.0.mlp.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, weights_file)
    with pytest.raises(ConfigError, match="model.layers.0.mlp.extra.weight has no place"):
        LLM(str(path))


def test_hub_id_resolves_through_the_local_cache(checkpoint, tmp_path, monkeypatch):
    """An id like org/name is found in the hub cache layout, without network."""
    cache = tmp_path / "hub"
    snap = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(checkpoint("llama"), snap)
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    llm = LLM("tiny-org/tiny-llama", max_model_len=32)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_sample_ids_that_clash_with_a_live_request_change_nothing(checkpoint):
    """The samples of an n > 1 request are addressed as "id#i"; a live request
    already named so makes the whole request fail, adding none of its samples."""
    core = EngineCore(EngineArgs(model=checkpoint("llama"), max_model_len=64))
    greedy = SamplingParams(temperature=0, max_tokens=3)
    core.add_request("x#1", [5, 6, 7], greedy, 0.0)
    with pytest.raises(ValueError, match="'x#1', the id of a live request"):
        core.add_request("x", [8, 9], SamplingParams(n=3, max_tokens=3, seed=1), 0.0)
    assert set(core.scheduler.requests) == {"x#1"} and not core.live("x")
    with pytest.raises(ValueError, match="already in use"):  # and the other way round
        core.add_request("x#1", [8, 9], greedy, 0.0)
    finished = {}
    while core.has_unfinished:
        for out in core.step():
            finished[out.request_id] = out.finish_reason
    assert finished == {"x#1": "length"}
    assert core.scheduler.kv.num_free_blocks == core.cache_config.num_blocks
    assert not core.executor.states.req_to_slot


@pytest.mark.parametrize("name,read", [("HEADRACE_FUSED_PROJECTIONS", envs.fused_projections),
                                       ("HEADRACE_FUSED_DECODE", envs.fused_decode), ("HEADRACE_PDL", envs.pdl),
                                       ("HEADRACE_SAMPLING_GRAPHS", envs.sampling_graphs),
                                       ("HEADRACE_INT4_MMA", envs.int4_mma)])
def test_on_off_variables_take_0_or_1(name, read, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert read() is True  # on by default
    monkeypatch.setenv(name, "0")
    assert read() is False
    monkeypatch.setenv(name, "false")  # not silently read as "on"
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'false'"):
        read()
