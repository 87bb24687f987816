"""Dataset expansion: the target regenerates every training response.

DFlash (like EAGLE) trains on the target's own outputs, so the drafter learns
what the target would actually say. Prompts are processed in chunks of
``chunk_size`` rows; each finished chunk is written atomically under a work
directory next to the output, together with a ``settings.json`` describing
everything that determines the generations. A killed job resumes from the
chunks already written; a change of settings (target, prompts, sampling)
discards them. The work directory is removed once the output is complete.

Backends (``expand.backend``): ``embedded`` generates in this process with
transformers ``generate`` (:func:`_generate_chunk`); ``batched`` in this process
with continuous batching over a static KV cache and a CUDA-graph decode step
(:mod:`dflashpipe.decode.slots`); ``auto`` is ``batched`` on a GPU where the
target's layout allows it, else ``embedded``; ``openai`` sends the prompts
to an OpenAI-compatible server the user runs (:mod:`dflashpipe.stages.expand_openai`).
Each backend is opened once per job by a function in :data:`BACKENDS` and
returns a ``generate(rows, chunk_seed, progress, num_samples=None) -> (records,
new_tokens)`` callable; the records have the same columns whatever the backend,
among them ``token_ids``: the ids the target generated for the reply (null when a
server does not return them).

A multi-turn chat is regenerated turn by turn (``expand.turns: all``,
:func:`turn_by_turn`, around every backend's ``generate``): the target answers the
first user turn, its reply is the context of the second, and so on, so every
assistant turn of the row is the target's; ``turns: last`` answers the last user
turn only, the corpus's earlier replies staying in the context.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch

from dflashpipe.decode.cuda_graph import round_capacity
from dflashpipe.inputs.data import screen_prompt, target_context
from dflashpipe.inputs.target import describe_neutralised, end_token_ids, generation_arguments, prompt_text
from dflashpipe.inputs.turns import next_turns, turn_plan
from dflashpipe.jobs.atomic import atomic_path, write_json
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.settings import on_server, schema_enum, schema_settings
from dflashpipe.stages.expand_openai import ServerSettings


@schema_settings("expand")
class ExpandSettings:
    """The ``expand`` section (and the expansion seed). Defaults: the schema's."""

    JOB_KEYS = ("shards", "threads", "server")  # the rule's jobs and threads; server: ServerSettings

    max_new_tokens: int
    batch_size: int
    temperature: float  # 0 = greedy
    top_p: float
    num_samples: int  # samples per prompt (needs temperature > 0 when > 1)
    chunk_size: int
    seed: int
    chat_template_kwargs: dict
    backend: str  # auto | embedded | batched | openai (see BACKENDS)
    decode_step: str  # batched backend: auto (compiled on a GPU) | compiled | static (see DECODE_STEPS)
    turns: str  # all: every assistant turn of a multi-turn chat, turn by turn | last: the last reply only

    def check(self, where: str = "expand") -> None:
        if self.backend not in BACKENDS:
            raise UserError(f"{where}.backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.decode_step not in DECODE_STEPS:
            raise UserError(f"{where}.decode_step: {self.decode_step!r} is not one of {', '.join(DECODE_STEPS)}")
        if self.turns not in TURNS:
            raise UserError(f"{where}.turns: {self.turns!r} is not one of {', '.join(TURNS)}")
        if self.num_samples > 1 and self.temperature == 0:
            raise UserError(f"{where}.num_samples is {self.num_samples} but temperature is 0: greedy samples are identical; set temperature > 0 or num_samples: 1")


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def shard_rows(df: pd.DataFrame, shard: int, n_shards: int) -> pd.DataFrame:
    """Deterministic, disjoint shard of the prompts: every n_shards-th row."""
    return df.iloc[shard::n_shards].reset_index(drop=True)


def _generate_chunk(model, tokenizer, rows: pd.DataFrame, s: ExpandSettings, chunk_seed: int, device: str,
                    progress=lambda prompts, tokens: None, num_samples: int | None = None) -> tuple[list[dict], int]:
    """Generate responses for one chunk of prompts, batched with a KV cache; ``progress(prompts, tokens)`` per batch;
    ``num_samples`` replies per prompt (None: ``s.num_samples``)."""
    n_samples = num_samples or s.num_samples
    texts = [prompt_text(tokenizer, p, s.chat_template_kwargs) for p in rows["prompt"]]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    context = target_context(model)
    skip = [screen_prompt(p, n, context, s.max_new_tokens) for p, n in zip(rows["prompt"], lengths)]
    # a skipped prompt stays in the table, with its reason as finish_reason: tokenize counts it
    out = [
        {"id": rows["id"].iloc[i], "sample": j, "messages": [dict(t) for t in rows["prompt"].iloc[i]]
         + [{"role": "assistant", "content": ""}], "response": "", "num_prompt_tokens": lengths[i],
         "num_new_tokens": 0, "finish_reason": reason, "token_ids": []}
        for i, reason in enumerate(skip) if reason for j in range(n_samples)
    ]
    progress(sum(r is not None for r in skip), 0)
    order = sorted((i for i in range(len(texts)) if not skip[i]), key=lambda i: lengths[i])  # less padding per batch
    eos_ids = set(end_token_ids(tokenizer, getattr(model, "generation_config", None)))
    new_tokens = 0
    for start in range(0, len(order), s.batch_size):
        idx = order[start : start + s.batch_size]
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        kwargs, _ = generation_arguments(getattr(model, "generation_config", None), s.max_new_tokens, s.temperature,
                                         s.top_p, sorted(eos_ids), tokenizer.pad_token_id)
        kwargs["num_return_sequences"] = n_samples
        if s.temperature > 0:
            torch.manual_seed(chunk_seed + start)
        with torch.no_grad():
            gen = model.generate(**enc, **kwargs)
        gen = gen[:, enc["input_ids"].shape[1] :].cpu()
        tokens_before = new_tokens
        for j, ids in enumerate(gen):
            i = idx[j // n_samples]
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
                    "sample": j % n_samples,
                    "messages": prompt + [{"role": "assistant", "content": response}],
                    "response": response,
                    "num_prompt_tokens": lengths[i],
                    "num_new_tokens": len(kept),
                    "finish_reason": "stop" if stop is not None else "length",
                    "token_ids": kept,
                }
            )
        progress(len(idx), new_tokens - tokens_before)
    return out, new_tokens


