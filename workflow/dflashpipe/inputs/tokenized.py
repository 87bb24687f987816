"""The tokenized data on disk: its files, its writer and its reader.

:mod:`dflashpipe.inputs.tokenize` makes the samples; this module is the format they are kept in
(``results/tokenized/train``), read by training, its compile warm-up, the AR draft and the draft vocabulary.
Those stages' code digests take in this module, not the tokenizing code: an edit of how chats are
tokenized reruns the tokenize job, and a job after it whose input comes out with the same bytes
restores its outputs instead of computing them again (training does not start over).
"""

from __future__ import annotations

from pathlib import Path

from dflashpipe.jobs.atomic import atomic_path
from dflashpipe.jobs.errors import UserError, damaged_output

#: the files of the tokenized dataset (``datasets.save_to_disk`` in one shard): the workflow asks for each
#: of them, so a file deleted from ``results/tokenized/train/`` makes the tokenize job run again
TOKENIZED_FILES = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")


def save_tokenized(records: list[dict], out_dir: str) -> None:
    """The samples as one ``datasets`` dataset on disk (atomically)."""
    import datasets

    features = datasets.Features(
        {
            "dataset": datasets.Value("string"),
            "id": datasets.Value("string"),
            "sample": datasets.Value("int32"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "length": datasets.Value("int32"),
            "num_loss_tokens": datasets.Value("int32"),
            "bucket": datasets.Value("int32"),
        }
    )
    ds = datasets.Dataset.from_list(records, features=features)
    with atomic_path(out_dir, is_dir=True) as tmp:
        ds.save_to_disk(str(tmp), num_shards=1)


def load_tokenized(path: str):
    import datasets

    if not Path(path).exists():
        raise UserError(f"{path}: tokenized dataset missing; run the tokenize stage first")
    try:
        return datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001 - pyarrow and datasets raise several types for a damaged file
        raise damaged_output(path, err) from None
