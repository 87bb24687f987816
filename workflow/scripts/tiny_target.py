from dflashpipe.inputs.data import read_prompts
from dflashpipe.inputs.target import target_fingerprint, write_target_id
from dflashpipe.inputs.tiny_target import TinyTargetConfig, train_tiny_target
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config, settings


def chats(path):
    df = read_prompts(path)
    df = df[df["reference"].notna()]
    if df.empty:
        raise UserError(f"{path}: no row has an assistant reply; the tiny target needs reference chats to learn from")
    return [list(p) + [{"role": "assistant", "content": r}] for p, r in zip(df["prompt"], df["reference"])]


with job(snakemake.log[0], threads=snakemake.threads, name="tiny_target", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        # the whole section (params hold the result-changing keys only to trigger reruns)
        config = job_config(snakemake)
        cfg = settings(TinyTargetConfig, config["target"]["tiny"], seed=config["seed"])
        train = [c for path in snakemake.input.train for c in chats(path)]
        model = folder_of(snakemake.output.model)
        metrics = train_tiny_target(train, chats(snakemake.input.heldout), cfg, model, snakemake.output.metrics, log=log)
        write_target_id(snakemake.output.target_id, target_fingerprint(model))
        log(
            f"held-out loss {metrics['heldout_loss']:.3f}, {metrics['tokens_per_second']:.0f} tok/s, "
            f"{metrics['train_minutes']:.1f} min, format ok {metrics['format_ok']:.0%}"
        )
        memo.keep(log)
