"""Export in the published DFlash layout, and loading it back."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflashpipe.export.card import model_card
from dflashpipe.export.write import load_drafter, save_drafter
from dflashpipe.drafter.masks import block_position_ids, dense_mask
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig, expected_state_shapes
from dflashpipe.jobs.errors import UserError

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
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, arch="dflash")
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
    cfg = DrafterConfig.from_target_config(tc, d["num_hidden_layers"], d["block_size"], d["mask_token_id"], arch="dflash")
    assert cfg.target_layer_ids == d["target_layer_ids"]  # the default taps are the published ones
    with torch.device("meta"):  # 1 B parameters: shapes only
        model = DFlashDrafter(cfg)
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == REFERENCE["safetensors"]


PUBLISHED_CONFIG = json.loads((Path(__file__).parent / "fixtures/dflash_reference_config_qwen3_8b.json").read_text())


def qwen3_8b_drafter_config_json() -> dict:
    """The config.json this export writes for a Qwen3-8B target (shapes only: no weights are built)."""
    from transformers import Qwen3Config

    from dflashpipe.export.write import drafter_config_json

    t, d = REFERENCE["target"], REFERENCE["drafter"]
    tc = Qwen3Config(
        **{k: v for k, v in t.items() if k != "model_type"},
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=151643,
        eos_token_id=151645,
    )
    cfg = DrafterConfig.from_target_config(tc, d["num_hidden_layers"], d["block_size"], d["mask_token_id"], arch="dflash")
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


# -- DFlash 2 and sliding windows -------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
DFLASH2_CONFIG = json.loads((FIXTURES / "dflash2_reference_config.json").read_text())
DFLASH2_LAYOUT = json.loads((FIXTURES / "dflash2_reference_layout.json").read_text())["safetensors"]


def dflash2_reference_drafter_config():
    """The target and drafter settings of z-lab's DFlash 2 fixture (a 52-layer, hidden 6656 target)."""
    from transformers import Qwen3Config

    z, dz = DFLASH2_CONFIG, DFLASH2_CONFIG["dflash_config"]
    tc = Qwen3Config(vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_hidden_layers=52,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                     max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                     bos_token_id=200000, eos_token_id=200001, pad_token_id=200018)
    cfg = DrafterConfig.from_target_config(
        tc, 5, 16, 201818, arch="dflash2", sliding_window=2048, conv_kernel_size=2, conv_group_size=16,
        selector_rank=256, selector_top_k=16, final_logit_softcapping=20.0, output_multiplier=z["dflash_config"]["output_multiplier"])
    assert cfg.target_layer_ids == dz["target_layer_ids"]  # the default taps are z-lab's
    return tc, cfg


