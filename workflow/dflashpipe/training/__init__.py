"""A drafter's training run: its data (:mod:`.data`), step (:mod:`.step`), loop (:mod:`.loop`),
checkpoints and identity (:mod:`.checkpoint`, :mod:`.run`), ranks (:mod:`.distributed`,
:mod:`.launch`), and the job's entry points (:mod:`.train`).

Import from the submodules. This file imports nothing, so that a module's import closure (which
decides what a code edit reruns and what a training run's identity covers) holds only what the
module really uses.
"""
