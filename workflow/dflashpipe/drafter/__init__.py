"""The DFlash drafter: model (:mod:`.model`), masks, loss, training (:mod:`.train`, its step loop
in :mod:`.loop`) and export.

Import from the submodules (e.g. ``from dflashpipe.drafter.model import DFlashDrafter``). This
file imports nothing, so that a module's import closure (which decides what a code edit reruns
and what a training run's identity covers) holds only what the module really uses.
"""
