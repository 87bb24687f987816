"""The model card written beside every export: ``README.md`` in the Hugging Face model-card layout.

YAML front matter (``base_model``, ``library_name``, ``tags``, ``datasets`` for Hub datasets, and
``license`` when every training dataset's licence is known), then the target, the recipe, the data
and its size, the training run and its held-out figures, and how to serve the drafter with SGLang,
vLLM and transformers, with the flags that must match training.

The measured acceptance length and speed-up of the run's evaluation are not here: evaluation reads
this export, so it runs after it; the card points to ``results/tables/eval.csv`` instead.

Where the serving flags come from:

* SGLang: ``--speculative-algorithm DFLASH`` (or ``DSPARK``) and ``--speculative-draft-model-path``
  as in SGLang's speculative-decoding docs and z-lab/dflash's README. ``--speculative-num-draft-tokens``
  is the verify width: a DFlash block (the anchor and ``block_size - 1`` drafts) for DFlash; DSpark's
  ``gamma + 1`` with gamma = ``block_size`` (sglang ``speculative/dspark_components/dspark_config.py``,
  which warns when the two disagree).
* vLLM: ``--speculative-config`` with ``method: dflash`` and ``num_speculative_tokens`` = the drafted
  tokens, ``block_size - 1`` (z-lab/dflash's README: 15 for a block of 16); ``method: dspark`` with
  ``num_speculative_tokens`` = ``block_size`` (every DSpark slot drafts).
* DFlash 2: the candidate selector reads the target's LM head directly, so the target's LM head must
  stay a dense fp16/bf16/fp32 matrix (sglang ``speculative/dflash_utils.py``, ``is_dense_head_weight``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

#: where the measured tau and speed-up of the run's evaluation end up (written after the export)
EVAL_TABLE = "results/tables/eval.csv"
#: the speed-up under load, with the concurrency where DFlash stops paying (evaluate.concurrency)
LOAD_TABLE = "results/tables/concurrency.csv"
#: the embedded default's training prompts, shipped in this checkout; their licence is stated in
#: resources/README.md (reasoning-gym: Apache-2.0)
SHIPPED_PROMPTS = ((Path(__file__).resolve().parents[3] / "resources" / "prompts").resolve(), "apache-2.0")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _target_name(target: str) -> str:
    """A Hub id as given (``org/name``), else the directory's name."""
    if _HUB_ID.match(target) and not Path(target).exists():
        return target
    return Path(target).name or target


def _data_rows(datasets: dict, stats: dict) -> tuple[list[str], list[str], str | None]:
    """Table rows of the training datasets, the Hub ids among them, and their common licence (or None)."""
    rows, hub, licences = [], [], set()
    kept = stats.get("per_dataset", {})
    for name, spec in datasets.items():
        if spec.get("hf"):
            source, licence = f"`{spec['hf']}` (Hugging Face)", "its Hub page's"
            hub.append(spec["hf"])
            licences.add(None)
        else:
            path = str(spec.get("path", ""))
            shipped = SHIPPED_PROMPTS[0] in Path(path).resolve().parents
            source = f"`{path}`" + (" (shipped with dflash-pipeline, see its resources/README.md)" if shipped else "")
            licence = SHIPPED_PROMPTS[1] if shipped else "not recorded"
            licences.add(SHIPPED_PROMPTS[1] if shipped else None)
        n = kept.get(name, {})
        rows.append(f"| {name} | {source} | {licence} | {n.get('kept', '?')} of {n.get('rows', '?')} |")
    common = next(iter(licences)) if len(licences) == 1 else None
    return rows, hub, common


def _recipe_rows(cfg) -> list[str]:
    rows = [
        ("architecture", f"`{cfg.arch}`"),
        ("block size", f"{cfg.block_size} ({cfg.num_drafts} drafted tokens per block)"),
        ("drafter layers", cfg.num_hidden_layers),
        ("target layers tapped", f"`{list(cfg.target_layer_ids)}` of {cfg.num_target_layers}"),
        ("mask token id", cfg.mask_token_id),
    ]
    if cfg.arch == "dflash2":
        rows += [("convolutions (kernel, group)", f"{cfg.conv_kernel_size}, {cfg.conv_group_size}"),
                 ("candidate selector (rank, top-k)", f"{cfg.selector_rank}, {cfg.selector_top_k}")]
    if cfg.arch == "dspark":
        rows.append(("Markov head rank", cfg.markov_rank))
    if "sliding_attention" in cfg.layer_types:
        rows.append(("sliding window", f"{cfg.sliding_window} ({', '.join(cfg.layer_types)})"))
    return [f"| {k} | {v} |" for k, v in rows]


def _config_section(recipe: dict | None) -> list[str]:
    """The config that trained the drafter: its recipe line and the result-deciding sections as YAML."""
    if not recipe:
        return []
    import yaml

    sections = {k: v for k, v in recipe.items() if k != "recipe"}
    return ["## Configuration", "", f"`{recipe['recipe']}`", "", "The keys that decided this drafter "
            "(results/effective_config.yaml has every key of the run):", "", "```yaml",
            yaml.safe_dump(sections, sort_keys=True).rstrip(), "```", ""]


