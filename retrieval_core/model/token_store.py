"""Each staged caption tokenised once per tokenizer: a token-id store beside the staged shards.

Layout, inside the staged folder (nothing the stager wrote changes, so staged content, its checksums and the
models trained on it stay as they were)::

    <staged>/token_ids/<fingerprint>/store.json          fingerprint, max_len, tokenizer class
    <staged>/token_ids/<fingerprint>/<caption shard>.npz  caption_id (int64), offsets (int64), ids (int32),
                                                          source_sha256 (the caption shard it was made from)

``fingerprint`` (``tokenizer_fingerprint``) is a digest of the tokenizer's full definition and the truncation
length: another tokenizer gets its own folder, and a reader asking for one fingerprint never sees another's ids.
A shard's ids are refused when the caption shard they were made from has changed since (its sha256 in the
staged summary differs). The encode and rerank jobs build the store on the launching host before their graph
runs (``ensure_token_store``) and pass ``fingerprint`` to their handler, which refuses a model whose tokenizer
has another. A URL staged folder (gs://) gets its store there too, written through the caller's writer, so a
job's batches are the same whichever file system holds its data.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Callable, Optional

import numpy as np

from retrieval_core.data.paths import LOCAL_FILES, is_url, join_path, read_file, write_local_atomic
from retrieval_core.data.store import StagedDataset
from retrieval_core.errors import StagedDataError
from retrieval_core.model.collate import TOKEN_ID_DTYPE, TextCollator

TOKEN_DIR = "token_ids"
STORE_JSON = "store.json"
STORE_VERSION = 1


class TokenStoreError(StagedDataError):
    """A token-id store that does not belong to the staged captions or the tokenizer asked for."""


def tokenizer_fingerprint(collator: TextCollator) -> str:
    """16 hex digits of sha256 over the tokenizer's serialised definition (vocabulary, normaliser,
    pre-tokeniser, post-processor, special tokens) and the truncation length: what decides its ids."""
    tok = collator.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tok).__name__} is not a fast tokenizer: its definition cannot be fingerprinted")
    definition = json.loads(backend.to_str())
    for state in ("truncation", "padding"):  # the last call's settings, not the tokenizer's; max_len is added below
        definition.pop(state, None)
    digest = hashlib.sha256()
    digest.update(json.dumps(definition, sort_keys=True).encode("utf-8"))
    digest.update(f"\0max_len={collator.max_len}\0pad={tok.pad_token_id}".encode("utf-8"))
    return digest.hexdigest()[:16]


def store_dir(staged_dir: str, fingerprint: str) -> str:
    return join_path(join_path(staged_dir, TOKEN_DIR), fingerprint)


def _shard_file(rel: str) -> str:
    return rel.replace("/", "__") + ".npz"


def _files(staged: StagedDataset, path: str):
    return staged.files if is_url(path) else LOCAL_FILES


class TokenStore:
    """The token ids of one staged folder's captions under one tokenizer fingerprint (module docstring)."""

    def __init__(self, staged: StagedDataset, fingerprint: str):
        self.staged = staged
        self.fingerprint = fingerprint
        self.root = store_dir(staged.root, fingerprint)
        path = join_path(self.root, STORE_JSON)
        try:
            meta = json.loads(read_file(path, _files(staged, path)))
        except FileNotFoundError:
            raise TokenStoreError(f"no token-id store {self.root}: build it with ensure_token_store") from None
        if meta.get("fingerprint") != fingerprint or meta.get("version") != STORE_VERSION:
            raise TokenStoreError(f"{path} records fingerprint {meta.get('fingerprint')} (version "
                                  f"{meta.get('version')}), not {fingerprint}: delete {self.root} and rebuild it")
        self.meta = meta

    def read_shard(self, rel: str) -> tuple[np.ndarray, list[np.ndarray]]:
        """(caption ids, their token-id arrays) of one staged caption shard, in the shard's row order."""
        with self._open_checked(rel) as z:
            caption_ids, offsets, ids = z["caption_id"], z["offsets"], z["ids"]
        return caption_ids, np.split(ids, offsets[1:-1])

    def check_shard(self, rel: str) -> None:
        """Refuse the shard's ids when they were made from another version of the caption shard (reads only
        the recorded checksum of a local store: a job's start-up does not load every id to check them)."""
        with self._open_checked(rel):
            pass

    def _open_checked(self, rel: str):
        path = join_path(self.root, _shard_file(rel))
        try:  # a local .npz is read lazily, member by member; a URL one is fetched whole
            z = np.load(io.BytesIO(read_file(path, self.staged.files)) if is_url(path) else path, allow_pickle=False)
        except FileNotFoundError:
            raise TokenStoreError(f"{path} is missing: the store was built before caption shard {rel} was "
                                  f"staged; rebuild it with ensure_token_store") from None
        source, expected = str(z["source_sha256"]), self.staged.shard_sha256(rel)
        if source != expected:
            z.close()
            raise TokenStoreError(f"{path} was made from caption shard {rel} with sha256 {source[:12]}, the staged "
                                  f"shard now has {expected[:12]}: delete {self.root} and rebuild it")
        return z

    def ids_of(self, rel: str, caption_ids) -> list[np.ndarray]:
        """The token ids of the given captions of one staged caption shard, in the order given."""
        have, ids = self.read_shard(rel)
        pos = {int(c): i for i, c in enumerate(have.tolist())}
        missing = [int(c) for c in caption_ids if int(c) not in pos]
        if missing:
            raise TokenStoreError(f"captions {missing[:5]} of shard {rel} have no token ids in {self.root}")
        return [ids[pos[int(c)]] for c in caption_ids]