def test_dflash2_layout_and_config_equal_the_reference():
    """A DFlash 2 drafter of the fixture's shapes has exactly z-lab's keys and shapes, and its config.json
    equals z-lab's key by key (the only additions: auto_map, top-level block_size and rope_theta)."""
    from dflashpipe.export.write import _cfg_from_json, drafter_config_json

    tc, cfg = dflash2_reference_drafter_config()
    with torch.device("meta"):  # 1.6 B parameters: shapes only
        model = DFlashDrafter(cfg)
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == DFLASH2_LAYOUT
    assert {k: list(v) for k, v in expected_state_shapes(cfg).items()} == DFLASH2_LAYOUT

    ours = drafter_config_json(cfg, tc, torch.bfloat16)
    for key, want in DFLASH2_CONFIG.items():
        if key != "transformers_version":
            assert ours[key] == want, key
    assert set(ours) - set(DFLASH2_CONFIG) == {"auto_map", "block_size", "rope_theta"}
    assert ours["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
    assert ours["block_size"] == 16 and ours["rope_theta"] == 500000.0
    # and z-lab's config.json reads back as this drafter
    assert _cfg_from_json(DFLASH2_CONFIG, Path("config.json")) == cfg


def small_target_config(layers: int = 6):
    cfg = tiny_target_config()
    cfg.num_hidden_layers = layers
    return cfg


ARCH_CASES = {
    "dflash2": dict(arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=5,
                    final_logit_softcapping=15.0, output_multiplier=0.5),
    "sliding": dict(arch="dflash", layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    "dflash2_sliding": dict(arch="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=3,
                            layer_types=["full_attention", "sliding_attention"], sliding_window=4),
    "dspark": dict(arch="dspark", markov_rank=8),
}


def random_drafter(cfg, seed=0):
    """A drafter with every parameter random (the convolutions and selector too, not their identity init)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "base_kernel" in name or "codebook" in name or "kernel_projection" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_roundtrip_of_every_arch_and_sliding_windows(tmp_path, case):
    tc = tiny_target_config()
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, **ARCH_CASES[case])
    model = random_drafter(cfg)
    out = save_drafter(model, cfg, tmp_path / "d", tc)
    loaded, cfg2 = load_drafter(out)
    assert cfg2 == cfg
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "dflash.py", "model.safetensors"]
    d = json.loads((out / "config.json").read_text())
    arch = {"dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}.get(cfg.arch, "DFlashDraftModel")
    assert d["architectures"] == [arch] and d["auto_map"] == {"AutoModel": f"dflash.{arch}"}
    assert d["layer_types"] == cfg.layer_types
    if cfg.sliding_window:
        assert (d["sliding_window"], d["use_sliding_window"], d["is_causal"]) == (cfg.sliding_window, True, False)
    if cfg.arch == "dflash2":
        assert d["dflash_config"]["selector_top_k"] == cfg.selector_top_k and d["use_cache"] is False
    # the same drafts, step by step, from the loaded drafter (windows and selector included)
    g = torch.Generator().manual_seed(5)
    S = 14
    feats = torch.randn(1, S, len(cfg.target_layer_ids) * H, generator=g)
    block = torch.randn(1, 4, H, generator=g)
    head = torch.randn(V, H, generator=g)
    drafts = []
    for m in (model, loaded):
        cache = m.new_cache()
        m.extend_context(cache, feats, torch.arange(S).view(1, -1))
        hidden = m.draft(cache, block, torch.arange(S, S + 4).view(1, -1))
        drafts.append((hidden, m.propose(hidden, torch.tensor([7]), head)))
    assert torch.equal(drafts[0][0], drafts[1][0]) and torch.equal(drafts[0][1], drafts[1][1])


def test_a_sliding_layer_without_is_causal_false_is_refused(tmp_path):
    tc = tiny_target_config()
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, **ARCH_CASES["sliding"])
    out = save_drafter(random_drafter(cfg), cfg, tmp_path / "d", tc)
    d = json.loads((out / "config.json").read_text())
    del d["is_causal"]  # z-lab's reference would then make the sliding layers causal inside the block
    (out / "config.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="sliding_attention layers need 'is_causal': false") as info:
        load_drafter(out)
    assert "\n" not in str(info.value)



def _engine_value(d, key, nested=("dspark_config", "dflash_config")):
    """A key as SGLang's DFlash/DSpark parsers read it: the nested config first, then the top level."""
    for section in nested:
        if key in (d.get(section) or {}):
            return d[section][key]
    return d.get(key)


@pytest.mark.parametrize("case", ["dflash", *sorted(ARCH_CASES)])
def test_config_carries_what_sglang_and_vllm_readers_require(tmp_path, case):
    """config.json holds what SGLang's parse_dflash_draft_config / parse_dspark_draft_config and vLLM's
    qwen3_dflash.py read: block_size, target_layer_ids, mask_token_id; DFlash 2's conv_kernel_size with
    conv_group_size and selector_rank with selector_top_k as pairs (SGLang refuses one without the other);
    with sliding layers is_causal: false (vLLM and z-lab's reference make sliding layers causal without it)."""
    tc = tiny_target_config()
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, **ARCH_CASES.get(case, {"arch": "dflash"}))
    d = json.loads((save_drafter(random_drafter(cfg), cfg, tmp_path / "d", tc) / "config.json").read_text())
    assert _engine_value(d, "block_size") == cfg.block_size == d["block_size"]
    layers = _engine_value(d, "target_layer_ids")
    assert layers and all(isinstance(i, int) and 0 <= i < d["num_target_layers"] for i in layers)
    assert layers == list(cfg.target_layer_ids) and d["num_target_layers"] == tc.num_hidden_layers
    mask = _engine_value(d, "mask_token_id")
    assert isinstance(mask, int) and not isinstance(mask, bool) and 0 <= mask < d["vocab_size"]
    dc = d["dflash_config"]
    for a, b in (("conv_kernel_size", "conv_group_size"), ("selector_rank", "selector_top_k")):
        assert bool(dc.get(a, 0)) == bool(dc.get(b, 0)), (a, b, dc)
        assert bool(dc.get(a, 0)) == (cfg.arch == "dflash2"), (a, dc)
    if cfg.arch == "dflash2":
        assert (dc["conv_kernel_size"], dc["conv_group_size"]) == (cfg.conv_kernel_size, cfg.conv_group_size)
        assert (dc["selector_rank"], dc["selector_top_k"]) == (cfg.selector_rank, cfg.selector_top_k)
    sliding = "sliding_attention" in (d.get("layer_types") or [])
    assert sliding == bool(cfg.sliding_window)
    if sliding:
        assert d["is_causal"] is False and isinstance(d["sliding_window"], int) and d["sliding_window"] > 0
    else:
        assert d.get("is_causal") is not True
    if cfg.arch == "dspark":  # SGLang's DSpark parser: a Markov head needs its type; the mask is required
        assert _engine_value(d, "markov_rank") == cfg.markov_rank > 0
        assert _engine_value(d, "markov_head_type") == "vanilla" and d["dspark_config"]["mask_token_id"] == mask


@pytest.mark.parametrize("case", ["dflash", "dflash2", "dspark"])
def test_every_export_has_a_model_card_naming_target_recipe_and_serving_flags(tmp_path, case):
    tc = tiny_target_config()
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, **ARCH_CASES.get(case, {"arch": "dflash"}))
    card = save_drafter(random_drafter(cfg), cfg, tmp_path / "d", tc,
                        card=model_card(cfg, target="Qwen/Qwen3-8B", drafter="out/drafter")) / "README.md"
    text = card.read_text()
    front = text.split("---\n")[1]
    assert "base_model: Qwen/Qwen3-8B" in front and f"- {cfg.arch}" in front
    assert f"| architecture | `{cfg.arch}` |" in text and f"| block size | {cfg.block_size} " in text
    assert f"`{list(cfg.target_layer_ids)}`" in text and "results/tables/eval.csv" in text
    algorithm, method, verify, drafted = {
        "dspark": ("DSPARK", "dspark", cfg.block_size + 1, cfg.block_size),
    }.get(case, ("DFLASH", "dflash", cfg.block_size, cfg.block_size - 1))
    assert f"--speculative-algorithm {algorithm} --speculative-draft-model-path out/drafter" in text
    assert f"--speculative-num-draft-tokens {verify}" in text
    spec = json.loads(text.split("--speculative-config '")[1].split("'")[0])
    assert spec == {"method": method, "model": "out/drafter", "num_speculative_tokens": drafted}
    assert ("unquantized" in text) == (case == "dflash2")
    # without run details the export still has a card, named after the target's config
    plain = save_drafter(random_drafter(cfg), cfg, tmp_path / "p", tc) / "README.md"
    assert plain.read_text().startswith("---\nbase_model: ")

