"""Llama-family decoders: Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Projections are fused (q|k|v, gate|up); the loader maps the checkpoint's
separate tensors into their slices. Under tensor parallelism each rank holds
the slices executor/parallel.py describes (tp_slice cuts them).
"""
from __future__ import annotations

import torch
from torch import nn

from headrace import envs
from headrace.checkpoint.config import ModelConfig
from headrace.executor.attention import Attention, AttentionMetadata
from headrace.executor.models.layers import RMSNorm, fuse_few_rows, project, project_gated, rope_cos_sin
from headrace.executor.parallel import TPGroup, local_kv_heads, vocab_rows


def _linear(in_features: int, out_features: int, bias: bool, meta: bool, projection: bool = True) -> nn.Linear:
    """nn.Linear; with meta, its weight on the meta device (never allocated:
    the loader replaces the layer by its quantized form) and its bias real. A
    decoder projection is prepared for project()'s few-row kernel."""
    if not meta:
        layer = nn.Linear(in_features, out_features, bias=bias)
        if projection and envs.fused_projections():
            fuse_few_rows(layer)
        return layer
    layer = nn.Linear(in_features, out_features, bias=False, device="meta")
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features))  # [out] loaded as usual
    return layer


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor, tp: TPGroup, meta: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.head_dim = cfg.num_heads // tp.size, cfg.head_dim
        self.first_kv_head, self.num_kv_heads = local_kv_heads(cfg, tp)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = _linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, meta)
        self.o_proj = _linear(self.q_size, cfg.hidden_size, cfg.o_bias, meta)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # [max_positions, head_dim] float32, one table for all layers; a plain
        # attribute, not a buffer, so casting the model's dtype keeps it float32
        self.cos_sin = cos_sin
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output on norm(x + residual), and the next residual (project())."""
        qkv, residual = project(self.qkv_proj, x, norm, residual)  # [num_tokens, q_size + 2 * kv_size]
        qk_norm = (None, None, 0.0) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight,
                                                                 self.q_norm.eps)
        # q, k per-head normed (Qwen3) and rotated; k and v into the cache; attention
        attn = self.attn.from_qkv(qkv, positions, self.cos_sin, qk_norm, meta)
        out, _ = project(self.o_proj, attn.view(-1, self.q_size))
        return self.tp.all_reduce(out), residual


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, meta: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * self.intermediate_size, cfg.mlp_bias, meta)
        self.down_proj = _linear(self.intermediate_size, cfg.hidden_size, cfg.mlp_bias, meta)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's output on norm(x + residual), and the next residual (project())."""
        out, residual = project_gated(self.gate_up_proj, self.down_proj, x, norm, residual)
        return self.tp.all_reduce(out), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cos_sin: torch.Tensor, tp: TPGroup, meta: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, cos_sin, tp, meta)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, meta)

    def forward(self, positions, x, residual, meta):
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm, meta)
        return self.mlp(x, residual, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor name part -> (fused parameter name part, shard index)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup(),
                 meta: tuple[str, ...] = ()) -> None:
        """meta: the weights the loader builds in quantized form, held on the
        meta device until then: "projections" (the decoder's), "embeddings" (the
        embedding table and the LM head), "lm_head" (the LM head alone)."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.vocab_start, self.vocab_rows = vocab_rows(cfg.vocab_size, tp)  # this rank's slice of the vocabulary
        vocab_meta = "embeddings" in meta
        self.embed_tokens = nn.Embedding(self.vocab_rows, cfg.hidden_size, device="meta" if vocab_meta else None)
        cos_sin = rope_cos_sin(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cos_sin, tp, "projections" in meta)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # With tied embeddings the table serves as the LM head (an FP8 table: lm_head shares its buffers).
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, self.vocab_rows, False,
                                                                    vocab_meta or "lm_head" in meta, False)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = self.embed_tokens(local.clamp(0, self.vocab_rows - 1)).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed(input_ids), None  # [num_tokens, hidden]
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:  # [num_rows, vocab]
        """float32 logits, or with upcast off in the head's own dtype (the
        sampler's kernels widen them as they read)."""
        if self.lm_head is None:
            logits = nn.functional.linear(hidden, self.embed_tokens.weight)
        else:  # an FP8 head's rows are padded to a multiple of 16 (a GPTQ head's are not)
            logits = self.lm_head(hidden)[:, : self.vocab_rows]
        if self.tp.size == 1:
            return (logits.float() if upcast else logits).contiguous()
        return self.tp.all_gather_columns(logits, torch.float32 if upcast else logits.dtype)[:, : self.cfg.vocab_size]

    def shard_sizes(self, fused: str) -> list[int]:
        attn = self.layers[0].self_attn
        if fused == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.layers[0].mlp.intermediate_size] * 2

    def tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (our naming, after
        q/k/v and gate/up are told apart by `part`)."""
        tp = self.tp
        if tp.size == 1:
            return tensor
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        if name.startswith(("embed_tokens.", "lm_head.")):
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
            pad = self.vocab_rows - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
        if ".q_proj." in name:
            return tensor.narrow(0, tp.rank * attn.q_size, attn.q_size)
        if ".k_proj." in name or ".v_proj." in name:
            return tensor.narrow(0, attn.first_kv_head * attn.head_dim, attn.kv_size)
        if ".gate_proj." in name or ".up_proj." in name:
            return tensor.narrow(0, tp.rank * mlp.intermediate_size, mlp.intermediate_size)
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            cols = attn.q_size if "o_proj" in name else mlp.intermediate_size
            return tensor.narrow(1, tp.rank * cols, cols)
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)  # added once by the all-reduce
        return tensor  # norms: every rank holds them whole
