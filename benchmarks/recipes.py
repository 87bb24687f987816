"""Drafter recipes compared at equal data, steps and compute: tau, speed-up, simulated tau, training cost.

For one target and one config (merged onto config/config.yaml, as the workflow does) this
prepares the data once through the pipeline's own library functions (prompts -> expansion by the
target -> tokenize; skipped when ``--data`` already holds them), then, for every recipe and seed,
trains a drafter with the pipeline's training (one rank) and evaluates it with the pipeline's
evaluation (DFlash and same-harness AR, greedy) on every ``use: eval`` dataset:

* ``config``         the config files' own arch and loss (the workflow's run, e.g. the CPU default)
* ``dflash_ce``       the paper's recipe (today's default): DFlash, CE on the data, exp decay weights
* ``dflash_kl_dpace`` distillation: KL to the target's own distribution, D-PACE position weights
* ``dflash_swa``      DFlash with every layer sliding-window (``--window`` tokens)
* ``dflash_kl``       DFlash, KL to the target's own distribution, exp decay weights
* ``dflash2``         DFlash 2: convolutions + candidate selector, KL (speculators' default objective)
* ``dspark``          DSpark: Markov and confidence heads, every block position drafting, DeepSpec's
                      0.1 CE + 0.9 L1 loss, at one block position less than the config's (the same
                      number of drafted and verified tokens as the others; DeepSpec's recipe: 7)

Every recipe sees the same samples in the same order with the same anchors (the data order is a
function of the seed only), the same number of steps and the same attention path. GPU training
is not bit-deterministic, so each recipe runs under several seeds (``--seeds``; the seed also
draws the drafter's initial weights) and the summary gives the mean and the spread (min-max).

Writes under ``--out``: ``runs.csv`` (one row per recipe, seed and eval dataset), ``summary.csv``
and ``summary.md`` (mean and spread per recipe and dataset), ``recipes.png``; and logs.

    python benchmarks/recipes.py --out $OUT/smollm2 --config config/smollm2.yaml --seeds 0,1
    python benchmarks/recipes.py --out OUT --config my_small.yaml --seeds 0 --device cpu   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402

RECIPES = {  # each names its arch and loss: the config files' own choices must not leak into a row
    "config": {},  # the config files' own drafter and loss, as the workflow trains them
    "dflash_ce": {"drafter": {"arch": "dflash"}, "train": {"loss": "ce", "position_weights": "decay"}},
    "dflash_kl": {"drafter": {"arch": "dflash"}, "train": {"loss": "kl", "position_weights": "decay"}},
    "dflash_kl_dpace": {"drafter": {"arch": "dflash"}, "train": {"loss": "kl", "position_weights": "dpace"}},
    "dflash_swa": {"drafter": {"arch": "dflash", "sliding_window": "WINDOW"}, "train": {"loss": "ce"}},
    "dflash2": {"drafter": {"arch": "dflash2"}, "train": {"loss": "kl", "position_weights": "decay"}},
    # every position of a DSpark block drafts: a block one shorter proposes as many tokens and verifies
    # as many as the others' (DeepSpec's recipe: 7)
    "dspark": {"drafter": {"arch": "dspark", "block_size": "BLOCK-1"},
               "train": {"loss": "dspark", "position_weights": "decay"}},
}


def merged_config(files: list[str], overrides: list[str]) -> dict:
    """config/config.yaml with ``files`` merged on (as Snakemake does), ``key.sub=value`` overrides, validated."""
    import yaml

    from dflashpipe.config import _merge, load_yaml, prepare_config, user_datasets

    cfg = load_yaml(str(REPO / "config" / "config.yaml"))
    for f in files:
        cfg = _merge(cfg, load_yaml(f))
    cfg["datasets"] = user_datasets(files) or cfg["datasets"]  # a file's datasets replace the shipped ones
    for item in overrides:
        key, value = item.split("=", 1)
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = yaml.safe_load(value)
    # the datasets are settled above (an override under `datasets` adds to the files'): no files passed on
    for note in prepare_config(cfg, ", ".join(files) or "config"):
        print(note)
    return cfg


def tiny_target(cfg: dict, prompts: dict, out: Path, log) -> str:
    """The embedded default target, trained as the workflow's ``tiny_target`` rule trains it (on the CPU)."""
    from dflashpipe.inputs.data import read_prompts
    from dflashpipe.inputs.tiny_target import TinyTargetConfig, train_tiny_target
    from dflashpipe.jobs.settings import settings

    def chats(path):
        df = read_prompts(str(path))
        df = df[df["reference"].notna()]
        return [list(p) + [{"role": "assistant", "content": r}] for p, r in zip(df["prompt"], df["reference"])]

    tiny = cfg["target"]["tiny"]
    if not (out / "model").exists():
        t0 = time.time()
        train = [c for name in tiny["train_datasets"] for c in chats(prompts[name])]
        train_tiny_target(train, chats(prompts[tiny["heldout_dataset"]]), settings(TinyTargetConfig, tiny, seed=cfg["seed"]),
                          str(out / "model"), str(out / "metrics.json"), log=log)
        log(f"tiny target trained in {time.time() - t0:.1f}s")
    return str(out / "model")


