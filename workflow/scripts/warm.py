import time

from dflashpipe.training.train import TrainConfig, warm_compile
from dflashpipe.jobs.compile_cache import seed_slot_cache
from dflashpipe.jobs.compile_cache import use_slot_cache
from dflashpipe.jobs.hotstart import write_stamp
from dflashpipe.jobs.lease import lease_for_job, one_compile_at_a_time
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config, settings

slot = int(snakemake.wildcards.slot)
p = snakemake.params
with job(snakemake.log[0], threads=snakemake.threads, name=f"warm_slot{slot}", outputs=snakemake.output) as log:
    started = time.time()
    config = job_config(snakemake)
    lease = lease_for_job(config, slot=slot)
    log(f"leased slot {slot}: device {lease.device} (CUDA_VISIBLE_DEVICES={lease.visible_devices})")
    with one_compile_at_a_time(config, log):  # never two compiles at once, in any chain
        seeded = seed_slot_cache(p.cache_root, slot)
        if seeded:
            log(f"seeded the cache with {seeded} files compiled by warm_slot{slot - 1}")
        cache = use_slot_cache(p.cache_root, slot)
        cfg = settings(TrainConfig, p.compile["drafter"], p.compile["train"], seed=config["seed"])  # the keys that decide compiled code
        ranks = p.compile["train"]["shards"] * p.compile["train"]["nodes"]  # one rank's shapes of a run of that many
        out = warm_compile(cfg, folder_of(snakemake.input.tokenized), snakemake.params.target, lease.device, ranks, log=log)
        stamp = write_stamp(snakemake.output[0], out["signature"], lease.device, cache, out["bucket_seconds"], slot,
                            interval=(started, time.time()))
        log(f"stamp {stamp['fingerprint']}: {stamp['compile_seconds']:.1f}s compiling, counters {stamp['counters']}")
