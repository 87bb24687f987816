"""The serial compile-warm chain, stamps and hot-start proof, through real Snakemake runs on CPU slots."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, mini_config, planned_rules, snakemake, write_config
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.hotstart import check_stamp, fingerprint_parts


def dag_edges(workdir, *args):
    res = snakemake(workdir, "--dag", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    labels, edges = {}, set()
    for line in res.stdout.splitlines():
        line = line.strip()
        if "[label = " in line:
            node, rest = line.split("[", 1)
            label = rest.split('label = "', 1)[1].split('"', 1)[0]
            labels[node.strip()] = label.replace("\\n", "\n")
        elif "->" in line:
            a, b = (x.strip().rstrip(";") for x in line.split("->"))
            edges.add((a, b))
    return labels, edges


def shipped_config(workdir: Path) -> None:
    """``config/config.yaml`` as shipped, where the Snakefile looks for it (relative to the working directory)."""
    (workdir / "config").mkdir()
    (workdir / "config/config.yaml").write_text((REPO / "config/config.yaml").read_text())


def planned_job(workdir, rule: str, *args) -> str:
    """The dry run's lines of the one planned job of ``rule`` (its inputs, log, threads, resources)."""
    res = snakemake(workdir, "-n", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    blocks = (res.stdout + res.stderr).split("\nrule ")
    (block,) = [b for b in blocks if b.startswith(f"{rule}:")]
    return block


def test_the_gpus_of_the_command_are_the_slots_and_the_ranks_of_the_shipped_config(tmp_path):
    """`--resources gpu=3` on the shipped config, unedited: 3 warm jobs in a chain, and ONE training job
    of 3 ranks that waits for the whole chain; without --resources, one slot and one rank."""
    shipped_config(tmp_path)
    labels, edges = dag_edges(tmp_path, "--cores", "8", "--resources", "gpu=3")
    node = {}
    for n, label in labels.items():
        name = label.split("\n")[0]
        slot = [line.split(": ")[1] for line in label.split("\n")[1:] if line.startswith("slot: ")]
        node[(name, slot[0] if slot else None)] = n
    warm = [node[("warm_slot", str(i))] for i in range(3)]
    assert ("warm_slot", "3") not in node
    assert (warm[0], warm[1]) in edges and (warm[1], warm[2]) in edges
    assert (warm[0], warm[2]) not in edges  # a chain, not a fan
    train = node[("train", None)]  # ONE job runs the 3 ranks together, once every stamp is there
    assert all((w, train) in edges for w in warm)
    job = planned_job(tmp_path, "train", "--cores", "8", "--resources", "gpu=3")
    assert "gpu=3" in job and "rank2.log" in job and "rank3.log" not in job and "threads: 6" in job
    job = planned_job(tmp_path, "train", "--cores", "8")  # no --resources gpu: the CPU's one slot
    assert "gpu=1" in job and "rank0.log" in job and "rank1.log" not in job
    assert "slot1" not in job


def test_warm_jobs_never_overlap_and_shards_do(mini_run):
    work, _ = mini_run
    stamps = [json.loads((work / f"results/warm/slot{i}.json").read_text()) for i in range(2)]
    assert stamps[0]["finished_at"] <= stamps[1]["started_at"]
    summary = json.loads((work / "results/train/summary.json").read_text())
    ranks = summary["ranks"]
    assert max(r["started_at"] for r in ranks) < min(r["finished_at"] for r in ranks)
    assert [r["rank"] for r in ranks] == [0, 1] and summary["world_size"] == 2
    for stamp in stamps:
        assert stamp["torch"] and stamp["buckets"] and "fxgraph_cache_miss" in stamp["counters"]
        assert stamp["cache_dirs"]["TORCHINDUCTOR_CACHE_DIR"].endswith(f"slot{stamp['slot']}/inductor")


def test_shards_log_metrics_and_export_the_drafter(mini_run):
    work, _ = mini_run
    r = work / "results"
    m = pd.read_csv(r / "train/metrics.csv")
    assert list(m["step"]) == [1, 2, 3, 4, 5, 6]
    assert {"loss", "acc", "lr", "tokens_per_s", "tokens_per_s_per_gpu", "peak_mem_mb"} <= set(m.columns)
    for k in range(2):
        log = (r / f"logs/train/rank{k}.log").read_text()
        assert f"train rank {k}/2 on cpu" in log and "6 steps of 4 sequences (2 on this rank)" in log
    cfg = json.loads((r / "drafter/config.json").read_text())
    assert cfg["block_size"] == 4 and "dflash_config" in cfg and (r / "drafter/model.safetensors").exists()


def test_drafter_config_change_invalidates_stamps_but_lr_does_not(mini_run):
    work, _ = mini_run
    cfg = mini_config()
    cfg["drafter"]["num_layers"] = 2
    changed = planned_rules(work, "--configfile", str(write_config(work / "layers.yaml", cfg)))
    assert {"warm_slot", "train"} <= set(changed)
    assert not {"expand_shard", "tokenize", "tiny_target"} & set(changed)
    cfg = mini_config()
    cfg["drafter"]["block_size"] = 6  # the tokenized data is every drafter's: no key of this section retokenizes
    changed = planned_rules(work, "--configfile", str(write_config(work / "block.yaml", cfg)))
    assert {"warm_slot", "train", "export", "evaluate"} <= set(changed)
    assert not {"expand_shard", "tokenize", "ar_draft", "tiny_target"} & set(changed)
    cfg = mini_config()
    cfg["train"]["lr"] = 1e-3
    changed = planned_rules(work, "--configfile", str(write_config(work / "lr.yaml", cfg)))
    assert "warm_slot" not in changed and "train" in changed


#: what a new value of any key plans besides the jobs that read it: the record of the config
#: (rule effective_config, a local job that writes results/effective_config.yaml) and the default target
RECORD = {"effective_config": 1, "all": 1}


def test_operational_settings_rerun_nothing(mini_run):
    """Every key the schema marks x-operational (and not x-compile) is read at run time: a new value of
    each, all at once, plans no job. The list comes from the schema, not from this test."""
    from dflashpipe.jobs.settings import load_schema

    work, _ = mini_run
    cfg = mini_config()
    changed = []

    def walk(node, values, path):
        for key, sub in node.get("properties", {}).items():
            if "properties" in sub:  # a section of the config (not a free-form map such as chat_template_kwargs)
                walk(sub, values.setdefault(key, {}), path + [key])
            elif sub.get("x-operational") and not sub.get("x-compile"):
                old = values.get(key, sub.get("default"))
                types = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
                if "boolean" in types:  # flipping wandb on reruns nothing either (it is checked when training starts)
                    values[key] = not old
                else:
                    values[key] = old + 1 if "integer" in types else (old * 2 if "number" in types else str(work / "elsewhere"))
                changed.append(".".join(path + [key]))

    walk(load_schema(), cfg, [])
    cfg["expand"] = dict(reversed(list(cfg["expand"].items())))  # the order a user writes keys in changes nothing
    assert {"threads", "target.tiny.max_minutes", "train.eval_every", "gpu.lock_dir", "ar_draft.threads",
            "train.tensorboard", "train.wandb"} <= set(changed)
    # only the record of the config (results/effective_config.yaml, a local job) writes the new values down
    assert planned_rules(work, "--configfile", str(write_config(work / "ops.yaml", cfg))) == RECORD


def _change_result_keys(section: dict, values: dict) -> list[str]:
    """A new valid value for every key of a schema section that changes results (neither x-operational
    nor x-compile; lists and free strings left out); returns the keys changed."""
    changed = []
    for key, sub in section["properties"].items():
        if sub.get("x-operational") or sub.get("x-compile") or "properties" in sub:
            continue
        if sub.get("x-concurrency"):  # rule concurrency's alone (tests/test_concurrency_rule.py)
            continue
        old = values.get(key, sub.get("default"))
        if "anyOf" in sub:  # "auto" or a count (evaluate.timing_repeats): a count, another one
            if not any(alt.get("type") == "integer" for alt in sub["anyOf"]):
                continue
            values[key] = old + 1 if isinstance(old, int) else 2
            changed.append(key)
            continue
        types = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
        if "enum" in sub:
            new = next(v for v in sub["enum"] if v != old)
        elif "boolean" in types:
            new = not old
        elif "integer" in types:
            new = 1000 if old is None else old + 1
        elif "number" in types:
            new = old / 2 if old else 0.5
        elif "object" in types:  # a mapping of training datasets to numbers (train.repeat)
            new = {"code": 2}
        else:
            continue
        values[key] = new
        changed.append(key)
    return changed


@pytest.mark.parametrize("section, dependent", [
    ("train", {"train", "export", "evaluate", "tables", "plots"}),
    ("evaluate", {"draft_vocab", "evaluate", "tables", "plots"}),  # draft_vocab: counts evaluate.draft_vocab's tokens
])
def test_result_settings_rerun_exactly_the_dependent_jobs(mini_run, section, dependent):
    """Every result-changing key of a section (from the schema), all changed at once: the jobs that
    read the section and those downstream are planned, nothing upstream or beside them."""
    from dflashpipe.jobs.settings import load_schema, result_params

    work, _ = mini_run
    cfg = mini_config()
    keys = _change_result_keys(load_schema()["properties"][section], cfg[section])
    assert len(keys) >= 5, keys
    assert set(keys) <= set(result_params(cfg, section))  # each one is in the params of the rule that reads it
    planned = planned_rules(work, "--configfile", str(write_config(work / f"{section}_results.yaml", cfg)))
    assert set(planned) - set(RECORD) == dependent, (keys, planned)


def test_stale_stamp_makes_the_shard_fail_with_the_reason(mini_copy):
    work, cfg = mini_copy
    stamp_path = work / "results/warm/slot1.json"
    stamp = json.loads(stamp_path.read_text())
    stamp["torch"] = "2.11.0"
    stamp_path.write_text(json.dumps(stamp))
    shutil.rmtree(work / "results/train/checkpoints")  # a finished run would only write its outputs again
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg), "--forcerun", "train")
    assert res.returncode != 0
    log = (work / "results/logs/train/rank1.log").read_text()
    assert "slot1.json is stale (torch: stamp has '2.11.0'" in log
    assert "rerun the warm chain" in log


