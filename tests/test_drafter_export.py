"""Export in the published DFlash layout, and loading it back."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflashpipe.drafter.export import load_drafter, save_drafter
from dflashpipe.drafter.masks import block_position_ids, dense_mask
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig, expected_state_shapes
from dflashpipe.errors import UserError

torch.set_num_threads(1)

H, V = 64, 101


def tiny_target_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0},
        eos_token_id=3,
    )


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    tc = tiny_target_config()
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1)
    model = DFlashDrafter(cfg).eval()
    out = save_drafter(model, cfg, tmp_path / "drafter", tc)
    return model, cfg, out


def _logits(model, cfg, lm_head):
    g = torch.Generator().manual_seed(1)
    S, bs = 12, cfg.block_size
    anchors = torch.tensor([[2, 7]])
    keep = torch.tensor([[True, True]])
    th = torch.randn(1, S, len(cfg.target_layer_ids) * H, generator=g)
    emb = torch.randn(1, 2 * bs, H, generator=g)
    with torch.no_grad():
        h = model(emb, th, block_position_ids(anchors, S, bs), dense_mask(anchors, keep, S, bs))
    return h @ lm_head.t()


def test_roundtrip_identical_logits(saved):
    model, cfg, out = saved
    loaded, cfg2 = load_drafter(out, "cpu")
    assert cfg2 == cfg
    lm_head = torch.randn(V, H)
    assert torch.equal(_logits(model, cfg, lm_head), _logits(loaded, cfg2, lm_head))
    # no temporary siblings left behind
    assert sorted(p.name for p in out.parent.iterdir()) == ["drafter"]


def test_config_json_layout(saved):
    _, cfg, out = saved
    d = json.loads((out / "config.json").read_text())
    assert d["model_type"] == "qwen3"
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["num_hidden_layers"] == 2
    assert d["block_size"] == 4
    assert d["num_target_layers"] == 6
    assert d["rope_theta"] == 250000.0
    assert d["dflash_config"] == {"block_size": 4, "mask_token_id": V - 1, "target_layer_ids": cfg.target_layer_ids}
    assert d["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert d["layer_types"] == ["full_attention"] * 2 and d["use_sliding_window"] is False
    assert cfg.target_layer_ids == [1, 3]  # default: spread over 1..L-3 with n = drafter layers
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        assert d[key] == getattr(cfg, key), key
    assert d["eos_token_id"] == 3
    # transformers reads it as a Qwen3 config with the right theta
    from transformers import AutoConfig

    qc = AutoConfig.from_pretrained(out)
    assert qc.model_type == "qwen3" and qc.rope_parameters["rope_theta"] == 250000.0


REFERENCE = json.loads((Path(__file__).parent / "fixtures/dflash_reference_layout_qwen3_8b.json").read_text())


def test_layout_equals_the_published_qwen3_8b_drafter():
    """The drafter for a Qwen3-8B target has exactly the keys and shapes of z-lab's published one."""
    from transformers import Qwen3Config

    t, d = REFERENCE["target"], REFERENCE["drafter"]
    tc = Qwen3Config(**{k: v for k, v in t.items() if k != "model_type"})
    cfg = DrafterConfig.from_target_config(tc, d["num_hidden_layers"], d["block_size"], d["mask_token_id"])
    assert cfg.target_layer_ids == d["target_layer_ids"]  # the default taps are the published ones
    with torch.device("meta"):  # 1 B parameters: shapes only
        model = DFlashDrafter(cfg)
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == REFERENCE["safetensors"]


PUBLISHED_CONFIG = json.loads((Path(__file__).parent / "fixtures/dflash_reference_config_qwen3_8b.json").read_text())


def qwen3_8b_drafter_config_json() -> dict:
    """The config.json this export writes for a Qwen3-8B target (shapes only: no weights are built)."""
    from transformers import Qwen3Config

    from dflashpipe.drafter.export import drafter_config_json

    t, d = REFERENCE["target"], REFERENCE["drafter"]
    tc = Qwen3Config(
        **{k: v for k, v in t.items() if k != "model_type"},
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643,
        eos_token_id=151645,
    )
    cfg = DrafterConfig.from_target_config(tc, d["num_hidden_layers"], d["block_size"], d["mask_token_id"])
    return drafter_config_json(cfg, tc, torch.bfloat16)


