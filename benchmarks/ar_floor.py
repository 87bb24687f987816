"""The batch-1 AR step of a small target against its floor: kernels per step x the cost of a graph node.

A 135M-parameter target reads its weights (~0.27 GB in bf16) in ~0.06 ms at an H200's bandwidth, so
its batch-1 step is bound by the number of GPU kernels it runs, not by memory. For each way the
evaluation can run the target's step (:class:`~dflashpipe.decode.static_target.StaticTargetRunner`:
captured as is, or compiled by Inductor first) this prints:

* ``kernels``: GPU kernels of one step (profiled uncaptured: the same kernels the graph holds);
* ``graph_ms``: one replay of the captured step alone;
* ``loop_ms``: one token of the evaluation's AR loop (:class:`~dflashpipe.decode.speculative.ARDecoder`:
  replay + argmax + the host's copy of the token), over ``--new`` tokens;
* the floor: ``kernels x node_us``, where ``node_us`` is a replayed graph's cost per node, measured
  on a graph of tiny kernels; and the weights' memory-bound time beside it.

With ``--drafter DIR`` (an exported drafter for this target) it also splits the compiled DFlash step
the evaluation runs into its pieces: the three captured graphs (draft, verify of the block, the draft
cache's update), each with its kernels and its replay time alone, and the loop's whole step (the
pieces, the host's copies, the one read-back of the verdict) over ``--new`` tokens of a prompt.

The compiled steps are measured three times: attending with SDPA under PyTorch's default backends, with
SDPA and cuDNN attention off (the backend is chosen when the step is compiled, and the evaluation turns
cuDNN's off: ``evaluate/settings.py``, ``cudnn_sdpa``), and with flex_attention, as the evaluation
compiles them (``--modes eval``: that one only).

``--target`` may be a ``config.json`` instead of a model directory, and ``--drafter random`` a drafter
of its shapes with ``--config``'s ``drafter`` section (layers, block, mask token): random weights, since which kernels run
and how long they take do not depend on the weights (tau does). ``--inductor k=v,...`` sets
``torch._inductor.config`` for every compile (e.g. ``max_autotune=1``); ``--kernels`` adds each
captured piece's kernels by kind (matmul, attention, Inductor's fused, other) and its slowest kernels.

    python benchmarks/ar_floor.py --target resources/targets/smollm2-135m-instruct --out ar_floor.json
    python benchmarks/ar_floor.py --target T --drafter results/train/drafter --out ar_floor.json
    python benchmarks/ar_floor.py --target T/config.json --drafter random --modes eval --kernels --inductor max_autotune=1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from decode_speed import set_inductor  # noqa: E402


def node_cost_us(device, nodes: int = 1000) -> float:
    """Replay time per node of a CUDA graph of ``nodes`` tiny kernels (the launch floor inside a graph)."""
    from dflashpipe.decode.cuda_graph import capture

    x = torch.zeros(16, device=device)

    def many():
        for _ in range(nodes):
            x.add_(1)
        return x

    graph, _ = capture(many, device)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps / nodes * 1e6


def copy_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * a.numel() * 5 / (time.perf_counter() - t0)


def cuda_kernels(fn, device) -> list:
    """(name, microseconds) of each GPU kernel one uncaptured call of ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


KINDS = (("matmul", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "triton_tem", "splitk")),
         ("attention", ("fmha", "flash", "attention", "sdpa", "efficient")), ("fused", ("triton_",)))


def kernel_breakdown(kernels: list, top: int = 8) -> dict:
    """:func:`cuda_kernels`' list by kind (count, busy us) and its ``top`` slowest kernels (name, count, us)."""
    kinds, names = {}, {}
    for name, us in kernels:
        kind = next((k for k, keys in KINDS if any(key in name.lower() for key in keys)), "other")
        c = kinds.setdefault(kind, [0, 0.0])
        c[0], c[1] = c[0] + 1, c[1] + us
        c = names.setdefault(name[:90], [0, 0.0])
        c[0], c[1] = c[0] + 1, c[1] + us
    slowest = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {"busy_us": sum(c[1] for c in kinds.values()), "kinds": kinds, "slowest": slowest}


