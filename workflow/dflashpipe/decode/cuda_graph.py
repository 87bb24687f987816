"""Capture a step as a CUDA graph: the one routine the decoders share (:mod:`.slots`, :mod:`.static_target`, :mod:`.static_drafter`)."""

from __future__ import annotations

import torch

# A static KV cache's positions are a multiple of this: a captured (and compiled) step's shapes follow
# the cache's size, so jobs whose needs differ a little (two datasets' longest prompts) build the same
# graphs, and a later job loads what an earlier one compiled from the slot's compile cache.
CAPACITY_STEP = 256


def round_capacity(positions: int, step: int = CAPACITY_STEP) -> int:
    """The static KV cache size for ``positions`` positions: rounded up to a multiple of ``step``."""
    return -(-int(positions) // step) * step


def capture(fn, device, warmups: int = 2):
    """Run ``fn()`` ``warmups`` times on a side stream (lazy inits, cuBLAS handles, compiling), then
    capture one call; returns (graph, outputs). ``graph.replay()`` reruns it on the same buffers, so
    ``fn`` must read and write only tensors that outlive the graph (its outputs are static too)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
