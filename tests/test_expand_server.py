"""Expansion through a real OpenAI-compatible server (`transformers serve`, loopback, CPU) against the embedded backend.

The server is the one transformers ships (FastAPI + Uvicorn: the `transformers[serving]` extras
pinned in requirements.txt). It serves a copy of the micro target whose weights are re-drawn at
random (seeded): the micro target itself greedy-decodes little but newlines after its 8 training
steps, which would make the comparison empty; random weights give varied replies, among them byte
sequences that decode to U+FFFD and do not re-tokenize to the ids generated.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict

import pandas as pd
import pytest

from conftest import PROMPTS
from dflashpipe.inputs.data import prepare_prompts
from dflashpipe.inputs.tokenize import encode_chat, tokenize_expanded
from dflashpipe.jobs.errors import UserError
from dflashpipe.stages.expand import ExpandSettings, expand_prompts
from dflashpipe.stages.expand_openai import OpenAIClient, ServerSettings

SETTINGS = dict(max_new_tokens=24, batch_size=1, chunk_size=3, temperature=0.0)
N_PROMPTS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_target(random_target):
    """The micro target with seeded random weights (conftest): replies that vary."""
    return random_target


@pytest.fixture(scope="module")
def server(served_target, tmp_path_factory):
    """`transformers serve` on 127.0.0.1 with the served target preloaded; stopped (process group) even on failure."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", str(served_target),
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise AssertionError(f"transformers serve not up after 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "math.parquet"
    prepare_prompts({"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": N_PROMPTS},
                    "math", str(out))
    return out


def _server_settings(url, **kw):
    return ServerSettings(**{"url": url, "concurrency": 2, "retries": 2, "backoff_s": 0.05, "timeout_s": 60, **kw})


def test_server_expansion_matches_the_embedded_backend(server, served_target, prompts, tmp_path):
    """Greedy, float32, one sequence at a time on both sides: the same tokens. What differs is what the
    server reports: `transformers serve` returns no token ids, and for Qwen-family models it parses the
    reply (a response template whose text fields are stripped), so its content is the embedded reply
    with surrounding whitespace removed; the embedded backend keeps the raw decode and the ids."""
    emb, srv = tmp_path / "embedded.parquet", tmp_path / "server.parquet"
    s_emb = expand_prompts(str(prompts), str(served_target), ExpandSettings(**SETTINGS), str(emb), log=lambda m: None)
    logs = []
    s_srv = expand_prompts(str(prompts), str(served_target), ExpandSettings(**SETTINGS, backend="openai"), str(srv),
                           log=logs.append, server=_server_settings(server))
    assert any("tokenizer matches" in m for m in logs), logs
    assert any("no generated token ids" in m for m in logs), logs
    a = pd.read_parquet(emb).set_index(["id", "sample"]).sort_index()
    b = pd.read_parquet(srv).set_index(["id", "sample"]).sort_index()
    assert len(a) == len(b) == N_PROMPTS and list(a.index) == list(b.index)
    assert list(a["finish_reason"]) == list(b["finish_reason"])
    assert list(a["num_prompt_tokens"]) == list(b["num_prompt_tokens"])
    assert list(a["num_new_tokens"]) == list(b["num_new_tokens"])  # the same number of tokens generated
    assert [r.strip() for r in a["response"]] == list(b["response"])
    assert sum(len(r.strip()) for r in b["response"]) > 20, "the comparison must not be between empty replies"
    assert b["token_ids"].isna().all() and s_srv["replies_without_token_ids"] == N_PROMPTS
    assert a["token_ids"].notna().all() and s_emb["replies_without_token_ids"] == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_target)
    assert [tok.decode(list(t), skip_special_tokens=True) for t in a["token_ids"]] == list(a["response"])
    assert [m[-1]["content"] for m in b["messages"]] == list(b["response"])

    # tokenize: the embedded replies carry ids (some re-tokenize differently), the server's do not
    st_a = tokenize_expanded({"math": str(emb)}, str(served_target), [512], str(tmp_path / "ta"), str(tmp_path / "a.json"),
                             reply_ids="generated", log=lambda m: None)
    st_text = tokenize_expanded({"math": str(emb)}, str(served_target), [512], str(tmp_path / "tt"),
                                str(tmp_path / "t.json"), log=lambda m: None)  # the default: the text, differences counted
    st_b = tokenize_expanded({"math": str(srv)}, str(served_target), [512], str(tmp_path / "tb"), str(tmp_path / "b.json"),
                             log=lambda m: None)
    ga, gb = st_a["generated_ids"], st_b["generated_ids"]
    assert ga["replies_without_ids"] == 0 and ga["replies_with_ids"] > 0
    assert ga["retokenized_differently"] == ga["used_generated_ids"] + ga["kept_retokenized_text"]
    assert ga["retokenized_differently"] > 0, "random weights emit partial UTF-8 sequences: some replies must differ"
    assert gb["replies_with_ids"] == 0 and gb["replies_without_ids"] > 0
    gt = st_text["generated_ids"]
    assert gt["used_generated_ids"] == 0 and gt["retokenized_differently"] == ga["retokenized_differently"]
    assert json.loads((tmp_path / "a.json").read_text())["generated_ids"] == ga


