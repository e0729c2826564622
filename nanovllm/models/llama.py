"""The Llama decoder (SmolLM2, Llama 3) — chapter 01 walks through it layer by layer.

Per layer: ``x + attention(rmsnorm(x))`` then ``x + mlp(rmsnorm(x))``, where attention uses
rotary positions and grouped-query heads, and the MLP is SwiGLU. Qwen3 is the same with an
extra RMSNorm on each query and key head (``qk_norm``), see ``qwen3.py``. The code carries the
residual stream beside the sub-layer output, so every ``+`` happens inside the next norm: with
the fused kernels switched on (``nanovllm/layers/fused.py``) the add, the norms, RoPE and
SwiGLU's gate run as fused Triton kernels (chapter 11).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.distributed import tp_size
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.models.model_config import ModelConfig


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads // tp_size()
        self.num_kv_heads = cfg.num_kv_heads // tp_size()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias
        )
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.sliding_window
        )
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = qk_norm
        self.fused_kernel: Callable | None = None  # q/k norm + RoPE in one (layers/fused.py)

    @staticmethod
    def load_fused_kernel() -> Callable:
        from nanovllm.kernels.rope import qk_norm_rope_  # needs triton: imported when on

        return qk_norm_rope_

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        if self.fused_kernel is not None:
            self._fused_norm_rope(positions, qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.fused_kernel is None:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1))

    def _fused_norm_rope(self, positions: torch.Tensor, qkv: torch.Tensor) -> None:
        """The q/k norms (Qwen3) and RoPE as one Triton kernel, in place on ``qkv`` (ch. 11)."""
        rope = self.rotary_emb
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        args = (qkv, positions, rope.cos, rope.sin, *shape)
        if self.qk_norm:
            self.fused_kernel(*args, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        else:
            self.fused_kernel(*args)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg) if mlp is None else mlp  # or a mixture of experts (chapter 16)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous sub-layer's output, not yet added to ``residual`` (the stream).

        Each norm first adds its input to the stream, the textbook ``x + sublayer(...)``, so the
        add and the norm can be one fused kernel (chapter 11). Returns the MLP's output and the
        stream; the next layer (or the final norm) adds them.
        """
        if residual is None:  # first layer: the stream starts as the embeddings
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool,
                 make_mlp: Callable[[int], nn.Module | None] = lambda layer: None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, qk_norm, make_mlp(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)  # the last layer's MLP output joins the stream here
        return x


class LlamaForCausalLM(nn.Module):
    """Tokens in, final hidden states out; ``compute_logits`` applies the LM head."""

    qk_norm = False
    # checkpoint name fragment -> (our packed parameter, which part of it)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.qk_norm, self.make_mlp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Layer ``layer``'s MLP; ``None``: the dense SwiGLU ``MLP`` (MoE models, chapter 16)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
