"""DFlash's speed-up under load: AR and DFlash decoding B prompts at once, at concurrency 1, 4, 16, 64.

At batch 1 a target step reads the weights once for one token (AR) or for a block (a DFlash verify),
so a block costs little more than a token and DFlash wins by its acceptance length tau. With B
requests in flight a verify computes B blocks: the step becomes compute-bound sooner than AR's, so
the speed-up per user shrinks with B. This measures it with one harness for both methods
(:mod:`dflashpipe.decode.batched`: continuous batching over a static slotted KV cache, greedy; the
same target step code for AR's one token and DFlash's verify block, CUDA graphs on a GPU), at each
concurrency c (c rows; ``--waves`` x c prompts, so finished rows take waiting prompts):

* ``total_tok_s``: new tokens of all requests / wall time of the run (prefills included);
* ``per_user_tok_s``: the mean over requests of its decode tokens / its decode time (first token to
  last, the evaluation's convention); ``per_user_e2e_tok_s``: its new tokens / admission to last token;
* ``tau``: mean tokens per row and verify step reaching the output (DFlash); ``tau_uncut``: a + 1 per
  step before the reply's last step is cut at ``--new`` (with forced acceptance: close to the forced tau);
* ``speedup_total`` / ``speedup_per_user``: DFlash over AR at the same concurrency;
* ``ar_slot_decoder``: the expansion's batched AR decoder (:class:`~dflashpipe.decode.slots.SlotDecoder`,
  dense attention, CUDA graphs), total tokens/s: a check that the AR baseline is not slow.

Modes (one or both per call, each a section of the JSON):

* ``--shapes qwen3-8b``: a random-weight Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8,
  vocab 151936; ``benchmarks/train_throughput.py``'s builder) and a random 5-layer drafter, bf16 on
  CUDA; random prompts, no end token. SPEED ONLY: random weights accept nothing, so by default the
  acceptance is FORCED (``--tau``: each draft accepted with the probability that makes the mean
  accepted length tau; the drafts and verify still run, the outputs are not the target's). ``--tau
  real`` checks drafts as usual (tau ~ 1 with random weights).
* ``--run DIR``: a finished pipeline run (its results directory): the target (``DIR/target/model``,
  the tiny default, or ``--target``), its trained drafter (``DIR/drafter``), the held-out prompts of
  its first evaluated dataset (``DIR/eval/*.summary.json``, ``DIR/prompts/<dataset>.parquet``), real
  acceptance and end tokens; DFlash's outputs are compared with AR's, row by row (``lossless``).

Writes ``concurrency.json`` and ``speedup_vs_concurrency.png`` to ``--out``.

    python benchmarks/concurrency.py --shapes qwen3-8b --run results --out $OUT/concurrency
    bash benchmarks/gpu_concurrency.sh $OUT/concurrency results   # + the CUDA-graph path's correctness check
    python benchmarks/concurrency.py --device cpu --tiny --concurrency 1,2 --new 8 --out /tmp/c   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from train_throughput import QWEN3_8B, TINY, build_target  # noqa: E402

from dflashpipe.decode.batched import BatchedDecoder, BatchSettings  # noqa: E402
from dflashpipe.decode.cuda_graph import round_capacity  # noqa: E402
from dflashpipe.decode.speculative import sync  # noqa: E402
from dflashpipe.evaluate.concurrency import summarise  # noqa: E402


@dataclass
class Case:
    """One mode's models and prompts: what every concurrency decodes."""

    label: str
    target: object
    drafter: object
    prompts: list  # prompt ids, at least waves x the largest concurrency (cycled)
    eos: list
    taus: list  # None: real acceptance; a float: forced (speed only)
    notes: dict


def free_memory(dev) -> None:
    gc.collect()
    if torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()


