"""Expansion through an OpenAI-compatible server the user runs (vLLM, SGLang, ``transformers serve``).

Standard library only (urllib + threads): the machines that run expansion may not
install packages. Each prompt is one ``/v1/chat/completions`` request carrying
the chat messages, so the server applies the target's chat template; the
pipeline's ``expand.chat_template_kwargs`` travel as ``chat_template_kwargs``
(accepted by vLLM, SGLang and ``transformers serve``). At most
``server.concurrency`` requests are in flight; a connection error, a time-out,
HTTP 429 or 5xx is retried with exponential back-off, and a server that stays
unreachable ends the job with one line naming the url and the key.

Before any prompt is sent, the server is checked against ``target.path``: a
probe chat must have as many prompt tokens there as the local tokenizer and chat
template give (the exact ids when the server returns them, as vLLM does with
``return_token_ids``), and every reply's ``usage.prompt_tokens`` is checked
again. A mismatch is refused with one line: the drafter is trained with the
local tokenizer, so a server with another one would teach it another model.

Replies: when the server returns the generated token ids (vLLM), the reply text
is decoded from them locally exactly as the embedded backend decodes its own
(cut at the first end token, special tokens skipped) and the ids are kept;
otherwise the reply is the server's ``content`` and the ids are null (counted
in the tokenize stats). A server that splits the reply into reasoning and
content (a reasoning parser) and returns no ids is refused: the drafter must
learn the raw reply.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

from dflashpipe.inputs.target import prompt_ids as local_prompt_ids
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.settings import schema_settings

# a chat that many tokenizers split differently: digits, accents, CJK, symbols, code, emoji
PROBE = [{"role": "user", "content": "Tokenizer probe 0123456789: naïve café Ærø 漢字かな 한국어 ∑∫√ "
          "def f(x):\n\treturn x ** 2  # 🙂 <b>bold</b> {\"k\": [1, 2.5e-3]} ...!?"}]
# fields outside the OpenAI schema: vLLM/SGLang take them, `transformers serve` refuses unknown fields
# (HTTP 422); they are dropped for the whole run when the probe is refused because of them
EXTRA_FIELDS = ("return_token_ids", "top_k", "repetition_penalty", "min_p", "min_tokens")
# sent with them: the neutral values of what vLLM (`--generation-config auto`, its default) and SGLang would
# otherwise take from the target's generation_config.json (dflashpipe.inputs.target.generation_arguments)
NEUTRAL_FIELDS = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0}
# `transformers serve` samples only if the request's generation config says so (it never derives do_sample
# from the temperature): when sampling without EXTRA_FIELDS, this is sent too (dropped if refused)
HF_SAMPLING = {"generation_config": json.dumps({"do_sample": True, "top_k": 0})}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


@schema_settings("expand.server")
class ServerSettings:
    """``expand.server``: operational (read at run time; a change reruns nothing). Defaults: the schema's."""

    url: str | None
    model: str | None
    concurrency: int
    timeout_s: float
    retries: int
    backoff_s: float
    api_key_env: str | None


class _Retryable(Exception):
    pass