def prepare_data(cfg: dict, target: str | None, data: Path, device: str, log) -> tuple[dict, str]:
    """Prompts of every dataset, the tiny default target when no target is given, expansion of the
    training datasets by the target, tokenization (each once: kept in ``data``). Returns (prompts, target)."""
    from dflashpipe.inputs.data import prepare_prompts
    from dflashpipe.inputs.tokenize import tokenize_expanded
    from dflashpipe.jobs.settings import settings
    from dflashpipe.stages.expand import ExpandSettings, expand_prompts

    data.mkdir(parents=True, exist_ok=True)
    prompts, expanded = {}, {}
    for name, spec in cfg["datasets"].items():
        prompts[name] = data / f"prompts_{name}_{digest(spec)}.parquet"  # a changed spec reads its file again
        if not prompts[name].exists():
            prepare_prompts(spec, name, str(prompts[name]), repo_root=str(REPO))
    target = target or tiny_target(cfg, prompts, data / "target", log)
    tokenized = tokenized_dir(cfg, data)
    if tokenized.exists():
        return prompts, target
    s = settings(ExpandSettings, cfg["expand"], seed=cfg["seed"])
    for name, spec in cfg["datasets"].items():
        if spec["use"] != "train":
            continue
        expanded[name] = expanded_path(cfg, name, data)
        if not expanded[name].exists():
            t0 = time.time()
            expand_prompts(str(prompts[name]), target, s, str(expanded[name]), device=device, log=log)
            log(f"expanded {name} in {time.time() - t0:.1f}s")
    tk = cfg["tokenize"]
    tokenize_expanded({n: str(p) for n, p in expanded.items()}, target, cfg["drafter"]["block_size"], tk["buckets"],
                      str(tokenized), f"{tokenized}_stats.json",
                      chat_template_kwargs=cfg["expand"]["chat_template_kwargs"], cut_replies=tk["cut_replies"],
                      reply_ids=tk["reply_ids"], log=log)
    return prompts, target


def expanded_path(cfg: dict, name: str, data: Path) -> Path:
    """A training dataset's replies, named by its spec and the expansion's settings: a dataset or an
    `expand` key changed under the same name is expanded again, never read from the old file. One
    ``--data`` folder holds one target's replies. Keys that change no reply (threads, a server's
    concurrency: the schema's operational ones) are left out, as the workflow leaves them out."""
    from dflashpipe.jobs.settings import result_params

    key = [cfg["datasets"][name], result_params(cfg, "expand"), cfg["seed"]]
    return data / f"expanded_{name}_{digest(key)}.parquet"


def tokenized_dir(cfg: dict, data: Path) -> Path:
    """One tokenized dataset per way of reading the replies and per mix: its name carries the
    expansions' names (each dataset's spec and the expansion's settings), the tokenize section and
    the block size. A mix with another dataset, or replies read another way, is tokenized again."""
    from dflashpipe.jobs.settings import result_params

    tk = cfg["tokenize"]
    train = sorted(name for name, spec in cfg["datasets"].items() if spec["use"] == "train")
    key = [[expanded_path(cfg, n, data).name for n in train], result_params(cfg, "tokenize"), cfg["drafter"]["block_size"]]
    return data / f"tokenized_{tk['cut_replies']}_{tk['reply_ids']}_{digest(key)}"


