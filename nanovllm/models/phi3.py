"""Phi-3: the Llama decoder with fused projections in its checkpoints (chapter 12 §6).

Its checkpoints store ``self_attn.qkv_proj`` (rows of q, then k, then v) and ``mlp.gate_up_proj``
(gate, then up) as one tensor each. At one rank a plain copy would fill our packed parameters,
but each rank holds its own heads of q, of k and of v (``QKVParallelLinear``), so
``split_fused_tensor`` turns a fused tensor back into a Llama checkpoint's pieces, under Llama's
names, and the loader (``nanovllm/weights/loader.py``) feeds each to its ``weight_loader``.
``ModelConfig`` refuses what we do not support (``longrope`` scaling, a ``partial_rotary_factor``
below 1); a ``sliding_window`` works as Mistral's.
"""

from __future__ import annotations

import torch

from nanovllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's modules; the loader splits the fused checkpoint tensors first."""

    def split_fused_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Split a fused Phi-3 checkpoint tensor into the pieces a Llama checkpoint would hold.

        Handout (chapter 12 §6, assignment ``12.phi3_fused_weights``): the loader calls this
        for every checkpoint tensor, before it looks up where the tensor goes, and loads each
        returned ``(name, piece)`` as if a Llama checkpoint held it (``packed_modules_mapping``
        then sends ``q_proj`` to the q part of our ``qkv_proj``, with the rank's slice).

        - ``...self_attn.qkv_proj.weight`` (or ``.bias``): rows ``[q | k | v]`` with
          ``q = num_heads * head_dim`` and ``k = v = num_kv_heads * head_dim`` rows. Return
          ``[("...self_attn.q_proj.weight", q rows), ("...k_proj.weight", k rows),
          ("...v_proj.weight", v rows)]``, the rest of the name unchanged.
        - ``...mlp.gate_up_proj.weight``: rows ``[gate | up]``, ``intermediate_size`` each;
          return the ``gate_proj`` then the ``up_proj`` piece.
        - Any other name: ``[(name, tensor)]`` unchanged.

        The sizes are the whole model's (``self.config``, a ``ModelConfig``), not this rank's
        parameter shapes: every rank reads the whole checkpoint tensor and its loader takes
        the rank's slice of each piece. A fused tensor whose rows do not add up raises
        ``ValueError`` saying so. Hint: ``Tensor.split`` along dimension 0 (views, no copy).
        """
        # >>> assignment 12.phi3_fused_weights (5 points)
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
            "gate_up_proj": (("gate_proj", "up_proj"), (cfg.intermediate_size,) * 2),
        }
        for fragment, (parts, sizes) in fused.items():
            if f".{fragment}." not in name:
                continue
            if tensor.shape[0] != sum(sizes):
                raise ValueError(
                    f"{fragment} holds {tensor.shape[0]} rows, expected "
                    f"{' + '.join(map(str, sizes))} = {sum(sizes)}"
                )
            pieces = tensor.split(list(sizes), dim=0)
            return [
                (name.replace(f".{fragment}.", f".{part}."), piece)
                for part, piece in zip(parts, pieces)
            ]
        return [(name, tensor)]
        # <<< assignment 12.phi3_fused_weights
