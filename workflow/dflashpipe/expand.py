"""Dataset expansion: the target regenerates every training response.

DFlash (like EAGLE) trains on the target's own outputs, so the drafter learns
what the target would actually say. Prompts are processed in chunks of
``chunk_size`` rows; each finished chunk is written atomically under a work
directory next to the output, together with a ``settings.json`` describing
everything that determines the generations. A killed job resumes from the
chunks already written; a change of settings (target, prompts, sampling)
discards them. The work directory is removed once the output is complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from dflashpipe.atomic import atomic_path, write_json
from dflashpipe.data import read_parquet, screen_prompt, target_context
from dflashpipe.errors import UserError


@dataclass
class ExpandSettings:
    max_new_tokens: int = 320
    batch_size: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    num_samples: int = 1  # samples per prompt (needs temperature > 0 when > 1)
    chunk_size: int = 512
    seed: int = 0
    chat_template_kwargs: dict = field(default_factory=dict)

    def check(self, where: str = "expand") -> None:
        if self.num_samples > 1 and self.temperature == 0:
            raise UserError(f"{where}.num_samples is {self.num_samples} but temperature is 0: greedy samples are identical; set temperature > 0 or num_samples: 1")


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def shard_rows(df: pd.DataFrame, shard: int, n_shards: int) -> pd.DataFrame:
    """Deterministic, disjoint shard of the prompts: every n_shards-th row."""
    return df.iloc[shard::n_shards].reset_index(drop=True)


def _generate_chunk(model, tokenizer, rows: pd.DataFrame, s: ExpandSettings, chunk_seed: int, device: str,
                    progress=lambda prompts, tokens: None) -> tuple[list[dict], int]:
    """Generate responses for one chunk of prompts, batched with a KV cache; ``progress(prompts, tokens)`` per batch."""
    texts = [
        tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True, **s.chat_template_kwargs)
        for p in rows["prompt"]
    ]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    context = target_context(model)
    skip = [screen_prompt(p, n, context, s.max_new_tokens) for p, n in zip(rows["prompt"], lengths)]
    # a skipped prompt stays in the table, with its reason as finish_reason: tokenize counts it
    out = [
        {"id": rows["id"].iloc[i], "sample": j, "messages": [dict(t) for t in rows["prompt"].iloc[i]]
         + [{"role": "assistant", "content": ""}], "response": "", "num_prompt_tokens": lengths[i],
         "num_new_tokens": 0, "finish_reason": reason}
        for i, reason in enumerate(skip) if reason for j in range(s.num_samples)
    ]
    progress(sum(r is not None for r in skip), 0)
    order = sorted((i for i in range(len(texts)) if not skip[i]), key=lambda i: lengths[i])  # less padding per batch
    # every end token the target stops at (tokenizer and generation config): a reply ended by any
    # of them is finished, not cut at the length limit
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = {tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])} - {None}
    new_tokens = 0
    for start in range(0, len(order), s.batch_size):
        idx = order[start : start + s.batch_size]
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        kwargs = dict(max_new_tokens=s.max_new_tokens, pad_token_id=tokenizer.pad_token_id, num_return_sequences=s.num_samples)
        if s.temperature > 0:
            torch.manual_seed(chunk_seed + start)
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.no_grad():
            gen = model.generate(**enc, **kwargs)
        gen = gen[:, enc["input_ids"].shape[1] :].cpu()
        tokens_before = new_tokens
        for j, ids in enumerate(gen):
            i = idx[j // s.num_samples]
            ids = ids.tolist()
            stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
            kept = ids if stop is None else ids[:stop]
            kept = [t for t in kept if t != tokenizer.pad_token_id]
            new_tokens += len(kept) + (stop is not None)
            response = tokenizer.decode(kept, skip_special_tokens=True)
            prompt = [dict(t) for t in rows["prompt"].iloc[i]]
            out.append(
                {
                    "id": rows["id"].iloc[i],
                    "sample": j % s.num_samples,
                    "messages": prompt + [{"role": "assistant", "content": response}],
                    "response": response,
                    "num_prompt_tokens": lengths[i],
                    "num_new_tokens": len(kept),
                    "finish_reason": "stop" if stop is not None else "length",
                }
            )
        progress(len(idx), new_tokens - tokens_before)
    return out, new_tokens


def expand_prompts(
    prompts_path: str,
    target_path: str,
    settings: ExpandSettings,
    out_path: str,
    shard: int = 0,
    n_shards: int = 1,
    device: str = "cpu",
    log=print,
) -> dict:
    """Regenerate the responses of one shard of a prompts file; write parquet atomically."""
    from tqdm import tqdm

    from dflashpipe.data import read_prompts
    from dflashpipe.target import load_target, target_fingerprint

    settings.check()
    prompts = shard_rows(read_prompts(prompts_path), shard, n_shards)
    identity = {
        "settings": asdict(settings),
        "target_fingerprint": target_fingerprint(target_path),
        "prompts_digest": _file_digest(prompts_path),
        "shard": shard,
        "n_shards": n_shards,
    }
    work = Path(str(out_path) + ".chunks")
    settings_file = work / "settings.json"
    if work.exists() and (not settings_file.exists() or json.loads(settings_file.read_text()) != json.loads(json.dumps(identity))):
        log(f"settings changed since the chunks in {work} were written: discarding them")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    write_json(settings_file, identity)

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tokenizer = load_target(target_path, device=device, dtype=dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    n_chunks = (len(prompts) + settings.chunk_size - 1) // settings.chunk_size
    for c in range(n_chunks):  # a damaged chunk (e.g. a disk fault) is made again, not read
        chunk_file = work / f"chunk_{c:05d}.parquet"
        if chunk_file.exists():
            try:
                pd.read_parquet(chunk_file)
            except Exception as err:  # noqa: BLE001
                log(f"WARNING: {chunk_file} cannot be read ({str(err).splitlines()[0][:120]}); generating it again")
                chunk_file.unlink()
    done = sum((work / f"chunk_{c:05d}.parquet").exists() for c in range(n_chunks))
    if done:
        log(f"resuming: {done} of {n_chunks} chunks already written")
    t0, gen_tokens = time.time(), 0
    todo = [c for c in range(n_chunks) if not (work / f"chunk_{c:05d}.parquet").exists()]
    bar = tqdm(total=sum(len(prompts.iloc[c * settings.chunk_size : (c + 1) * settings.chunk_size]) for c in todo),
               desc=f"expand shard {shard} (prompts)", mininterval=5)

    def progress(n_prompts: int, n_tokens: int) -> None:  # per generate batch: prompts done, tokens/s
        nonlocal gen_tokens
        gen_tokens += n_tokens
        bar.update(n_prompts)
        bar.set_postfix(tok_s=f"{gen_tokens / max(1e-9, time.time() - t0):.0f}", refresh=False)

    for c in todo:
        chunk_file = work / f"chunk_{c:05d}.parquet"
        rows = prompts.iloc[c * settings.chunk_size : (c + 1) * settings.chunk_size]
        tc = time.time()
        records, n_new = _generate_chunk(model, tokenizer, rows, settings, settings.seed * 1_000_003 + shard * 10_007 + c,
                                         device, progress)
        with atomic_path(chunk_file) as tmp:
            pd.DataFrame(records).to_parquet(tmp, index=False)
        log(f"chunk {c + 1}/{n_chunks}: {len(records)} responses, {n_new} tokens, {n_new / (time.time() - tc):.0f} tok/s")
    bar.close()

    df = pd.concat([pd.read_parquet(work / f"chunk_{c:05d}.parquet") for c in range(n_chunks)], ignore_index=True)
    for key in ("temperature", "top_p", "max_new_tokens", "seed"):
        df[key] = getattr(settings, key)
    df["target"] = identity["target_fingerprint"]
    df["target_path"] = str(target_path)
    with atomic_path(out_path) as tmp:
        df.to_parquet(tmp, index=False)
    shutil.rmtree(work)
    seconds = time.time() - t0
    summary = {
        "rows": len(df),
        "generated_tokens_this_run": gen_tokens,
        "seconds": seconds,
        "tokens_per_second": gen_tokens / seconds if seconds > 0 else None,
        "finish_reason": df["finish_reason"].value_counts().to_dict() if len(df) else {},
        "mean_new_tokens": float(df["num_new_tokens"].mean()) if len(df) else 0.0,
    }
    log(f"expansion done: {summary}")
    return summary


def merge_shards(shard_paths: list[str], out_path: str) -> int:
    """Concatenate expanded shards into one parquet file (atomically)."""
    df = pd.concat([read_parquet(p) for p in shard_paths], ignore_index=True)
    with atomic_path(out_path) as tmp:
        df.to_parquet(tmp, index=False)
    return len(df)
