"""quantization="fp8": the engine against transformers on the same weights quantized the same way."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from headrace import LLM, SamplingParams
from headrace.config import EngineArgs
from tests.conftest import ARCHS, assert_blocks_free
from tests.test_generate import prompts_of_lengths

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled so their largest magnitude is 448, rounded to E4M3, scaled back."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def fp8_reference(model: nn.Module) -> nn.Module:
    """transformers' model with every decoder projection's weight quantized per
    output channel and its input per token: FP8 arithmetic, dequantized."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.weight.data = fake_fp8(module.weight.data)
            module.register_forward_pre_hook(lambda m, args: (fake_fp8(args[0]),))
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_greedy_matches_the_dequantized_reference(arch, checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    path = checkpoint(arch)
    ref = fp8_reference(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(path, quantization="fp8", max_model_len=256, max_num_batched_tokens=32)  # chunked prefill too
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, [3, 17, 40, 90], seed=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    differs = 0
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, attention_mask=None)
            unquantized = plain.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, attention_mask=None)
        assert out.outputs[0].token_ids == want[0, len(p):].tolist()
        differs += unquantized[0, len(p):].tolist() != want[0, len(p):].tolist()
    assert differs, "FP8 changed no output: the test cannot tell quantized arithmetic from none"
    layer = llm.engine.executor.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight.element_size() == 1
    assert_blocks_free(llm)
    llm.shutdown()


def test_unknown_quantization_is_refused():
    for name in ("awq", "int4", "FP8"):
        with pytest.raises(ValueError, match="quantization must be None or one of"):
            EngineArgs(model="unused", quantization=name)