@pytest.mark.parametrize("case", ["dflash2", "sliding", "dspark"])
def test_transformers_assistant_refuses_what_it_cannot_run(tmp_path, case):
    from dflashpipe.evaluate.hf_assistant import export_hf_assistant

    tc = tiny_target_config()
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, **ARCH_CASES[case])
    out = save_drafter(random_drafter(cfg), cfg, tmp_path / "d", tc)
    with pytest.raises(UserError, match="MuseGlimmerAssistantModel") as info:
        export_hf_assistant(out, tmp_path / "hf")
    assert "\n" not in str(info.value) and not (tmp_path / "hf").exists()


# -- the export is self-contained: AutoModel with trust_remote_code, our own modeling file ----------

import subprocess  # noqa: E402
import sys  # noqa: E402

SV, SBS, SMASK, SEOS = 101, 4, 100, 3
SPEC_PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26]]

#: run in a fresh process: the export loaded through AutoModel (its dflash.py), the pipeline NOT importable
REMOTE_SCRIPT = r"""
import json, sys
sys.modules["dflashpipe"] = None  # the export must not need the pipeline
import torch
from transformers import AutoModel, AutoModelForCausalLM
args = json.loads(sys.argv[1])
torch.set_num_threads(1)
target = AutoModelForCausalLM.from_pretrained(args["target"], dtype=torch.float64).eval()
drafter = AutoModel.from_pretrained(args["drafter"], trust_remote_code=True, dtype=torch.float64).eval()
out = {"class": type(drafter).__name__, "module": type(drafter).__module__, "runs": []}
for prompt in args["prompts"]:
    ids, stats = drafter.spec_generate(target, torch.tensor([prompt]), args["max_new"], args["stop"], return_stats=True)
    out["runs"].append({"tokens": ids[0, len(prompt):].tolist(), **stats})
print("RESULT " + json.dumps(out))
"""