def test_finished_chunks_are_reused_whatever_the_server_url(server, served_target, prompts, tmp_path):
    """The server's keys are operational: chunks written through one url are kept when the job is resumed
    through another spelling of it (no trailing /v1), and the result equals an uninterrupted run."""
    from dflashpipe.inputs.target import target_fingerprint
    from dflashpipe.stages.expand import _file_digest, decoder_identity, decoding_code_digest

    settings = ExpandSettings(**SETTINGS, backend="openai")
    ref = tmp_path / "ref.parquet"
    expand_prompts(str(prompts), str(served_target), settings, str(ref), log=lambda m: None, server=_server_settings(server))
    out = tmp_path / "out.parquet"
    work = tmp_path / "out.parquet.chunks"
    work.mkdir()
    (work / "settings.json").write_text(json.dumps({
        "settings": asdict(settings), "target_fingerprint": target_fingerprint(str(served_target)),
        "prompts_digest": _file_digest(str(prompts)), "shard": 0, "n_shards": 1,
        "decoder": decoder_identity(str(served_target), settings, "cpu"), "code": decoding_code_digest()}))
    first = pd.read_parquet(ref).head(SETTINGS["chunk_size"])  # the server backend writes rows in prompt order
    first.drop(columns=["temperature", "top_p", "max_new_tokens", "seed", "target", "target_path"]).to_parquet(
        work / "chunk_00000.parquet", index=False)
    logs = []
    expand_prompts(str(prompts), str(served_target), settings, str(out), log=logs.append,
                   server=_server_settings(server.removesuffix("/v1"), concurrency=1))
    assert any("resuming: 1 of 2 chunks" in m for m in logs), logs
    cols = ["id", "sample", "response", "finish_reason", "num_new_tokens"]
    pd.testing.assert_frame_equal(pd.read_parquet(out)[cols], pd.read_parquet(ref)[cols])


def test_sampled_expansion_through_the_server(server, served_target, prompts, tmp_path):
    """Several samples per prompt are separate requests with their own seeds; `transformers serve`
    refuses the non-OpenAI fields (return_token_ids, top_k), which are then left out for the run."""
    logs = []
    out = tmp_path / "s.parquet"
    expand_prompts(str(prompts), str(served_target),
                   ExpandSettings(**{**SETTINGS, "temperature": 1.0, "num_samples": 2, "max_new_tokens": 8}, backend="openai"),
                   str(out), log=logs.append, server=_server_settings(server))
    df = pd.read_parquet(out)
    assert len(df) == 2 * N_PROMPTS and sorted(df["sample"].unique()) == [0, 1]
    assert set(df["finish_reason"]) <= {"stop", "length"}
    assert any("refuses return_token_ids, top_k" in m for m in logs), logs
    pairs = df.groupby("id")["response"].apply(list)
    assert any(a != b for a, b in pairs), "two samples of every prompt came out equal"


def test_multi_turn_chats_are_answered_turn_by_turn_through_the_server(server, served_target, tmp_path):
    """expand.turns all through the server: every user turn answered in turn, the served model's reply in each
    assistant position, the first reply in the context of the second."""
    chats = [[{"role": "user", "content": f"Add {i} and 2."}, {"role": "assistant", "content": "CORPUS"},
              {"role": "user", "content": "Now double it."}] for i in range(2)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "messages": c}) + "\n"
                                                  for i, c in enumerate(chats)))
    prepare_prompts({"path": str(tmp_path / "chats.jsonl"), "messages_column": "messages"}, "chats",
                    str(tmp_path / "chats.parquet"))
    out = tmp_path / "e.parquet"
    summary = expand_prompts(str(tmp_path / "chats.parquet"), str(served_target), ExpandSettings(**SETTINGS, backend="openai"),
                             str(out), log=lambda m: None, server=_server_settings(server))
    assert summary["turns"] == {"regenerated": 4, "unanswered": {}}
    from transformers import AutoTokenizer

    from dflashpipe.inputs.target import prompt_ids

    tok = AutoTokenizer.from_pretrained(served_target)
    for messages, turns in zip(pd.read_parquet(out)["messages"], pd.read_parquet(out)["turns"]):
        messages = [dict(t) for t in messages]
        assert [t["role"] for t in messages] == ["user", "assistant", "user", "assistant"]
        assert [int(t["message"]) for t in turns] == [1, 3] and "CORPUS" not in str(messages)
        assert turns[1]["num_prompt_tokens"] == len(prompt_ids(tok, messages[:3]))  # the server agreed (usage)


