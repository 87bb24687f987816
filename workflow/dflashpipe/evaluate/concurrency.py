"""The speed-up under load: AR and DFlash decoding an eval set's prompts many at a time.

The batch-1 evaluation (:mod:`.run`) says what one user gets. A server decodes many requests at once,
and a DFlash verify computes a block per request where AR computes one token, so the step turns
compute-bound sooner and the speed-up shrinks with the number of requests in flight. At each
concurrency ``c`` of ``evaluate.concurrency`` this decodes ``evaluate.concurrency_waves x c`` of the
set's prompts (cycled when the set has fewer) with greedy AR and DFlash in one continuous-batching
harness (:class:`~dflashpipe.decode.batched.BatchedDecoder`: the same target step code for both, CUDA
graphs on a GPU), after an untimed warm-up at that concurrency, and records:

* ``total_tok_s``: new tokens of every request over the run's wall time (prefills included);
* ``per_user_tok_s``: the mean over requests of its decode tokens over its decode time (the
  evaluation's convention: from its first token to its last);
* ``tau``: tokens per request and verify step that reach the output (DFlash);
* ``speedup_total`` and ``speedup_per_user``: DFlash over AR at the same concurrency;
* ``lossless_rows``: the requests whose DFlash output equals AR's token for token (greedy); and
  ``dflash_outputs``, each distinct prompt's DFlash output by its id.

The table's rows and the crossover: :mod:`.crossover` (no torch: the report job reads it too).

The crossover (:func:`.crossover.crossover`) is the first measured concurrency at which DFlash no longer beats AR.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.evaluate.crossover import crossover, crossover_line, table_rows
from dflashpipe.jobs.atomic import write_json
from dflashpipe.jobs.errors import UserError

#: ``evaluate.concurrency: auto`` by device type: a GPU serves many requests; the CPU demo measures a few
AUTO_LEVELS = {"cuda": (1, 4, 16, 64), "cpu": (1, 4)}
#: new tokens of the untimed warm-up run at each concurrency (captures the graphs, warms the allocator)
WARMUP_NEW_TOKENS = 8


@dataclass(frozen=True)
class ConcurrencyRun:
    """One set's measurement: the models, the prompts, the settings and the output."""

    target_dir: str
    drafter_dir: str
    prompts_parquet: str
    out_json: str
    levels: tuple[int, ...] | str  # or "auto" (:data:`AUTO_LEVELS`)
    waves: int
    settings: object  # EvalSettings: max_new_tokens, num_prompts, chat_template_kwargs (greedy always)
    device: str = "cpu"
    draft_vocab_json: str | None = None  # rule draft_vocab's ids (evaluate.draft_vocab > 0): DFlash drafts among them


def summarise(run) -> dict:
    """A :class:`~dflashpipe.decode.batched.BatchRun`'s figures."""
    timed = [r for r in run.results if r.decode_s > 0]
    raw = [c for r in run.results if r.accepted for c in r.committed_raw]  # a + 1 per step, before the length cut
    return {
        "requests": len(run.results),
        "new_tokens": run.new_tokens,
        "wall_s": run.wall_s,
        "total_tok_s": run.tokens_per_second,
        "per_user_tok_s": sum(r.decode_tokens / r.decode_s for r in timed) / max(1, len(timed)),
        # a request's new tokens over its admission to its last token (its wait for a free row excluded)
        "per_user_e2e_tok_s": sum(r.new_tokens / (r.prefill_s + r.decode_s) for r in timed) / max(1, len(timed)),
        "tau": run.tau if run.tau == run.tau else None,
        "tau_uncut": sum(raw) / len(raw) if raw else None,
        "steps": run.steps,
        "mean_busy_rows": sum(run.busy_rows) / max(1, len(run.busy_rows)),
    }