def load_target(path: str, device):
    """A model directory, or a config.json: that model with random weights (the same kernels, the same times)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if Path(path).is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model.to(device).eval()


def random_drafter(target: str, config: str, out: Path) -> str:
    """An exported drafter of ``target``'s shapes and ``config``'s drafter section, random weights, at ``out``."""
    from transformers import AutoConfig

    from dflashpipe.config import load_yaml
    from dflashpipe.export.write import save_drafter
    from dflashpipe.drafter.model import ARCH_KEYS, DFlashDrafter, DrafterConfig

    d = load_yaml(config)["drafter"]  # the keys it sets; DrafterConfig's defaults (the schema's) for the rest
    named = {"num_layers": "num_hidden_layers", "block_size": "block_size", "mask_token_id": "mask_token_id",
             **{k: k for k in ARCH_KEYS}}
    tc = AutoConfig.from_pretrained(target)
    cfg = DrafterConfig.from_target_config(tc, **{named[k]: v for k, v in d.items() if k in named})
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), cfg, out, target_config=tc, dtype=torch.bfloat16)
    return str(out)


def measure(target: str, compile: bool, attention: str, new: int, prompt_len: int, device, breakdown: bool = False) -> dict:
    """The AR step of ``target`` (captured; compiled first with ``compile``) attending with ``attention``
    (flex, or SDPA under the backends set now)."""
    from dflashpipe.decode.speculative import ARDecoder
    from dflashpipe.decode.static_target import StaticTargetRunner

    model = load_target(target, device)
    runner = StaticTargetRunner(model, capacity=1024, graph_sizes=(1,), compile=compile, attention=attention)
    prompt = torch.randint(100, 1000, (prompt_len,)).tolist()
    dec = ARDecoder(model, eos_ids=[], runner=runner)
    t0 = time.perf_counter()
    dec.generate(prompt, 8)  # captures (and compiles) the step
    setup_s = time.perf_counter() - t0
    res = dec.generate(prompt, new)
    loop_ms = res.decode_s / max(1, res.decode_tokens) * 1e3
    ids = torch.tensor([[prompt[-1]]], device=device)
    pos = runner.step_pos[1].fill_(prompt_len)
    with torch.no_grad():
        step = cuda_kernels(lambda: runner._captured_step(ids, pos, False, True), device)
        kernels, detail = len(step), kernel_breakdown(step) if breakdown else None
        graph = runner._graphs[(1, False)][0]
        torch.cuda.synchronize(device)
        t0, reps = time.perf_counter(), 200
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize(device)
    graph_ms = (time.perf_counter() - t0) / reps * 1e3
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"mode": runner.mode, "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(), "kernels": kernels,
            "graph_ms": graph_ms, "loop_ms": loop_ms, "loop_tokens": res.decode_tokens, "setup_s": setup_s, "weight_bytes": weight_bytes,
            **({"kernel_breakdown": detail} if detail else {})}


def replay_ms(graph, device, reps: int = 200) -> float:
    graph.replay()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps * 1e3


def measure_dflash(target: str, drafter_dir: str, attention: str, new: int, prompt_len: int, device,
                   breakdown: bool = False) -> dict:
    """The compiled DFlash step's pieces (as the evaluation builds them), each alone, and the loop's step."""
    from dflashpipe.decode.speculative import DFlashDecoder, drafter_runner, target_runner
    from dflashpipe.export.write import load_drafter

    model = load_target(target, device)
    drafter, dcfg = load_drafter(drafter_dir, device=device, dtype=torch.bfloat16)
    verify = target_runner(model, "compiled", dcfg.target_layer_ids, 1024, graph_sizes=(dcfg.num_drafts + 1,),
                           attention=attention)
    draft = drafter_runner(drafter, verify, "compiled", 1024)
    dec = DFlashDecoder(model, drafter, dcfg, eos_ids=[], runner=verify, draft_runner=draft)
    prompt = torch.randint(100, 1000, (prompt_len,)).tolist()
    t0 = time.perf_counter()
    dec.generate(prompt, 16)  # compiles and captures the three pieces
    setup_s = time.perf_counter() - t0
    res = dec.generate(prompt, new)
    pieces = {"draft": draft._graphs["propose"][0], "extend": draft._graphs["extend"][0],
              "verify": verify._graphs[(dcfg.num_drafts + 1, True)][0]}
    e = verify._graphs[(dcfg.num_drafts + 1, True)]
    fns = {"draft": draft._pieces["propose"], "extend": draft._pieces["extend"],
           "verify": lambda: verify._captured_step(e[1], verify.step_pos[dcfg.num_drafts + 1], True, False)}
    with torch.no_grad():
        listed = {name: cuda_kernels(fn, device) for name, fn in fns.items()}
    kernels = {name: len(ks) for name, ks in listed.items()}
    detail = {name: kernel_breakdown(ks) for name, ks in listed.items()} if breakdown else None
    out = {"arch": dcfg.arch, "mode": verify.mode, "draft_mode": draft.mode,
           "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(), "block_size": dcfg.block_size,
           "num_drafts": dcfg.num_drafts, "setup_s": setup_s,
           "step_ms": res.decode_s / max(1, res.verify_steps) * 1e3, "steps": res.verify_steps,
           "tau": res.tau, "tokens": res.decode_tokens}
    for name, graph in pieces.items():
        out[f"{name}_kernels"] = kernels[name]
        out[f"{name}_ms"] = replay_ms(graph, device)
    out["host_ms"] = out["step_ms"] - sum(out[f"{n}_ms"] for n in pieces)
    if detail:
        out["kernel_breakdown"] = detail
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=120)
    ap.add_argument("--drafter", help="an exported drafter for this target, or 'random': split the DFlash step too")
    ap.add_argument("--config", default=str(REPO / "config" / "smollm2.yaml"), help="--drafter random: its drafter section")
    ap.add_argument("--modes", choices=("all", "eval"), default="all",
                    help="eval: only the evaluation's (compiled, flex attention, cuDNN attention off)")
    ap.add_argument("--inductor", default="", help="torch._inductor.config settings for every compile: k=v,...")
    ap.add_argument("--kernels", action="store_true", help="each step's kernels by kind, and its slowest")
    ap.add_argument("--out")
    a = ap.parse_args()
    device = torch.device("cuda")
    # every setting compiled afresh: Inductor's FX graph cache does not key on the attention backend
    # flags, so a second compile of the same step would reuse the first one's kernels
    torch._inductor.config.fx_graph_cache = False
    set_inductor(a.inductor)
    if a.drafter == "random":
        import tempfile

        a.drafter = random_drafter(a.target, a.config, Path(tempfile.mkdtemp()) / "drafter")
    node_us, bw = node_cost_us(device), copy_bandwidth(device)
    cudnn_default = torch.backends.cuda.cudnn_sdp_enabled()
    out = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "node_us": node_us,
           "copy_bytes_per_s": bw, "inductor": a.inductor, "modes": [], "dflash_steps": []}
    # (compile, cuDNN attention, attention): captured as is; compiled with SDPA, cuDNN on and off; compiled
    # with flex_attention (the evaluation's setting)
    settings = (((False, cudnn_default, "sdpa"), (True, cudnn_default, "sdpa"), (True, False, "sdpa"), (True, False, "flex"))
                if a.modes == "all" else ((True, False, "flex"),))
    for compile, cudnn, attention in settings:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        torch._dynamo.reset()  # Dynamo does not guard on the backend flags: trace each setting afresh
        r = measure(a.target, compile, attention, a.new, a.prompt_len, device, a.kernels)
        r["floor_ms"] = r["kernels"] * node_us / 1e3
        r["memory_bound_ms"] = r["weight_bytes"] / bw * 1e3
        out["modes"].append(r)
        print(f"{r['mode']} (cuDNN attention {'on' if cudnn else 'off'}): {r['kernels']} kernels/step, graph "
              f"{r['graph_ms']:.3f} ms, AR loop {r['loop_ms']:.3f} ms/token; floor {r['kernels']} x {node_us:.2f} us = "
              f"{r['floor_ms']:.3f} ms; memory-bound {r['memory_bound_ms']:.3f} ms; setup {r['setup_s']:.1f} s", flush=True)
        if compile and a.drafter:
            d = measure_dflash(a.target, a.drafter, attention, a.new, a.prompt_len, device, a.kernels)
            out["dflash_steps"].append(d)
            print(f"DFlash step ({d['arch']}, {d['num_drafts']} drafts), {d['mode']}, cuDNN attention "
                  f"{'on' if cudnn else 'off'}: {d['step_ms']:.3f} ms = {d['step_ms'] / r['loop_ms']:.2f} AR tokens "
                  f"({r['loop_ms']:.3f} ms); draft {d['draft_kernels']} kernels {d['draft_ms']:.3f} ms, verify "
                  f"{d['verify_kernels']} kernels {d['verify_ms']:.3f} ms, extend {d['extend_kernels']} kernels "
                  f"{d['extend_ms']:.3f} ms, the rest (host) {d['host_ms']:.3f} ms; floor "
                  f"{(d['draft_kernels'] + d['verify_kernels'] + d['extend_kernels']) * node_us / 1e3:.3f} ms", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1))
    torch.backends.cuda.enable_cudnn_sdp(cudnn_default)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
