"""Dataset expansion (resumable, settings-aware) and tokenization (assistant-only loss mask) on a real micro target."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from transformers import AutoTokenizer

from conftest import PROMPTS, REPO
from dflashpipe.inputs.data import prepare_prompts
from dflashpipe.inputs.tokenize import bucket_for, encode_chat, tokenize_expanded
from dflashpipe.jobs.errors import UserError
from dflashpipe.stages.expand import ExpandSettings, expand_prompts

SETTINGS = dict(max_new_tokens=24, batch_size=4, chunk_size=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "math.parquet"
    spec = {"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 12}
    prepare_prompts(spec, "math", str(out))
    return out


def run_expand(prompts, target, out, **overrides):
    return expand_prompts(str(prompts), str(target), ExpandSettings(**{**SETTINGS, **overrides}), str(out), log=lambda m: None)


def test_expansion_output(prompts, micro_target, tmp_path):
    out = tmp_path / "e.parquet"
    summary = run_expand(prompts, micro_target, out)
    df = pd.read_parquet(out)
    assert summary["rows"] == len(df) == 12
    assert set(df["finish_reason"]) <= {"stop", "length"}
    assert (df["num_new_tokens"] <= 24).all()
    assert (df["temperature"] == 1.0).all() and df["target"].nunique() == 1
    assert [m[-1]["content"] for m in df["messages"]] == list(df["response"])
    assert not (tmp_path / "e.parquet.chunks").exists()


def test_killed_expansion_resumes_from_its_chunks(prompts, micro_target, tmp_path):
    """SIGKILL after the first chunk: the rerun reuses it and the result equals an uninterrupted run."""
    slow = {**SETTINGS, "batch_size": 1, "chunk_size": 2}  # 6 chunks, one prompt at a time
    clean = tmp_path / "clean.parquet"
    run_expand(prompts, micro_target, clean, batch_size=1, chunk_size=2)
    out = tmp_path / "killed.parquet"
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from dflashpipe.stages.expand import ExpandSettings, expand_prompts\n"
        "expand_prompts(%r, %r, ExpandSettings(**%r), %r, log=print)\n"
    ) % (str(REPO / "workflow"), str(prompts), str(micro_target), slow, str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    chunks = tmp_path / "killed.parquet.chunks"
    deadline = time.time() + 120
    while not list(chunks.glob("chunk_*.parquet")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in chunks.glob("chunk_*.parquet"))
    assert done and not out.exists(), "the kill must land after a chunk and before the end"
    logs = []
    expand_prompts(str(prompts), str(micro_target), ExpandSettings(**slow), str(out), log=logs.append)
    assert any(f"resuming: {len(done)} of 6 chunks" in m for m in logs)
    a, b = pd.read_parquet(clean), pd.read_parquet(out)
    assert list(a["response"]) == list(b["response"])  # seeds are per chunk: resuming changes nothing


def test_changed_settings_discard_old_chunks(prompts, micro_target, tmp_path):
    out = tmp_path / "e.parquet"
    chunks = tmp_path / "e.parquet.chunks"
    chunks.mkdir()
    (chunks / "settings.json").write_text(json.dumps({"settings": {"max_new_tokens": 999}}))
    pd.DataFrame({"x": [1]}).to_parquet(chunks / "chunk_00000.parquet")  # from other settings
    logs = []
    expand_prompts(str(prompts), str(micro_target), ExpandSettings(**SETTINGS), str(out), log=logs.append)
    assert any("settings changed" in m for m in logs)
    assert "response" in pd.read_parquet(out).columns and len(pd.read_parquet(out)) == 12


def test_greedy_with_samples_is_refused(prompts, micro_target, tmp_path):
    with pytest.raises(UserError, match="num_samples"):
        run_expand(prompts, micro_target, tmp_path / "x.parquet", temperature=0.0, num_samples=2)


def test_loss_mask_covers_exactly_the_assistant_reply(micro_target):
    tok = AutoTokenizer.from_pretrained(micro_target)
    chat = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3=5\n#### 5"}]
    ids, mask, full = encode_chat(tok, chat, max_length=512)
    assert len(ids) == len(mask) == full
    reply = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(reply) == "2+3=5\n#### 5<|im_end|>\n"
    assert tok.decode([t for t, m in zip(ids, mask) if not m]).endswith("<|im_start|>assistant\n")
    ids, mask, full = encode_chat(tok, chat, max_length=10)
    assert len(ids) == 10 and full > 10


def test_tokenize_filters_and_counts(micro_target, tmp_path):
    rows = [
        {"id": "long", "sample": 0, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c d e f g h i j k l"}]},
        {"id": "short", "sample": 0, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"id": "empty", "sample": 0, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
    ]
    path = tmp_path / "x.parquet"
    pd.DataFrame(rows).to_parquet(path)
    stats = tokenize_expanded({"x": str(path)}, str(micro_target), [64, 128], str(tmp_path / "tok"), str(tmp_path / "s.json"), log=lambda m: None)
    # the data does not depend on the drafter: a short reply is kept (a run of long blocks leaves it out)
    assert stats["samples"] == 2 and stats["dropped"] == {"empty_response": 1}
    assert json.loads((tmp_path / "s.json").read_text())["buckets"] == {"64": 2, "128": 0}
    pd.DataFrame(rows[2:]).to_parquet(path)
    with pytest.raises(UserError, match="no sample left after filtering"):
        tokenize_expanded({"x": str(path)}, str(micro_target), [64], str(tmp_path / "tok2"), str(tmp_path / "s2.json"), log=lambda m: None)
    assert not (tmp_path / "tok2").exists() and not (tmp_path / "s2.json").exists()


def test_bucket_for():
    assert bucket_for(1, [128, 256]) == 128 and bucket_for(128, [128, 256]) == 128 and bucket_for(129, [128, 256]) == 256


def test_unusable_prompts_are_counted_not_generated_and_damaged_files_are_one_line(prompts, micro_target, tmp_path):
    """An empty prompt and one that leaves no room for max_new_tokens in the target's context
    (4096) are not generated; tokenize drops them by reason. A truncated expansion output is
    one line naming the file; a damaged chunk of an unfinished expansion is generated again."""
    df = pd.read_parquet(prompts).head(3).copy()
    df["prompt"] = [list(df["prompt"].iloc[0]), [{"role": "user", "content": " "}], [{"role": "user", "content": "seven " * 5000}]]
    df.to_parquet(tmp_path / "p.parquet")
    out = tmp_path / "e.parquet"
    run_expand(tmp_path / "p.parquet", micro_target, out)
    e = pd.read_parquet(out).set_index("id")
    ids = list(df["id"])
    assert list(e.loc[ids[1:], "finish_reason"]) == ["skipped_empty_prompt", "skipped_prompt_too_long"]
    assert e.loc[ids[0], "finish_reason"] in ("stop", "length") and len(e) == 3
    assert (e.loc[e["finish_reason"].str.startswith("skipped"), "num_new_tokens"] == 0).all()
    stats = tokenize_expanded({"math": str(out)}, str(micro_target), [512], str(tmp_path / "tok"), str(tmp_path / "s.json"))
    assert stats["dropped"]["skipped_empty_prompt"] == 1 and stats["dropped"]["skipped_prompt_too_long"] == 1

    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"e\.parquet: cannot read .*truncated or corrupt: delete it and rerun") as err:
        tokenize_expanded({"math": str(out)}, str(micro_target), [512], str(tmp_path / "tok2"), str(tmp_path / "s2.json"))
    assert "\n" not in str(err.value)

    # a damaged chunk left by an interrupted expansion is made again
    from dataclasses import asdict

    from dflashpipe.inputs.target import target_fingerprint
    from dflashpipe.stages.expand import _file_digest, decoder_identity, decoding_code_digest

    run_expand(tmp_path / "p.parquet", micro_target, tmp_path / "ref.parquet", chunk_size=1)
    settings = ExpandSettings(**{**SETTINGS, "chunk_size": 1})
    work = tmp_path / "f.parquet.chunks"
    work.mkdir()
    (work / "settings.json").write_text(json.dumps({
        "settings": asdict(settings), "decoder": decoder_identity(str(micro_target), settings, "cpu"),
        "code": decoding_code_digest(), "target_fingerprint": target_fingerprint(str(micro_target)),
        "prompts_digest": _file_digest(str(tmp_path / "p.parquet")), "shard": 0, "n_shards": 1}))
    (work / "chunk_00000.parquet").write_bytes(b"PAR1 not really")
    lines = []
    expand_prompts(str(tmp_path / "p.parquet"), str(micro_target), settings, str(tmp_path / "f.parquet"), log=lines.append)
    assert any("chunk_00000.parquet cannot be read" in ln for ln in lines)
    cols = ["id", "response", "finish_reason"]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "f.parquet")[cols], pd.read_parquet(tmp_path / "ref.parquet")[cols])


def test_shard_without_prompts_writes_an_empty_output_and_merges(micro_target, tmp_path):
    """More shards than prompts (config/qwen3_8b_8gpu.yaml's 8 shards on a small dataset): the empty shard
    loads no model and writes an output with the usual columns; the merge has every prompt once."""
    from dflashpipe.stages.shards import merge_shards

    prompts = tmp_path / "p.parquet"
    prepare_prompts({"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 2}, "math",
                    str(prompts))
    outs, logs = [tmp_path / f"shard{k}.parquet" for k in range(3)], []
    for k, out in enumerate(outs):
        summary = expand_prompts(str(prompts), str(micro_target), ExpandSettings(**{**SETTINGS, "temperature": 0.0}),
                                 str(out), shard=k, n_shards=3, log=logs.append)
    assert summary["rows"] == 0 and any("shard 2 of 3 has no prompts" in m for m in logs)
    empty, full = pd.read_parquet(outs[2]), pd.read_parquet(outs[0])
    assert len(empty) == 0 and list(empty.columns) == list(full.columns)
    assert merge_shards([str(o) for o in outs], str(tmp_path / "merged.parquet")) == 2
    merged = pd.read_parquet(tmp_path / "merged.parquet")
    assert sorted(merged["id"]) == sorted(pd.read_parquet(prompts)["id"])
    assert set(merged["backend"]) == {"embedded"} and set(merged["dtype"]) == {"float32"}  # what ran, not `auto`


def test_chunks_of_another_decoder_or_code_are_not_resumed(prompts, micro_target, tmp_path, monkeypatch):
    """The chunks' identity holds the backend `auto` resolves to, its device and dtype, and a digest of the
    decoding code: chunks written before a decoder fix, or by another backend/dtype (a GPU->CPU move), are
    discarded on resume, not mixed with new ones."""
    import dflashpipe.stages.expand as expand

    settings = ExpandSettings(**SETTINGS)  # backend auto: embedded on the CPU, 3 chunks of 4
    assert expand.decoder_identity(str(micro_target), settings, "cpu") == {"backend": "embedded", "device": "cpu",
                                                                           "dtype": "float32"}
    assert expand.decoder_identity(str(micro_target), ExpandSettings(**{**SETTINGS, "backend": "batched"}), "cuda:3") == {
        "backend": "batched", "device": "cuda", "dtype": "bfloat16", "decode_step": "compiled"}

    def killed_after_first_chunk(out):
        def log(m):
            if m.startswith("chunk 1/3"):
                raise KeyboardInterrupt  # the job dies with one chunk written
        with pytest.raises(KeyboardInterrupt):
            expand_prompts(str(prompts), str(micro_target), settings, str(out), log=log)
        assert len(list((tmp_path / (out.name + ".chunks")).glob("chunk_*.parquet"))) == 1

    for name, attr, value in (("code", "decoding_code_digest", lambda: "before-the-fix"),
                              ("decoder", "decoder_identity", lambda *a: {"backend": "batched", "device": "cuda",
                                                                          "dtype": "bfloat16", "decode_step": "compiled"})):
        out, logs = tmp_path / f"{name}.parquet", []
        with monkeypatch.context() as m:
            m.setattr(expand, attr, value, raising=False)
            killed_after_first_chunk(out)
        expand_prompts(str(prompts), str(micro_target), settings, str(out), log=logs.append)
        assert any("settings changed" in m for m in logs), name
        assert not any(m.startswith("resuming") for m in logs), name
        assert len(pd.read_parquet(out)) == 12
    # the same decoder and code resume (the chunk is kept)
    out, logs = tmp_path / "same.parquet", []
    killed_after_first_chunk(out)
    expand_prompts(str(prompts), str(micro_target), settings, str(out), log=logs.append)
    assert any(m.startswith("resuming: 1 of 3 chunks") for m in logs)