def resolve_levels(levels, device: str) -> tuple[int, ...]:
    """The concurrencies to measure: ``levels`` as given, or ``auto``'s for the device type, ascending."""
    import torch

    if levels == "auto":
        levels = AUTO_LEVELS["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return tuple(sorted(int(c) for c in levels))


def measure_concurrency(run: ConcurrencyRun, log=print) -> dict:
    """Decode at each concurrency, AR then DFlash; write the JSON atomically and return it."""
    import torch

    from dflashpipe.decode.batched import BatchedDecoder, BatchSettings
    from dflashpipe.decode.cuda_graph import round_capacity
    from dflashpipe.decode.slots import unsupported_reason
    from dflashpipe.decode.speculative import eos_ids_of
    from dflashpipe.export.write import load_drafter
    from dflashpipe.inputs.target import load_target

    from .run import read_eval_prompts, use_draft_vocab

    s = run.settings
    if s.temperature != 0:
        raise UserError(f"evaluate.concurrency: measured greedy only (evaluate.temperature is {s.temperature}); "
                        "set evaluate.concurrency: [] to skip it")
    dev = torch.device(run.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, tok = load_target(run.target_dir, device=str(dev), dtype=dtype)
    drafter, dcfg = load_drafter(run.drafter_dir, device=dev, dtype=dtype)
    vocab = use_draft_vocab(drafter, target, run.draft_vocab_json, log)
    levels = resolve_levels(run.levels, run.device)
    out = {"dataset": Path(run.prompts_parquet).name.removesuffix(".parquet"), "levels": list(levels), "draft_vocab": vocab,
           "waves": run.waves, "max_new_tokens": s.max_new_tokens, "device": str(dev),
           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "rows": []}
    why = unsupported_reason(target)
    if why:  # the batched harness writes each layer out; a target it cannot run is recorded, not failed
        out["skipped"] = f"the batched harness cannot run this target: {why}"
        log(f"concurrency: skipped ({out['skipped']})")
        write_json(run.out_json, out)
        return out
    ids, prompts, _ = read_eval_prompts(run.prompts_parquet, tok, target, dcfg.block_size, s, log)
    eos = eos_ids_of(tok, target)
    graphs = None if dev.type == "cuda" else False
    for c in levels:
        batch = [prompts[i % len(prompts)] for i in range(run.waves * c)]
        capacity = round_capacity(max(len(p) for p in batch) + s.max_new_tokens + 2 * dcfg.block_size, 64)
        row = {"concurrency": c, "distinct_prompts": min(len(prompts), len(batch))}
        tokens = {}
        for name, model in (("ar", None), ("dflash", drafter)):
            settings = BatchSettings(slots=c, max_new_tokens=s.max_new_tokens, capacity=capacity, cuda_graphs=graphs)
            dec = BatchedDecoder(target, settings, eos, model)
            t0 = time.perf_counter()
            dec.generate(batch[:c], max_new_tokens=min(WARMUP_NEW_TOKENS, s.max_new_tokens))  # untimed
            warm = time.perf_counter() - t0
            result = dec.generate(batch)
            row[name] = {**summarise(result), "warmup_s": warm, "mode": dec.mode}
            tokens[name] = [r.tokens for r in result.results]
            del dec
        ar, df = row["ar"], row["dflash"]
        row["speedup_total"] = df["total_tok_s"] / ar["total_tok_s"]
        row["speedup_per_user"] = df["per_user_tok_s"] / ar["per_user_tok_s"]
        row["lossless_rows"] = sum(a == b for a, b in zip(tokens["ar"], tokens["dflash"]))
        # DFlash's output of each distinct prompt, by the prompt's id: what a test compares with batch-1 decoding
        row["dflash_outputs"] = {ids[i]: tokens["dflash"][i] for i in range(min(len(ids), len(batch)))}
        out["rows"].append(row)
        log(f"concurrency {c}: {len(batch)} requests, AR {ar['total_tok_s']:.0f} tok/s, DFlash {df['total_tok_s']:.0f} "
            f"tok/s ({row['speedup_total']:.2f}x total, {row['speedup_per_user']:.2f}x per user, tau {df['tau']:.2f}), "
            f"{row['lossless_rows']}/{len(batch)} outputs equal AR's")
    flat = table_rows(out)
    out["crossover_total"] = crossover(flat, "speedup_total")
    out["crossover_per_user"] = crossover(flat, "speedup_per_user")
    log(crossover_line(out["dataset"], flat))
    write_json(run.out_json, out)
    return out
