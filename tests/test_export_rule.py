"""The export is a rule of its own: it reads the training run's final weights, so a change of the export code
reruns the export (and what reads the drafter), never the warm chain or training."""

from __future__ import annotations

import json

from conftest import CODE_EDIT, REPO, copy_checkout, planned_after_edit, snakemake

NOT_RERUN = {"warm_slot", "train", "tokenize", "expand_shard", "tiny_target", "prompts"}
READ_THE_DRAFTER = {"export", "evaluate", "tables", "plots", "all"}


def test_an_export_code_edit_reruns_the_export_only(mini_copy):
    work, cfg = mini_copy
    for module in ("export/write.py", "export/hf_modeling.py", "export/card.py"):
        planned = planned_after_edit(work, cfg, module)
        assert "export" in planned and not planned & NOT_RERUN, (module, planned)
        assert planned <= READ_THE_DRAFTER, (module, planned)

    r = work / "results"
    weights = (r / "drafter/model.safetensors").read_bytes()
    final = (r / "train/final.safetensors").read_bytes()
    metrics = (r / "train/metrics.csv").read_bytes()
    rank_log = (r / "logs/train/rank0.log").read_bytes()
    checkout = copy_checkout(work.parent / "edited")  # the edit in a checkout of its own, which runs the export
    export_py = checkout / "workflow/dflashpipe/export/write.py"
    export_py.write_text(export_py.read_text() + CODE_EDIT)
    res = snakemake(work, "export", "--cores", "2", "--configfile", str(cfg), snakefile=checkout / "Snakefile")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "rule export:" in out and "rule train:" not in out and "rule warm_slot:" not in out
    # the same drafter, byte for byte, from the same final weights; no training step ran
    assert (r / "drafter/model.safetensors").read_bytes() == weights
    assert (r / "train/final.safetensors").read_bytes() == final
    assert (r / "train/metrics.csv").read_bytes() == metrics and (r / "logs/train/rank0.log").read_bytes() == rank_log
    assert "exported the drafter (step 6, dflash2)" in (r / "logs/export/export.log").read_text()
    # the model card beside the weights: the target, the recipe, the data's size, the run's held-out figures
    card = (r / "drafter/README.md").read_text()
    stats = json.loads((r / "tokenized/stats.json").read_text())
    summary = json.loads((r / "train/summary.json").read_text())
    assert "base_model: model" in card and "`results/target/model`" in card and "license: apache-2.0" in card
    assert "| architecture | `dflash2` |" in card and "| block size | 4 (3 drafted tokens per block) |" in card
    assert f"{stats['samples']} samples, {stats['tokens']} tokens" in card
    assert f"| steps | {summary['steps']} " in card and f"{summary['heldout_acc']:.4f}" in card
    assert "--speculative-algorithm DFLASH" in card and '"num_speculative_tokens": 3' in card
    # the config that trained it: the recipe line (the mini config's target is the embedded tiny one, so
    # config/tiny_target.yaml filled what it leaves out: loss ce) and the deciding keys as YAML
    assert ("`recipe: drafter.arch=dflash2 train.loss=ce drafter.num_layers=1 drafter.block_size=4 (the embedded "
            "tiny target's 2-core demo recipe, config/tiny_target.yaml, under your config)`") in card
    assert "  selector_rank: 64\n" in card and "  max_steps: 6\n" in card
    # the export ships the modeling file its config names
    assert (r / "drafter/dflash.py").read_text() == (REPO / "workflow/dflashpipe/export/hf_modeling.py").read_text()
