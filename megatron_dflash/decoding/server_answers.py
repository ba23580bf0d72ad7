"""The target's answers from an OpenAI-compatible server (the chat-completions protocol), standard library only.

The answer back end of `decoding/regenerate.py` for a target served elsewhere (vLLM, SGLang, ...): one
`POST /v1/chat/completions` per request, `concurrency` of them in flight. A connection error, a timeout, a
5xx or a 429 answer is retried with exponential back-off (`backoff * 2**attempt` seconds, `retries`
times, each retry said in one line); another 4xx, a reply that is not the protocol, or a request that keeps
failing becomes a `RequestFailed` naming the reason, which `regenerate` reports with the record's id (a 400,
413 or 422, the request's own content refused, as a bad answer of the record).

Bounds, so that no server can hold or swamp the run:

* `timeout` is the whole request's deadline (connect, send, every byte of the reply), not one socket
  read's: a watchdog closes the connection when it passes; while requests wait, a line every
  `report_every` seconds says how many and for how long;
* a reply is read in chunks up to `reply_byte_limit(max_new_tokens)` bytes: a larger one is a bad answer
  of its record (named; skipped or failed by the bad-records rule), never read whole.

A reasoning parser's thinking (`reasoning_content`, or vLLM's newer `reasoning`) is kept as the answer's
`reasoning`; a reply whose `content` is null (cut inside the thinking) is an empty answer with its thinking.
With a tokenizer directory (`limits`, `decoding/prompt_limits.py`) records are checked against its chat
template's roles and its context before they are sent.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Sequence

from .regenerate import MAX_CHARS_PER_TOKEN, Answer, Request, RequestFailed, Settings

__all__ = ["chat_completions_url", "reply_byte_limit", "ServerAnswers"]

_CHUNK = 1 << 16


def chat_completions_url(url: str) -> str:
    """The endpoint of a server given as its root (`http://host:8000`), its `/v1`, or the endpoint itself."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def reply_byte_limit(max_new_tokens: int) -> int:
    """The most bytes a reply to `max_new_tokens` may hold: text and thinking of `MAX_CHARS_PER_TOKEN`
    characters per token, each character up to 12 bytes of JSON (a `\\ud83d\\ude00` pair), and 64 KiB else."""
    return (1 << 16) + 2 * 12 * MAX_CHARS_PER_TOKEN * max_new_tokens


class _Retry(Exception):
    """A failure worth another try (the server may recover)."""


class _Fatal(Exception):
    """A failure another try would repeat (a refused request, a reply that is not the protocol)."""

    def __init__(self, reason: str, bad_answer: bool = False):
        super().__init__(reason)
        self.bad_answer = bad_answer