def test_check_stamp_names_the_stale_part(tmp_path):
    parts = fingerprint_parts({"buckets": [128]}, "cpu")
    with pytest.raises(UserError, match="stamp missing"):
        check_stamp(str(tmp_path / "none.json"), parts)
    from dflashpipe.jobs.hotstart import fingerprint

    good = {"fingerprint": fingerprint(parts), "parts": parts}
    (tmp_path / "s.json").write_text(json.dumps(good))
    assert check_stamp(str(tmp_path / "s.json"), parts)["fingerprint"] == good["fingerprint"]
    other = fingerprint_parts({"buckets": [128, 256]}, "cpu")
    with pytest.raises(UserError, match=r"s.json is stale \(config: stamp has"):
        check_stamp(str(tmp_path / "s.json"), other)


def test_too_few_gpu_slots_for_the_shards_is_refused_at_dag_time(mini_run):
    work, cfg = mini_run
    res = snakemake(work, "-n", "--configfile", str(cfg), "--resources", "gpu=1")
    assert res.returncode != 0
    assert [ln for ln in res.stderr.splitlines() if "ERROR" in ln] == [
        f"ERROR: {cfg}: train.shards is 2 but --resources gpu=1: the training job runs its 2 shards at once, one "
        "GPU each; use --resources gpu=2 or more, or lower train.shards"]


