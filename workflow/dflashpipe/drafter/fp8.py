"""The frozen target's linear layers in FP8 for training (``train.target_fp8``).

Training never updates the target: it only reads its hidden states. Its
decoder layers' linears (attention projections, MLP) can therefore hold their
weights in FP8 (e4m3, one scale per output row) and run as FP8 matmuls
(``torch._scaled_mm`` with row-wise scales: one scale per token of the input,
computed on the fly from its absolute maximum). That halves the target's
weight memory (Qwen3-8B: 13 of its 16 GB are decoder-layer linears) and, on
GPUs with FP8 tensor cores (compute capability 8.9+: Ada, Hopper), runs those
GEMMs faster. The embedding, norms and LM head stay in their dtype.

The drafter then learns from features the FP8 target computes, which differ
from the bf16 target's by the rounding of a 3-bit mantissa (one matmul: ~4%
relative on random inputs; the shipped tiny target's tapped features: 5-8%,
its greedy next tokens unchanged on the test prompt); evaluation and serving
run the unchanged target, so what counts is the drafter's acceptance there
(benchmarks/results/README.md has the measurement). On the CPU the same arithmetic runs (slowly): tests use it.
"""

from __future__ import annotations

import torch
from torch import nn

from dflashpipe.jobs.errors import UserError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = 1e-12  # an all-zero row gets a harmless scale instead of dividing by 0


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (the rows in FP8, their fp32 scales [M, 1]) with x ~= fp8 * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (x / scale).to(FP8), scale


class Fp8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is FP8 with one scale per output feature."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = _rowwise(linear.weight.detach())
        self.register_buffer("weight", weight)  # [N, K] row-major: .t() is the column-major operand cuBLAS wants
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, scale = _rowwise(x.reshape(-1, self.in_features))
        out = torch._scaled_mm(rows, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 rowwise"


def _fits(linear: nn.Linear) -> bool:
    """FP8 GEMMs take operand dimensions that are multiples of 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def check_fp8_device(device: torch.device, field: str = "train.target_fp8") -> None:
    """A GPU without FP8 matmuls gets a one-line error before anything loads."""
    if device.type != "cuda":
        return  # the CPU runs the same arithmetic (slowly)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UserError(
            f"{field}: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 matmuls "
            "(8.9+: Ada, Hopper or newer); set it to false"
        )


def quantize_decoder_linears(target) -> dict:
    """Replace every ``nn.Linear`` inside ``target.model.layers`` by an :class:`Fp8Linear`, in place.

    One linear at a time, each original freed as soon as its FP8 replacement is in
    place (nothing here keeps a reference to it), so the peak is the bf16 model
    plus one weight's FP8 copy and fp32 temporaries. Returns counts (``quantized``,
    ``kept``: linears whose shapes FP8 GEMMs do not take) and the bytes of weights
    before and after.
    """
    layers = target.model.layers
    todo = [(parent, name) for parent in layers.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear]
    counts = {"quantized": 0, "kept": 0, "bytes_before": 0, "bytes_after": 0}
    for parent, name in todo:
        child = getattr(parent, name)
        before = child.weight.numel() * child.weight.element_size()
        counts["bytes_before"] += before
        if not _fits(child):
            counts["kept"] += 1
            counts["bytes_after"] += before
            continue
        new = Fp8Linear(child)
        del child  # the model's reference is the last one: replacing it frees the original
        setattr(parent, name, new)
        counts["quantized"] += 1
        counts["bytes_after"] += new.weight.numel() + new.weight_scale.numel() * 4
    return counts