def serving_lines(cfg, target: str, drafter: str) -> str:
    """The SGLang, vLLM and transformers lines for this drafter, with the flags that must match training."""
    if cfg.arch == "dspark":
        algorithm, method, verify, drafted = "DSPARK", "dspark", cfg.block_size + 1, cfg.block_size
    else:
        algorithm, method, verify, drafted = "DFLASH", "dflash", cfg.block_size, cfg.block_size - 1
    spec = json.dumps({"method": method, "model": drafter, "num_speculative_tokens": drafted})
    notes = [
        f"- `--speculative-num-draft-tokens {verify}` (SGLang) and `num_speculative_tokens: {drafted}` (vLLM) "
        f"follow the trained block size ({cfg.block_size}); another value drafts a block the drafter was not "
        "trained on.",
    ]
    if cfg.arch == "dflash2":
        notes.append("- DFlash 2's candidate selector reads the target's LM head: keep the target's LM head "
                     "unquantized (fp16/bf16/fp32); SGLang refuses a quantized one for DFlash 2.")
    if cfg.arch == "dspark":
        notes.append("- SGLang reads `--speculative-num-draft-tokens` as DSpark's gamma + 1, gamma being the "
                     "block size.")
    return "\n".join([
        "SGLang:", "", "```bash",
        f"python -m sglang.launch_server --model-path {target} \\",
        f"    --speculative-algorithm {algorithm} --speculative-draft-model-path {drafter} \\",
        f"    --speculative-num-draft-tokens {verify} --dtype bfloat16",
        "```", "", "vLLM:", "", "```bash",
        f"vllm serve {target} --speculative-config '{spec}'",
        "```", "",
        "transformers (the modeling file `dflash.py` beside the weights; greedy):", "", "```python",
        f'drafter = AutoModel.from_pretrained("{drafter}", trust_remote_code=True, dtype=torch.bfloat16)',
        "ids = drafter.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[eos_id])",
        "```", "", *notes,
    ])


def model_card(cfg, *, target: str, datasets: dict | None = None, stats: dict | None = None,
               summary: dict | None = None, drafter: str = "results/drafter", recipe: dict | None = None,
               caveat: str | None = None) -> str:
    """The model card (markdown) of a drafter export; ``stats``/``summary`` are the tokenize and train outputs,
    ``recipe`` the config's record (:meth:`dflashpipe.wiring.Pipeline.recipe`: its line and the sections),
    ``caveat`` what the drafter is not (:func:`dflashpipe.config.tiny_target_caveat`), under the title."""
    datasets, stats, summary = datasets or {}, stats or {}, summary or {}
    rows, hub, licence = _data_rows(datasets, stats)
    front = ["---", f"base_model: {_target_name(target)}", "library_name: transformers"]
    if licence:
        front.append(f"license: {licence}")
    front += ["tags:", "- speculative-decoding", f"- {cfg.arch}", "- dflash-pipeline"]
    if hub:
        front += ["datasets:", *[f"- {h}" for h in hub]]
    front.append("---")

    def fig(key, fmt="{:.4f}"):
        v = summary.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "not recorded"

    train = [
        "| training | |", "| --- | --- |",
        f"| loss | `{summary.get('loss', '?')}`, position weights `{summary.get('position_weights', '?')}` |",
        f"| steps | {summary.get('steps', '?')} ({fig('epochs', '{:.2f}')} epochs, global batch "
        f"{summary.get('global_batch', '?')}, {summary.get('world_size', '?')} ranks, {summary.get('dtype', '?')}) |",
        f"| held-out accuracy / loss | {fig('heldout_acc')} / {fig('heldout_loss')} "
        f"({summary.get('heldout_samples', '?')} samples) |",
        f"| simulated acceptance length (held-out blocks) | {fig('heldout_sim_tau', '{:.2f}')} |",
    ]
    data = [
        "| dataset | source | licence | samples kept of rows |", "| --- | --- | --- | --- |", *rows, "",
        f"Tokenized for training: {stats.get('samples', '?')} samples, {stats.get('tokens', '?')} tokens, "
        f"{stats.get('loss_tokens', '?')} loss tokens (chat template arguments: "
        f"`{json.dumps(stats.get('chat_template_kwargs', {}))}`).",
    ]
    return "\n".join([
        *front, "",
        f"# {cfg.arch} drafter for {_target_name(target)}", "",
        f"A speculative-decoding drafter trained by dflash-pipeline: each block proposes {cfg.num_drafts} tokens "
        "from the target's hidden states, and the target verifies them, so the output is the target's own.", "",
        *([f"**Caveat:** {caveat}.", ""] if caveat else []),
        "## Target", "", f"`{target}` (the drafter uses its embedding and LM head; they are not in this directory).", "",
        "## Recipe", "", "| | |", "| --- | --- |", *_recipe_rows(cfg), "",
        "## Data", "", *data, "",
        "## Training", "", *train, "",
        *_config_section(recipe),
        "## Measured", "",
        f"The acceptance length and speed-up this drafter measured against the target alone are in `{EVAL_TABLE}` "
        "(the evaluation reads this export, so it runs after it); the speed-up under load (many requests in flight), "
        f"with the concurrency at which DFlash stops paying, in `{LOAD_TABLE}`.", "",
        "## Serving", "", serving_lines(cfg, target, drafter), "",
    ])