def test_the_gpu_count_comes_from_the_command_and_another_one_remakes_the_warm_chain(mini_run, tmp_path):
    """The mini run trained 2 ranks (gpu.slots and train.shards written out). Left to the command, the
    same 2 GPUs plan nothing; 4 (or, without --resources, this CPU machine's one slot) remake the warm
    chain (other shapes per rank) and, as it is the training job's input, what follows it. A count that
    cannot split the global batch is refused in one line, before anything runs."""
    work, _ = mini_run
    c = mini_config()
    del c["gpu"]["slots"], c["train"]["shards"]
    cfg = write_config(tmp_path / "from_the_command.yaml", c)
    assert planned_rules(work, "--configfile", str(cfg), "--resources", "gpu=2") == {}
    after = {"train": 1, "export": 1, "evaluate": 1, "tables": 1, "plots": 1} | RECORD  # gpu.slots and train.shards recorded
    assert planned_rules(work, "--configfile", str(cfg), "--resources", "gpu=4") == {"warm_slot": 4} | after
    assert planned_rules(work, "--configfile", str(cfg)) == {"warm_slot": 1} | after
    res = snakemake(work, "-n", "--configfile", str(cfg), "--resources", "gpu=3")
    assert res.returncode != 0 and [ln for ln in res.stderr.splitlines() if "ERROR" in ln] == [
        f"ERROR: {cfg}: train.batch_size (4) is the global batch of a step, split over train.shards (3); "
        "make it a multiple of 3"]


def test_next_slot_cache_is_seeded_from_the_previous_one(tmp_path):
    from dflashpipe.jobs.compile_cache import seed_slot_cache
    from dflashpipe.jobs.compile_cache import slot_cache_dirs

    prev, mine = slot_cache_dirs(tmp_path, 0), slot_cache_dirs(tmp_path, 1)
    for key, name in (("TORCHINDUCTOR_CACHE_DIR", "fxgraph/ab/entry"), ("TRITON_CACHE_DIR", "KX/kernel.cubin")):
        (Path(prev[key]) / name).parent.mkdir(parents=True)
        (Path(prev[key]) / name).write_text("slot0")
    own = Path(mine["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph/ab/entry"
    own.parent.mkdir(parents=True)
    own.write_text("slot1's own")
    assert seed_slot_cache(tmp_path, 0) == 0  # slot 0 has no predecessor
    assert seed_slot_cache(tmp_path, 1) == 1  # only the missing file is copied
    assert own.read_text() == "slot1's own"
    assert (Path(mine["TRITON_CACHE_DIR"]) / "KX/kernel.cubin").read_text() == "slot0"
    assert seed_slot_cache(tmp_path, 1) == 0  # idempotent: a rerun of the warm job copies nothing
