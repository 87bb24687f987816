"""dflashpipe: the library behind the DFlash drafter pipeline.

Everything with real logic lives here and is importable and testable without
Snakemake; the workflow's scripts only unpack ``snakemake.input/output/params``
and call into this package.
"""
