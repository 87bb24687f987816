"""benchmarks/pipeline_jobs.py: each job's span, read from a real Snakemake run's log (the H200 run committed
under benchmarks/results/h200_pipeline_wall/)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG = REPO / "benchmarks" / "results" / "h200_pipeline_wall" / "snakemake.log"


def _module():
    spec = importlib.util.spec_from_file_location("pipeline_jobs", REPO / "benchmarks" / "pipeline_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spans_of_a_real_run():
    rows = _module().job_spans(LOG.read_text().splitlines())
    by = {(r["rule"], r["wildcards"]): r for r in rows}
    assert len(rows) == 17
    assert by[("warm_slot", "slot=0")]["seconds"] == 95
    assert by[("train", "")]["seconds"] == 83
    assert by[("evaluate", "dataset=math_heldout")]["start_s"] == 305
    assert max(r["start_s"] + r["seconds"] for r in rows) == 442


def test_a_job_without_its_finished_line_is_left_out(tmp_path):
    lines = LOG.read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("Finished jobid:") and "(Rule: plots)" in line)
    rows = _module().job_spans(lines[:cut])  # the log of a run stopped while the plots job ran
    assert "plots" not in {r["rule"] for r in rows}
    assert len(rows) == 15  # plots and all are missing


def test_cli_writes_the_table_and_csv(tmp_path, capsys):
    out = tmp_path / "jobs.csv"
    assert _module().main([str(LOG), "--csv", str(out)]) == 0
    assert "| warm_slot | slot=0 | 112 | 95 |" in capsys.readouterr().out
    assert out.read_text().splitlines()[0] == "rule,wildcards,start_s,seconds"


def test_a_real_runs_jobs_split_into_start_up_compile_and_work(mini_run, capsys):
    """The mini run's own Snakemake log and job logs: every job's span splits into start-up (its processes
    before the job began), compiling and work; the training job adds its ranks' start-up to its own."""
    work, _ = mini_run
    log = sorted((work / ".snakemake" / "log").glob("*.snakemake.log"))[0]  # the first run: every job ran
    mod = _module()
    rows = mod.job_spans(log.read_text().splitlines())
    train = next(r for r in rows if r["rule"] == "train")
    assert any("rank1" in p for p in train["logs"]), train["logs"]  # the ranks' logs come with the job's block
    split = {(r["rule"], r["wildcards"]): mod.cost_split(r, work) for r in rows}
    scripts = {k: v for k, v in split.items() if v}  # the jobs that run a script (not `all`)
    assert {"train", "evaluate", "export", "tokenize"} <= {rule for rule, _ in scripts}
    for key, c in scripts.items():
        assert c["startup_s"] > 0 and c["compile_s"] >= 0 and c["work_s"] >= 0, (key, c)
    own = mod.log_costs(work / train["logs"][0])
    assert split[("train", "")]["startup_s"] > own[0]  # the launcher's start-up, then a rank's
    assert mod.main([str(log), "--root", str(work)]) == 0
    out = capsys.readouterr().out
    assert "| job | wildcards | starts at (s) | seconds | startup (s) | compile (s) | work (s) |" in out
    assert "summed over the" in out


def test_a_job_log_says_how_long_it_compiled(tmp_path):
    """dflashpipe.jobs.runtime.job's last line counts torch.compile's time in that process (a process of its
    own, as a job is: the job redirects its descriptors to the log)."""
    import subprocess
    import sys

    log = tmp_path / "job.log"
    body = ("import torch\nfrom dflashpipe.jobs.runtime import job\n"
            f"with job({str(log)!r}, name='compiles'):\n"
            "    torch.compile(lambda x: (x.sin() + 1).cos())(torch.randn(8))\n")
    res = subprocess.run([sys.executable, "-c", body], cwd=REPO / "workflow", capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    began, compiled = _module().log_costs(log)
    assert began > 0 and compiled > 0.1, log.read_text()
