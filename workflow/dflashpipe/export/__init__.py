"""A trained drafter as a Hugging Face folder: the files (:mod:`.files`), the writer and loader
(:mod:`.write`), the remote code shipped beside the weights (:mod:`.hf_modeling`) and the model
card (:mod:`.card`).

Import from the submodules; this file imports nothing (see :mod:`dflashpipe.training`).
"""