def ensure_token_store(staged: StagedDataset, collator: TextCollator, log=None,
                       write: Optional[Callable[[str, bytes], object]] = None) -> TokenStore:
    """The token-id store of ``staged`` for ``collator``'s tokenizer, tokenising the caption shards it lacks (one
    tokenizer call per shard). ``write(path, data)`` writes a file atomically; a local folder needs none, a URL
    folder the caller's (the pipelines pass Beam's)."""
    fingerprint = tokenizer_fingerprint(collator)
    root = store_dir(staged.root, fingerprint)
    if write is None:
        if is_url(root):
            raise TokenStoreError(f"{staged.root} is a URL: writing its token-id store needs a writer for URLs")
        write = write_local_atomic
    if not is_url(root):
        os.makedirs(root, exist_ok=True)
    files = _files(staged, root)
    meta_path = join_path(root, STORE_JSON)
    if not files.exists(meta_path):
        meta = {"version": STORE_VERSION, "fingerprint": fingerprint, "max_len": collator.max_len,
                "tokenizer": type(collator.tokenizer).__name__}
        write(meta_path, json.dumps(meta, indent=2, sort_keys=True).encode("utf-8"))
    store = TokenStore(staged, fingerprint)
    made = 0
    for rel in staged.shard_names("captions"):
        path = join_path(root, _shard_file(rel))
        if files.exists(path):
            store.check_shard(rel)
            continue
        table = staged.read_shard_columns(rel, ("caption_id", "text"))
        ids = collator.ids(table.column("text").to_pylist()) if table.num_rows else []
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(t) for t in ids])
        buf = io.BytesIO()
        np.savez(buf, caption_id=table.column("caption_id").to_numpy().astype(np.int64), offsets=offsets,
                 ids=np.concatenate(ids) if ids else np.zeros(0, dtype=TOKEN_ID_DTYPE),
                 source_sha256=np.str_(staged.shard_sha256(rel)))
        write(path, buf.getvalue())
        made += 1
    if log is not None and made:
        log(f"token ids: tokenised {made} caption shard(s) of {staged.root} once for tokenizer {fingerprint}")
    return store
