"""Evaluation: DFlash speculative decoding, same-harness AR, transformers' peers, metrics."""

from .metrics import (
    account_steps,
    acceptance_histogram,
    cut_step,
    per_position_acceptance,
    speedup,
    tau,
    tau_mean,
    tau_pooled,
    tokens_per_second,
)
from .spec_decode import ARDecoder, DecodeResult, DFlashDecoder, ar_generate, check_lossless, dflash_generate, eos_ids_of

__all__ = [
    "ARDecoder",
    "DFlashDecoder",
    "DecodeResult",
    "acceptance_histogram",
    "account_steps",
    "ar_generate",
    "check_lossless",
    "cut_step",
    "dflash_generate",
    "eos_ids_of",
    "per_position_acceptance",
    "speedup",
    "tau",
    "tau_mean",
    "tau_pooled",
    "tokens_per_second",
]