def _log_neutralised(generation_config, s: ExpandSettings, log) -> None:
    """Name, once per job, the target's generation settings that regeneration does not apply."""
    line = describe_neutralised(generation_arguments(generation_config, s.max_new_tokens, s.temperature, s.top_p)[1])
    if line:
        log(line)


def _open_embedded(target_path: str, s: ExpandSettings, device: str, server: ServerSettings, log):
    """The target in this process: batched ``generate`` with a KV cache (:func:`_generate_chunk`)."""
    from dflashpipe.inputs.target import load_target

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tokenizer = load_target(target_path, device=device, dtype=dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    _log_neutralised(getattr(model, "generation_config", None), s, log)

    def generate(rows, chunk_seed, progress, num_samples=None):
        return _generate_chunk(model, tokenizer, rows, s, chunk_seed, device, progress, num_samples)

    return generate


def _chunk_prompts(tokenizer, rows: pd.DataFrame, s: ExpandSettings, context: int):
    """Chat-templated prompt ids of a chunk's rows and the reason each is skipped (None: generate it)."""
    ids = [prompt_text(tokenizer, p, s.chat_template_kwargs) for p in rows["prompt"]]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ids]
    return ids, [screen_prompt(p, len(i), context, s.max_new_tokens) for p, i in zip(rows["prompt"], ids)]


