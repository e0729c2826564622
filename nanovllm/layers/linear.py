"""Linear layers that know how to load (a shard of) their checkpoint weights.

Chapter 01 introduces the packed projections; chapter 09 §2 the tensor-parallel split. Every
weight carries a ``weight_loader(param, loaded, shard_id=None)``, so the checkpoint loader is one
generic loop that never needs to know how a layer packs or shards weights. Each loader first
checks that the checkpoint tensor has the full (unsharded) shape it expects: ``narrow`` and
``copy_`` would otherwise quietly take a slice of a tensor that is too big, or broadcast one that
is too small. ``ColumnParallelLinear`` splits the output features across ranks (packed:
``MergedColumnParallelLinear`` for gate and up, ``QKVParallelLinear`` for q, k and v, by heads);
``RowParallelLinear`` splits the input features and sums partial outputs. Quantization
(chapter 08) plugs in after loading: ``quant_method.apply`` does the matmul; its scales are per
output channel, so a rank's scales are its own rows' (column-parallel) or apply to its own
partial sums before the all-reduce (row-parallel), never mixed by sharding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size


def check_shape(loaded: torch.Tensor, *expected: int) -> None:
    """Raise ``ValueError`` unless ``loaded`` has exactly the ``expected`` shape."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"expected shape {expected}, got {tuple(loaded.shape)}")


class LinearBase(nn.Module):
    quant_method = None  # a LinearMethod once quantized (nanovllm.layers.quantization)

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape(loaded, *param.shape)
        param.data.copy_(loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, through the quantized kernel when there is one."""
        if self.quant_method is None:
            return F.linear(x, self.weight, bias)
        return self.quant_method.apply(self, x, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        assert output_size % tp_size() == 0, "output features must divide evenly across ranks"
        super().__init__(input_size, output_size // tp_size(), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of a checkpoint tensor (weight or bias) into ``param``.

        Handout (chapter 09 §2, assignment ``09.column_shard``): a column-parallel layer
        splits the output features, so rank ``r`` of ``N`` (``tp_rank()``, ``tp_size()``)
        holds rows ``r * rows .. (r + 1) * rows - 1`` of the full weight ``[out, in]`` (and
        the same entries of a bias ``[out]``), where ``rows = out / N`` is ``param.shape[0]``.
        ``loaded`` is the full checkpoint tensor; its shape is checked above. Copy the
        rank's slice into ``param.data`` in place (the engine's memory is already
        allocated). Hint: ``Tensor.narrow`` selects a slice without copying; at ``N = 1``
        the slice is the whole tensor.
        """
        rows = param.shape[0]
        check_shape(loaded, rows * tp_size(), *param.shape[1:])
        # >>> assignment 09.column_shard (3 points)
        param.data.copy_(loaded.narrow(0, tp_rank() * rows, rows))
        # <<< assignment 09.column_shard


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input, stored as one matrix."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        check_shape(loaded, self.output_sizes[shard_id], *param.shape[1:])
        local = [size // tp_size() for size in self.output_sizes]
        offset = sum(local[:shard_id])
        part = loaded.narrow(0, tp_rank() * local[shard_id], local[shard_id])
        param.data.narrow(0, offset, local[shard_id]).copy_(part)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, laid out ``[q heads | k heads | v heads]``."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = tp_size()
        assert num_heads % tp == 0 and num_kv_heads % tp == 0, "heads must divide across ranks"
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, total, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        check_shape(loaded, size * tp_size(), *param.shape[1:])
        part = loaded.narrow(0, tp_rank() * size, size)
        param.data.narrow(0, offset, size).copy_(part)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        assert input_size % tp_size() == 0, "input features must divide evenly across ranks"
        super().__init__(input_size // tp_size(), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's columns of the checkpoint weight, or the whole bias, into ``param``.

        Handout (chapter 09 §2, assignment ``09.row_shard``): a row-parallel layer splits
        the *input* features, so rank ``r`` of ``N`` (``tp_rank()``, ``tp_size()``) holds
        columns ``r * cols .. (r + 1) * cols - 1`` of the full weight ``[out, in]``, where
        ``cols = in / N`` is ``param.shape[1]``; each rank's matmul is then a partial sum
        that ``forward`` all-reduces. The bias (``param.dim() == 1``, shape ``[out]``) is
        not split: it is added once, after the reduction, so every rank loads it whole.
        ``loaded`` is the full checkpoint tensor (its shape is checked above); copy into
        ``param.data`` in place. Only ``N > 1`` reaches the region: one rank takes the whole
        tensor (every model at ``N = 1``). Hint: ``Tensor.narrow`` along dimension 1.
        """
        if tp_size() == 1:
            return super().weight_loader(param, loaded)
        full = param.shape if param.dim() == 1 else (param.shape[0], param.shape[1] * tp_size())
        check_shape(loaded, *full)
        # >>> assignment 09.row_shard (3 points)
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * cols, cols))
        # <<< assignment 09.row_shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