def run_script(script: str, args: dict, extra_env: dict | None = None) -> dict:
    import os

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_MODULES_CACHE=str(Path(args["cwd"]) / "hf_modules"), **(extra_env or {}))
    env.pop("PYTHONPATH", None)
    res = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=args["cwd"])
    assert res.returncode == 0, res.stderr[-4000:]
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def spec_target(tmp_path_factory):
    """A random float64 Qwen3 (weights scaled up: a varied greedy output), saved as a checkpoint directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=SV, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, max_position_embeddings=256, eos_token_id=SEOS)
    model = Qwen3ForCausalLM(tc).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
    model = model.to(torch.float64)
    out = tmp_path_factory.mktemp("spec_target") / "model"
    model.save_pretrained(out)
    return model, out


def fit_drafter(target, cfg, steps: int = 60) -> DFlashDrafter:
    """Fit a drafter (float64) to the target's greedy continuations of the first two prompts, so that some
    drafts are accepted and some are not."""
    from dflashpipe.decode.speculative import ARDecoder
    from dflashpipe.drafter.masks import build_block_inputs

    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).to(torch.float64)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings().weight
    batches = []
    for p in SPEC_PROMPTS[:2]:
        ids = torch.tensor([p + ARDecoder(target, []).generate(p, 20 + SBS).tokens])
        S = ids.shape[1]
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], dim=-1)
        loss_mask = torch.zeros(1, S, dtype=torch.bool)
        loss_mask[0, len(p) - 1:] = True
        anchors = torch.arange(len(p) - 1, S - 1).view(1, -1)
        keep = torch.ones_like(anchors, dtype=torch.bool)
        block_ids, labels, w = build_block_inputs(ids, loss_mask, anchors, keep, SBS, SMASK, shift=cfg.label_shift)
        pos = block_position_ids(anchors, S, SBS)
        previous = ids.gather(1, (pos[:, S:] + cfg.label_shift - 1).clamp(0, S - 1))  # the token before each label
        with torch.no_grad():
            block_embeds = emb(block_ids)
        batches.append((feats, block_embeds, pos, dense_mask(anchors, keep, S, SBS), labels, w, previous))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        for feats, block_embeds, pos, mask, labels, w, previous in batches:
            logits = drafter.compute_logits(drafter(block_embeds, feats, pos, mask), head)
            if drafter.markov_head is not None:  # DSpark: the Markov head's bias, teacher-forced
                logits = logits + drafter.markov_head.bias(previous)
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
            ((ce * w.flatten()).sum() / w.sum()).backward()
        opt.step()
    return drafter.eval()


REMOTE_CASES = {
    "dflash": dict(arch="dflash"),
    "dflash2": dict(arch="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4,
                    final_logit_softcapping=30.0, output_multiplier=0.5),
    "sliding": dict(arch="dflash", layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "dspark": dict(arch="dspark", markov_rank=8),
}


@pytest.mark.parametrize("case", sorted(REMOTE_CASES))
def test_export_loads_with_automodel_trust_remote_code_and_decodes_as_the_pipeline(spec_target, tmp_path, case):
    """The export alone (config.json, model.safetensors, dflash.py) loads through AutoModel with remote code, in a
    process that cannot import the pipeline, and its spec_generate gives, step for step, what the pipeline's loop
    gives (the same tokens as plain greedy decoding, the same drafts accepted per verify step)."""
    from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder

    target, target_dir = spec_target
    cfg = DrafterConfig.from_target_config(target.config, 2, SBS, SMASK, **REMOTE_CASES[case])
    drafter = fit_drafter(target, cfg)
    if cfg.arch == "dflash2":  # a live selector: random codebooks (it then overrules the argmax sometimes)
        with torch.no_grad():
            sel = drafter.candidate_selector
            for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
                p.normal_(0.0, 1.0)
    out = save_drafter(drafter, cfg, tmp_path / "drafter", target.config)
    got = run_script(REMOTE_SCRIPT, {"target": str(target_dir), "drafter": str(out), "prompts": SPEC_PROMPTS,
                                     "max_new": 20, "stop": [SEOS], "cwd": str(tmp_path)})
    want_class = {"dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}.get(cfg.arch, "DFlashDraftModel")
    assert got["class"] == want_class and "dflashpipe" not in got["module"]

    ours, cfg2 = load_drafter(out, dtype=torch.float64)
    accepted = []
    for prompt, run in zip(SPEC_PROMPTS, got["runs"]):
        pipe = DFlashDecoder(target, ours, cfg2, [SEOS]).generate(prompt, 20)
        plain = ARDecoder(target, [SEOS]).generate(prompt, 20)
        assert run["tokens"] == pipe.tokens == plain.tokens, prompt
        assert run["accepted"] == pipe.accepted and run["committed"] == pipe.committed, prompt
        accepted += run["accepted"]
    assert max(accepted) >= 1, accepted  # drafts were accepted: the comparison is not of empty steps
    if cfg.arch == "dflash2":  # the selector is live: it proposes other tokens than the argmax somewhere
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(8, SBS, cfg.hidden_size, generator=g, dtype=torch.float64)
        head = target.get_output_embeddings().weight
        anchors = torch.arange(8) + 5
        assert not torch.equal(ours.propose(hidden, anchors, head), ours.compute_logits(hidden[:, 1:], head).argmax(-1))


#: z-lab's own classes and loop (github.com/z-lab/dflash, dflash/model.py) on our exports, in a fresh process
REFERENCE_SCRIPT = r"""
import json, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["reference"])
import torch
from transformers import AutoModelForCausalLM
import dflash.model as ref
ref._cuda_time = time.perf_counter  # its stats timer synchronizes CUDA; this runs on the CPU
torch.set_num_threads(1)
target = AutoModelForCausalLM.from_pretrained(args["target"], dtype=torch.float64).eval()
out = {}
for name, (path, arch) in args["drafters"].items():
    cls = ref.DFlash2DraftModel if arch == "dflash2" else ref.DFlashDraftModel
    model = cls.from_pretrained(path, dtype=torch.float64).eval()
    runs = []
    for prompt in args["prompts"]:
        res = ref.dflash_generate(model, target, torch.tensor([prompt]), args["max_new"], args["stop"], return_stats=True)
        runs.append({"tokens": res.output_ids[0, len(prompt):].tolist(), "committed": res.acceptance_lengths})
    out[name] = runs
