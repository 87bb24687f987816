"""Decoding with the target: one module per concern.

* :mod:`.speculative`: the batch-1 loops, DFlash speculative decoding (:class:`~.speculative.DFlashDecoder`)
  and plain autoregressive decoding (:class:`~.speculative.ARDecoder`) in one harness, their result
  (:class:`~.speculative.DecodeResult`), the eager target and drafter steps (``TargetRunner``,
  ``DrafterRunner``) and the factories that pick a step (``target_runner``, ``drafter_runner``).
  The evaluation runs these (:mod:`dflashpipe.evaluate.run`).
* :mod:`.static_target`: the target's batch-1 step on a static KV cache, captured as CUDA graphs
  (``StaticTargetRunner``, the ``TargetRunner`` interface).
* :mod:`.static_drafter`: the drafter's batch-1 step on static buffers, captured as CUDA graphs
  (``StaticDrafterRunner``, the ``DrafterRunner`` interface).
* :mod:`.slots`: continuous batching over a slotted static KV cache (``SlotDecoder``): the
  ``batched`` backend of the dataset expansion (:mod:`dflashpipe.stages.expand`).
* :mod:`.batched`: greedy AR and DFlash over many prompts at once (``BatchedDecoder``: continuous
  batching over a slotted static KV cache, one verify forward for every row): the speed-up under load
  (``benchmarks/concurrency.py``).
* :mod:`.cuda_graph`: capturing a step as a CUDA graph, the one routine the steps above share.
* :mod:`.stop`: the stop rule every decoder cuts its steps by (``cut_step``).

What only the evaluation needs (the lossless check, metrics, transformers' peers) lives in
:mod:`dflashpipe.evaluate`. Import the modules directly; this file imports nothing, so a stage
depends only on the modules it uses (the expansion on :mod:`.slots`, not on the loops).
"""
