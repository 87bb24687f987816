"""The pipeline's promises under edits, kills, faults and bad input, through real Snakemake runs.

Each test works on a private copy of the mini run (conftest.mini_copy: K=2 gloo shards on CPU,
6 steps, a checkpoint every 2) and compares with the mini run itself, which is the uninterrupted
reference. Faults are injected with DFLASH_FAULTS (dflashpipe.jobs.faults): a rank parks at a known
step so the test can SIGKILL the whole Snakemake process group, a rank is killed, or the export
hits a full disk. Same code, config and K on the CPU in fp32 give the same numbers, so a resumed
run must match the reference to 1e-6; another K changes only the summation order of the gradient
all-reduce (~1e-7 relative per step, far below the ~6e-4 a step moves a weight): 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from conftest import (copy_checkout, mini_config, planned_after_edit, planned_rules, sha256, snakemake, snakemake_cmd,
                      snakemake_env, write_config)


def weights(work: Path) -> dict:
    return load_file(work / "results/drafter/model.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def metrics(work: Path) -> pd.DataFrame:
    return pd.read_csv(work / "results/train/metrics.csv")


def summary(work: Path) -> dict:
    return json.loads((work / "results/train/summary.json").read_text())


def rank_log(work: Path, k: int = 0) -> str:
    return (work / f"results/logs/train/rank{k}.log").read_text()


def run(work: Path, cfg: Path, *targets: str, forcerun: str | None = None, cores: int = 2, env=None,
        snakefile: Path | None = None):
    """``snakemake TARGETS --cores N [--forcerun RULE] --configfile CFG`` (targets first: the options take lists);
    ``snakefile``: an edited copy of the checkout's (:func:`~conftest.copy_checkout`)."""
    args = [*targets, "--cores", str(cores), *(["--forcerun", forcerun] if forcerun else []), "--configfile", str(cfg)]
    return snakemake(work, *args, env=env, snakefile=snakefile)


def run_ok(work: Path, cfg: Path, *targets: str, **kw):
    res = run(work, cfg, *targets, **kw)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


# rank 1 killed as step 4 starts (checkpoint_every is 2): step 3's collectives came after rank 0 wrote step 2's
# checkpoint, so the rerun resumes from step 2 (killed at step 3, rank 0 could still be writing it when stopped)
KILL_RANK_1 = {"at": "train.step", "step": 4, "rank": 1, "do": "kill"}


def faults(*items: dict, marker: Path | None = None) -> dict:
    extra = {"DFLASH_FAULTS": json.dumps(list(items))}
    if marker:
        extra["DFLASH_FAULT_MARKER"] = str(marker)
    return snakemake_env(**extra)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("ERROR:")]


def forget_finished_runs(work: Path) -> None:
    """What a user does to train a finished run again (the train log names the directory)."""
    shutil.rmtree(work / "results/train/checkpoints")


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if text in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


# -- edits retrain; --forcerun retrains; an unchanged rerun after a kill resumes -------------------


def test_an_edit_of_the_training_code_retrains_from_step_one(mini_run, mini_copy):
    ref, _ = mini_run
    work, cfg = mini_copy
    checkout = copy_checkout(work.parent / "edited")  # the edit in a checkout of its own: tests beside it plan
    data_py = checkout / "workflow/dflashpipe/training/data.py"  # with the code as it is
    data_py.write_text(data_py.read_text() + "\nTRAIN_SALT = 7  # an edit: other anchors\n")
    run_ok(work, cfg, "export", snakefile=checkout / "Snakefile")
    s = summary(work)
    assert s["resumed_from_step"] is None and "resumed" not in rank_log(work)
    assert list(metrics(work)["step"]) == [1, 2, 3, 4, 5, 6]
    assert max_diff(weights(work), weights(ref)) > 1e-3  # really retrained, with the edited code
    assert s["checkpoint_dir"] != summary(ref)["checkpoint_dir"]  # the run of the old code stays apart

    # the finished run of the original code, deleted (what the train log says to do to train it again),
    # trains again from scratch and, deterministic on one machine, gives the same drafter bit for bit, the
    # same metrics, and then the same evaluation figures
    forget_finished_runs(work)
    run_ok(work, cfg, "tables", forcerun="train")  # up to the evaluation's table (the plots read nothing compared here)
    assert summary(work)["resumed_from_step"] is None and summary(work)["checkpoint_dir"] == summary(ref)["checkpoint_dir"]
    assert max_diff(weights(work), weights(ref)) == 0.0
    figures = ["loss", "acc", "grad_norm", "heldout_loss", "heldout_acc", "heldout_sim_tau"]
    pd.testing.assert_frame_equal(metrics(work)[figures], metrics(ref)[figures])
    ev, ev_ref = (pd.read_csv(w / "results/tables/eval.csv") for w in (work, ref))
    model_figures = ["tau_mean", "tau_pooled", "tau_uncut_pooled", "simulated_tau", "tokens_per_target_forward",
                     "decode_tokens", "matches_ar"]  # not the times
    pd.testing.assert_frame_equal(ev[["dataset", "method", *model_figures]], ev_ref[["dataset", "method", *model_figures]])