print("RESULT " + json.dumps(out))
"""


def test_loads_into_zlab_reference(spec_target, tmp_path):
    """Our DFlash, DFlash 2 and sliding-window exports load into z-lab's reference classes
    (``DFlashDraftModel`` / ``DFlash2DraftModel.from_pretrained``) and its greedy ``dflash_generate`` gives the
    tokens of our loop, committing as many per verify step (the reference shortens the last block to the
    length budget, so the last step may differ). Set DFLASH_REFERENCE_DIR to a checkout of z-lab/dflash."""
    import os

    from dflashpipe.decode.speculative import DFlashDecoder

    reference = os.environ.get("DFLASH_REFERENCE_DIR")
    if not reference:
        pytest.skip("DFLASH_REFERENCE_DIR is not set (a checkout of github.com/z-lab/dflash)")
    target, target_dir = spec_target
    drafters, ours = {}, {}
    for case in sorted(REMOTE_CASES):
        cfg = DrafterConfig.from_target_config(target.config, 2, SBS, SMASK, **REMOTE_CASES[case])
        drafter = fit_drafter(target, cfg)
        if cfg.arch == "dflash2":
            with torch.no_grad():
                sel = drafter.candidate_selector
                for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
                    p.normal_(0.0, 1.0)
        out = save_drafter(drafter, cfg, tmp_path / case, target.config)
        drafters[case] = (str(out), cfg.arch)
        ours[case] = load_drafter(out, dtype=torch.float64)
    got = run_script(REFERENCE_SCRIPT, {"reference": reference, "target": str(target_dir), "drafters": drafters,
                                        "prompts": SPEC_PROMPTS, "max_new": 20, "stop": [SEOS], "cwd": str(tmp_path)})
    for case, runs in got.items():
        drafter, cfg = ours[case]
        for prompt, run in zip(SPEC_PROMPTS, runs):
            pipe = DFlashDecoder(target, drafter, cfg, [SEOS]).generate(prompt, 20)
            assert run["tokens"] == pipe.tokens, (case, prompt)
            assert run["committed"][:-1] == pipe.committed[:-1], (case, prompt, run["committed"], pipe.committed)


# -- DSpark: DeepSpec's layout, the keys SGLang reads ----------------------------------------------

DSPARK_CONFIG = json.loads((FIXTURES / "dspark_reference_config.json").read_text())
DSPARK_LAYOUT = json.loads((FIXTURES / "dspark_reference_layout.json").read_text())["safetensors"]


def dspark_reference_drafter_config():
    """The target and drafter of DeepSpec's DSpark recipe (Qwen3-4B, block 7, rank 256)."""
    from transformers import Qwen3Config

    t, d = DSPARK_CONFIG["target"], DSPARK_CONFIG["config"]
    tc = Qwen3Config(**{k: v for k, v in t.items() if k not in ("model_type", "rope_theta")},
                     rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"]})
    cfg = DrafterConfig.from_target_config(tc, d["num_hidden_layers"], d["block_size"], d["mask_token_id"],
                                           arch="dspark", markov_rank=d["markov_rank"])
    assert cfg.target_layer_ids == d["target_layer_ids"]  # the default taps are DeepSpec's
    return tc, cfg


def test_dspark_layout_and_config_equal_the_reference(tmp_path):
    """A DSpark drafter of the recipe's shapes has DeepSpec's keys and shapes (less the target's embedding and LM
    head), its config.json carries every DeepSpec key with its value (less the training-only num_anchors) plus
    SGLang's nested dspark_config and dflash_config, reads back as the same drafter, and a checkpoint that carries
    the target's embedding and LM head loads with them skipped."""
    from dflashpipe.export.write import SHARED_PREFIXES, _cfg_from_json, drafter_config_json

    tc, cfg = dspark_reference_drafter_config()
    with torch.device("meta"):  # shapes only
        model = DFlashDrafter(cfg)
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: v for k, v in DSPARK_LAYOUT.items() if not k.startswith(SHARED_PREFIXES)}
    assert set(DSPARK_LAYOUT) - set(ours) == {"embed_tokens.weight", "lm_head.weight"}

    written = drafter_config_json(cfg, tc, torch.bfloat16)
    for key, want in DSPARK_CONFIG["config"].items():
        if key not in DSPARK_CONFIG["training_only"]:
            assert written[key] == want, key
    assert written["auto_map"] == {"AutoModel": "dflash.Qwen3DSparkModel"}
    assert written["dspark_config"] == {"block_size": 7, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
                                        "markov_rank": 256, "markov_head_type": "vanilla"}
    assert written["dflash_config"] == {"block_size": 7, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert _cfg_from_json(written, Path("config.json")) == cfg
    # DeepSpec's own config (every key at the top level, no nested sections) reads back as this drafter too
    deepspec = {**DSPARK_CONFIG["config"], "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    assert _cfg_from_json(deepspec, Path("config.json")) == cfg
    with pytest.raises(UserError, match="markov_head_type 'gated'"):
        _cfg_from_json({**deepspec, "markov_head_type": "gated"}, Path("config.json"))

    # a small one on disk, with the target's embedding and LM head added as DeepSpec's module holds them
    small = DrafterConfig.from_target_config(tiny_target_config(), 2, 4, V - 1, arch="dspark", markov_rank=8)
    drafter = random_drafter(small)
    out = save_drafter(drafter, small, tmp_path / "d", tiny_target_config())
    state = load_file(str(out / "model.safetensors"))
    assert set(state) == set(expected_state_shapes(small))
    state["embed_tokens.weight"], state["lm_head.weight"] = torch.zeros(2, V, small.hidden_size)
    save_file(state, str(out / "model.safetensors"))
    loaded, cfg2 = load_drafter(out)
    assert cfg2 == small
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
