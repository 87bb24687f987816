"""Evaluation: DFlash speculative decoding, same-harness AR, transformers' peers, metrics.

Modules: :mod:`.spec_decode` (the DFlash and AR loops, lossless check),
:mod:`.baselines` (transformers' generate, prompt lookup, assisted generation),
:mod:`.ar_draft` (the assisted peer's small draft model), :mod:`.metrics`
(tau, histograms, per-position acceptance, speed-up), :mod:`.run` (one dataset
end to end). Import them directly; this package imports nothing eagerly, so a
stage depends only on the modules it uses.
"""
