"""The files of a drafter export, named once: the export writes exactly these, and the workflow asks for
each of them (a file deleted from ``results/drafter/`` makes the export run again)."""

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: the remote code beside the weights: a copy of hf_modeling.py (what ``auto_map`` names)
CODE_NAME = "dflash.py"
#: the model card
CARD_NAME = "README.md"
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, CODE_NAME, CARD_NAME)
