"""The DFlash drafter network: the model (:mod:`.model`), its attention masks (:mod:`.masks`), its
objectives (:mod:`.loss`) and the target features it reads (:mod:`.features`, :mod:`.fp8`).
Training it is :mod:`dflashpipe.training`'s; exporting it, :mod:`dflashpipe.export`'s.

Import from the submodules (e.g. ``from dflashpipe.drafter.model import DFlashDrafter``). This
file imports nothing, so that a module's import closure (which decides what a code edit reruns
and what a training run's identity covers) holds only what the module really uses.
"""