def test_a_target_whose_template_differs_from_the_server_is_refused(server, served_target, prompts, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(served_target, other)
    template = other / "chat_template.jinja"
    template.write_text("{{- 'You are a careful assistant.\\n' }}" + template.read_text())
    with pytest.raises(UserError) as err:
        expand_prompts(str(prompts), str(other), ExpandSettings(**SETTINGS, backend="openai"), str(tmp_path / "x.parquet"),
                       log=lambda m: None, server=_server_settings(server))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"target.path: the tokenizer or chat template of {other} does not match the model served at {server}")
    assert not (tmp_path / "x.parquet").exists()


def test_an_unreachable_server_is_one_line_naming_the_url_and_key(served_target, prompts, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}/v1"  # nothing listens there
    t0 = time.time()
    with pytest.raises(UserError) as err:
        expand_prompts(str(prompts), str(served_target), ExpandSettings(**SETTINGS, backend="openai"),
                       str(tmp_path / "x.parquet"), log=lambda m: None,
                       server=ServerSettings(url=url, retries=2, backoff_s=0.01, timeout_s=5))
    msg = str(err.value)
    assert "\n" not in msg and time.time() - t0 < 10
    assert msg.startswith(f"expand.server.url: the server at {url} cannot be reached after 3 attempts")
    with pytest.raises(UserError, match=r"^expand.server.url: expand.backend is openai but no server url is set"):
        expand_prompts(str(prompts), str(served_target), ExpandSettings(**SETTINGS, backend="openai"),
                       str(tmp_path / "y.parquet"), log=lambda m: None, server=ServerSettings())


def test_transient_errors_are_retried_with_exponential_backoff():
    """503 twice, then an answer: three attempts, back-off 0.5 s then 1 s (sleeps recorded, not slept)."""
    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            calls.append(self.path)
            code, body = (503, b"busy") if len(calls) <= 2 else (200, b'{"data": [{"id": "m"}]}')
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        sleeps = []
        client = OpenAIClient(ServerSettings(url=f"http://127.0.0.1:{httpd.server_address[1]}", retries=3, backoff_s=0.5),
                              sleep=sleeps.append)
        assert client.call("/models") == {"data": [{"id": "m"}]}
        assert calls == ["/v1/models"] * 3 and sleeps == [0.5, 1.0]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_generated_ids_replace_a_reply_that_retokenizes_differently(micro_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(micro_target)
    text = "12 + 30 = 42 apples"
    chat = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": text}]
    merged = tok(text, add_special_tokens=False)["input_ids"]
    per_char = [tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in text]  # one token per character
    assert tok.decode(per_char) == text and per_char != merged
    plain, plain_mask, _ = encode_chat(tok, chat, 512)
    for cut in (False, True):
        info = {}
        ids, mask, full = encode_chat(tok, chat, 512, cut=cut, reply_ids=per_char, info=info)
        assert info["ids"] == "generated" and full == len(ids) == len(plain) - len(merged) + len(per_char)
        reply = [t for t, m in zip(ids, mask) if m]
        assert reply[: len(per_char)] == per_char
        assert tok.decode(reply) == text + ("" if cut else "<|im_end|>\n")
    info = {}
    assert encode_chat(tok, chat, 512, reply_ids=merged, info=info) == (plain, plain_mask, len(plain)) and info["ids"] == "same"
    info = {}
    encode_chat(tok, chat, 512, info=info)
    assert info["ids"] == "none"


def test_server_settings_defaults_agree_with_the_schema():
    import dataclasses

    from dflashpipe.jobs.settings import load_schema

    props = load_schema()["properties"]["expand"]["properties"]["server"]["properties"]
    fields = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
    assert fields == {k: v["default"] for k, v in props.items()}
    assert all(v.get("x-operational") for v in props.values())