def test_sigkill_of_the_whole_run_then_the_plain_rerun_resumes_with_every_step(mini_run, mini_copy, tmp_path):
    ref, _ = mini_run
    work, cfg = mini_copy
    marker = tmp_path / "parked"
    env = faults({"at": "train.step", "step": 5, "rank": 0, "do": "park"}, marker=marker)
    forget_finished_runs(work)
    proc = subprocess.Popen(snakemake_cmd(work, "--cores", "2", "--forcerun", "train", "--configfile", str(cfg)),
                            cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, "the run ended before reaching step 5"
        assert time.time() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(1)
    assert processes_mentioning(str(work)) == []  # no rank survives its job
    assert not (work / "results/train/summary.json").exists()

    # the README's rerun after a kill: Snakemake's lock of the killed run, then the same command
    assert snakemake(work, "--unlock", "--configfile", str(cfg)).returncode == 0
    run_ok(work, cfg)
    assert "resumed from step 4" in rank_log(work, 0) and "resumed from step 4" in rank_log(work, 1)
    m, r = metrics(work), metrics(ref)
    assert list(m["step"]) == [1, 2, 3, 4, 5, 6]  # every step once: the history survived the kill
    assert (m["loss"] - r["loss"]).abs().max() <= 1e-6 and (m["heldout_loss"].dropna() - r["heldout_loss"].dropna()).abs().max() <= 1e-6
    assert max_diff(weights(work), weights(ref)) <= 1e-6
    assert len(pd.read_csv(work / "results/tables/training.csv")) == 6  # plots and tables see the whole run


def test_a_killed_rank_and_a_failed_export_recover_on_a_plain_rerun(mini_run, mini_copy):
    ref, _ = mini_run
    work, cfg = mini_copy
    # the run's final weights and the drafter made from them (a failed run leaves the previous drafter
    # in place, consistent with its final weights, so the drafter alone would be up to date)
    drafter = ("results/train/final.safetensors", "export")

    forget_finished_runs(work)
    res = run(work, cfg, *drafter, forcerun="train", env=faults(KILL_RANK_1))
    assert res.returncode != 0
    (line,) = {ln.split("  [")[0] for ln in error_lines(res.stderr)}
    assert "train rank 1 of 2 failed (exit code -9), the other ranks were stopped" in line
    assert not (work / "results/train/summary.json").exists() and not (work / "results/train/final.safetensors").exists()
    run_ok(work, cfg, *drafter)
    assert "resumed from step 2" in rank_log(work)
    assert max_diff(weights(work), weights(ref)) <= 1e-6

    forget_finished_runs(work)
    res = run(work, cfg, *drafter, forcerun="train", env=faults({"at": "train.export", "rank": 0, "do": "raise"}))
    assert res.returncode != 0
    assert any("cannot write the run's outputs ([Errno 28] No space left on device" in ln for ln in error_lines(res.stderr))
    run_ok(work, cfg, *drafter)
    assert "resumed from step 6" in rank_log(work)  # nothing retrained: only the outputs were written
    assert list(metrics(work)["step"]) == [1, 2, 3, 4, 5, 6]
    assert max_diff(weights(work), weights(ref)) <= 1e-6


def test_a_reworded_log_message_in_the_training_code_resumes_a_killed_run(mini_run, mini_copy):
    """The run identity digests the training code by meaning: a killed run whose code then only
    changed a log message reruns (its outputs are missing) and RESUMES from its checkpoint."""
    ref, _ = mini_run
    work, cfg = mini_copy
    targets = ("results/train/final.safetensors", "export")
    forget_finished_runs(work)
    res = run(work, cfg, *targets, forcerun="train", env=faults(KILL_RANK_1))
    assert res.returncode != 0
    checkout = copy_checkout(work.parent / "edited")  # the edit in a checkout of its own
    train_py = checkout / "workflow/dflashpipe/training/loop.py"  # the loop logs the first step
    original = train_py.read_text()
    assert 'log(f"first step done in ' in original
    train_py.write_text(original.replace('log(f"first step done in ', 'log(f"the first step took '))
    planned = set(planned_rules(work, *targets, "--configfile", str(cfg), snakefile=checkout / "Snakefile"))
    assert "train" in planned and "warm_slot" not in planned  # the killed job's, not the message's
    run_ok(work, cfg, *targets, snakefile=checkout / "Snakefile")
    log = rank_log(work)
    assert "resumed from step 2" in log and "the first step took" in log  # the new code ran, and resumed
    assert max_diff(weights(work), weights(ref)) <= 1e-6


# -- the target's content decides what reruns -----------------------------------------------------

READ_THE_TARGET = {"expand_shard", "merge_expanded", "tokenize", "ar_draft", "warm_slot", "train", "export", "evaluate",
                   "tables", "plots", "all"}


def test_the_tiny_target_overwritten_in_place_replans_expansion_onwards_and_a_touch_nothing(mini_copy):
    """The tiny target trained here is read through its files (each an output of its rule): a fine-tune
    written over its weights (same name and size) replans what reads the target; a touch or the same bytes
    copied back plan nothing (Snakemake compares the checksum of a file under 1 MB; a bigger one by its
    date). A configured target.path: tests/test_nothing_stale.py."""
    work, cfg = mini_copy
    weights = work / "results/target/model/model.safetensors"
    original = weights.read_bytes()

    os.utime(weights)  # the same content, a new mtime
    assert planned_rules(work, "--configfile", str(cfg)) == {}
    tuned = bytearray(original)
    tuned[-64:] = bytes(255 - b for b in tuned[-64:])  # a fine-tune: the same name and size, other bytes
    weights.write_bytes(bytes(tuned))
    assert set(planned_rules(work, "--configfile", str(cfg))) == READ_THE_TARGET  # not tiny_target, not prompts
    weights.write_bytes(original)  # copied back
    assert planned_rules(work, "--configfile", str(cfg)) == {}


# -- a finished run is never trained again unless its identity changed ---------------------------------

TRAIN_OUTPUTS = ("results/train/summary.json", "results/train/metrics.csv", "results/train/final.safetensors")


def finished_run(work: Path) -> dict:
    """The finished run as files: its checkpoints by (inode, mtime) (a file deleted or written again
    differs), the train job's summary and metrics by their bytes, its final weights by tensors and metadata
    (safetensors writes the metadata's keys in a random order)."""
    from safetensors import safe_open

    ckpts = {str(f.relative_to(work)): (f.stat().st_ino, f.stat().st_mtime_ns)
             for f in sorted((work / "results/train/checkpoints").rglob("step*.pt"))}
    with safe_open(work / TRAIN_OUTPUTS[2], "pt") as f:
        final = (f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()})
    return {"checkpoints": ckpts, "outputs": {f: (work / f).read_bytes() for f in TRAIN_OUTPUTS[:2]}, "final": final}