def timed_run(case: Case, prompts, c: int, a, tau, capacity: int) -> tuple[dict, list]:
    """Warm-up (captures the graphs; untimed), then the timed run of ``prompts`` at concurrency c."""
    s = BatchSettings(slots=c, max_new_tokens=a.new, capacity=capacity, cuda_graphs=None if a.graphs else False,
                      forced_tau=tau if isinstance(tau, float) else None)
    drafter = case.drafter if tau is not None else None
    dec = BatchedDecoder(case.target, s, case.eos, drafter)
    if torch.device(a.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    graphs_error = None
    try:
        dec.generate(prompts[:c], max_new_tokens=a.warmup_new)
    except RuntimeError as err:  # a capture that fails: measure uncaptured rather than nothing (recorded)
        if s.cuda_graphs is False:
            raise
        traceback.print_exc()
        graphs_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        s.cuda_graphs = False
        dec = BatchedDecoder(case.target, s, case.eos, drafter)
        dec.generate(prompts[:c], max_new_tokens=a.warmup_new)
    sync(a.device)
    warm = time.perf_counter() - t0
    run = dec.generate(prompts)
    out = {**summarise(run), "warmup_s": warm, "mode": dec.mode}
    if graphs_error:
        out["cuda_graphs_error"] = graphs_error
    if torch.device(a.device).type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    tokens = [r.tokens for r in run.results]
    del dec, run
    free_memory(a.device)
    return out, tokens


def slot_decoder_ar(case: Case, prompts, c: int, a, capacity: int) -> dict:
    """The expansion's batched AR decoder on the same prompts (dense attention: nothing compiled)."""
    from dflashpipe.decode.slots import SlotDecoder

    dec = SlotDecoder(case.target, c, capacity, cuda_graphs=None if a.graphs else False, attention="dense")
    # captures every step the run takes: rows finish one after another (every partial-step size)
    dec.generate(prompts[:c], [min(a.new, 2 + i * 64 // c) for i in range(c)], case.eos)
    sync(a.device)
    t0 = time.perf_counter()
    out = dec.generate(prompts, a.new, case.eos)
    sync(a.device)
    secs = time.perf_counter() - t0
    n = sum(len(ids) for ids, _ in out)
    del dec
    free_memory(a.device)
    return {"new_tokens": n, "wall_s": secs, "total_tok_s": n / secs}


def at_concurrency(case: Case, c: int, a) -> dict:
    """AR, then DFlash at each tau, at concurrency c; speed-ups DFlash / AR."""
    k = a.waves * c
    prompts = [case.prompts[i % len(case.prompts)] for i in range(k)]
    bs = case.drafter.cfg.num_drafts + 1
    capacity = round_capacity(max(len(p) for p in prompts) + a.new + 2 * bs, 64)  # attention reads it all
    res: dict = {"concurrency": c, "prompts": k}
    res["ar"], ar_tokens = timed_run(case, prompts, c, a, None, capacity)
    for tau in case.taus:
        name = "dflash" if tau == "real" else f"dflash_forced_tau_{tau:g}"
        r, tokens = timed_run(case, prompts, c, a, tau, capacity)
        r["speedup_total"] = r["total_tok_s"] / res["ar"]["total_tok_s"]
        r["speedup_per_user"] = r["per_user_tok_s"] / res["ar"]["per_user_tok_s"]
        if tau == "real":  # greedy: every row must decode what AR decodes (ties aside, in bf16)
            r["lossless_exact_rows"] = sum(x == y for x, y in zip(tokens, ar_tokens))
        res[name] = r
    if a.slot_decoder:
        try:
            res["ar_slot_decoder"] = slot_decoder_ar(case, prompts, c, a, capacity)
        except Exception as err:  # a reference only: the measurement stands without it
            res["ar_slot_decoder"] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
    return res


def shapes_case(a) -> Case:
    """Random weights at the Qwen3-8B shapes (``--tiny``: the tiny shapes), random prompts, no end token."""
    from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig

    shapes = TINY if a.shapes == "tiny" else QWEN3_8B
    target, tcfg = build_target(shapes, 4096, a.block_size, a.device)
    dcfg = DrafterConfig.from_target_config(tcfg, a.layers, a.block_size, tcfg.vocab_size - 1, arch=a.arch)
    torch.manual_seed(0)
    with torch.device(a.device):  # initialised where it runs (a billion parameters at the 8B shapes)
        drafter = DFlashDrafter(dcfg).to(target.dtype).eval()
    g = torch.Generator().manual_seed(0)
    n = a.waves * max(a.concurrency)
    prompts = [torch.randint(0, tcfg.vocab_size - 2, (a.prompt_len,), generator=g).tolist() for _ in range(n)]
    taus = [None if t == "real" else float(t) for t in a.tau.split(",")]
    return Case(a.shapes, target, drafter, prompts, [],
                ["real" if t is None else t for t in taus],
                {"shapes": shapes, "drafter_layers": a.layers, "arch": a.arch, "block_size": a.block_size,
                 "prompt_tokens": a.prompt_len,
                 "weights": "random", "acceptance": "forced (speed only, outputs are not the target's) for "
                 "dflash_forced_tau_*; real for dflash"})


def run_case(a) -> Case:
    """A finished pipeline run: its target, trained drafter and held-out prompts, real acceptance."""
    from dflashpipe.decode.speculative import eos_ids_of
    from dflashpipe.export.write import load_drafter
    from dflashpipe.evaluate.run import encode_prompt
    from dflashpipe.inputs.data import read_prompts
    from dflashpipe.inputs.target import load_target
    from dflashpipe.inputs.turns import next_turns, turn_plan

    run = Path(a.run)
    summaries = sorted((run / "eval").glob("*.summary.json"))
    if a.dataset:
        summaries = [run / "eval" / f"{a.dataset}.summary.json"]
    if not summaries or not summaries[0].is_file():
        raise SystemExit(f"{run}: no evaluation summary (eval/*.summary.json): is it a finished pipeline run?")
    dataset = summaries[0].name.removesuffix(".summary.json")
    summary = json.loads(summaries[0].read_text())
    target_dir = a.target or str(run / "target" / "model")
    dtype = torch.bfloat16 if torch.device(a.device).type == "cuda" else torch.float32
    target, tok = load_target(target_dir, device=a.device, dtype=dtype)
    drafter, _ = load_drafter(run / "drafter", device=a.device, dtype=dtype)
    df = read_prompts(str(run / "prompts" / f"{dataset}.parquet"))
    kwargs = summary.get("chat_template_kwargs") or {}
    # a multi-turn prompt (MT-Bench) by its first user turn, as the rule `concurrency` reads it
    prompts = [encode_prompt(tok, next_turns(turns, turn_plan(turns, "all")[0], 0), kwargs)
               for turns in df["prompt"][: a.run_prompts]]
    context = int(getattr(target.config, "max_position_embeddings", 1 << 30))
    prompts = [p for p in prompts if len(p) + a.new + 2 * drafter.cfg.block_size <= context]
    return Case(f"run:{dataset}", target, drafter, prompts, eos_ids_of(tok, target), ["real"],
                {"run": str(run), "dataset": dataset, "target": target_dir, "distinct_prompts": len(prompts),
                 "block_size": drafter.cfg.block_size, "arch": drafter.cfg.arch,
                 "dtype": str(dtype).removeprefix("torch."),
                 "eval_batch1": {k: (summary.get("methods") or {}).get("dflash", {}).get(k)
                                 for k in ("tau_pooled", "speedup_vs_ar", "n_prompts")}})


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, section in out["modes"].items():
        rows = section["by_concurrency"]
        cs = [r["concurrency"] for r in rows]
        right.plot(cs, [r["ar"]["per_user_tok_s"] for r in rows], "k--", marker="o", label=f"{label}: AR")
        for name in [k for k in rows[0] if k.startswith("dflash")]:
            tag = f"{label}: {name.replace('dflash_forced_tau_', 'forced tau ')}"
            line = left.plot(cs, [r[name]["speedup_per_user"] for r in rows], marker="o", label=f"{tag}, per user")[0]
            left.plot(cs, [r[name]["speedup_total"] for r in rows], ls=":", marker="s", color=line.get_color(),
                      label=f"{tag}, total")
            right.plot(cs, [r[name]["per_user_tok_s"] for r in rows], marker="o", color=line.get_color(), label=tag)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("speed-up DFlash / AR")
    right.set_yscale("log")
    right.set_ylabel("tokens/s per user (decode)")
    fig.suptitle(f"DFlash vs AR under load ({out['device']}, greedy, {out['new_tokens']} new tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=["qwen3-8b", "tiny"], default=None,
                    help="random-weight target of these shapes (tiny: train_throughput.py's, for smoke runs)")
    ap.add_argument("--tiny", action="store_true", help="= --shapes tiny")
    ap.add_argument("--run", default=None, help="a finished pipeline run's results directory")
    ap.add_argument("--target", default=None, help="--run: the target directory (default: DIR/target/model)")
    ap.add_argument("--dataset", default=None, help="--run: the held-out dataset (default: the first evaluated)")
    ap.add_argument("--run-prompts", type=int, default=64,
                    help="--run: distinct prompts (cycled when fewer are needed)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--waves", type=int, default=2, help="prompts per row: waves x concurrency prompts per run")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument("--warmup-new", type=int, default=8, help="new tokens of the untimed warm-up run")
    ap.add_argument("--prompt-len", type=int, default=128, help="shapes mode: prompt tokens")
    ap.add_argument("--tau", default="3,6", help="shapes mode: forced mean acceptance lengths, or 'real' (comma list)")
    ap.add_argument("--layers", type=int, default=5, help="shapes mode: drafter layers")
    ap.add_argument("--arch", default="dflash", help="shapes mode: the drafter's architecture (the figures': dflash)")
    ap.add_argument("--block-size", type=int, default=16, help="shapes mode: drafter block size")
    ap.add_argument("--no-cuda-graphs", dest="graphs", action="store_false")
    ap.add_argument("--no-slot-decoder", dest="slot_decoder", action="store_false",
                    help="skip the expansion's batched AR decoder (reference)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    if a.tiny:
        a.shapes = "tiny"
    if not (a.shapes or a.run):
        ap.error("give --shapes qwen3-8b, --run DIR, or both")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else "cpu",
           "torch": torch.__version__, "new_tokens": a.new, "waves": a.waves, "cuda_graphs": a.graphs, "modes": {}}
    if torch.device(a.device).type == "cuda":  # as the evaluation: cuDNN attention plans each new shape (prefills)
        torch.backends.cuda.enable_cudnn_sdp(False)
    makers = ([shapes_case] if a.shapes else []) + ([run_case] if a.run else [])
    for make in makers:
        t0 = time.perf_counter()
        case = make(a)
        section = {"notes": case.notes, "by_concurrency": []}
        out["modes"][case.label] = section
        for c in a.concurrency:
            section["by_concurrency"].append(at_concurrency(case, c, a))
            print(json.dumps({case.label: section["by_concurrency"][-1]}), flush=True)
            (outdir / "concurrency.json").write_text(json.dumps(out, indent=1))  # a run cut short keeps these
        section["seconds"] = time.perf_counter() - t0
        del case
        free_memory(a.device)
    (outdir / "concurrency.json").write_text(json.dumps(out, indent=1))
    plot(out, outdir / "speedup_vs_concurrency.png")
    print(f"wrote {outdir / 'concurrency.json'} and {outdir / 'speedup_vs_concurrency.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
