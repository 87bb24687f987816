"""What makes a run the same run (code by meaning, target content, library versions), and resuming it."""

from __future__ import annotations

import os

import torch


# -- a resumed run keeps ONE copy of the ZeRO optimiser state ------------------------------------------


def _state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for s in state.values() if isinstance(s, dict) for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


def test_resumed_zero_optimizer_holds_one_copy_of_its_state(one_rank_group, tmp_path):
    from dflashpipe.training.distributed import full_optimizer_state, sharded_adamw

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))

    def step(m, opt, seed):
        torch.manual_seed(seed)
        m(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    cpu = torch.device("cpu")
    a = model()
    opt_a = sharded_adamw(a, 1e-2, 0.1, cpu)
    for s in range(3):
        step(a, opt_a, s)
    torch.save({"model": a.state_dict(), "optimizer": full_optimizer_state(opt_a)}, tmp_path / "ckpt.pt")

    ckpt = torch.load(tmp_path / "ckpt.pt", mmap=True, weights_only=True)
    b = model()
    b.load_state_dict(ckpt["model"])
    opt_b = sharded_adamw(b, 1e-2, 0.1, cpu)
    opt_b.load_state_dict(ckpt["optimizer"])

    n_params = sum(1 for _ in b.parameters())
    assert _state_tensors(opt_b.state) == []  # the wrapper keeps no copy of its own ...
    local = _state_tensors(opt_b.optim.state)  # ... the local AdamW holds the moments, once
    assert len(local) == 2 * n_params and len({t.data_ptr() for t in local}) == 2 * n_params
    assert all(s is None or isinstance(s, dict) for s in ckpt["optimizer"]["state"].values())
    assert all(s is not None for s in ckpt["optimizer"]["state"].values())  # the caller's dict is untouched

    # and the resumed optimiser continues exactly like the uninterrupted one
    step(a, opt_a, 10)
    step(b, opt_b, 10)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    sd_a, sd_b = full_optimizer_state(opt_a), full_optimizer_state(opt_b)
    for i, s in sd_a["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(sd_b["state"][i][k], v, rtol=0, atol=0)


# -- the target's weights count by content ---------------------------------------------------------------


def _big_target(tmp_path, seed: int):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    w = d / "model.safetensors"
    w.write_bytes(torch.randint(0, 256, (65 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
                  .numpy().tobytes())
    return d, w


def test_a_fine_tune_swapped_into_the_target_directory_is_another_target(tmp_path):
    from dflashpipe.inputs.target import target_fingerprint

    d, w = _big_target(tmp_path, 0)
    before, st = target_fingerprint(str(d)), w.stat()
    _big_target(tmp_path, 1)  # same name, same size (over 64 MB), other weights, and even the old mtime
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_size == st.st_size
    assert target_fingerprint(str(d)) != before
    _big_target(tmp_path, 0)
    assert target_fingerprint(str(d)) == before  # the same content is the same target
    for name in ("README.md", ".snakemake_timestamp", "LICENSE"):  # no tokens change
        (d / name).write_text("edited")
    assert target_fingerprint(str(d)) == before
    (d / "tokenizer_config.json").write_text("{}")
    assert target_fingerprint(str(d)) != before


def test_big_files_are_read_once_per_version(tmp_path, monkeypatch):
    import json

    from dflashpipe.inputs.target import target_fingerprint
    from dflashpipe.jobs.filedigest import ENV, file_digest

    cache = tmp_path / "results" / ".cache" / "file-digests.json"
    monkeypatch.setenv(ENV, str(cache))
    d, w = _big_target(tmp_path, 0)
    first = target_fingerprint(str(d))
    entries = json.loads(cache.read_text())
    assert list(entries.values()) == [file_digest(w, cache="")]
    # a cached entry is used as long as the file is the same version (proof: a planted value is returned) ...
    cache.write_text(json.dumps({k: "planted" for k in entries}))
    assert file_digest(w) == "planted" and target_fingerprint(str(d)) != first
    # ... and a new version of the file (same size, mtime set back) is read again
    st = w.stat()
    _big_target(tmp_path, 2)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(w) not in ("planted", entries[next(iter(entries))])


# -- the run identity: the libraries' versions and the target loader count ---------------------------------


def test_run_identity_holds_the_library_versions_and_the_target_loader(micro_target, tmp_path, monkeypatch):
    import transformers

    from dflashpipe.training.checkpoint import checkpoint_dir, run_identity
    from dflashpipe.training.train import TrainConfig

    tokenized = tmp_path / "tokenized"
    tokenized.mkdir()
    (tokenized / "state.json").write_text("{}")
    cfg = TrainConfig(num_layers=1, block_size=4)
    identity = run_identity(cfg, str(tokenized), str(micro_target))
    assert identity["versions"] == {"torch": torch.__version__, "transformers": transformers.__version__}
    assert identity["target_loader"] and identity["code"]
    assert run_identity(cfg, str(tokenized), str(micro_target)) == identity  # stable
    run = checkpoint_dir(str(tmp_path / "run"), identity)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert checkpoint_dir(str(tmp_path / "run"), run_identity(cfg, str(tokenized), str(micro_target))) != run
    monkeypatch.undo()
    monkeypatch.setattr(transformers, "__version__", "9.9.9")
    assert checkpoint_dir(str(tmp_path / "run"), run_identity(cfg, str(tokenized), str(micro_target))) != run


def test_a_finished_run_evaluates_again_when_the_held_out_code_changed(tmp_path):
    """republish writes a finished run's outputs again only while the held-out evaluation code (not part of
    the identity, but of the summary's figures) is the one that made them; else the run resumes at its
    final checkpoint, trains no step and evaluates again (through Snakemake: test_reliability)."""
    import json

    from dflashpipe.training.checkpoint import COMPLETE, heldout_code, republish, save_checkpoint

    identity, ckpt, out = {"run": 1}, tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    save_checkpoint(ckpt, 6, {"w": torch.ones(2)}, {}, identity, {})
    (ckpt / "metrics.csv").write_text("step\n6\n")
    done = {"summary": {"steps": 6}, "final_metadata": {"step": "6"}, "heldout_code": heldout_code()}
    (ckpt / COMPLETE).write_text(json.dumps({**done, "heldout_code": "another"}))
    logged = []
    outputs = [str(out / n) for n in ("metrics.csv", "summary.json", "final.safetensors")]
    assert republish(ckpt, identity, *outputs, log=logged.append) is None and not out.exists()
    assert "the held-out evaluation code changed since: it resumes at its final checkpoint" in logged[0]
    (ckpt / COMPLETE).write_text(json.dumps(done))
    assert republish(ckpt, identity, *outputs, log=logged.append) == {"steps": 6}
    assert json.loads((out / "summary.json").read_text()) == {"steps": 6} and (out / "metrics.csv").read_text() == "step\n6\n"