def test_a_finished_run_is_not_trained_again_after_a_comment_edit_or_an_x_compile_key(mini_copy):
    """A comment appended to drafter/model.py plans nothing (the rules' code params digest what the code
    means). train.activation_memory_budget (an x-compile key: no effect on a CPU) reruns the warm chain and
    so `train`; `--forcerun train` runs it too. Each time the job finds the finished run of its identity:
    it writes the same outputs again from the final checkpoint, starts no rank (no training step), and
    every checkpoint stays as it was."""
    work, cfg = mini_copy
    before = finished_run(work)
    assert len(before["checkpoints"]) == 2

    def trains_no_step(config: Path, **kw) -> None:
        stamped = [(work / f"results/warm/slot{i}.json").stat().st_mtime_ns for i in (0, 1)]
        run_ok(work, config, *TRAIN_OUTPUTS, **kw)
        log = (work / "results/logs/train/train.log").read_text()  # this job's
        assert "finished (step 6): its outputs are written again from there and no step is trained" in log
        assert "started 2 rank(s)" not in log and rank_log(work, 0) == rank_log(work, 1) == ""  # no rank, no step
        assert finished_run(work) == before  # the same outputs; no checkpoint touched
        if not kw:  # the warm chain reran first
            assert all((work / f"results/warm/slot{i}.json").stat().st_mtime_ns > stamped[i] for i in (0, 1))

    assert planned_after_edit(work, cfg, "drafter/model.py", "\n# _EDITED_BY_A_TEST: a comment, the same drafter\n") == set()
    trains_no_step(cfg, forcerun="train")  # asked for again: the same (first: the config's warm chain stays as it is)
    c = mini_config()
    c["train"]["activation_memory_budget"] = 0.5
    trains_no_step(write_config(work / "budget.yaml", c))


