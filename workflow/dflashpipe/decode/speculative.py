"""DFlash speculative decoding and plain autoregressive decoding in ONE harness (batch size 1).

Both decoders share the target wrapper (:class:`TargetRunner`: an HF causal LM
with a ``DynamicCache``), the stop rule (:func:`dflashpipe.decode.stop.cut_step`)
and the timing (device synchronised around prefill and decode), so the speed-up
DFlash / AR compares like with like.

DFlash loop (the authors' benchmark, DESIGN "Evaluation loop"):

1. prefill the target on the prompt (``output_hidden_states=True``): first token
   from the last logits; the context features of the prompt (concatenation of
   ``hidden_states[id + 1]`` for ``id`` in ``target_layer_ids``) are projected into
   the draft cache;
2. repeat: the sequence has ``n`` tokens, the last one (position ``n-1``) not yet
   seen by the target. Draft the block ``[last, MASK x (bs-1)]`` at positions
   ``n-1 .. n+bs-2`` in ONE drafter forward (embeddings: the target's input
   embedding; logits: the target's LM head on the drafter's hidden); the drafts
   are the argmax of block positions 1..bs-1 (DSpark: of every position, its Markov head applied
   over the token before: ``D = num_drafts`` drafts). Verify ``[last, d_1..d_D]``
   with ONE target forward; ``a`` = length of the matching prefix; commit
   ``d_1..d_a`` + the target's bonus token; crop the target cache to the
   verified positions and extend the draft cache with the features of those
   positions only (so it never needs cropping).

Sampling (T > 0) is lossless speculative sampling for a deterministic (one-hot)
drafter: accept ``d`` with probability ``p(d)``; on rejection sample from ``p``
with ``d`` removed and renormalised; the bonus token is sampled from ``p``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from dflashpipe.decode.stop import cut_step
from dflashpipe.jobs.errors import UserError


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class DecodeResult:
    """One response.

    ``tokens``: the output (cut at the stop token / length limit; stop token kept).
    ``committed``: per verify step, tokens that reached the output (cut convention).
    ``committed_raw``: per verify step, ``a + 1`` before cutting (``tau_uncut``; evaluate.metrics).
    ``accepted``: per verify step, accepted draft tokens ``a`` (empty for AR).
    ``target_forwards``: decode forwards of the target (prefill excluded).
    Times are seconds; ``decode_s`` excludes the prefill (which yields the first token).
    """

    tokens: list[int]
    committed: list[int] = field(default_factory=list)
    committed_raw: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = "length"
    target_forwards: int = 0
    prompt_tokens: int = 0
    first_tokens: int = 1  # output tokens produced by the prefill step

    @property
    def verify_steps(self) -> int:
        return len(self.committed)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.first_tokens

    @property
    def tau(self) -> float:
        """Mean tokens per verify step that reach the output (NaN without steps)."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")

    @property
    def tau_uncut(self) -> float:
        """a + 1 per step, counted before cutting (the authors' benchmark before z-lab/dflash 10129599)."""
        return sum(self.committed_raw) / len(self.committed_raw) if self.committed_raw else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


# ---------------------------------------------------------------------------
# Target wrapper
# ---------------------------------------------------------------------------


