"""A sharded stage's output put back together: the expansion's shards into one table per dataset.

Apart from the decoding backends (:mod:`dflashpipe.stages.expand`) on purpose: the merge rule's code
dependencies are this module's imports, so a decoder edit does not rerun a merge by itself.
"""

from __future__ import annotations

import pandas as pd

from dflashpipe.inputs.data import read_parquet
from dflashpipe.jobs.atomic import atomic_path


def merge_shards(shard_paths: list[str], out_path: str) -> int:
    """Concatenate expanded shards into one parquet file (atomically)."""
    frames = [read_parquet(p) for p in shard_paths]
    df = pd.concat([f for f in frames if len(f)] or frames[:1], ignore_index=True)  # empty shards add nothing
    with atomic_path(out_path) as tmp:
        df.to_parquet(tmp, index=False)
    return len(df)
