"""Content keys: one 64-bit key per full page, chained, so a page's key covers every token before
it and equal keys mean equal prefixes (up to a 2^-64 collision).

The rule for keys given precomputed (`admit(..., page_keys=)`, trace replay): they must be what
`page_keys(prompt ids, page_tokens)` gives, or keys of any other scheme with the same promise
(equal keys only for equal content from the first token on): a wrong key hands another request's
KV to whoever matches it. Where both sides are known the cache checks it: keys given beside the
prompt's token_ids must equal the ids' keys, and a request admitted with keys and finished with
token_ids has the ids' keys checked against them (`ContentMismatchError`, nothing published).

Finish-time ids are checked the same way (`verified_keys`): they may extend the admitted prompt
(the generated tokens), never differ from it, because the pages the request wrote hold the
prompt it was admitted with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..checks import whole
from ..errors import KvatlasError


class ContentMismatchError(KvatlasError):
    """Token ids or keys that contradict the content a request was admitted and written with."""


def check_token_ids(token_ids) -> None:
    """Refuse what is not a flat sequence of integer ids (KvatlasError naming token_ids)."""
    as_tokens(token_ids)


def as_tokens(token_ids, field: str = "token_ids") -> np.ndarray:
    try:
        ids = np.asarray(token_ids)
    except (TypeError, ValueError):   # ragged nesting, objects numpy cannot hold
        ids = None
    if ids is None or ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise KvatlasError(f"{field}: give a flat sequence of integer token ids, not a {type(token_ids).__name__}")
    return ids.astype(np.int64, copy=False)


def page_keys(token_ids, page_tokens: int, parent: int = 0) -> np.ndarray:
    """Keys of the full pages of `token_ids` (a partial last page has none): key i hashes key
    i - 1 (`parent` for the first) and page i's token ids."""
    ids = as_tokens(token_ids)
    whole("page_tokens", page_tokens, 1)
    n = len(ids) // page_tokens
    out = np.empty(n, np.uint64)
    raw = ids[: n * page_tokens].tobytes()
    step = page_tokens * 8
    prev = int(parent).to_bytes(8, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step], digest_size=8).digest()
        out[i] = int.from_bytes(prev, "little")
    return out


@dataclass(frozen=True, slots=True, eq=False)
class PromptKeys:
    """A prompt's page keys and its ids past the last full page, computed once
    (`PrefixCache.prompt_keys`): given as `page_keys=` to can_admit, admit and a tier's prefetch,
    they hash nothing again, however many times a waiting request is asked about, and the finish
    still checks its ids against the prompt (the tail is kept). Read-only arrays."""
    keys: np.ndarray
    tail: np.ndarray
    prompt_tokens: int
    page_tokens: int


def prompt_keys(token_ids, prompt_tokens: int, page_tokens: int) -> PromptKeys:
    ids = as_tokens(token_ids)
    whole("prompt_tokens", prompt_tokens, 1)
    if len(ids) < prompt_tokens:
        raise KvatlasError(f"token_ids: {len(ids)} ids for a {prompt_tokens}-token prompt; give at least "
                           "the prompt's ids")
    keys, tail = page_keys(ids[:prompt_tokens], page_tokens), prompt_tail(ids, prompt_tokens, page_tokens)
    keys.setflags(write=False)
    tail.setflags(write=False)
    return PromptKeys(keys, tail, int(prompt_tokens), int(page_tokens))


def check_keys(keys, prompt_tokens: int, page_tokens: int, token_ids=None) -> np.ndarray:
    """Precomputed keys (trace replay): at most one per full page of the prompt; given beside the
    prompt's token_ids, exactly the ids' keys."""
    arr = np.asarray(keys)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise KvatlasError("page_keys: give a flat sequence of integer keys, one per full page")
    if len(arr) > prompt_tokens // page_tokens:
        raise KvatlasError(f"page_keys: {len(arr)} keys for {prompt_tokens // page_tokens} full pages of the "
                           "prompt; give one key per full page (a partial last page has none)")
    arr = arr.astype(np.uint64)
    if token_ids is not None:
        own = page_keys(as_tokens(token_ids)[:prompt_tokens], page_tokens)[: len(arr)]
        _same(arr, own, "page_keys", "the keys of token_ids (kvatlas.prefix.page_keys)",
              "give the keys page_keys(token_ids) returns, or only one of the two")
    return arr


def prompt_tail(token_ids, prompt_tokens: int, page_tokens: int) -> np.ndarray:
    """The prompt's ids past its last full page (a copy: the caller's array may change later)."""
    return as_tokens(token_ids)[prompt_tokens // page_tokens * page_tokens: prompt_tokens].copy()


def verified_keys(admitted: np.ndarray, tail: np.ndarray | None, prompt_tokens: int, token_ids,
                  written: int, page_tokens: int) -> np.ndarray:
    """Keys of the pages a finishing request may publish, from the ids given at finish.

    `admitted`: the keys it was admitted with (of its prompt's full pages); `tail`: the prompt's
    ids past them (None when admitted with page_keys: then only whole pages can be checked). The
    ids must agree with the prompt wherever both exist; past it they are the generated tokens.
    Raises ContentMismatchError (or KvatlasError for ids that are not ids), changing nothing."""
    ids = as_tokens(token_ids)
    if not len(admitted) and tail is None:
        raise ContentMismatchError("token_ids: this request was admitted without token_ids or page_keys, so the "
                                   "pages it wrote cannot be checked against them; give token_ids at admit, or "
                                   "finish it without token_ids")
    keys = page_keys(ids[: max(written, prompt_tokens)], page_tokens)   # every prompt id given is checked
    n = min(len(keys), len(admitted))
    _same(keys[:n], admitted[:n], "token_ids", "the prompt it was admitted with",
          "give the admitted prompt's ids followed by the generated ones (nothing is cached)")
    if tail is not None:
        start = len(admitted) * page_tokens
        given = ids[start: min(prompt_tokens, len(ids))]
        if not np.array_equal(given, tail[: len(given)]):
            at = start + int(np.argmax(given != tail[: len(given)]))
            raise ContentMismatchError(f"token_ids: id {at} differs from the prompt it was admitted with; give the "
                                       "admitted prompt's ids followed by the generated ones (nothing is cached)")
    keys = keys[: written // page_tokens]   # pages the request has written
    return keys if len(keys) > len(admitted) else admitted


def _same(given: np.ndarray, expected: np.ndarray, field: str, what: str, fix: str) -> None:
    if len(given) and given[-1] != expected[-1]:   # chained: the last key covers every page before it
        page = int(np.argmax(given != expected))
        raise ContentMismatchError(f"{field}: page {page} differs from {what}; {fix}")