def _open_batched(target_path: str, s: ExpandSettings, device: str, server: ServerSettings, log):
    """The target in this process, continuous batching over a static KV cache (:mod:`dflashpipe.decode.slots`)."""
    from dflashpipe.decode.slots import SlotDecoder, kv_bytes_per_token, unsupported_reason
    from dflashpipe.inputs.target import load_target

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model, tokenizer = load_target(target_path, device=device, dtype=dtype)
    why = unsupported_reason(model)
    if why:
        raise UserError(f"expand.backend: batched cannot run {target_path}: {why}; use backend: embedded (or auto)")
    end_ids, context = set(end_token_ids(tokenizer, getattr(model, "generation_config", None))), target_context(model)
    _log_neutralised(getattr(model, "generation_config", None), s, log)  # the slot decoder applies none of them
    compile_step = s.decode_step == "compiled" or (s.decode_step == "auto" and device.startswith("cuda"))
    decoder = None

    def generate(rows, chunk_seed, progress, num_samples=None):
        nonlocal decoder
        n_samples = num_samples or s.num_samples
        ids, skip = _chunk_prompts(tokenizer, rows, s, context)
        progress(sum(r is not None for r in skip), 0)
        todo = [i for i, r in enumerate(skip) if not r]
        # shortest prompts first, as the embedded backend: prefill groups with little padding
        requests = [i for i in sorted(todo, key=lambda i: len(ids[i])) for _ in range(n_samples)]
        finished = 0

        def request_done(n: int, tokens: int) -> None:  # progress counts prompts: a prompt is done with its last sample
            nonlocal finished
            before, finished = finished // n_samples, finished + n
            progress(finished // n_samples - before, tokens)

        results = []
        for group in length_groups([len(ids[i]) + s.max_new_tokens for i in requests]):
            # every row of a cache is as long as its longest request: a long prompt gets a cache of its own
            # (fewer rows where memory is short) instead of sizing every row of the shard for itself
            need_min, need_max = group[0][1], group[-1][1]
            if decoder is None or not need_max <= decoder.capacity <= round_capacity(2 * need_min):
                capacity = round_capacity(need_max)
                slots = s.batch_size
                decoder = None  # the old cache is given back before the new one is sized
                if device.startswith("cuda"):  # the cache may take 85% of what is free
                    gc.collect()
                    torch.cuda.empty_cache()
                    free = torch.cuda.mem_get_info(torch.device(device))[0]
                    slots = max(1, min(slots, int(0.85 * free) // (capacity * kv_bytes_per_token(model))))
                decoder = SlotDecoder(model, slots, capacity, compile=compile_step)
                log(f"batched decoding: {slots} rows x {capacity} positions of KV cache ({decoder.mode})")
            results += decoder.generate([ids[requests[k]] for k, _ in group], s.max_new_tokens, end_ids, s.temperature,
                                        s.top_p, chunk_seed + group[0][0], request_done)
        out, new_tokens, sample = [], 0, {}
        for i, reason in enumerate(skip):
            if reason:
                out += [_record(rows, i, j, len(ids[i]), "", [], reason) for j in range(n_samples)]
        for i, (gen, finish) in zip(requests, results):
            kept = gen[:-1] if finish == "stop" else gen
            j = sample[i] = sample.get(i, -1) + 1
            new_tokens += len(gen)
            out.append(_record(rows, i, j, len(ids[i]), tokenizer.decode(kept, skip_special_tokens=True), kept, finish))
        return out, new_tokens

    return generate


#: the columns of an expanded reply, whatever the backend (an empty shard writes them too); ``turns``,
#: ``user_turns`` and ``unanswered``: :func:`turn_by_turn`
RECORD_COLUMNS = ["id", "sample", "messages", "response", "num_prompt_tokens", "num_new_tokens", "finish_reason",
                  "token_ids", "turns", "user_turns", "unanswered"]

#: expand.turns: all (every user turn of a chat answered, turn by turn) | last (the last one only)
TURNS = schema_enum("expand.turns")

#: added to a chunk's seed per round of :func:`turn_by_turn` (round 0 draws as a single-turn expansion does)
ROUND_SEED_STEP = 7_919


def _turn(record: dict) -> dict:
    """One regenerated assistant turn: its index in ``messages`` and what generating it gave."""
    return {"message": len(record["messages"]) - 1, "finish_reason": record["finish_reason"],
            "num_prompt_tokens": record["num_prompt_tokens"], "num_new_tokens": record["num_new_tokens"],
            "token_ids": record["token_ids"]}


def _answer(chain: dict, record: dict, more: bool) -> bool:
    """Add the reply ``record`` to ``chain`` (one sample of one row); whether the chain goes on to its next user
    turn (``more``: the row has one). A chain stops at a skipped context (too long for the target) and at an empty
    reply (after the first turn: left out); ``unanswered`` says why. A reply cut at the length limit goes on, as
    the target wrote it (tokenize takes its unmade end of turn out of the loss)."""
    reason, empty = record["finish_reason"], not str(record["response"]).strip()
    first = not chain["turns"]
    if reason.startswith("skipped_") or (empty and not first):
        chain["unanswered"] = reason if reason.startswith("skipped_") else "empty_reply"
        if first:  # the row's record says why it was skipped, as a single-turn expansion does
            chain["last"] = record
        return False
    chain["last"] = record
    chain["turns"].append(_turn(record))
    if more and empty:
        chain["unanswered"] = "empty_reply"
        return False
    return more


def turn_by_turn(generate, s: ExpandSettings):
    """A backend's ``generate`` that answers the user turns of each row in turn (:func:`~dflashpipe.inputs.turns.turn_plan`).

    Round k generates the reply to user turn k of every row that has one, in the context of the target's own
    earlier replies; after round 0 (``num_samples`` replies per row, as a single-turn expansion) each sample
    goes on as its own chain. A record's ``turns`` lists the target's replies (index in ``messages``, finish
    reason, token ids); its reply columns are those of the last; ``user_turns`` counts the row's user turns
    and ``unanswered`` says why some have no reply of the target (None: all have)."""

    def run(rows, chunk_seed, progress):
        prompts, ids = list(rows["prompt"]), list(rows["id"])
        plans = [turn_plan(p, s.turns) for p in prompts]
        single = all(len(points) == 1 for points, _, _ in plans)

        def quiet(n_prompts: int, tokens: int) -> None:  # a row is counted once all its turns are answered
            progress(0, tokens)

        first = pd.DataFrame({"id": ids, "prompt": [next_turns(p, plan[0], 0) for p, plan in zip(prompts, plans)]})
        records, new_tokens = generate(first, chunk_seed, progress if single else quiet)
        row_of = {rid: i for i, rid in enumerate(ids)}
        chains, live = [], []
        for r in records:
            i = row_of[r["id"]]
            chain = {"row": i, "sample": r["sample"], "last": r, "turns": [], "unanswered": plans[i][2]}
            chains.append(chain)
            if _answer(chain, r, len(plans[i][0]) > 1):
                live.append(chain)
        open_rows = {}  # row -> its chains still going
        for c in live:
            open_rows[c["row"]] = open_rows.get(c["row"], 0) + 1
        if not single:
            progress(len(rows) - len(open_rows), 0)
        k = 1
        while live:
            batch = pd.DataFrame({"id": range(len(live)), "prompt": [
                [dict(t) for t in c["last"]["messages"]] + next_turns(prompts[c["row"]], plans[c["row"]][0], k)
                for c in live]})
            records, n_new = generate(batch, chunk_seed + k * ROUND_SEED_STEP, quiet, num_samples=1)
            new_tokens += n_new
            going, finished = [], 0
            for r in records:
                chain = live[r["id"]]
                if _answer(chain, r, k + 1 < len(plans[chain["row"]][0])):
                    going.append(chain)
                else:
                    open_rows[chain["row"]] -= 1
                    finished += open_rows[chain["row"]] == 0
            progress(finished, 0)
            live, k = going, k + 1
        out = []
        for c in chains:
            i = c["row"]
            out.append({**c["last"], "id": ids[i], "sample": c["sample"], "turns": c["turns"],
                        "user_turns": plans[i][1], "unanswered": c["unanswered"]})
        return out, new_tokens

    return run


def turn_counts(df: pd.DataFrame) -> dict:
    """The assistant turns of an expansion: regenerated, and the user turns left without a reply of the
    target, by reason (``unanswered``: turns_last, tool_turns, a skip reason, empty_reply)."""
    regenerated, unanswered = 0, {}
    for turns, user_turns, reason in zip(df["turns"], df["user_turns"], df["unanswered"]):
        regenerated += len(turns)
        if isinstance(reason, str) and user_turns > len(turns):
            unanswered[reason] = unanswered.get(reason, 0) + int(user_turns - len(turns))
    return {"regenerated": regenerated, "unanswered": unanswered}


def length_groups(needs: list[int]) -> list[list[tuple[int, int]]]:
    """Consecutive runs of ``needs`` (ascending: cache positions each request needs) that one KV cache
    serves without any row's capacity exceeding twice its request's need (or 256): ``[(index, need), ...]``
    per group. A typical chunk is one group; an over-long prompt starts a group of its own."""
    groups: list[list[tuple[int, int]]] = []
    for k, need in enumerate(needs):
        if groups and round_capacity(need) <= round_capacity(2 * groups[-1][0][1]):
            groups[-1].append((k, need))
        else:
            groups.append([(k, need)])
    return groups


def _record(rows: pd.DataFrame, i: int, sample: int, prompt_tokens: int, response: str, token_ids: list[int],
            finish_reason: str) -> dict:
    """One expanded reply (the columns every backend writes)."""
    return {"id": rows["id"].iloc[i], "sample": sample,
            "messages": [dict(t) for t in rows["prompt"].iloc[i]] + [{"role": "assistant", "content": response}],
            "response": response, "num_prompt_tokens": prompt_tokens, "num_new_tokens": len(token_ids),
            "finish_reason": finish_reason, "token_ids": token_ids}


def _auto_backend(target_path: str, device: str) -> tuple[str, str | None]:
    """What ``auto`` runs: ``batched`` on a GPU when the target's layout allows it, else ``embedded`` (and why not)."""
    from transformers import AutoConfig

    from dflashpipe.decode.slots import unsupported_reason

    why = unsupported_reason(type("M", (), {"config": AutoConfig.from_pretrained(target_path)})())
    return ("batched" if device.startswith("cuda") and not why else "embedded"), why


def _open_auto(target_path: str, s: ExpandSettings, device: str, server: ServerSettings, log):
    """``batched`` on a GPU when the target's layout allows it, else ``embedded``."""
    chosen, why = _auto_backend(target_path, device)
    log(f"expand.backend auto: {chosen}" + (f" ({why})" if why and device.startswith("cuda") else ""))
    return BACKENDS[chosen](target_path, s, device, server, log)


def decoder_identity(target_path: str, s: ExpandSettings, device: str) -> dict:
    """What decodes the replies, as it will run: the backend ``auto`` resolves to, the device type, the
    weights' dtype and the batched decode step (part of the chunks' identity: a chunk decoded by
    another backend, dtype or device is not resumed into the same output)."""
    backend = _auto_backend(target_path, device)[0] if s.backend == "auto" else s.backend
    if on_server(backend):  # the server's own engine and dtype (expand.server is operational)
        return {"backend": backend}
    on_gpu = device.startswith("cuda")
    out = {"backend": backend, "device": "cuda" if on_gpu else device.split(":")[0],
           "dtype": "bfloat16" if on_gpu else "float32"}
    if backend == "batched":
        out["decode_step"] = "compiled" if s.decode_step == "compiled" or (s.decode_step == "auto" and on_gpu) else "static"
    return out


def decoding_code_digest() -> str:
    """What the library code an expansion runs (this module and what it imports, transitively) means: a
    decoder fix discards the finished chunks instead of mixing old and new replies in one output; a comment,
    a log message or a module's move keeps them (:func:`dflashpipe.jobs.codedeps.meaning_digest`)."""
    from dflashpipe.jobs.codedeps import meaning_digest, module_closure

    package = Path(__file__).resolve().parents[1]
    return meaning_digest(module_closure(package, [__name__]), package)


def _open_openai(target_path: str, s: ExpandSettings, device: str, server: ServerSettings, log):
    """The target behind an OpenAI-compatible server (``expand.server``); only its tokenizer is loaded here."""
    from types import SimpleNamespace

    from transformers import AutoConfig, GenerationConfig

    from dflashpipe.inputs.target import load_tokenizer
    from dflashpipe.stages.expand_openai import OpenAIBackend

    tokenizer = load_tokenizer(target_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model_config = AutoConfig.from_pretrained(target_path)
    try:
        gen_config = GenerationConfig.from_pretrained(target_path)
    except OSError:  # no generation_config.json: what transformers derives from config.json, as for the model
        gen_config = GenerationConfig.from_model_config(model_config)
    _log_neutralised(gen_config, s, log)
    context = target_context(SimpleNamespace(config=model_config))
    backend = OpenAIBackend(server, tokenizer, target_path, s, set(end_token_ids(tokenizer, gen_config)), log=log)
    warned = False

    def generate(rows, chunk_seed, progress, num_samples=None):
        nonlocal warned
        n_samples = num_samples or s.num_samples
        texts = [prompt_text(tokenizer, p, s.chat_template_kwargs) for p in rows["prompt"]]
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        skip = [screen_prompt(p, n, context, s.max_new_tokens) for p, n in zip(rows["prompt"], lengths)]
        progress(sum(r is not None for r in skip), 0)
        done = backend.generate_chunk(rows, lengths, [i for i, r in enumerate(skip) if not r], chunk_seed, progress,
                                      n_samples)
        out, new_tokens = [], 0
        for i, reason in enumerate(skip):  # the row order of the embedded backend does not matter; this one is fixed
            prompt = [dict(t) for t in rows["prompt"].iloc[i]]
            for j in range(n_samples):
                rec = ({"response": "", "num_new_tokens": 0, "finish_reason": reason, "token_ids": []} if reason
                       else done[(i, j)])
                new_tokens += rec["num_new_tokens"] + (rec["finish_reason"] == "stop")
                out.append({"id": rows["id"].iloc[i], "sample": j,
                            "messages": prompt + [{"role": "assistant", "content": rec["response"]}],
                            "response": rec["response"], "num_prompt_tokens": lengths[i],
                            "num_new_tokens": rec["num_new_tokens"], "finish_reason": rec["finish_reason"],
                            "token_ids": rec["token_ids"]})
        if backend.ids_missing and not warned:
            warned = True
            log("the server returns no generated token ids: token_ids is null for its replies "
                "(tokenize re-tokenizes their text; tokenized/stats.json counts them)")
        return out, new_tokens

    return generate


#: the batched backend's decode step. compiled: Inductor fuses each layer's small ops before the CUDA-graph
#: capture: shorter steps for a compile per shape (figures: docs/decoding.md). static: captured as is.
#: auto: compiled on a GPU
DECODE_STEPS = schema_enum("expand.decode_step")

# expand.backend (each value of the schema's enum: tests/test_schema_enums.py)
#   -> opener(target_path, settings, device, server, log) -> generate(rows, chunk_seed, progress)
BACKENDS = {"auto": _open_auto, "embedded": _open_embedded, "batched": _open_batched, "openai": _open_openai}


def check_chat_template(prompts: pd.DataFrame, target_path: str, s: ExpandSettings, source: str) -> None:
    """Every prompt rendered by the target's chat template before any is generated: a template that refuses
    one (:func:`dflashpipe.inputs.target.prompt_text`) stops the job in seconds, not in its last chunk."""
    from dflashpipe.inputs.target import load_tokenizer, prompt_text

    if prompts.empty:
        return
    tokenizer = load_tokenizer(target_path)
    for rid, turns in zip(prompts["id"], prompts["prompt"]):
        prompt_text(tokenizer, turns, s.chat_template_kwargs, f"{source} row id {rid!r}")


# reason: the job's own keywords (shard, device, log, server) beside the four that say what to expand
def expand_prompts(
    prompts_path: str,
    target_path: str,
    settings: ExpandSettings,
    out_path: str,
    shard: int = 0,
    n_shards: int = 1,
    device: str = "cpu",
    log=print,
    server: ServerSettings | None = None,
) -> dict:
    """Regenerate the responses of one shard of a prompts file; write parquet atomically.

    ``server``: ``expand.server`` (used by the ``openai`` backend; operational, so not part of the
    chunks' identity: a new url or concurrency resumes the finished chunks)."""
    from dflashpipe.inputs.data import read_prompts
    from dflashpipe.inputs.target import target_fingerprint

    settings.check()
    prompts = shard_rows(read_prompts(prompts_path), shard, n_shards)
    decoder = decoder_identity(target_path, settings, device)
    identity = {
        "settings": asdict(settings),
        "decoder": decoder,
        "code": decoding_code_digest(),
        "target_fingerprint": target_fingerprint(target_path),
        "prompts_digest": _file_digest(prompts_path),
        "shard": shard,
        "n_shards": n_shards,
    }
    work = _chunk_dir(out_path, identity, log)
    n_chunks = (len(prompts) + settings.chunk_size - 1) // settings.chunk_size
    todo = _chunks_to_generate(work, n_chunks, log)
    t0, gen_tokens = time.time(), 0
    if todo:  # a shard with nothing left to generate (or no prompts at all) loads no model
        check_chat_template(prompts, target_path, settings, prompts_path)
        backend = BACKENDS[settings.backend](target_path, settings, device, server or ServerSettings(), log)
        generate = turn_by_turn(backend, settings)  # a multi-turn chat answered turn by turn (expand.turns)
        gen_tokens = _generate_chunks(generate, prompts, todo, work, settings, shard, n_chunks, log)
    elif not n_chunks:
        log(f"shard {shard} of {n_shards} has no prompts (the dataset has fewer rows than shards): writing an empty output")

    df = _merged_chunks(work, n_chunks, settings, decoder, identity["target_fingerprint"], target_path)
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
        "replies_without_token_ids": int(df["token_ids"].isna().sum()) if "token_ids" in df else len(df),
        "turns": turn_counts(df),
    }
    log(f"expansion done: {summary}")
    return summary


def chunk_dir(out_path: str) -> Path:
    """Where a shard's expansion keeps its finished chunks until its output is written (a killed job resumes
    from them)."""
    return Path(str(out_path) + ".chunks")


def discard_chunks(out_path: str) -> None:
    """A killed attempt's chunks, of no use once the shard's output is in place (restored by the memo)."""
    shutil.rmtree(chunk_dir(out_path), ignore_errors=True)


def _chunk_dir(out_path: str, identity: dict, log) -> Path:
    """The shard's chunk directory, emptied when its chunks were made with another identity."""
    work = chunk_dir(out_path)
    settings_file = work / "settings.json"
    if work.exists() and (not settings_file.exists() or json.loads(settings_file.read_text()) != json.loads(json.dumps(identity))):
        log(f"settings changed (generation, decoder or decoding code) since the chunks in {work} were written: discarding them")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    write_json(settings_file, identity)
    return work


def _chunks_to_generate(work: Path, n_chunks: int, log) -> list[int]:
    """The chunks not written yet; a damaged chunk (e.g. a disk fault) is made again, not read."""
    for c in range(n_chunks):
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
    return [c for c in range(n_chunks) if not (work / f"chunk_{c:05d}.parquet").exists()]


def _generate_chunks(generate, prompts: pd.DataFrame, todo: list[int], work: Path, settings: ExpandSettings, shard: int,
                     n_chunks: int, log) -> int:
    """Generate and write the chunks ``todo``; returns the tokens generated."""
    from tqdm import tqdm

    t0, gen_tokens = time.time(), 0
    size = settings.chunk_size
    bar = tqdm(total=sum(len(prompts.iloc[c * size : (c + 1) * size]) for c in todo),
               desc=f"expand shard {shard} (prompts)", mininterval=5)

    def progress(n_prompts: int, n_tokens: int) -> None:  # per generate batch: prompts done, tokens/s
        nonlocal gen_tokens
        gen_tokens += n_tokens
        bar.update(n_prompts)
        bar.set_postfix(tok_s=f"{gen_tokens / max(1e-9, time.time() - t0):.0f}", refresh=False)

    for c in todo:
        chunk_file = work / f"chunk_{c:05d}.parquet"
        rows = prompts.iloc[c * size : (c + 1) * size]
        tc = time.time()
        records, n_new = generate(rows, settings.seed * 1_000_003 + shard * 10_007 + c, progress)
        with atomic_path(chunk_file) as tmp:
            pd.DataFrame(records).to_parquet(tmp, index=False)
        log(f"chunk {c + 1}/{n_chunks}: {len(records)} responses, {n_new} tokens, {n_new / (time.time() - tc):.0f} tok/s")
    bar.close()
    return gen_tokens


def _merged_chunks(work: Path, n_chunks: int, settings: ExpandSettings, decoder: dict, target: str,
                   target_path: str) -> pd.DataFrame:
    """The shard's chunks as one table, with the settings, the decoder and the target that made them."""
    frames = [pd.read_parquet(work / f"chunk_{c:05d}.parquet") for c in range(n_chunks)]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RECORD_COLUMNS)
    for key in ("temperature", "top_p", "max_new_tokens", "seed"):
        df[key] = getattr(settings, key)
    df["backend"] = decoder["backend"]  # what ran (expand.backend may say auto)
    df["dtype"] = decoder.get("dtype")
    df["target"] = target
    df["target_path"] = str(target_path)
    return df

