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
