"""The token ids of a request, as the engine will see them, for the predictor.

A prompt given as token ids is taken as is. Text needs the model's own tokenizer: a local model
directory (or any directory holding `tokenizer.json` / `tokenizer_config.json`) loaded with
transformers' `AutoTokenizer`, never downloaded. Chat messages go through the tokenizer's chat
template with what vLLM's chat endpoint passes it (`add_generation_prompt`, default True;
`continue_final_message`; `tools`; `chat_template_kwargs`; a request's own `chat_template`), and
vLLM's default of no extra special tokens for chat (`add_special_tokens` False) — so the ids match
the engine's when the engine serves the same tokenizer files.

Errors the client caused are `ClientError`s: an HTTP status, the OpenAI error type and the field.
"""

from __future__ import annotations

import os
from array import array
from typing import Sequence

import numpy as np

from ..errors import ConfigError, KvatlasError
from .digest import U32_CODE

MAX_TOKEN_ID = 2**31 - 1


class ClientError(KvatlasError):
    """Bad client input: answered with OpenAI's error JSON and `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


NO_TOKENIZER = ("kvatlas route was started without a tokenizer, so it cannot read text prompts: send the prompt as "
                "token ids, or start kvatlas route with --tokenizer DIR (a local directory holding the model's "
                "tokenizer.json and tokenizer_config.json; MODEL itself works when it is such a directory)")


def has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


class PromptTokenizer:
    """Text and chat messages → token ids with the model's tokenizer (None: token ids only)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.tok = None
        if path is None:
            return
        if not has_tokenizer_files(path):
            raise ConfigError("--tokenizer", f"{path!r} holds no tokenizer.json or tokenizer_config.json",
                              "give the local model directory the engine serves")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ConfigError("--tokenizer", f"transformers cannot be imported ({e})",
                              "pip install transformers, or send prompts as token ids") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError("--tokenizer", f"{path!r} cannot be loaded as a tokenizer ({e})",
                              "give the local model directory the engine serves") from None

    def _need(self, what: str) -> None:
        if self.tok is None:
            raise ClientError(f"{what}: {NO_TOKENIZER}", param=what)

    def completion_ids(self, body: dict) -> Sequence[int]:
        """The first prompt's ids (a batch of prompts routes by its first)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._need("prompt")
            add = body.get("add_special_tokens", True)
            return list(self.tok(prompt, add_special_tokens=bool(add))["input_ids"])
        return token_ids(prompt, "prompt")

    def chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ClientError("messages: give a non-empty list of {role, content} objects", param="messages")
        self._need("messages")
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if not isinstance(kwargs, dict):
            raise ClientError("chat_template_kwargs: give an object", param="chat_template_kwargs")
        cont = bool(body.get("continue_final_message", False))
        kwargs.update(add_generation_prompt=bool(body.get("add_generation_prompt", not cont)),
                      continue_final_message=cont, tokenize=False)
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        if isinstance(body.get("chat_template"), str):
            kwargs["chat_template"] = body["chat_template"]
        try:
            text = self.tok.apply_chat_template(messages, **kwargs)
        except Exception as e:   # a template's own error (jinja2, a missing field): the client's messages
            raise ClientError(f"messages: the chat template refused them ({type(e).__name__}: {e})",
                              param="messages") from None
        return list(self.tok(text, add_special_tokens=bool(body.get("add_special_tokens", False)))["input_ids"])


def token_ids(value, field: str):
    """Token ids, checked (bools and negative or huge ids refused): the uint32 array built to check
    them where they all fit one (the digest reads it as is, so a long prompt is converted once),
    else the list."""
    if not isinstance(value, list) or not value:
        raise ClientError(f"{field}: give a non-empty string or a non-empty list of token ids", param=field)
    try:        # the common case, in C: ints in [0, 2**32) (a float, a string, a negative one raise)
        ids = np.frombuffer(array(U32_CODE, value), dtype=np.uint32)
    except (TypeError, OverflowError):
        ids = None
    if ids is not None and int(ids.max()) <= MAX_TOKEN_ID \
            and not any(type(value[i]) is bool for i in np.flatnonzero(ids <= 1).tolist()):
        return ids
    for t in value:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise ClientError(f"{field}: {t!r} is not a token id; give integers in [0, {MAX_TOKEN_ID}]", param=field)
    return value
