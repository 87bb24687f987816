"""A draft vocabulary (evaluate.draft_vocab): the counted tokens, the drafts among them, decoding still lossless."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, drafter_runner, target_runner
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
from dflashpipe.inputs.draft_vocab import count_reply_tokens, top_tokens, write_draft_vocab
from dflashpipe.jobs.errors import UserError

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ARCHS = ("dflash", "dflash2", "dspark")


@pytest.fixture(scope="module")
def model64(random_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float64).eval().requires_grad_(False)


def make_drafter(model, arch: str, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig.from_target_config(model.config, num_hidden_layers=2, block_size=4, mask_token_id=3, arch=arch)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # large weights: drafts that vary (DFlash 2's selector and DSpark's Markov head too)
        for name, p in drafter.named_parameters():
            if p.dim() >= 2 and "conv" not in name:
                p.normal_(0.0, 0.5 if "proj" in name or "fc" in name else 1.0)
    return drafter.to(torch.float64).eval()


def _tokenized(tmp_path, rows) -> str:
    """A tokenized dataset on disk (the tokenize stage's columns) of rows [(input_ids, loss_mask)]."""
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    ds = datasets.Dataset.from_list([{"input_ids": i, "loss_mask": m} for i, m in rows], features=features)
    path = tmp_path / "train"
    ds.save_to_disk(str(path))
    return str(path)


def test_the_vocabulary_is_the_most_frequent_trained_reply_tokens(tmp_path):
    """Counted at loss positions only; ties go to the lower id; fewer seen tokens than asked: all of them."""
    rows = [([1, 5, 5, 7, 9, 9, 9], [0, 1, 1, 1, 1, 1, 1]),  # the prompt's 1 is not counted
            ([9, 2, 2, 7, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0])]  # neither the 9 nor the 1s: not trained
    path = _tokenized(tmp_path, rows)
    counts = count_reply_tokens(path)
    assert counts.tolist() == [0, 0, 1, 0, 0, 2, 0, 2, 0, 3]  # 9 x3, 5 x2, 7 x2, 2 x1
    assert top_tokens(counts, 1).tolist() == [9]
    assert top_tokens(counts, 2).tolist() == [5, 9]  # 5 and 7 tie: the lower id
    assert top_tokens(counts, 10).tolist() == [2, 5, 7, 9]  # never-seen tokens left out
    out = write_draft_vocab(path, 3, str(tmp_path / "v.json"), log=lambda *_: None)
    assert out["ids"] == [5, 7, 9] and out["size"] == 3 and out["reply_tokens"] == 8
    assert out["coverage"] == pytest.approx(7 / 8)
    with pytest.raises(UserError, match="no trained reply tokens"):
        write_draft_vocab(_tokenized(tmp_path / "none", [([1, 2], [0, 0])]), 3, str(tmp_path / "w.json"))


def test_a_real_tokenized_set_counts_its_replies(micro_tokenized, tmp_path):
    """The shipped math chats through the tokenize stage's format: the top tokens cover most reply tokens."""
    out = write_draft_vocab(str(micro_tokenized), 32, str(tmp_path / "v.json"), log=lambda *_: None)
    ds = datasets.load_from_disk(str(micro_tokenized))
    trained = sum(int(np.sum(np.array(m) == 1)) for m in ds["loss_mask"])
    assert out["reply_tokens"] == trained and out["size"] == 32 and 0.5 < out["coverage"] < 1


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_lie_in_the_vocabulary_and_the_whole_one_changes_nothing(model64, arch):
    drafter = make_drafter(model64, arch)
    W = model64.get_output_embeddings().weight
    V, bs = W.shape[0], drafter.cfg.block_size
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, bs, drafter.cfg.hidden_size, generator=g, dtype=torch.float64) * 3
    anchors = torch.randint(5, V, (3,), generator=g)
    full = drafter.propose(hidden, anchors, W)
    drafter.use_draft_vocab(torch.arange(V), W)
    assert torch.equal(drafter.propose(hidden, anchors, W), full)
    subset = torch.tensor(sorted(set(torch.randperm(V, generator=g)[: V // 4].tolist()) - set(full.flatten().tolist())))
    drafter.use_draft_vocab(subset, W)
    restricted = drafter.propose(hidden, anchors, W)
    assert set(restricted.flatten().tolist()) <= set(subset.tolist())  # none of the whole vocabulary's drafts
    if arch == "dflash":  # the argmax among the subset's logits, by hand
        logits = drafter.compute_logits(hidden[:, 1:], W)[..., subset]
        assert torch.equal(restricted, subset[logits.argmax(-1)])
    drafter.use_draft_vocab(None)
    assert torch.equal(drafter.propose(hidden, anchors, W), full)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_with_a_draft_vocabulary_stays_lossless(model64, arch):
    """The eager and the static drafter draft alike among the vocabulary, and DFlash's tokens stay AR's; the
    whole vocabulary given as one accepts what decoding without one does. A drafter whose logits are all
    equal drafts the vocabulary's first token: of one token AR's reply holds, some drafts are accepted; of one
    it does not hold, none (DFlash 2's selector needs its top 16)."""
    drafter = make_drafter(model64, arch, seed=2)
    cfg, W, V = drafter.cfg, model64.get_output_embeddings().weight, model64.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(5, V, (9,), generator=g).tolist()
    ar = ARDecoder(model64, []).generate(prompt, 24)

    def dflash(static: bool):
        runner = target_runner(model64, "static" if static else "dynamic", cfg.target_layer_ids, 128)
        draft = drafter_runner(drafter, runner, "static", 128) if static else None
        return DFlashDecoder(model64, drafter, cfg, [], runner=runner, draft_runner=draft).generate(prompt, 24)

    whole = dflash(static=False)
    assert whole.tokens == ar.tokens
    drafter.use_draft_vocab(torch.arange(V), W)
    assert dflash(static=True).accepted == whole.accepted
    drafter.use_draft_vocab(torch.arange(0, V, 2), W)
    eager, static = dflash(static=False), dflash(static=True)
    assert eager.tokens == static.tokens == ar.tokens and eager.accepted == static.accepted
    if arch == "dflash2":
        return
    with torch.no_grad():
        drafter.norm.weight.zero_()  # every logit 0: the argmax is the vocabulary's first token
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w2.weight.zero_()
    common = max(set(ar.tokens[1:]), key=ar.tokens[1:].count)
    drafter.use_draft_vocab(torch.tensor([common]), W)
    hit = dflash(static=True)
    drafter.use_draft_vocab(torch.tensor([min(set(range(V)) - set(ar.tokens))]), W)
    miss = dflash(static=True)
    assert hit.tokens == miss.tokens == ar.tokens
    assert sum(hit.accepted) > 0 and set(miss.accepted) == {0}


def test_a_vocabulary_smaller_than_the_selectors_candidates_is_refused(model64):
    drafter = make_drafter(model64, "dflash2")
    W = model64.get_output_embeddings().weight
    with pytest.raises(ValueError, match="smaller than the candidate selector's top 16"):
        drafter.use_draft_vocab(torch.arange(8), W)
    with pytest.raises(ValueError, match="LM head's weight is needed"):
        drafter.use_draft_vocab(torch.arange(64))
    assert drafter.draft_ids is None  # nothing half set
