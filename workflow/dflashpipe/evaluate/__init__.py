"""Evaluation: DFlash speculative decoding, same-harness AR, transformers' peers, metrics.

Modules: :mod:`.run` (one dataset end to end), :mod:`.settings` (what one evaluation is: its
settings, models, prompts and outputs), :mod:`.methods` (the registry of methods),
:mod:`.lossless` (greedy DFlash against greedy AR, token for token), :mod:`.baselines`
(transformers' generate, prompt lookup, assisted generation), :mod:`.hf_assistant` (the drafter as
transformers' own DFlash assistant), :mod:`.ar_draft` (the assisted peer's small draft model),
:mod:`.metrics` (tau, histograms, per-position acceptance, speed-up). The DFlash and AR loops
themselves are in :mod:`dflashpipe.decode.speculative`. Import the modules directly; this package
imports nothing eagerly, so a stage depends only on the modules it uses.
"""
