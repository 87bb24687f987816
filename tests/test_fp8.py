"""train.target_fp8: the frozen target's decoder linears as FP8 matmuls (row-wise scales).

Real arithmetic on the CPU (torch's ``_scaled_mm`` runs there too): the module
against its own dequantized weights, the shipped tiny target's features and
greedy tokens against the unquantized target, and a training run through
``train_rank`` whose target really is quantized.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dflashpipe.drafter.features import context_features
from dflashpipe.drafter.fp8 import FP8, Fp8Linear, check_fp8_device, quantize_decoder_linears
from dflashpipe.training.step import resolve_setup
from dflashpipe.training.train import TrainConfig, build, train_rank
from dflashpipe.inputs.target import load_target
from dflashpipe.jobs.errors import UserError

from test_train import BASE, quiet, rank_args, read_metrics

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "resources" / "tiny_target"


def test_an_fp8_linear_is_the_matmul_of_its_rounded_operands():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    fp8 = Fp8Linear(lin)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (1, 48)
    x = torch.randn(3, 5, 64)
    out = fp8(x)
    # the same rounding by hand: rows of x scaled to +-448, cast to e4m3, multiplied in fp32, scaled back
    rows = x.reshape(-1, 64)
    sa = rows.abs().amax(-1, keepdim=True) / 448
    by_hand = ((rows / sa).to(FP8).float() * sa) @ (fp8.weight.float() * fp8.weight_scale.t()).t() + lin.bias
    assert out.shape == (3, 5, 48)
    torch.testing.assert_close(out.reshape(-1, 48), by_hand, rtol=1e-5, atol=1e-5)
    exact = lin(x).detach()
    rel = ((out - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.08  # really rounded (3 mantissa bits), and not broken


def test_the_tiny_targets_features_in_fp8_stay_close_and_its_greedy_tokens_stay():
    target, tok = load_target(str(TINY), "cpu", torch.float32)
    ids = torch.tensor([tok.encode("Janet has 3 apples and buys 5 more. How many apples does she have? She has 8.")])
    layers = [0, 1, 2, 3]
    ref, ref_final = context_features(target, ids, None, layers, final=True)
    before = sum(m.weight.numel() * 4 for m in target.model.layers.modules() if isinstance(m, nn.Linear))
    counts = quantize_decoder_linears(target)
    assert counts == {"quantized": 7 * 4, "kept": 0, "bytes_before": before,
                      "bytes_after": counts["bytes_after"]} and counts["bytes_after"] < before / 3.5  # fp32 -> 1 byte
    assert all(type(m) is not nn.Linear for m in target.model.layers.modules())
    q, q_final = context_features(target, ids, None, layers, final=True)
    rel = ((q - ref).norm() / ref.norm()).item()
    assert 0.005 < rel < 0.15
    same = (target.lm_head(q_final).argmax(-1) == target.lm_head(ref_final).argmax(-1)).float().mean().item()
    assert same >= 0.9


def test_each_original_linear_is_freed_as_soon_as_its_fp8_replacement_is_in():
    """The load peak is the model plus ONE weight's conversion, not plus every FP8 weight: each original
    linear dies (a weakref callback) while the model holds as many FP8 linears as have been made."""
    import weakref

    target, _ = load_target(str(TINY), "cpu", torch.float32)
    originals = [m for m in target.model.layers.modules() if type(m) is nn.Linear]
    made_when_freed = []

    def freed():
        made_when_freed.append(sum(isinstance(m, Fp8Linear) for m in target.model.layers.modules()))

    for m in originals:
        weakref.finalize(m, freed)
    n = len(originals)
    del originals, m
    quantize_decoder_linears(target)
    assert made_when_freed == list(range(1, n + 1)) and n == 28


def test_training_with_an_fp8_target_quantizes_it_and_learns(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**{**BASE, "loss": "kl"}, epochs=2.0, checkpoint_every=100, target_fp8=True)
    target, *_ = build(cfg, str(micro_target), resolve_setup(cfg, "cpu", 0, [0]))
    assert any(isinstance(m, Fp8Linear) for m in target.modules())
    assert not any(type(m) is nn.Linear for m in target.model.layers.modules())
    a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "rdzv", "fp8")
    summary = train_rank(**a, log=quiet)
    losses = [r["loss"] for r in read_metrics(a["run"].metrics_csv)]
    assert len(losses) >= 4 and losses[-1] < losses[0]
    assert summary["heldout_loss"] > 0


def test_a_gpu_without_fp8_matmuls_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(UserError, match=r"train.target_fp8: NVIDIA A100 \(compute capability 8.0\) has no FP8"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0))  # Hopper: fine
    check_fp8_device(torch.device("cpu"))
