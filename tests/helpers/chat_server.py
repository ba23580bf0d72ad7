"""The tests' oracle of regeneration and a chat-completions server on 127.0.0.1 that answers from the tiny target.

* `greedy_answer`: one conversation's next answer from one `model.generate` call of its own (batch of one,
  no padding), the oracle the regeneration back ends are compared with;
* `reference_messages`: a record's conversation regenerated turn by turn with `greedy_answer`;
* `ChatServer`: `http.server` in a thread answering `POST /v1/chat/completions` greedily with
  `greedy_answer`; `faults(body, count)` may drop the connection ("drop") or answer an HTTP status instead;
  `edit(body, reply)` may change the reply (a reasoning parser's fields) or return bytes to send instead
  (a hostile server), and `send(handler, body)` writes every response itself instead (a slow server).
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Callable, Optional

import torch

from megatron_dflash.embedded_job.tiny_target import SHIPPED_TARGET_DIR


def load_tiny_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED_TARGET_DIR)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_TARGET_DIR, dtype=torch.float32).eval()
    return model, tok


@torch.no_grad()
def greedy_answer(model, tok, messages: list, max_new_tokens: int, chat_template_kwargs=None) -> tuple[str, str, int]:
    """(text, finish_reason, generated tokens) of the target's greedy answer to `messages`."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {}))
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    if tok.eos_token_id in out:
        end = out.index(tok.eos_token_id)
        return tok.decode(out[:end], skip_special_tokens=True), "stop", end + 1
    return tok.decode(out, skip_special_tokens=True), "length", len(out)


def reference_messages(model, tok, messages: list, max_new_tokens: int) -> tuple[list, str]:
    """The conversation with every assistant turn regenerated in order (ending at a cut answer)."""
    out, reason = [], "stop"
    for m in messages + [{"role": "assistant", "content": ""}]:
        if m["role"] != "assistant":
            out.append(m)
        elif out and out[-1]["role"] != "assistant":
            text, reason, _ = greedy_answer(model, tok, out, max_new_tokens)
            out.append({"role": "assistant", "content": text})
            if reason == "length":
                break
    return out, reason


class ChatServer:
    """`with ChatServer(model, tok) as server:` serves at `server.url` until the block ends."""

    def __init__(self, model, tok, faults: Optional[Callable[[dict, int], object]] = None,
                 edit: Optional[Callable[[dict, dict], object]] = None,
                 send: Optional[Callable[[object, dict], None]] = None):
        self.model, self.tok, self.faults, self.edit, self.send = model, tok, faults, edit, send
        self.lock = threading.Lock()
        self.count = 0
        self.requests: list = []

    def __enter__(self):
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.count += 1
                    count = owner.count
                    owner.requests.append(body)
                    fault = owner.faults(body, count) if owner.faults else None
                    if fault == "drop":
                        self.close_connection = True
                        return  # no answer: the client sees the connection closed
                    custom = fault is None and owner.send is not None
                    if fault is None and not custom and self.path == "/v1/chat/completions":
                        text, reason, tokens = greedy_answer(owner.model, owner.tok, body["messages"],
                                                             body["max_tokens"], body.get("chat_template_kwargs"))
                        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                              "finish_reason": reason}],
                                 "usage": {"completion_tokens": tokens}}
                        status = 200
                    elif not custom:
                        reply, status = {"error": {"message": "injected"}}, int(fault or 404)
                if custom:
                    owner.send(self, body)  # the test's own sender writes the whole response
                    return
                edited = owner.edit(body, reply) if status == 200 and owner.edit is not None else None
                data = edited if isinstance(edited, bytes) else json.dumps(edited or reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                try:
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client is gone (a killed run): nothing to answer

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