class _Refused(Exception):
    """A 4xx answer: the request itself is wrong; retrying would not help."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


def _one_line(text: str, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]


def base_url(url: str) -> str:
    """``http://host:8000``, ``.../v1`` and ``.../v1/`` all name the same API root ``.../v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class OpenAIClient:
    """A tiny JSON client with retries (thread-safe: no shared connection state)."""

    def __init__(self, server: ServerSettings, sleep=time.sleep):
        if not server.url:
            raise UserError("expand.server.url: expand.backend is openai but no server url is set "
                            "(e.g. http://127.0.0.1:8000/v1)")
        self.server = server
        self.root = base_url(server.url)
        self.sleep = sleep
        self.headers = {"Content-Type": "application/json"}
        if server.api_key_env:
            key = os.environ.get(server.api_key_env)
            if not key:
                raise UserError(f"expand.server.api_key_env: the environment variable {server.api_key_env} is not set")
            self.headers["Authorization"] = f"Bearer {key}"

    def _once(self, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.root + path, data=data, headers=self.headers,
                                     method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=self.server.timeout_s) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            if err.code == 429 or err.code >= 500:
                raise _Retryable(f"HTTP {err.code}: {_one_line(text)}") from None
            raise _Refused(err.code, text) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout, OSError) as err:
            reason = getattr(err, "reason", err)
            raise _Retryable(f"{type(reason).__name__}: {_one_line(reason)}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise _Retryable(f"not a JSON answer ({_one_line(err)})") from None

    def call(self, path: str, body: dict | None = None) -> dict:
        """GET (``body`` None) or POST ``path``; retry transient failures, then one line naming url and key."""
        attempts = self.server.retries + 1
        for attempt in range(attempts):
            try:
                return self._once(path, body)
            except _Retryable as err:
                last = err
                if attempt + 1 < attempts:
                    self.sleep(min(60.0, self.server.backoff_s * 2**attempt))
        raise UserError(f"expand.server.url: the server at {self.root} cannot be reached after {attempts} attempts "
                        f"({last}); start it, or fix expand.server.url (expand.server.retries / timeout_s to wait longer)")


class OpenAIBackend:
    """One server session for an expansion job: checked once, then one request per (prompt, sample)."""

    def __init__(self, server: ServerSettings, tokenizer, target_path: str, settings, eos_ids: set[int], log=print,
                 sleep=time.sleep):
        self.client = OpenAIClient(server, sleep=sleep)
        self.server, self.tokenizer, self.target_path, self.s = server, tokenizer, str(target_path), settings
        self.eos_ids = eos_ids
        self.log = log
        self.extras = True  # send EXTRA_FIELDS until the server refuses them
        self.hf_sampling = settings.temperature > 0  # send HF_SAMPLING (once EXTRA_FIELDS are refused) until refused
        self.ids_missing = 0
        self._lock = threading.Lock()
        self.model = self._pick_model()
        self._check_tokenizer()

    # ---- start-up checks ----

    def _pick_model(self) -> str | None:
        listed = self.client.call("/models")
        ids = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)]
        if self.server.model:
            if ids and self.server.model not in ids:
                raise UserError(f"expand.server.model: {self.server.model!r} is not served at {self.client.root} "
                                f"(it serves {', '.join(map(str, ids))})")
            return self.server.model
        if len(ids) != 1:
            raise UserError(f"expand.server.model: the server at {self.client.root} serves "
                            f"{len(ids)} models ({', '.join(map(str, ids)) or 'none listed'}); name the one to use")
        return ids[0]

    def _mismatch(self, what: str) -> UserError:
        return UserError(f"target.path: the tokenizer or chat template of {self.target_path} does not match the model "
                         f"served at {self.client.root} ({what}); serve target.path, or set target.path to the served "
                         "model's directory")

    def _check_tokenizer(self) -> None:
        local = local_prompt_ids(self.tokenizer, PROBE, self.s.chat_template_kwargs)
        answer = self.request(PROBE, max_tokens=1, seed=None)
        prompt_ids = answer.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and prompt_ids and prompt_ids != local:
            first = next((i for i, (a, b) in enumerate(zip(prompt_ids, local)) if a != b), min(len(prompt_ids), len(local)))
            raise self._mismatch(f"probe prompt ids differ from position {first}")
        served = (answer.get("usage") or {}).get("prompt_tokens")
        if served is None:
            raise UserError(f"expand.server.url: the server at {self.client.root} reports no usage.prompt_tokens, "
                            "so its tokenizer cannot be checked against target.path")
        if served != len(local):
            raise self._mismatch(f"probe prompt: {served} tokens there, {len(local)} here")
        how = "token ids" if isinstance(prompt_ids, list) and prompt_ids else "token count"
        self.log(f"server {self.client.root} model {self.model!r}: tokenizer matches {self.target_path} (probe {how}); "
                 f"generated token ids {'returned' if self.extras else 'not returned (server refuses return_token_ids)'}")

    # ---- requests ----

    def _body(self, messages: list[dict], max_tokens: int, seed: int | None) -> dict:
        s = self.s
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": float(s.temperature), "stream": False}
        if self.model is not None:
            body["model"] = self.model
        if s.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(s.chat_template_kwargs)
        if s.temperature > 0:  # greedy needs neither (and some servers warn about unused flags)
            body["top_p"] = float(s.top_p)
            if seed is not None:
                body["seed"] = int(seed)
        if self.extras:
            body["return_token_ids"] = True
            body.update(NEUTRAL_FIELDS)
            if s.temperature > 0:
                body["top_k"] = -1  # no top-k cut, as the embedded backend (top_k=0 there); -1: disabled in vLLM/SGLang
        elif self.hf_sampling:
            body.update(HF_SAMPLING)
        return body

    def request(self, messages: list[dict], max_tokens: int, seed: int | None) -> dict:
        try:
            return self.client.call("/chat/completions", self._body(messages, max_tokens, seed))
        except _Refused as err:
            with self._lock:
                drop_extras = self.extras and any(f in err.body for f in EXTRA_FIELDS)
                drop_hf = not drop_extras and not self.extras and self.hf_sampling and "generation_config" in err.body
                if drop_extras:
                    self.extras = False
                if drop_hf:
                    self.hf_sampling = False
            if drop_extras:
                self.log(f"the server at {self.client.root} refuses {', '.join(EXTRA_FIELDS)} ({_one_line(err.body, 120)}): "
                         "sending without them; replies keep no generated token ids")
            if drop_hf:
                self.log(f"the server at {self.client.root} refuses a generation_config field: sampling settings other "
                         "than temperature and top_p are the server's")
            if drop_extras or drop_hf:
                return self.request(messages, max_tokens, seed)
            raise UserError(f"expand.server.url: the server at {self.client.root} refused a request "
                            f"(HTTP {err.status}: {_one_line(err.body)})") from None

    def _record(self, answer: dict, n_prompt: int) -> dict:
        served = (answer.get("usage") or {}).get("prompt_tokens")
        if served is not None and served != n_prompt:
            raise self._mismatch(f"a training prompt has {served} tokens there, {n_prompt} here")
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        reason = choice.get("finish_reason") or "stop"
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            stop = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
            kept = ids if stop is None else ids[:stop]
            kept = [int(t) for t in kept if t != self.tokenizer.pad_token_id]
            response = self.tokenizer.decode(kept, skip_special_tokens=True)
            return {"response": response, "num_new_tokens": len(kept), "token_ids": kept,
                    "finish_reason": "stop" if reason != "length" else "length"}
        if any(message.get(f) for f in REASONING_FIELDS):
            raise UserError(f"expand.server.url: the server at {self.client.root} splits replies into reasoning and "
                            "content (a reasoning parser) and returns no token ids, so the raw reply is lost; start it "
                            "without a reasoning parser (vLLM/SGLang: no --reasoning-parser), or use the embedded backend")
        if message.get("tool_calls") or reason == "tool_calls":
            return {"response": "", "num_new_tokens": 0, "token_ids": [], "finish_reason": "skipped_server_parsed_tool_call"}
        completion = int((answer.get("usage") or {}).get("completion_tokens") or 0)
        with self._lock:
            self.ids_missing += 1
        return {"response": message.get("content") or "", "token_ids": None,
                "num_new_tokens": max(0, completion - (reason == "stop")),  # the end token is not counted (as embedded)
                "finish_reason": "length" if reason == "length" else "stop"}

    def generate_chunk(self, rows, lengths: list[int], todo: list[int], chunk_seed: int, progress,
                       num_samples: int | None = None) -> dict:
        """``{(row index, sample): record fields}`` for the rows in ``todo``, ``num_samples`` each (None: the
        settings'); ``progress(prompts, tokens)`` per prompt."""
        s = self.s
        n_samples = num_samples or s.num_samples
        jobs = [(i, j) for i in todo for j in range(n_samples)]
        out, left = {}, {i: n_samples for i in todo}
        pool = ThreadPoolExecutor(max_workers=max(1, self.server.concurrency), thread_name_prefix="expand-request")
        failed = True
        try:
            futures = {
                pool.submit(self.request, [dict(t) for t in rows["prompt"].iloc[i]], s.max_new_tokens,
                            chunk_seed + k if s.temperature > 0 else None): (i, j)
                for k, (i, j) in enumerate(jobs)
            }
            for fut in as_completed(futures):
                i, j = futures[fut]
                rec = self._record(fut.result(), lengths[i])
                out[(i, j)] = rec
                left[i] -= 1
                progress(int(left[i] == 0), rec["num_new_tokens"] + (rec["finish_reason"] == "stop"))
            failed = False
        finally:  # on an error, requests not yet sent are dropped and the job fails without waiting for them
            pool.shutdown(wait=not failed, cancel_futures=True)
        return out
