"""CPU inference matmuls with weights pre-packed by oneDNN.

Decode and verify on CPU are weight-streaming GEMV / skinny GEMM. Measured on the 2-core AMD EPYC (torch 2.13,
MKL + oneDNN 3.12; see bench/results/linear_kernels.json): `F.linear` (MKL sgemm on the [out, in] weight)
streams the tall lm_head at ~11 GB/s for 1 row and collapses for 2-16 rows (speculative verify), bf16 F.linear
is slower still; `x @ W.T.contiguous()` helps 1 row only. oneDNN with the weight reordered once into its blocked
layout (`mkldnn._reorder_linear_weight`, what inductor's freezing pass does) is as fast or faster at every row
count, 2x at 2-64 rows, in fp32 and bf16. So CPU targets use it; CUDA keeps plain F.linear (cuBLAS is fine),
and fp16 on CPUs without avx512_fp16 / avx_ne_convert stays dense (oneDNN refuses it there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


class PackedLinear(nn.Module):
    """Inference-only replacement for nn.Linear on CPU: y = x W^T + b with W in oneDNN's blocked layout.

    `keep_dense=False` drops the plain weight (no second copy in memory); `.weight` then unpacks on demand
    (a copy: read it, do not train it). `keep_dense=True` keeps the original Parameter (needed when it is
    shared, e.g. lm_head tied to the embeddings).
    """

    def __init__(self, lin: nn.Linear, keep_dense: bool = False, one_row_transposed: bool = False):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        w = lin.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = lin.bias
        self.dense = lin.weight if keep_dense else None
        # fp32, 1 row: MKL streaming a [in, out] copy beats both F.linear and oneDNN's packed GEMV
        self.wt = w.t().contiguous() if one_row_transposed else None

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        return self.wt.t() if self.wt is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wt is not None and x.numel() == self.in_features:
            y = torch.mm(x.view(1, -1), self.wt)
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, keep_dense: tuple[str, ...] = ("lm_head",), one_row: str = "auto") -> int:
    """Swap every packable nn.Linear in `model` for a PackedLinear, in place; returns how many were swapped.

    Names in `keep_dense` (module names, matched exactly) keep their dense weight as well. one_row: "auto"
    (a transposed copy for 1-row calls in fp32, where it is faster), "packed" or "transposed"."""
    n = 0
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                full = f"{name}.{child_name}" if name else child_name
                tr = one_row == "transposed" or (one_row == "auto" and child.weight.dtype == torch.float32)
                setattr(mod, child_name, PackedLinear(child, keep_dense=full in keep_dense, one_row_transposed=tr))
                n += 1
    return n