def test_config_json_equals_the_published_qwen3_8b_drafter():
    """Key by key against z-lab/Qwen3-8B-DFlash-b16's config.json (as far as public copies verify it)."""
    ours = qwen3_8b_drafter_config_json()
    published = PUBLISHED_CONFIG["verified"]["config"]
    for key, want in published.items():
        if key == "dflash_config":
            # ours nests block_size too (what SGLang reads first); every published key is equal
            assert {k: ours[key][k] for k in want} == want, key
            assert ours[key]["block_size"] == ours["block_size"] == 16
        else:
            assert ours[key] == want, key
    family = PUBLISHED_CONFIG["family"]
    replaced = set(family["keys_transformers_5_replaces"])
    assert set(family["keys"]) - replaced <= set(ours), sorted(set(family["keys"]) - replaced - set(ours))
    # what ours adds: transformers 5's rope_parameters (rope_theta stays at the top level) and a null pad id
    assert set(ours) - set(family["keys"]) == {"rope_parameters", "pad_token_id"}
    assert ours["rope_theta"] == ours["rope_parameters"]["rope_theta"] == 1000000.0
    for key, want in family["target_independent"].items():
        if key == "layer_types_each":
            assert ours["layer_types"] == [want] * ours["num_hidden_layers"]
        else:
            assert ours[key] == want, key


def test_safetensors_keys_exact(saved):
    _, cfg, out = saved
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    # the published names, for this drafter's 2 layers
    published = {k for k in REFERENCE["safetensors"] if not k.startswith("layers.") or int(k.split(".")[1]) < 2}
    assert keys == published
    assert shapes == expected_state_shapes(cfg)  # and what the loader checks against
    assert "fc.weight" in keys and shapes["fc.weight"] == (H, 2 * H)
    assert not any(k.startswith("model.") or "bias" in k or "embed" in k or "lm_head" in k for k in keys)
    assert all(t.is_floating_point() for t in load_file(out / "model.safetensors").values())


def test_loads_block_size_and_target_layers_nested_in_dflash_config(saved):
    """Newer published drafters (e.g. z-lab's Qwen3.5 ones) keep them only in dflash_config."""
    _, cfg, out = saved
    d = json.loads((out / "config.json").read_text())
    d["dflash_config"]["num_target_layers"] = d.pop("num_target_layers")
    del d["block_size"]
    (out / "config.json").write_text(json.dumps(d))
    assert load_drafter(out)[1] == cfg


def test_save_bf16_and_load_dtype(tmp_path, saved):
    model, cfg, _ = saved
    out = save_drafter(model, cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, _ = load_drafter(out)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    loaded32, _ = load_drafter(out, dtype=torch.float32)
    assert next(loaded32.parameters()).dtype == torch.float32


def test_load_errors_are_one_line_user_errors(tmp_path, saved):
    _, _, out = saved
    with pytest.raises(UserError, match="directory not found"):
        load_drafter(tmp_path / "nope")

    state = load_file(out / "model.safetensors")
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, out / "model.safetensors")
    with pytest.raises(UserError, match=r"model\.safetensors: missing key 'layers\.1\.mlp\.up_proj\.weight'"):
        load_drafter(out)

    state["layers.1.mlp.up_proj.weight"] = torch.zeros(5, 5)
    save_file(state, out / "model.safetensors")
    with pytest.raises(UserError, match=r"key 'layers\.1\.mlp\.up_proj\.weight' has shape \[5, 5\], expected \[96, 64\]"):
        load_drafter(out)

    state["layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    state["embed_tokens.weight"] = torch.zeros(V, H)
    save_file(state, out / "model.safetensors")
    with pytest.raises(UserError, match="unexpected key 'embed_tokens.weight'"):
        load_drafter(out)

    d = json.loads((out / "config.json").read_text())
    del d["num_target_layers"]
    (out / "config.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match=r"config\.json: missing key 'num_target_layers'"):
        load_drafter(out)

    (out / "config.json").unlink()
    with pytest.raises(UserError, match=r"config\.json: file not found") as info:
        load_drafter(out)
    assert "\n" not in str(info.value)
