from dflashpipe.jobs.compile_cache import lease_gpu_slot
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import expansion_seed, job_config, on_server, settings
from dflashpipe.stages.expand import ExpandSettings, discard_chunks, expand_prompts
from dflashpipe.stages.expand_openai import ServerSettings

with job(snakemake.log[0], threads=snakemake.threads, name=f"expand {snakemake.wildcards.dataset} shard {snakemake.wildcards.shard}", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if memo.restore(log):  # the same inputs (by content), params and code: their outputs
        discard_chunks(snakemake.output[0])
    else:
        p = snakemake.params
        config = job_config(snakemake)
        expand_settings = settings(ExpandSettings, config["expand"], seed=expansion_seed(config))
        server = settings(ServerSettings, config["expand"]["server"])  # operational: read at run time
        if not on_server(expand_settings.backend):  # the target runs in this job
            lease = lease_gpu_slot(config, log)  # any free GPU slot
            device = lease.device
        else:  # the server generates; this job only tokenizes and sends requests
            log(f"backend {expand_settings.backend}: no GPU slot leased; server {server.url}")
            device = "cpu"
        expand_prompts(
            snakemake.input.prompts,
            snakemake.params.target,
            expand_settings,
            snakemake.output[0],
            shard=int(snakemake.wildcards.shard),
            n_shards=snakemake.params.n_shards,
            device=device,
            log=log,
            server=server,
        )
        memo.keep(log)