# -- more GPUs, the same drafter -----------------------------------------------------------


# K = 4 on one core (~80 s) is in the slow set; K = 1 (its own code path: no DDP, plain AdamW) stays
@pytest.mark.parametrize("shards,cores", [(1, 2), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_any_number_of_shards_trains_the_same_drafter(mini_run, mini_copy, shards, cores):
    """K=1 and K=4 against the reference's K=2: same steps, same global batches, same weights.
    Asked for as the drafter alone, the run starts all its ranks in one job; 4 ranks on 1 core
    run (slowly): they never wait for each other. (A new shard count reruns the warm chain, other
    shapes per rank, and so the train job, which would write the finished run's outputs again: the
    shard count is not part of the run identity. Deleted here, the run trains at K, on K GPU slots: one
    warm job a slot.)"""
    ref, _ = mini_run
    work, _ = mini_copy
    forget_finished_runs(work)
    c = mini_config()
    c["train"]["shards"] = shards
    c["gpu"]["slots"] = shards
    cfg = write_config(work / f"k{shards}.yaml", c)
    assert planned_rules(work, "export", "--configfile", str(cfg)) == {"warm_slot": shards, "train": 1, "export": 1}
    run_ok(work, cfg, "export", cores=cores)
    s, r = summary(work), summary(ref)
    assert (s["world_size"], s["rank_batch"], s["resumed_from_step"]) == (shards, 4 // shards, None)
    assert (s["steps"], s["global_batch"], s["train_samples"]) == (r["steps"], r["global_batch"], r["train_samples"])
    assert (metrics(work)["loss"] - metrics(ref)["loss"]).abs().max() <= 1e-5
    assert max_diff(weights(work), weights(ref)) <= 1e-5


# -- evaluation that sees accepted drafts -----------------------------------------------------


def constant_drafter(drafter_dir: Path, target_dir: Path, token: int) -> None:
    """Rewrite an exported drafter so that it proposes ``token`` at every block position.

    Its layers pass the block embeddings through unchanged (attention and MLP outputs zeroed),
    so position k >= 1 carries the MASK embedding; the final RMSNorm weight then maps that onto
    a direction whose logits under the target's LM head peak at ``token``.
    """
    from transformers import AutoModelForCausalLM

    cfg = json.loads((drafter_dir / "config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    W = target.get_output_embeddings().weight.detach().double()
    e = target.get_input_embeddings().weight[cfg["dflash_config"]["mask_token_id"]].detach().double()
    x = e / e.pow(2).mean().add(cfg["rms_norm_eps"]).sqrt()
    u = torch.linalg.lstsq(W, 10.0 * torch.nn.functional.one_hot(torch.tensor(token), W.shape[0]).double()).solution
    assert int((W @ u).argmax()) == token, "no final-norm weight makes the LM head pick the token"
    state = load_file(drafter_dir / "model.safetensors")
    for k in state:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            state[k] = torch.zeros_like(state[k])
    state["norm.weight"] = (u / x).to(state["norm.weight"].dtype)
    save_file(state, drafter_dir / "model.safetensors")


def test_workflow_lossless_check_sees_accepted_drafts(mini_copy):
    """The mini target's greedy reply to the held-out prompts is one token repeated; a drafter
    built to propose it must have its drafts accepted by the evaluate job, and DFlash's output
    must still equal AR's token for token."""
    work, cfg = mini_copy
    r = work / "results"
    ar = pd.read_parquet(r / "eval/math_heldout.samples.parquet").query("method == 'ar'")
    token = int(ar["output_ids"].iloc[0][0])
    assert all(set(ids) == {token} for ids in ar["output_ids"]), "precondition: the mini target repeats one token"
    constant_drafter(r / "drafter", r / "target/model", token)
    run_ok(work, cfg, "tables", forcerun="evaluate")  # the evaluation and its table, not the plots
    s = json.loads((r / "eval/math_heldout.summary.json").read_text())
    d = s["methods"]["dflash"]
    assert s["lossless"]["passed"] and s["lossless"]["exact_matches"] == 2
    assert d["acceptance_histogram"][-1] > 0 and d["tau_pooled"] > 2  # whole blocks accepted (block size 4)
    assert pd.read_csv(r / "tables/eval.csv").query("method == 'dflash'")["tau_pooled"].iloc[0] > 2


# -- bad input: one line naming the file; nothing half-written taken as complete ---------------


def test_a_truncated_expansion_is_one_line_and_recovers_once_deleted(mini_copy):
    work, cfg = mini_copy
    bad = work / "results/expanded/math.parquet"
    bad.write_bytes(bad.read_bytes()[:2000])
    res = run(work, cfg, "tokenize", forcerun="tokenize")
    assert res.returncode != 0
    (line,) = {ln.split("  [")[0] for ln in error_lines(res.stderr)}
    assert line.startswith("ERROR: results/expanded/math.parquet: cannot read (")
    assert "truncated or corrupt: delete it and rerun" in line and "Traceback" not in res.stderr
    bad.unlink()
    run_ok(work, cfg, "tokenize")


def test_outputs_follow_the_umask(mini_run):
    """Every file and folder of a finished run, the weights (written by safetensors and save_pretrained)
    included, has the mode a new file or folder gets under the umask."""
    work, _ = mini_run
    mask = os.umask(0)
    os.umask(mask)
    results = work / "results"
    weights = sorted(p.relative_to(work).as_posix() for p in results.rglob("*.safetensors"))
    for w in ["results/train/final.safetensors", "results/drafter/model.safetensors", "results/target/model/model.safetensors"]:
        assert w in weights
    for p in [results, *results.rglob("*")]:
        want = 0o777 & ~mask if p.is_dir() else 0o666 & ~mask
        assert p.stat().st_mode & 0o777 == want, (p.relative_to(work), oct(p.stat().st_mode & 0o777))


def test_a_republished_run_has_the_same_bytes(mini_copy):
    """--forcerun train on a finished run writes its outputs again without a step: byte for byte the same
    (safetensors' header metadata came out in another order on every save)."""
    work, cfg = mini_copy
    final = work / "results/train/final.safetensors"
    before = sha256(final)
    for _ in range(2):
        run_ok(work, cfg, "results/train/final.safetensors", forcerun="train")
        assert sha256(final) == before


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "my.yaml"
    bad.write_text("train:\n  shards: 2\n   lr: [1, 2\n")
    res = subprocess.run([os.sys.executable, "-m", "dflashpipe.config", str(bad)], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.strip() == (f"ERROR: {bad}:3:6: YAML syntax error (mapping values are not allowed here); "
                                  "fix that line (indentation, a missing ':' or bracket)")
    good = tmp_path / "ok.yaml"
    good.write_text(yaml.safe_dump({"train": {"lr": 0.001}}))
    assert subprocess.run([os.sys.executable, "-m", "dflashpipe.config", str(good)], capture_output=True).returncode == 0


def test_the_wall_clock_safety_stop_fails_the_job_instead_of_passing_on_a_cut_model(micro_target):
    from transformers import AutoTokenizer

    from dflashpipe.inputs.tiny_target import TinyTargetConfig, build_model, train_lm
    from dflashpipe.jobs.errors import UserError

    tok = AutoTokenizer.from_pretrained(str(micro_target))
    cfg = TinyTargetConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                           seq_len=32, batch_size=2, max_steps=5, max_minutes=1e-9)
    with pytest.raises(UserError) as e:
        train_lm(build_model(cfg, tok), [list(range(5, 200))] * 4, cfg, log=lambda m: None, desc="tiny target",
                 stop_key="target.tiny.max_minutes")
    msg = str(e.value)
    assert "the target.tiny.max_minutes safety stop" in msg and "after step 1 of 5" in msg and "nothing was saved" in msg