def _log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ServerAnswers:
    """Answers of model `model` on the server at `url`."""

    def __init__(self, url: str, model: str, settings: Settings, *, concurrency: int = 8, retries: int = 5,
                 backoff: float = 1.0, timeout: float = 600.0, api_key: str = "", limits=None,
                 report_every: float = 60.0, log: Callable[[str], None] = _log_stderr):
        self.url, self.model, self.settings = chat_completions_url(url), model, settings
        self.concurrency, self.retries, self.backoff, self.timeout = concurrency, retries, backoff, timeout
        self.api_key, self.limits, self.report_every, self.log = api_key, limits, report_every, log
        self.max_bytes = reply_byte_limit(settings.max_new_tokens)
        if limits is not None:  # records checked against the tokenizer's roles and context before sending
            self.check_record = limits.check_record

    def body(self, request: Request) -> dict:
        s = self.settings
        body = {"model": self.model, "messages": request.messages, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "seed": request.seed, "n": 1}
        if s.chat_template_kwargs:
            body["chat_template_kwargs"] = s.chat_template_kwargs
        return body

    def answer(self, requests: Sequence[Request]) -> list:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            futures = [pool.submit(self._one, q) for q in requests]
            start, pending = time.monotonic(), set(futures)
            report = start + self.report_every
            while pending:
                _, pending = wait(pending, timeout=max(0.0, report - time.monotonic()), return_when=FIRST_COMPLETED)
                now = time.monotonic()
                if pending and now >= report:
                    report = now + self.report_every
                    self.log(f"[regenerate] waiting for {self.url}: {len(pending)} of {len(futures)} requests "
                             f"unanswered after {now - start:.1f} s (--timeout {self.timeout:g} s per request, then "
                             f"retried up to --retries {self.retries} times)")
            return [f.result() for f in futures]

    def _one(self, request: Request):
        data = json.dumps(self.body(request)).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1)
                self.log(f"[regenerate] {request.name}: {last}; try {attempt + 1} of {self.retries + 1} in "
                         f"{delay:g} s")
                time.sleep(delay)
            try:
                return self._post(data)
            except _Retry as err:
                last = str(err)
            except _Fatal as err:
                return RequestFailed(str(err), bad_answer=err.bad_answer)
        return RequestFailed(f"{self.retries + 1} tries failed, the last with: {last}")

    def _connection(self) -> tuple[http.client.HTTPConnection, str]:
        parts = urllib.parse.urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port, timeout=self.timeout), path

    def _post(self, data: bytes) -> Answer:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn, path = self._connection()
        expired = threading.Event()

        def expire():  # the whole request's deadline: a blocked read or a trickling reply ends here
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.settimeout(0.01)  # the next read of a trickle times out (Linux reads on after SHUT_RD)
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked now
                except OSError:
                    pass

        watchdog = threading.Timer(self.timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("POST", path, body=data, headers=headers)
            reply = conn.getresponse()
            if reply.status >= 400:
                text = reply.read(200).decode("utf-8", "replace")
                if reply.status >= 500 or reply.status == 429:
                    raise _Retry(f"HTTP {reply.status} {text}")
                # 400 / 413 / 422: this request's content refused (a prompt past the server's context, ...)
                raise _Fatal(f"HTTP {reply.status} {text}", bad_answer=reply.status in (400, 413, 422))
            payload = self._read(reply, expired)
        except (OSError, http.client.HTTPException) as err:
            if expired.is_set():
                raise _Retry(f"no whole reply within --timeout {self.timeout:g} s") from None
            raise _Retry(f"{type(err).__name__}: {err}") from None
        finally:
            watchdog.cancel()
            conn.close()
        if expired.is_set():
            raise _Retry(f"no whole reply within --timeout {self.timeout:g} s")
        return self._parse(payload)

    def _read(self, reply, expired: threading.Event) -> bytes:
        """The reply's body, in chunks, refused past `max_bytes` (declared or read)."""
        too_big = (f"the server's reply is over {self.max_bytes} bytes, far beyond what --max-new-tokens "
                   f"{self.settings.max_new_tokens} allows (a runaway server?)")
        declared = reply.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            raise _Fatal(too_big, bad_answer=True)
        chunks, size = [], 0
        while not expired.is_set():
            chunk = reply.read1(_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_bytes:
                raise _Fatal(too_big, bad_answer=True)
            chunks.append(chunk)
        return b""  # the deadline passed: the caller says so

    @staticmethod
    def _parse(payload: bytes) -> Answer:
        try:
            reply = json.loads(payload)
            choice = reply["choices"][0]
            message, reason = choice["message"], choice["finish_reason"]
            text = message.get("content")
            reasoning = message.get("reasoning_content")
            if reasoning is None:
                reasoning = message.get("reasoning")
            tokens = int((reply.get("usage") or {}).get("completion_tokens", 0))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as err:
            raise _Fatal(f"not a chat-completions reply ({type(err).__name__}: {str(err)[:80]})")
        if text is None and (reasoning is not None or reason == "length"):
            text = ""  # cut inside the thinking, or all of it thinking: an empty answer
        if not isinstance(text, str) or not isinstance(reasoning, (str, type(None))):
            shown = "content" if not isinstance(text, str) else "reasoning"
            raise _Fatal(f"the reply's {shown} is {type(text if shown == 'content' else reasoning).__name__}, not "
                         f"a string (finish_reason {reason!r})", bad_answer=True)
        return Answer(text, reason, tokens, reasoning)
