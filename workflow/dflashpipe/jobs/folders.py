"""Folders the workflow names file by file."""

import os


def folder_of(files) -> str:
    """The folder of an input or output that the workflow names file by file (the tokenized data, a model,
    the drafter export; each file an output of its own, so that one deleted makes its job run again): the
    one folder that holds them all."""
    (folder,) = {os.path.dirname(str(f)) for f in files}
    return folder