def digest(obj) -> str:
    """8 hex digits naming a JSON-able value (a dataset's spec, a mix) in a file name."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:8]


def recipe_config(cfg: dict, recipe: str, window: int, seed: int) -> dict:
    out = copy.deepcopy(cfg)
    for section, keys in RECIPES[recipe].items():
        special = {"WINDOW": window, "BLOCK-1": cfg["drafter"]["block_size"] - 1}
        out[section].update({k: special.get(v, v) if isinstance(v, str) else v for k, v in keys.items()})
    out["seed"] = seed
    return out


def train_one(cfg: dict, target: str, tokenized: str, run: Path, device: str, log) -> dict:
    """One rank of the pipeline's training on this process's device, then its export; returns its summary."""
    from dflashpipe.drafter.export import export_final
    from dflashpipe.drafter.train import TrainConfig, TrainRun, train_rank
    from dflashpipe.jobs.settings import settings

    if (run / "drafter").is_dir() and (run / "summary.json").exists():  # trained by an earlier call
        log(f"{run}: trained already, evaluating its drafter")
        return json.loads((run / "summary.json").read_text())
    tc = settings(TrainConfig, cfg["drafter"], cfg["train"], seed=cfg["seed"], tensorboard=False)
    run.mkdir(parents=True, exist_ok=True)
    rdzv = (run / "rendezvous").resolve()  # a file:// URL needs an absolute path
    rdzv.unlink(missing_ok=True)
    t0 = time.time()
    train_run = TrainRun(tc, tokenized, target, str(run), str(run / "metrics.csv"), str(run / "summary.json"),
                         final_state=str(run / "final.safetensors"), init_method=f"file://{rdzv}")
    summary = train_rank(train_run, 0, device, log=log)  # checkpoints in run/checkpoints/<identity key>
    summary["wall_s"] = time.time() - t0
    export_final(run / "final.safetensors", target, run / "drafter", log=log)
    return summary


def evaluate_one(cfg: dict, target: str, drafter: Path, prompts: dict, run: Path, device: str, log,
                 methods=("dflash", "ar"), sets=None) -> dict:
    from dflashpipe.evaluate.run import evaluate_dataset
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings

    ev = cfg["evaluate"]
    settings = EvalSettings(max_new_tokens=ev["max_new_tokens"], temperature=0.0, num_prompts=ev["num_prompts"],
                            methods=list(methods), lossless="report", target_step=ev["target_step"],
                            attention=ev["attention"], seed=cfg["seed"],
                            chat_template_kwargs=cfg["expand"]["chat_template_kwargs"])
    out = {}
    for name, spec in cfg["datasets"].items():
        if spec["use"] != "eval" or (sets and name not in sets):
            continue
        s = evaluate_dataset(EvalRun(settings, target, str(drafter), str(prompts[name]), str(run / f"{name}.samples.parquet"),
                                     str(run / f"{name}.summary.json"), device=device), log=log)
        out[name] = s
    return out


def row_of(recipe, seed, dataset, train, ev, timed=True) -> dict:
    """One run's figures on one dataset; ``timed=False`` (runs sharing the GPU): tau only, no speed figures."""
    d, ar = ev["methods"]["dflash"], ev["methods"]["ar"]  # the evaluation always runs AR, its reference
    if not timed:  # runs that shared the GPU: their times are no speed figures
        d = {k: v for k, v in d.items() if k not in ("speedup_vs_ar", "tokens_per_s")}
        ar = {}
    return {
        "recipe": recipe, "seed": seed, "dataset": dataset,
        "tau_pooled": d.get("tau_pooled"), "tau_mean": d.get("tau_mean"), "simulated_tau": train.get("heldout_sim_tau"),
        "speedup_vs_ar": d.get("speedup_vs_ar"), "dflash_tokens_per_s": d.get("tokens_per_s"),
        "ar_tokens_per_s": ar.get("tokens_per_s"), "ar_mode": ar.get("mode"), "lossless_passed": (ev.get("lossless") or {}).get("passed"),
        "heldout_acc": train.get("heldout_acc"), "heldout_loss": train.get("heldout_loss"),
        "train_tokens_per_s": train.get("tokens_per_s"), "train_steps": train.get("steps"),
        "train_peak_mem_mb": max(r["peak_mem_mb"] for r in train["ranks"]), "train_wall_s": train.get("wall_s"),
    }  # fmt: skip


