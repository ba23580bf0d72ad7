"""The target's answers from an OpenAI-compatible server (the chat-completions protocol), standard library only.

The answer back end of `decoding/regenerate.py` for a target served elsewhere (vLLM, SGLang, ...): one
`POST /v1/chat/completions` per request, `concurrency` of them in flight. A connection error, a timeout, a
5xx or a 429 answer is retried with exponential back-off (`backoff * 2**attempt` seconds, `retries`
times); another 4xx, a reply that is not the protocol, or a request that keeps failing becomes a
`RequestFailed` naming the reason, which `regenerate` reports with the record's id.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .regenerate import FINISH_REASONS, Answer, Request, RequestFailed, Settings

__all__ = ["chat_completions_url", "ServerAnswers"]


def chat_completions_url(url: str) -> str:
    """The endpoint of a server given as its root (`http://host:8000`), its `/v1`, or the endpoint itself."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class _Retry(Exception):
    """A failure worth another try (the server may recover)."""


class _Fatal(Exception):
    """A failure another try would repeat (a refused request, a reply that is not the protocol)."""


class ServerAnswers:
    """Answers of model `model` on the server at `url`."""

    def __init__(self, url: str, model: str, settings: Settings, *, concurrency: int = 8, retries: int = 5,
                 backoff: float = 1.0, timeout: float = 600.0, api_key: str = ""):
        self.url, self.model, self.settings = chat_completions_url(url), model, settings
        self.concurrency, self.retries, self.backoff, self.timeout = concurrency, retries, backoff, timeout
        self.api_key = api_key

    def body(self, request: Request) -> dict:
        s = self.settings
        body = {"model": self.model, "messages": request.messages, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "seed": request.seed, "n": 1}
        if s.chat_template_kwargs:
            body["chat_template_kwargs"] = s.chat_template_kwargs
        return body

    def answer(self, requests: Sequence[Request]) -> list:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(requests)))) as pool:
            return list(pool.map(self._one, requests))

    def _one(self, request: Request):
        data = json.dumps(self.body(request)).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._post(data)
            except _Retry as err:
                last = str(err)
            except _Fatal as err:
                return RequestFailed(str(err))
        return RequestFailed(f"{self.retries + 1} tries failed, the last with: {last}")

    def _post(self, data: bytes) -> Answer:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as reply:
                payload = reply.read()
        except urllib.error.HTTPError as err:
            text = err.read()[:200].decode("utf-8", "replace")
            if err.code >= 500 or err.code == 429:
                raise _Retry(f"HTTP {err.code} {text}")
            raise _Fatal(f"HTTP {err.code} {text}")
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout) as err:
            raise _Retry(f"{type(err).__name__}: {err}")
        return self._parse(payload)

    @staticmethod
    def _parse(payload: bytes) -> Answer:
        try:
            reply = json.loads(payload)
            choice = reply["choices"][0]
            text, reason = choice["message"]["content"], choice["finish_reason"]
            tokens = int((reply.get("usage") or {}).get("completion_tokens", 0))
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise _Fatal(f"not a chat-completions reply ({type(err).__name__}: {str(err)[:80]})")
        if not isinstance(text, str) or reason not in FINISH_REASONS:
            raise _Fatal(f"finish_reason {reason!r} (expected one of {', '.join(FINISH_REASONS)})")
        return Answer(text, reason, tokens)
