"""Where a pipeline job's first seconds go: each step of a GPU job's start, timed in one fresh process.

A job of the pipeline is a fresh Python process: it imports torch, the library and transformers,
starts CUDA, and loads the target before its own work. On the tiny default those steps, not the
work, are most of a job (see the job logs' "set up in" lines). This times them in the order a job
meets them, cumulatively (a module imported by an earlier step costs nothing later), and prints
one JSON object:

    python benchmarks/job_startup.py [--target resources/tiny_target] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="resources/tiny_target")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    seconds, t = {}, time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        seconds[name] = round(now - t, 3)
        t = now

    import torch

    step("import torch")
    if a.device.startswith("cuda"):
        torch.zeros(1, device=a.device)
        torch.cuda.synchronize()
    step("CUDA context")
    import transformers  # noqa: F401

    step("import transformers")
    from transformers import AutoModelForCausalLM  # noqa: F401

    step("transformers' auto model classes")
    from dflashpipe.inputs.target import load_target, load_tokenizer

    step("import dflashpipe.inputs.target")
    load_tokenizer(a.target)
    step("tokenizer")
    model, _ = load_target(a.target, device=a.device, dtype=torch.bfloat16)
    step("target weights to the device")
    x = torch.ones(1, 8, dtype=torch.long, device=a.device)
    model(x)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    step("first forward (cuBLAS, kernels)")
    import torch.nn.attention.flex_attention  # noqa: F401

    step("import flex_attention (torch._dynamo)")
    from dflashpipe.drafter import model as drafter_model  # noqa: F401
    from dflashpipe.export import write  # noqa: F401

    step("import the drafter and its export")
    print(json.dumps({"seconds": seconds, "total_s": round(time.perf_counter() - T0, 3),
                      "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
                      "torch": torch.__version__, "transformers": transformers.__version__}, indent=1))


if __name__ == "__main__":
    main()