def summarise(rows, out: Path) -> None:
    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(out / "runs.csv", index=False)
    figures = ["tau_pooled", "tau_mean", "simulated_tau", "speedup_vs_ar", "heldout_acc", "train_tokens_per_s",
               "train_peak_mem_mb"]
    df[figures] = df[figures].astype(float)  # a run evaluated for tau only has no speed-up (NaN)
    g = df.groupby(["dataset", "recipe"], sort=False)[figures]
    summary = g.mean().add_suffix("_mean").join(g.min().add_suffix("_min")).join(g.max().add_suffix("_max"))
    summary["seeds"] = g.size()
    summary["timed"] = g.count()["speedup_vs_ar"]  # the seeds whose speed was measured alone on the GPU
    summary.reset_index().to_csv(out / "summary.csv", index=False)
    lines = ["| dataset | recipe | tau pooled | tau mean | simulated tau | speed-up vs AR (seeds timed) | held-out acc | "
             "train ctx tok/s | train peak MiB | seeds |", "|" + " --- |" * 10]
    for (dataset, recipe), r in summary.iterrows():
        def cell(f, fmt="{:.2f}"):
            if pd.isna(r[f + "_mean"]):  # no seed has this figure (runs evaluated for tau only)
                return "-"
            return f"{fmt.format(r[f + '_mean'])} ({fmt.format(r[f + '_min'])}-{fmt.format(r[f + '_max'])})"

        lines.append(f"| {dataset} | {recipe} | {cell('tau_pooled')} | {cell('tau_mean')} | {cell('simulated_tau')} | "
                     f"{cell('speedup_vs_ar')} ({int(r['timed'])}) | {cell('heldout_acc', '{:.3f}')} | "
                     f"{r['train_tokens_per_s_mean']:,.0f} | {r['train_peak_mem_mb_mean']:,.0f} | {int(r['seeds'])} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(df, out / "recipes.png")


def copy_summary(out: Path, dest: Path) -> None:
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("runs.csv", "summary.csv", "summary.md", "recipes.png", "recipes.log"):
        if (out / name).exists():
            shutil.copy(out / name, dest / name)


def plot(df, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets, recipes = list(dict.fromkeys(df["dataset"])), list(dict.fromkeys(df["recipe"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(recipes))
    for i, recipe in enumerate(recipes):
        for ax, col in zip(axes, ["tau_pooled", "speedup_vs_ar"]):
            g = df[df["recipe"] == recipe].groupby("dataset")[col]
            mean, lo, hi = (g.mean().reindex(datasets), g.min().reindex(datasets), g.max().reindex(datasets))
            xs = [j + i * width for j in range(len(datasets))]
            ax.bar(xs, mean, width, yerr=[mean - lo, hi - mean], capsize=3, label=recipe)
            if col == "tau_pooled":
                sim = df[df["recipe"] == recipe].groupby("dataset")["simulated_tau"].mean().reindex(datasets)
                ax.plot(xs, sim, "k_", markersize=14, mew=2, label="simulated tau" if i == 0 else None)
    for ax, title in zip(axes, ["DFlash tau (pooled; bars: mean, whiskers: min-max over seeds)",
                                "decode speed-up over same-harness AR"]):
        ax.set_xticks([j + width * (len(recipes) - 1) / 2 for j in range(len(datasets))])
        ax.set_xticklabels(datasets)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", action="append", default=[], help="config files merged onto config/config.yaml")
    ap.add_argument("--set", action="append", default=[], help="key.sub=value overrides (YAML values)")
    ap.add_argument("--target", help="target model dir (default: the config's target.path; none: train the tiny one)")
    ap.add_argument("--data", help="folder for prompts/expansion/tokenized data (default: OUT/data)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--window", type=int, default=128, help="dflash_swa's sliding window (tokens)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--copy-to", help="also copy the summary files here (e.g. $OUT on the GPU machine)")
    ap.add_argument("--methods", default="dflash,ar", help="evaluation methods (AR, the reference, always runs)")
    ap.add_argument("--label", help="the rows' recipe name (default: the recipe's), e.g. for a data variant")
    ap.add_argument("--data-only", action="store_true", help="prepare the data (and tokenize) and stop")
    ap.add_argument("--train-only", action="store_true", help="train and export each run; evaluate nothing")
    ap.add_argument("--tau-only", action="store_true",
                    help="runs share the GPU: record tau, not speed (the combined table times only the others)")
    ap.add_argument("--eval-sets", help="evaluate on these eval datasets only (comma-separated; default: all)")
    ap.add_argument("--combine", nargs="+", help="summarise the runs.csv of these earlier --out folders into --out")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="with --combine: name OLD's rows NEW (e.g. a variant's label the recipe now is)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "recipes.log", "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(f"{msg}\n")
        logf.flush()

    if a.combine:
        import pandas as pd

        runs = pd.concat([pd.read_csv(Path(d) / "runs.csv").assign(folder=d) for d in a.combine])
        runs["recipe"] = runs["recipe"].replace(dict(r.split("=", 1) for r in a.rename))
        key = ["recipe", "seed", "dataset"]
        twice = runs[runs.duplicated(key, keep=False)]
        if len(twice):  # e.g. a report and the speed report folded into it: one run would count as two seeds
            r = twice.iloc[0]
            where = twice[(twice[key] == r[key]).all(axis=1)].folder
            sys.exit(f"recipes.py --combine: {r.recipe} seed {r.seed} on {r.dataset} is in {' and '.join(where)}: "
                     "combine each run once")
        rows = runs.drop(columns="folder").to_dict("records")
        summarise(rows, out)
        if a.copy_to:
            copy_summary(out, Path(a.copy_to))
        return 0
    cfg = merged_config(a.config, a.set + ([f"target.path={a.target}"] if a.target else []))
    target = cfg["target"]["path"]
    data = Path(a.data) if a.data else out / "data"
    t0 = time.time()
    prompts, target = prepare_data(cfg, target, data, a.device, log)
    log(f"data ready in {time.time() - t0:.1f}s: {data}")
    if a.data_only:
        return 0
    tokenized = str(tokenized_dir(cfg, data))
    rows = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for recipe in a.recipes.split(","):
            rc = recipe_config(cfg, recipe, a.window, seed)
            run = out / "runs" / f"{recipe}_s{seed}"
            log(f"== {recipe} seed {seed}")
            train = train_one(rc, target, tokenized, run, a.device, log)
            if a.train_only:
                continue
            evs = evaluate_one(rc, target, run / "drafter", prompts, run, a.device, log, a.methods.split(","),
                               a.eval_sets.split(",") if a.eval_sets else None)
            for dataset, ev in evs.items():
                rows.append(row_of(a.label or recipe, seed, dataset, train, ev, timed=not a.tau_only))
                r = rows[-1]
                speed = "not timed (--tau-only)" if a.tau_only else f"{r['speedup_vs_ar']:.2f}x"
                log(f"{recipe} s{seed} {dataset}: tau {r['tau_pooled']:.2f} (simulated {r['simulated_tau']:.2f}), "
                    f"speed-up {speed}, held-out acc {r['heldout_acc']:.3f}, "
                    f"train {r['train_tokens_per_s']:,.0f} tok/s")
            summarise(rows, out)  # after every run: a cut-off call still leaves its figures
            if a.copy_to:
                copy_summary(out, Path(a.copy_to))
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    json.dump({"config_files": a.config, "set": a.set, "seeds": a.seeds, "window": a.window,
               "seconds": time.time() - t0}, open(out / "meta.json", "w"), indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
