"""Shared VLA trunk: language, image and state tokens into a transformer; the chunk cache.

Both families derive from :class:`VLAModel`; they differ in the action tokens they append and
in the head on top (velocity for flow matching, bin logits for autoregressive decoding).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from envs.errors import CheckpointError, InvalidOptionError
from policies.config import PolicyConfig
from policies.language import LanguageEncoder, check_instruction
from policies.normalizer import Normalizer
from policies.perception import StateEstimator
from policies.rtc import RTCConfig, prefix_guide
from policies.vision import ImageEncoder

FORMAT = "groundflow-policy"
NULL_INSTRUCTION = "<null>"
"""Stands for "no instruction" (the learned null condition used by CFG and the PMI score)."""


class PolicyMismatchError(ValueError):
    """An observation, dataset or env that does not fit the policy (dims, cameras)."""


def check_vocabulary(policy: Any, instructions: list[str], suite: Any = None, what: str = "the suite") -> None:
    """Raise if ``policy`` was never trained on some of ``instructions`` (a checkpoint's vocabulary
    is the instruction features it carries). With ``suite``, a paraphrase counts as its task's
    canonical instruction, so paraphrase evaluation stays possible."""
    known = set(policy.lang.cache)
    if not known:
        return
    need = [suite.task(l).instruction if suite is not None else l for l in instructions]
    missing = sorted({l for l in need if l not in known})
    if missing:
        raise PolicyMismatchError(f"the checkpoint was not trained on {len(missing)} instruction(s) {what} needs: "
                                  f"{missing}; it knows {sorted(known)}")


RESOLVER_KEY = "instruction_resolver"
"""``extra`` entry of a checkpoint holding its ``InstructionResolver`` calibration (``to_json``)"""


def trained_instructions(policy: Any) -> list[str]:
    """The instructions ``policy`` was trained on: config.json's list for a loaded checkpoint, else
    (a policy built in this process) its instruction cache when first asked, kept from then on, so
    that wordings encoded later on demand (a paraphrase evaluation, a server's --paraphrases) never
    count as trained. Empty for a policy without a vocabulary (scripted, no language)."""
    got = getattr(policy, "trained_instructions", None)
    if got is None:
        lang = getattr(policy, "lang", None)
        got = sorted(getattr(lang, "pinned", None) or getattr(lang, "cache", None) or ())
        got = [t for t in got if t != NULL_INSTRUCTION]
        try:
            policy.trained_instructions = got
        except AttributeError:  # a policy that takes no attributes: computed again next time
            pass
    return list(got)


def fit_instruction_resolver(instructions: list[str], colours: dict[str, tuple[str, ...]] | None = None) -> Any:
    """The resolver ``groundflow train`` stores in a checkpoint (``InstructionResolver.fit``, seed 0:
    the same instructions give the same calibration, in about 1 s for a dozen); ``colours``: the
    training env's object colours its instructions do not name (``envs.registry.EnvSpec.colours``)."""
    from policies.instructions import InstructionResolver
    return InstructionResolver.fit(sorted(set(instructions)), colours=colours)


def instruction_resolver(policy: Any) -> Any:
    """The ``InstructionResolver`` of ``policy``'s trained instructions (None without any), built once.

    From the calibration ``groundflow train`` stored in the checkpoint (``extra[RESOLVER_KEY]``, for
    more than one instruction); a checkpoint saved before that, with one instruction, or whose stored
    calibration names other instructions, gets it fitted here from its trained instructions, which is
    deterministic (``fit_instruction_resolver``): the same checkpoint resolves the same way anywhere."""
    cached = getattr(policy, "_instruction_resolver", None)
    if cached is not None:
        return cached
    trained = trained_instructions(policy)
    if not trained:
        return None
    from policies.instructions import InstructionResolver
    data = getattr(policy, "resolver_data", None)
    resolver = None
    if isinstance(data, dict) and sorted(data.get("instructions") or []) == sorted(trained):
        resolver = InstructionResolver.from_json(data)
    if resolver is None:
        resolver = fit_instruction_resolver(trained)
    try:
        policy._instruction_resolver = resolver
    except AttributeError:
        pass
    return resolver


def resolve_instruction(policy: Any, text: str, allow_unknown: bool = False) -> str:
    """The instruction ``policy`` is conditioned on when a user says ``text``: ``text`` itself when
    it is a trained instruction (or the null one, or the policy has no vocabulary); the trained
    instruction the resolver maps it to (the policy then sees that instruction's features); else
    ``UnknownInstructionError`` with the resolver's reason, unless ``allow_unknown`` (``text`` as is:
    encoded on demand, the behaviour before the resolver). The one place a user's wording is
    resolved for a checkpoint (``deploy.serving.inference.infer_chunk``, the server, eval, P5)."""
    if not isinstance(text, str) or text == NULL_INSTRUCTION:
        return text
    trained = trained_instructions(policy)
    if not trained or text in trained:
        return text
    resolver = instruction_resolver(policy)
    res = resolver.resolve(text)
    if res.ok:
        return res.instruction
    if allow_unknown:
        return text
    from policies.instructions import UnknownInstructionError
    raise UnknownInstructionError(text, res.reason, trained)


def sinusoidal(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([ang.sin(), ang.cos()], -1)


class VLAModel(nn.Module):
    kind = ""  # "flow" | "ar": the family a subclass implements, recorded in its config
    inputs: dict | None = None
    """what the checkpoint reads at run time, by name (``train.bc.policy_inputs``; set by ``policies.load``)"""
    trained_instructions: list[str] | None = None
    """the instructions it was trained on (set by ``policies.load``; ``trained_instructions``)"""
    resolver_data: dict | None = None
    """the checkpoint's stored ``InstructionResolver`` calibration (set by ``policies.load``)"""
    _instruction_resolver: Any = None
    env_id: str | None = None
    """the env or suite the checkpoint was trained on (set by ``policies.load``)"""
    supports_prefix = False
    """True where ``predict_action_chunk`` can continue a committed plan (real-time chunking by
    prefix inpainting, ``policies.rtc``): flow policies, whose sampler takes a guide"""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        config.kind = self.kind or config.kind
        if config.state_dim <= 0 or config.action_dim <= 0:
            raise ValueError("PolicyConfig needs state_dim and action_dim (> 0)")
        self.config = c = config
        d = c.d_model
        self.normalizer = Normalizer(c.state_dim, c.action_dim, c.lang_dim if c.lang_norm else 0,
                                     3 * len(c.state_relative))
        self.lang = LanguageEncoder(c.lang_tokens, c.max_lang_tokens)
        self.lang_proj = nn.Linear(c.lang_dim, d)
        self.null_lang = nn.Parameter(torch.zeros(1, 1, d))  # the "no instruction" condition
        keep = [i for i in range(c.state_dim) if i not in set(c.state_ignore)]
        self.register_buffer("state_keep", torch.tensor(keep, dtype=torch.long), persistent=False)
        if c.state_relative:
            p, r = (torch.tensor([[i + k for k in range(3)] for i in idx]) for idx in zip(*c.state_relative))
            self.register_buffer("rel_pos_idx", p.flatten(), persistent=False)
            self.register_buffer("rel_ref_idx", r.flatten(), persistent=False)
        self.state_in_dim = len(keep) + 3 * len(c.state_relative) + len(c.estimated_state)
        """width of what ``state_input`` returns"""
        state_in = self.state_in_dim + (c.lang_dim if c.fusion == "early" else 0)
        self.state_proj = nn.Sequential(nn.Linear(state_in, c.state_hidden), nn.GELU(), nn.Linear(c.state_hidden, d))
        # with a perception head the images reach the policy only through its estimate (no image tokens)
        self.estimator = (StateEstimator(c.cameras, len(keep), len(c.estimated_state), c.estimator_channels,
                                         c.estimator_keypoints, shift=c.image_shift, jitter=c.image_jitter)
                          if c.estimated_state else None)
        self.register_buffer("estimated_idx", torch.tensor(c.estimated_state, dtype=torch.long), persistent=False)
        noise = c.estimate_noise_per_entry or (c.estimate_noise,) * len(c.estimated_state)
        self.register_buffer("estimate_noise_std", torch.tensor(noise, dtype=torch.float32), persistent=False)
        self.vision = (ImageEncoder(d, c.cameras, backbone=c.vision, frozen=c.vision_frozen, shift=c.image_shift,
                                    pool=c.image_pool, jitter=c.image_jitter)
                       if c.cameras and self.estimator is None else None)
        # predicts the hidden state entries from the image tokens (training only, see aux_state_weight)
        self.aux_head = (nn.Linear(len(c.cameras) * self.vision.n_tok * d, len(c.state_ignore))
                         if c.cameras and c.aux_state_weight > 0 else None)
        self.register_buffer("state_hidden_idx", torch.tensor(c.state_ignore, dtype=torch.long), persistent=False)
        self._aux_loss: torch.Tensor | None = None
        self.type_emb = nn.Parameter(torch.randn(4, d) * 0.02)  # lang, image, state, action
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d, c.n_heads, 4 * d, c.dropout, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(c.n_layers)])
        self.final_norm = nn.LayerNorm(d)
        self._queue: list[np.ndarray] = []

    @property
    def lang_placeholder(self) -> str:
        """Any cached instruction: its features are replaced by the null token anyway."""
        return next(iter(self.lang.cache), "do the task")

    # ----- inputs ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.null_lang.device

    def prefix(self, batch: dict[str, Any], drop_lang: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Conditioning tokens (B, P, d) and padding mask (B, P) from a batch of raw observations."""
        dev = self.device
        state = torch.as_tensor(batch["state"], dtype=torch.float32, device=dev)
        if state.ndim != 2 or state.shape[1] != self.config.state_dim:
            raise PolicyMismatchError(f"state has shape {tuple(state.shape)}, policy expects (B, {self.config.state_dim})")
        B = state.shape[0]
        instr = batch["instruction"]
        instr = [instr] * B if isinstance(instr, str) else list(instr)
        if len(instr) != B:
            raise PolicyMismatchError(f"{len(instr)} instructions for a batch of {B}")
        is_null = torch.tensor([s == NULL_INSTRUCTION for s in instr], dtype=torch.bool)
        if is_null.any():
            drop_lang = is_null if drop_lang is None else (torch.as_tensor(drop_lang).bool().cpu() | is_null)
            instr = [self.lang_placeholder if s == NULL_INSTRUCTION else s for s in instr]
        feats, lmask = self.lang(instr)
        feats = self.normalizer.language(feats.to(dev))
        ltok = self.lang_proj(feats) + self.type_emb[0]
        lmask = lmask.to(dev)
        if drop_lang is not None and drop_lang.any():
            drop = drop_lang.to(dev).bool()
            ltok = torch.where(drop[:, None, None], self.null_lang.expand_as(ltok), ltok)
            lmask = torch.where(drop[:, None], torch.arange(lmask.shape[1], device=dev)[None] > 0, lmask)
        toks, masks = [ltok], [lmask]
        if self.vision is not None:
            images, maps = batch.get("images"), batch.get("image_maps")
            if images is None and maps is None:
                raise PolicyMismatchError(f"policy needs cameras {list(self.config.cameras)}, batch has no images")
            # image_maps: the frozen trunk's maps of these frames, cached before training (train/feature_cache.py)
            itok = (self.vision(self._image_tensors(images)) if maps is None
                    else self.vision.tokens_from_maps(self._image_tensors(maps)))
            if self.aux_head is not None and self.training and torch.is_grad_enabled():
                target = self.normalizer.state(state)[:, self.state_hidden_idx]
                self._aux_loss = ((self.aux_head(itok.flatten(1)) - target) ** 2).mean()
            itok = itok + self.type_emb[1]
            toks.append(itok)
            masks.append(torch.zeros(B, itok.shape[1], dtype=torch.bool, device=dev))
        s_in = self.state_input(state, batch.get("images"))
        if self.config.fusion == "early":
            s_in = torch.cat([s_in, self._pooled(feats, lmask, drop_lang)], -1)
        stok = self.state_proj(s_in)[:, None] + self.type_emb[2]
        toks.append(stok)
        masks.append(torch.zeros(B, 1, dtype=torch.bool, device=dev))
        return torch.cat(toks, 1), torch.cat(masks, 1)

    def state_input(self, state: torch.Tensor, images: dict[str, Any] | None = None) -> torch.Tensor:
        """The normalized state entries the policy reads (all but ``config.state_ignore``), then the
        standardized relative positions of ``config.state_relative``, then the perception head's
        estimate of ``config.estimated_state`` (which needs ``images``)."""
        full = self.normalizer.state(state)
        s = full if len(self.state_keep) == full.shape[-1] else full[..., self.state_keep]
        parts = [s]
        if self.config.state_relative:
            parts.append(self.normalizer.relative(self._relative(state)))
        if self.estimator is not None:
            parts.append(self._estimate(full, s, images))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def _estimate(self, full: torch.Tensor, proprio: torch.Tensor, images: dict[str, Any] | None) -> torch.Tensor:
        """Standardized estimates of ``config.estimated_state``. While the policy trains: the true
        value plus ``estimate_noise`` (the simulator's value supervises, never acts); otherwise the
        perception head's estimate from the images and the proprioception alone."""
        if self.training:
            noise = torch.randn_like(full[..., self.estimated_idx]) * self.estimate_noise_std
            return full[..., self.estimated_idx] + noise / self.normalizer.state_std[self.estimated_idx]
        if images is None:
            raise PolicyMismatchError(f"policy needs cameras {list(self.config.cameras)}, batch has no images")
        return self.estimator(self._image_tensors(images), proprio)

    def _image_tensors(self, images: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(np.asarray(v) if not torch.is_tensor(v) else v, device=self.device)
                for k, v in images.items()}

    def _head(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the perception head's standardized estimate, the standardized true value) on a batch of demos."""
        full = self.normalizer.state(torch.as_tensor(batch["state"], dtype=torch.float32, device=self.device))
        pred = self.estimator(self._image_tensors(batch["images"]), full[..., self.state_keep])
        return pred, full[..., self.estimated_idx]

    def estimator_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean squared error of the perception head on standardized ``estimated_state`` entries
        (``groundflow train estimator``)."""
        pred, target = self._head(batch)
        loss = ((pred - target) ** 2).mean()
        return loss, {"loss": float(loss.detach())}

    def estimate(self, batch: dict[str, Any]) -> np.ndarray:
        """(B, n) the perception head's estimate of ``config.estimated_state`` in state units."""
        with torch.no_grad():
            z, _ = self._head(batch)
            x = z * self.normalizer.state_std[self.estimated_idx] + self.normalizer.state_mean[self.estimated_idx]
        return x.cpu().numpy()

    def _relative(self, state: torch.Tensor) -> torch.Tensor:
        """Raw (..., 3k) positions minus their references (``config.state_relative``)."""
        return state[..., self.rel_pos_idx] - state[..., self.rel_ref_idx]

    def action_cond(self, prefix: torch.Tensor) -> torch.Tensor | float:
        """What every action token adds to its input: with early fusion the fused state-instruction
        token (the last prefix token), so each action token starts from instruction-dependent scene
        features (the MLP-like path) instead of reaching them only through attention; else 0."""
        return prefix[:, -1:] if self.config.fusion == "early" else 0.0

    def _pooled(self, feats: torch.Tensor, lmask: torch.Tensor, drop_lang: torch.Tensor | None) -> torch.Tensor:
        """(B, lang_dim) mean instruction feature over its tokens; zeros where the instruction is
        dropped (the null condition of CFG and the PMI branch)."""
        keep = (~lmask).float()
        pooled = (feats * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1)
        if drop_lang is not None and drop_lang.any():
            pooled = torch.where(drop_lang.to(feats.device).bool()[:, None], torch.zeros_like(pooled), pooled)
        return pooled

    def run(self, x: torch.Tensor, pad: torch.Tensor, attn_mask: torch.Tensor | None = None,
            keep: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden = []
        for layer in self.layers:
            x = layer(x, src_mask=attn_mask, src_key_padding_mask=pad)
            if keep:
                hidden.append(x)
        return self.final_norm(x), hidden

    def forward(self, batch: dict[str, Any], aux: Any = None):
        """The training loss (what DDP wraps). ``aux(batch) -> (loss, metrics)`` adds a term computed
        inside the same forward (e.g. CIG), so data-parallel gradient reduction covers it too."""
        self._aux_loss = None
        loss, metrics = self.loss(batch)
        if self._aux_loss is not None:
            loss = loss + self.config.aux_state_weight * self._aux_loss
            metrics["loss_aux_state"] = float(self._aux_loss.detach())
            self._aux_loss = None
        if aux is not None:
            extra, m = aux(batch)
            loss = loss + extra
            metrics.update(m)
        return loss, metrics

    # ----- observation handling -------------------------------------------------------------
    def obs_to_batch(self, obs: dict[str, Any]) -> dict[str, Any]:
        state = np.asarray(obs["state"], dtype=np.float32)
        if state.shape != (self.config.state_dim,):
            raise PolicyMismatchError(f"observation state has shape {state.shape}, policy expects ({self.config.state_dim},)")
        if not np.all(np.isfinite(state)):
            raise PolicyMismatchError("observation state contains NaN/inf")
        batch: dict[str, Any] = {"state": state[None], "instruction": [check_instruction(obs.get("instruction", ""))]}
        if self.config.cameras:
            images = obs.get("images") or {}
            missing = [c for c in self.config.cameras if c not in images]
            if missing:
                raise PolicyMismatchError(f"observation lacks cameras {missing} the policy needs")
            batch["images"] = {c: np.asarray(images[c], np.uint8)[None] for c in self.config.cameras}
        return batch

    def predict_action_chunk(self, obs: dict[str, Any], *, prefix: np.ndarray | None = None, frozen: int = 0,
                             rtc: RTCConfig | None = None, **sampling: Any) -> np.ndarray:
        """One (H, A) chunk in env units for one observation.

        ``prefix`` (k, A) in env units: the plan already committed for the first steps this chunk
        covers; the chunk continues it (its first ``frozen`` steps exactly, the rest of the
        overlap softly, ``rtc`` options). Only where ``supports_prefix``."""
        if prefix is not None:
            if not self.supports_prefix:
                raise InvalidOptionError(f"a {self.config.kind or type(self).__name__} policy cannot continue a "
                                         "prefix (real-time chunking needs a flow policy)")
            sampling["guide"] = prefix_guide(self, prefix, frozen, rtc)
        self.eval()
        with torch.no_grad():
            a = self.sample_chunks(self.obs_to_batch(obs), **sampling)
        return self.normalizer.unaction(a)[0].cpu().numpy().astype(np.float32)

    def select_action(self, obs: dict[str, Any]) -> np.ndarray:
        """Serve the cached chunk step by step; re-plan every ``n_exec`` steps."""
        if not self._queue:
            chunk = self.predict_action_chunk(obs)
            self._queue = list(chunk[: self.config.n_exec])
        return self._queue.pop(0)

    def reset(self) -> None:
        self._queue = []

    def sample_chunks(self, batch: dict[str, Any], **sampling: Any) -> torch.Tensor:
        raise NotImplementedError

    # ----- instruction scores (CIG, diagnostics) ----------------------------------------------
    score_tau = 1.0
    """default temperature of ``instruction_scores`` for this family"""

    def instruction_scores(self, batch: dict[str, Any], candidates: list[list[str]], *, tau: float | None = None,
                           draws: int = 4, generator: torch.Generator | None = None,
                           detach_negatives: bool = False) -> torch.Tensor:
        """(B, K) scores s(l) of how well each sample's action chunk fits candidate instruction l
        (``candidates[b][0]`` is the commanded one); ``detach_negatives``: the other columns carry
        no gradient. The one scoring interface CIG and the diagnostics use, whatever the family."""
        raise NotImplementedError(f"a {self.kind or type(self).__name__} policy has no instruction score")

    def action_range(self) -> tuple[np.ndarray, np.ndarray]:
        """The trained action range per dimension (env units): what a served chunk is checked against."""
        return (self.normalizer.action_min.detach().cpu().numpy().astype(np.float64),
                self.normalizer.action_max.detach().cpu().numpy().astype(np.float64))

    # ----- statistics, persistence ----------------------------------------------------------
    def fit_normalizer(self, states: np.ndarray, actions: np.ndarray, instructions: list[str] | None = None) -> None:
        """Dataset statistics; with ``config.lang_norm`` also those of the training ``instructions``."""
        self.normalizer.fit(states, actions)
        if self.config.state_relative:
            self.normalizer.fit_relative(self._relative(torch.as_tensor(np.asarray(states), dtype=torch.float32)))
        if self.config.lang_norm:
            if not instructions:
                raise ValueError("lang_norm needs the training instructions to fit the language statistics")
            self.normalizer.fit_language(*self.lang(sorted(set(instructions))))

    def save(self, directory: str | os.PathLike, extra: dict | None = None) -> Path:
        """safetensors weights + JSON config + normalization stats + cached instruction features.

        Written to a temporary folder and renamed, so a crash never leaves a half checkpoint. A
        crash between the two renames of a replacement leaves only ``DIR.old`` (complete): loading
        falls back to it, and the next save removes it."""
        from safetensors.torch import save_file
        out = Path(directory)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:  # a write that fails (a full disk) leaves no half-written DIR.tmp behind
            state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / "model.safetensors"))
            texts = sorted(self.lang.cache)
            if texts:
                save_file({f"i{i}": self.lang.cache[t].contiguous() for i, t in enumerate(texts)},
                          str(tmp / "language.safetensors"))
            meta = {"format": FORMAT, "version": CONFIG_DIGEST_VERSION, "config": self.config.to_dict(),
                    "instructions": texts, "extra": extra or {},
                    "sha256": {f.name: file_sha256(f) for f in sorted(tmp.glob("*.safetensors"))}}  # checked on load
            meta = json.loads(json.dumps(meta))  # what a reader gets back (tuples as lists...): what the digest covers
            meta[CONFIG_DIGEST] = config_digest(meta)
            (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
            shutil.rmtree(out.with_name(out.name + ".old"), ignore_errors=True)  # an interrupted save's fallback
        # what it was trained on is now what it saved (training may have added instructions since a load)
        self.trained_instructions = self.resolver_data = self._instruction_resolver = None
        return out


def _resolve_checkpoint(d: Path, warn: bool = False) -> Path:
    """``d``, or ``d.old`` when ``d`` is missing because a save() was interrupted between its two
    renames (the previous version is complete there)."""
    old = d.with_name(d.name + ".old")
    if not d.exists() and (old / "config.json").is_file():
        if warn:
            import warnings
            warnings.warn(f"{d} is missing (a save was interrupted); loading the previous version {old}")
        return old
    return d


def read_checkpoint_meta(directory: str | os.PathLike, verify: bool = True) -> dict:
    """The checkpoint's config.json; ``DIR.old`` when ``DIR`` is missing because a save() was
    interrupted between its two renames (the previous version is complete there). ``verify``: refuse
    a config.json whose content differs from the digest recorded in it when it was saved
    (``check_config_digest``); what eval, serve and training read from it (env id, instructions,
    measured errors, data paths) is then what was saved, even without loading the weights."""
    d = _resolve_checkpoint(Path(directory), warn=True)
    cfg = d / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{d} is not a groundflow checkpoint (no config.json)")
    try:
        meta = json.loads(cfg.read_text())
    except ValueError as e:  # truncated or garbled JSON, bad UTF-8
        raise CheckpointError(f"{cfg} is not valid JSON (truncated or corrupt?): {e}") from e
    if verify and isinstance(meta, dict) and (meta.get("format") == FORMAT or CONFIG_DIGEST in meta):
        check_config_digest(meta, cfg)  # first: a flip in "format" is a changed file, not a foreign one
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{d}: not a groundflow policy checkpoint (format={fmt!r})")
    return meta


CONFIG_DIGEST = "config_sha256"
"""config.json's entry holding the sha256 of its own content (``config_digest``)"""
CONFIG_DIGEST_VERSION = 2
"""the checkpoint version from which config.json carries ``CONFIG_DIGEST`` (1: none, loaded unchecked)"""


def config_digest(meta: dict) -> str:
    """Hex sha256 of the canonical JSON (sorted keys, no spaces, ASCII) of everything in config.json but
    its ``CONFIG_DIGEST`` entry: the config, the instruction texts that name the stored language
    features, ``extra`` and the weights' digests. Indentation and key order do not count."""
    body = {k: v for k, v in meta.items() if k != CONFIG_DIGEST}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


def check_config_digest(meta: dict, cfg: Path) -> None:
    """Refuse a config.json (``cfg``) whose content changed after it was saved: a flipped character in
    an instruction (``'open"the door'``), a dimension or an ``extra`` value still parses, and would
    silently condition the policy on another text or change what eval reads. Checkpoints written
    before the digest (version 1, no ``CONFIG_DIGEST``) load unchecked; a version-2 one without it
    (a damaged entry name) is refused."""
    want = meta.get(CONFIG_DIGEST)
    version = meta.get("version")
    if want is None and not (isinstance(version, int) and version >= CONFIG_DIGEST_VERSION):
        return
    if not isinstance(want, str):
        raise CheckpointError(f"{cfg} records no valid digest of its own content ({CONFIG_DIGEST!r}: "
                              f"{str(want)[:80]}, version {str(version)[:20]}): edited by hand or corrupt")
    got = config_digest(meta)
    if got != want:
        raise CheckpointError(f"{cfg} fails its digest (sha256 of its content {got[:16]}..., it records "
                              f"{want[:16]}...): it changed after it was saved (edited by hand or corrupt; an "
                              "instruction, a dimension or a recorded value may differ from what was trained)")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_sha256(path: Path, meta: dict, d: Path) -> None:
    """Refuse a weights file whose bytes differ from the digest config.json recorded when it was
    saved (a flipped byte in the tensor data still parses and would load changed weights).
    Checkpoints written before digests were recorded carry none and load unchecked."""
    digests = meta.get("sha256")
    if digests is None:
        return
    want = digests.get(path.name) if isinstance(digests, dict) else None
    if not isinstance(want, str):
        raise CheckpointError(f"{d / 'config.json'} records no valid sha256 for {path.name} (edited or corrupt "
                              f"config?): {str(digests)[:120]}")
    got = file_sha256(path)
    if got != want:
        raise CheckpointError(f"{path} fails its checksum (sha256 {got[:16]}..., {d / 'config.json'} records "
                              f"{want[:16]}...): its bytes changed after it was saved (corrupt file, or files "
                              "mixed from two checkpoints)")


#: buffers added after the first checkpoints were written: absent ones keep their "unknown" value
_OPTIONAL_BUFFERS = ("normalizer.action_var",)


def load_weights(model: VLAModel, directory: str | os.PathLike, meta: dict) -> VLAModel:
    """Weights and instruction features into ``model``; damaged or mismatched files raise a
    one-line CheckpointError naming the file (not a SafetensorError or a multi-line RuntimeError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    d = _resolve_checkpoint(Path(directory))
    path = d / "model.safetensors"
    try:
        weights = load_file(str(path))
        _check_sha256(path, meta, d)
        try:
            missing = [k for k in _OPTIONAL_BUFFERS if k in model.state_dict() and k not in weights]
            model.load_state_dict({**weights, **{k: model.state_dict()[k] for k in missing}}, strict=True)
        except RuntimeError as e:  # size mismatch / missing keys: config.json and weights disagree
            lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()] or [str(e)]
            more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
            raise CheckpointError(f"{path} does not fit the policy described by {d / 'config.json'} "
                                  f"(edited config or mixed files?): {lines[0]}{more}") from e
        if (d / "language.safetensors").is_file():
            path = d / "language.safetensors"
            tensors = load_file(str(path))
            _check_sha256(path, meta, d)
            model.lang.cache.update({t: tensors[f"i{i}"] for i, t in enumerate(meta["instructions"])})
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is unreadable (missing, truncated or corrupt?): {e}") from e
    except KeyError as e:
        raise CheckpointError(f"{path} lacks the features of instruction {e} listed in {d / 'config.json'}") from e
    # what a user's wording is resolved against (resolve_instruction): the trained list, its calibration
    model.trained_instructions = [t for t in meta.get("instructions") or [] if t != NULL_INSTRUCTION]
    model.resolver_data = (meta.get("extra") or {}).get(RESOLVER_KEY)
    model.eval()
    return model
