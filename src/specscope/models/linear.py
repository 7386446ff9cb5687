"""CPU inference matmuls with pre-packed weights: our row-invariant kernel, else oneDNN.

Where it builds (AVX-512, AVX2+FMA or NEON and a C++ compiler; models/rowgemm.py), fp32 linears use our kernel for
every row count: each weight panel is streamed once for all rows (verify costs about one decode step) and every
row count gives the same bits (decode and verify agree exactly); in bf16 precision too (`precision="bf16"`: weights
and inputs rounded to bf16, fp32 sums; the loader's `--dtype bf16` on CPU). Elsewhere the stock path below.

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

from specscope.models import rowgemm, tuning
from specscope.models.kernels import use_row_kernels


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


class PackedLinear(nn.Module):
    """Inference-only replacement for nn.Linear on CPU: y = x W^T + b with W pre-packed, in our kernel's column
    panels (`kernel` == "rowgemm") or oneDNN's blocked layout ("onednn").

    `keep_dense=False` drops the plain weight (no second copy in memory); `.weight` then unpacks on demand
    (a copy: read it, do not train it). `keep_dense=True` keeps the original Parameter (needed when it is
    shared, e.g. lm_head tied to the embeddings).
    """

    def __init__(self, lin: nn.Linear, keep_dense: bool = False, one_row_transposed: bool = False,
                 kernel: str = "auto", tune: bool | None = None, precision: str = "fp32"):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        w = lin.weight.detach()
        self.bias = lin.bias
        self.dense = lin.weight if keep_dense else None
        self.packed = self.wt = self.rg = None
        self.kernel, self.fmt = "onednn", None
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"unknown linear precision {precision!r}; use fp32 or bf16")
        if precision == "bf16" and not (kernel in ("auto", "rowgemm") and rowgemm.supports(w)):
            # the bf16 precision is our kernel's (inputs rounded, fp32 sums, row-invariant): no stock stand-in
            raise ValueError("precision='bf16' needs the row-invariant kernels (models/rowgemm.py), which are "
                             "not available here or not asked for")
        if kernel in ("auto", "rowgemm") and rowgemm.supports(w):
            self.kernel = "rowgemm"
            # fp32: a bf16 checkpoint upcast to fp32 streams as bf16, half the bytes, the same bits
            # (rowgemm.is_bf16_exact); bf16: weights and inputs rounded to bf16, fp32 accumulation
            self.fmt = "bf16a" if precision == "bf16" else "bf16" if rowgemm.is_bf16_exact(w) else "f32"
            plan = tuning.tuned_plan(self.out_features, self.in_features, tune, fmt=self.fmt)
            self.nb = plan["nb"]
            self.rg = rowgemm.pack(w, self.nb, fmt=self.fmt)
            self.rbs = [0] + [tuning.rb_for(plan, n) for n in range(1, rowgemm.TUNE_ROWS[-1] + 1)]
            self.rg_bias = None if self.bias is None else self.bias.detach().float().contiguous()
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        # fp32, 1 row: MKL streaming a [in, out] copy beats both F.linear and oneDNN's packed GEMV
        self.wt = w.t().contiguous() if one_row_transposed else None

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        if self.rg is not None:
            return rowgemm.unpack(self.rg, self.nb, self.out_features, self.in_features, self.fmt)
        return self.wt.t() if self.wt is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rg is not None and x.dtype == torch.float32:
            x2 = x.reshape(-1, self.in_features)
            if not x2.is_contiguous():
                x2 = x2.contiguous()
            n = x2.shape[0]
            y = rowgemm.gemm(x2, self.rg, self.nb, self.out_features, self.rg_bias, self.rbs[min(n, len(self.rbs) - 1)],
                             fmt=self.fmt)
            return y.view(*x.shape[:-1], self.out_features)
        if self.rg is not None:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if self.wt is not None and x.numel() == self.in_features:
            y = torch.mm(x.view(1, -1), self.wt)
            if self.bias is not None:
                y += self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel}" + (f", format={self.fmt}" if self.fmt else ""))


def pack_linears(model: nn.Module, keep_dense: tuple[str, ...] = ("lm_head",), one_row: str = "auto",
                 kernel: str = "auto", tune: bool | None = None, precision: str = "fp32") -> int:
    """Swap every packable nn.Linear in `model` for a PackedLinear, in place; returns how many were swapped.

    Names in `keep_dense` (module names, matched exactly) keep their dense weight as well. kernel: "auto" (our
    row-invariant kernel where it builds, else oneDNN), "rowgemm" (same) or "onednn" (the stock path). one_row
    (oneDNN path only): "auto" (a transposed copy for 1-row calls in fp32, where it is faster), "packed" or
    "transposed". tune: measure the kernel's tiles for each new weight shape (default on, cached on disk).
    precision "bf16" (our kernel only): bf16 serving precision, weights and each linear's input rounded to bf16,
    fp32 accumulation (models/rowgemm.py FORMATS)."""
    if kernel not in ("auto", "rowgemm", "onednn"):
        raise ValueError(f"unknown linear kernel {kernel!r}; use auto, rowgemm or onednn")
    n, rows = 0, False
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                full = f"{name}.{child_name}" if name else child_name
                tr = one_row == "transposed" or (one_row == "auto" and child.weight.dtype == torch.float32)
                pl = PackedLinear(child, keep_dense=full in keep_dense, one_row_transposed=tr, kernel=kernel, tune=tune,
                                  precision=precision)
                setattr(mod, child_name, pl)
                n += 1
                rows = rows or pl.kernel == "rowgemm"
    if rows:   # norms and attention of this model take the row-invariant kernels too
        use_row_kernels(model)
    return n
