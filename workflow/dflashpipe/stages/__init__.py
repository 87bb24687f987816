"""Stage code that drives the packages beside it: the expansion (the target regenerates the
training replies, through :mod:`dflashpipe.decode` or a server; its shards merged) and the report
(tables and plots of the training and evaluation results)."""
