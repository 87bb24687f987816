"""The DFlash drafter: model, masks, loss and checkpoint export."""

from .export import load_drafter, save_drafter
from .loss import decayed_ce
from .masks import (
    block_mask,
    block_position_ids,
    build_block_inputs,
    default_gamma,
    dense_mask,
    dflash_mask_mod,
    sample_anchors,
)
from .model import (
    DFlashDrafter,
    DraftCache,
    DrafterConfig,
    default_target_layer_ids,
    set_flex_attention,
    use_compiled_flex_attention,
)

__all__ = [
    "DFlashDrafter",
    "DraftCache",
    "DrafterConfig",
    "block_mask",
    "block_position_ids",
    "build_block_inputs",
    "decayed_ce",
    "default_gamma",
    "default_target_layer_ids",
    "dense_mask",
    "dflash_mask_mod",
    "load_drafter",
    "sample_anchors",
    "save_drafter",
    "set_flex_attention",
    "use_compiled_flex_attention",
]