def sync(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eos_ids_of(tokenizer=None, model=None) -> list[int]:
    """All stop ids of a target model: :func:`dflashpipe.inputs.target.end_token_ids` of its generation config."""
    from dflashpipe.inputs.target import end_token_ids

    return end_token_ids(tokenizer, getattr(model, "generation_config", None))


def new_dynamic_cache(model):
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # older transformers
        cache = DynamicCache()
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # sliding-window layers can then roll back
    return cache


def crop_cache(cache, keep: int) -> None:
    """Keep the first ``keep`` positions. Uses the negative form (remove k), valid in all transformers 5.x."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)
    elif remove < 0:
        raise ValueError(f"crop_cache: cache holds {cache.get_seq_length()} positions, cannot keep {keep}")


class TargetRunner:
    """An HF causal LM driven with an explicit ``DynamicCache``; optional context features."""

    def __init__(self, model, layer_ids: list[int] | None = None):
        self.model = model
        self.layer_ids = list(layer_ids or [])
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self.device = next(model.parameters()).device
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()

    mode = "dynamic"

    def new_cache(self):
        return new_dynamic_cache(self.model)

    def keep(self, cache, n: int) -> None:
        """Keep the verified prefix of ``n`` positions."""
        crop_cache(cache, n)

    @torch.no_grad()
    def forward(self, cache, ids: torch.Tensor, start: int, features: bool = False, last_only: bool = False):
        """ids [1, T] at positions start..start+T-1 -> (logits [T or 1, V] fp32, features [1, T, nT*H] or None)."""
        T = ids.shape[1]
        kwargs = {self.cache_kw: cache, "use_cache": True}
        if features:
            kwargs["output_hidden_states"] = True
        if last_only:
            kwargs["logits_to_keep"] = 1
        pos = torch.arange(start, start + T, device=ids.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=pos, **kwargs)
        feats = None
        if features:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1] for i in self.layer_ids], dim=-1)
        return out.logits[0].float(), feats


def _sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _first_token(logits_last: torch.Tensor, temperature: float, gen) -> int:
    if temperature > 0:
        return _sample(torch.softmax(logits_last / temperature, dim=-1), gen)
    return int(logits_last.argmax().item())


def _matching_prefix(flags) -> int:
    """Number of leading True values."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _generator(device, seed: int | None):
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


# ---------------------------------------------------------------------------
# Decoders
# ---------------------------------------------------------------------------


class ARDecoder:
    """Plain autoregressive decoding: one token per target forward, with the cache.

    Greedy, the next token stays on the device (the argmax feeds the next forward) and the host reads the
    tokens back once every :attr:`READ_EVERY` forwards: a read-back per token would make the host wait
    for each step before it can launch the next. The stop rule then runs over those tokens in order, so
    the output is the same; after an end token up to ``READ_EVERY - 1`` forwards are wasted (timed).
    """

    READ_EVERY = 8

    def __init__(self, target_model, eos_ids: list[int], runner=None):
        self.target = runner or TargetRunner(target_model)
        self.eos_ids = list(eos_ids)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> DecodeResult:
        tgt, dev = self.target, self.target.device
        gen = _generator(dev, seed) if temperature > 0 else None
        ids = torch.tensor([prompt_ids], device=dev)
        cache = tgt.new_cache()
        sync(dev)
        t0 = time.perf_counter()
        logits, _ = tgt.forward(cache, ids, 0, last_only=True)
        out, reason = cut_step([_first_token(logits[-1], temperature, gen)], 0, max_new_tokens, self.eos_ids)
        sync(dev)
        t1 = time.perf_counter()
        res = DecodeResult(tokens=out, prompt_tokens=len(prompt_ids))
        n = len(prompt_ids) + 1
        nxt = torch.tensor([[out[-1]]], device=dev)
        while reason is None:
            steps = []  # this chunk's tokens, on the device (sampling draws each on the host, as before)
            for _ in range(min(self.READ_EVERY, max_new_tokens - len(out))):
                logits, _ = tgt.forward(cache, nxt, n - 1)
                n += 1
                nxt = (torch.tensor([[_first_token(logits[-1], temperature, gen)]], device=dev) if temperature > 0
                       else logits[-1].argmax().view(1, 1))
                steps.append(nxt)
            tokens = torch.cat(steps).view(-1).tolist()  # one read-back a chunk
            for token in tokens:  # the stop rule, token by token, as each came
                res.target_forwards += 1
                kept, reason = cut_step([token], len(out), max_new_tokens, self.eos_ids)
                out.extend(kept)
                res.committed.append(len(kept))
                res.committed_raw.append(1)
                if reason is not None:
                    break
        sync(dev)
        res.prefill_s, res.decode_s, res.stop_reason = t1 - t0, time.perf_counter() - t1, reason
        return res


class DrafterRunner:
    """The drafter's side of a DFlash step, eager: a growing :class:`DraftCache` (see :mod:`.static_drafter`)."""

    mode = "eager"

    def __init__(self, drafter, embed, lm_head, mask_token_id: int):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        self.bs = int(drafter.cfg.block_size)
        self.dtype = next(drafter.parameters()).dtype
        self.mask = torch.full((1, self.bs - 1), int(mask_token_id), dtype=torch.long, device=lm_head.weight.device)

    def new_cache(self):
        return self.drafter.new_cache()

    @torch.no_grad()
    def extend(self, cache, feats: torch.Tensor, start: int, keep: int) -> None:
        """Context positions start..start+keep-1 from the first ``keep`` rows of feats [1, T, F]."""
        pos = torch.arange(start, start + keep, device=feats.device).unsqueeze(0)
        self.drafter.extend_context(cache, feats[:, :keep].to(self.dtype), pos)

    @torch.no_grad()
    def propose(self, cache, n: int, last: torch.Tensor) -> torch.Tensor:
        """Drafts d_1..d_D [D = num_drafts] for the block [last, MASK x (bs-1)] at positions n-1 .. n+bs-2."""
        block = torch.cat([last, self.mask], dim=1)  # [1, bs]
        pos = torch.arange(n - 1, n - 1 + self.bs, device=block.device).unsqueeze(0)
        hidden = self.drafter.draft(cache, self.embed(block).to(self.dtype), pos)  # [1, bs, H]
        return self.drafter.propose(hidden, last[:, 0], self.lm_head.weight)[0]  # DFlash 2, DSpark: their heads


class DFlashDecoder:
    """DFlash speculative decoding with a :class:`~dflashpipe.drafter.model.DFlashDrafter`.

    ``_propose`` (draft step) and ``_accept`` (verification rule) are separate
    methods so tests can substitute an oracle drafter or a broken verifier.
    """

    def __init__(self, target_model, drafter, drafter_cfg, eos_ids: list[int], runner=None, draft_runner=None):
        tc = target_model.config.get_text_config() if hasattr(target_model.config, "get_text_config") else target_model.config
        if int(tc.hidden_size) != drafter_cfg.hidden_size or int(tc.num_hidden_layers) != drafter_cfg.num_target_layers:
            raise UserError(
                f"drafter (hidden {drafter_cfg.hidden_size}, {drafter_cfg.num_target_layers} target layers) does not fit the "
                f"target (hidden {tc.hidden_size}, {tc.num_hidden_layers} layers)"
            )
        if drafter_cfg.mask_token_id >= int(tc.vocab_size):
            raise UserError(f"drafter mask_token_id {drafter_cfg.mask_token_id} is not a row of the target embedding (vocab {tc.vocab_size})")
        self.target = runner or TargetRunner(target_model, drafter_cfg.target_layer_ids)
        self.drafter = drafter
        self.cfg = drafter_cfg
        self.n_drafts = drafter_cfg.num_drafts
        self.eos_ids = list(eos_ids)
        self.draft = draft_runner or DrafterRunner(drafter, self.target.embed, self.target.lm_head, drafter_cfg.mask_token_id)

    # -- one step, split for testing ----------------------------------------

    def _propose(self, dcache, seq: list[int], last: torch.Tensor) -> torch.Tensor:
        """Draft tokens d_1..d_D [D] for the block anchored at ``seq[-1]`` (position len(seq)-1).

        ``last``: [1, 1] tensor of ``seq[-1]`` on the device.
        """
        return self.draft.propose(dcache, len(seq), last)

    def _accept(self, draft: torch.Tensor, logits: torch.Tensor, temperature: float, gen) -> tuple[int, list[int]]:
        """Verification rule. draft [D]; logits [D+1, V] (row k predicts the token after d_k, d_0 the anchor).

        Returns (accepted a, committed tokens d_1..d_a + bonus).
        """
        if temperature <= 0:
            # One device->host copy per step: the drafts and the target's argmax.
            both = torch.cat([draft, logits.argmax(dim=-1)]).tolist()
            d, y = both[: self.n_drafts], both[self.n_drafts :]
            a = _matching_prefix([x == t for x, t in zip(d, y)])
            return a, d[:a] + [y[a]]
        probs = torch.softmax(logits / temperature, dim=-1)  # [D+1, V]
        k = torch.arange(self.n_drafts, device=probs.device)
        u = torch.rand(self.n_drafts, generator=gen, device=probs.device)
        ok = (u < probs[k, draft]).tolist()
        a = _matching_prefix(ok)
        d = draft[:a].tolist()
        if a < self.n_drafts:  # rejected d_{a+1}: sample from p with it removed, renormalised
            residual = probs[a].clone()
            residual[draft[a]] = 0.0
            if float(residual.sum()) <= 0:  # p(d)=1 numerically; cannot really be rejected
                residual = probs[a]
            return a, d + [_sample(residual / residual.sum(), gen)]
        return a, d + [_sample(probs[-1], gen)]

    # -- the loop -------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int | None = 0) -> DecodeResult:
        tgt, dev = self.target, self.target.device
        gen = _generator(dev, seed) if temperature > 0 else None
        ids = torch.tensor([prompt_ids], device=dev)
        P = len(prompt_ids)
        cache, dcache = tgt.new_cache(), self.draft.new_cache()
        sync(dev)
        t0 = time.perf_counter()
        logits, feats = tgt.forward(cache, ids, 0, features=True, last_only=True)
        self.draft.extend(dcache, feats, 0, P)
        out, reason = cut_step([_first_token(logits[-1], temperature, gen)], 0, max_new_tokens, self.eos_ids)
        sync(dev)
        t1 = time.perf_counter()
        res = DecodeResult(tokens=out, prompt_tokens=P)
        seq = list(prompt_ids) + out
        while reason is None:
            n = len(seq)  # target cache holds n-1 positions; seq[-1] sits at position n-1
            last = torch.tensor([[seq[-1]]], device=dev)
            draft = self._propose(dcache, seq, last)
            logits, feats = tgt.forward(cache, torch.cat([last, draft.view(1, -1)], dim=1), n - 1, features=True)
            res.target_forwards += 1
            a, step_tokens = self._accept(draft, logits, temperature, gen)
            # Keep the verified positions: the anchor and the a accepted drafts.
            tgt.keep(cache, n + a)
            self.draft.extend(dcache, feats, n - 1, a + 1)
            kept, reason = cut_step(step_tokens, len(out), max_new_tokens, self.eos_ids)
            out.extend(kept)
            seq.extend(step_tokens)
            res.accepted.append(a)
            res.committed.append(len(kept))
            res.committed_raw.append(len(step_tokens))
        sync(dev)
        res.prefill_s, res.decode_s, res.stop_reason = t1 - t0, time.perf_counter() - t1, reason
        return res


#: How the decoders run the target: ``compiled`` (static KV cache, steps compiled and captured as CUDA
#: graphs on a GPU), ``static`` (the same, not compiled), ``dynamic`` (HF ``DynamicCache``, eager) or
#: ``auto`` (``compiled`` on a GPU where the model's layout allows it, else ``dynamic``).
TARGET_STEPS = ("auto", "compiled", "static", "dynamic")


def target_runner(model, step: str = "auto", layer_ids=None, capacity: int = 2048, graph_sizes=(1,),
                  attention: str = "auto"):
    """The target wrapper both decoders use; its ``mode`` says which ran (recorded in eval summaries).
    ``attention``: the static steps' (:data:`~dflashpipe.decode.static_target.ATTENTION`; auto: flex when compiled)."""
    from .static_target import StaticTargetRunner, supports_static

    if step not in TARGET_STEPS:
        raise UserError(f"evaluate.target_step must be one of {', '.join(TARGET_STEPS)}, got {step!r}")
    why = supports_static(model)
    cuda = next(model.parameters()).device.type == "cuda"
    if step in ("static", "compiled") and why:
        raise UserError(f"evaluate.target_step: {step}: {why}; use auto or dynamic")
    if step == "dynamic" or (step == "auto" and (why or not cuda)):
        return TargetRunner(model, layer_ids)
    return StaticTargetRunner(model, layer_ids, capacity=capacity, graph_sizes=graph_sizes,
                              compile=step in ("auto", "compiled"), attention=attention)


def drafter_runner(drafter, target_runner_, step: str = "auto", capacity: int = 2048):
    """The drafter's side to go with a target runner: static (CUDA graphs on a GPU) when the target's is,
    compiled when the target's steps are, attending as they do."""
    from .static_drafter import StaticDrafterRunner

    mask_id = drafter.cfg.mask_token_id
    if target_runner_.mode == "dynamic" or step == "dynamic":
        return DrafterRunner(drafter, target_runner_.embed, target_runner_.lm_head, mask_id)
    return StaticDrafterRunner(drafter, target_runner_.embed, target_runner_.lm_head, mask_id, capacity,
                               cuda_graphs=getattr(target_runner_, "cuda_graphs", None),
                               compile=getattr(target_runner_, "compiled", False),
                               attention=getattr(target_runner_, "attention", "sdpa"))


def dflash_generate(target_model, drafter, drafter_cfg, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None) -> DecodeResult:
    """Convenience wrapper: one DFlash response."""
    return DFlashDecoder(target_model, drafter, drafter_cfg, eos_ids if eos_ids is not None else eos_ids_of(None, target_model)).generate(
        prompt_ids, max_new_tokens, temperature, seed
    )


def ar_generate(target_model, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None) -> DecodeResult:
    """Convenience wrapper: one plain autoregressive response in the same harness."""
    return ARDecoder(target_model, eos_ids if eos_ids is not None else eos_ids_of(None, target_model)).generate(
        prompt_ids, max_new_tokens, temperature, seed
    )
