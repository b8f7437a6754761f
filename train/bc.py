"""Behaviour cloning for both policy families (``groundflow train``), optionally with the CIG
term (``--cig-weight``) and as a CIG continuation stage (``groundflow train cig --from CKPT``).

AdamW + warmup/cosine schedule, EMA weights, gradient clipping, bf16 autocast on GPU, periodic
evaluation, atomic resumable checkpoints, wandb (offline without a key), and data parallel
training under ``torchrun`` (gloo on CPU, nccl on GPU). Each rank draws the randomness of the
whole global batch from the same seeded generator and keeps its slice, so N processes follow
the loss curve of one process with the same global batch.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import hashlib
import json
import math
import os
import pickle
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import numpy as np
import torch
import tyro
from tqdm import tqdm

import policies
from dataset.files import disk_full_errno, disk_full_error, hold_directory
from envs import list_envs, make as make_env, spec as env_spec
from envs import is_proprio, state_indices, state_slices
from envs.errors import CheckpointError, GroundflowError, InvalidOptionError
from envs.wordings import held_out_wordings
from policies import PolicyConfig, make_policy
from policies.config import ImagePool, VisionBackbone
from policies.model import NULL_INSTRUCTION, RESOLVER_KEY, check_vocabulary, fit_instruction_resolver
from train.cig import CIGObjective, CIGOptions
from train.data import ChunkData
from train.evaluate import evaluate
from train.feature_cache import FeatureCache, build_feature_cache, check_cache_options
from train.logger import Logger


class TrainingDivergedError(GroundflowError, FloatingPointError):
    """A non-finite loss: training stops before NaN weights reach a checkpoint."""


_MODEL = PolicyConfig()  # the one home of the model defaults TrainArgs exposes as flags


@dataclass
class TrainArgs:
    """Train a VLA policy by behaviour cloning."""

    data: tuple[Path, ...] = ()
    """dataset files (HDF5, `groundflow collect`)"""
    recipe: str = ""
    """named defaults (train/recipes.py): chunked (single task), multitask (suites), multitask_cig (suites
    whose layout gives the task away), pixels, pixels_kitchen, pixels_libero, pixels_large (cameras instead of
    object state), libero_dart; flags given beside it override"""
    policy: Literal["flow", "ar", "mlp"] = "flow"
    """flow (pi0-style), ar (RT-2-style) or mlp (the plain BC baseline, state only)"""
    # model fields: defaults and meaning are PolicyConfig's (policies/config.py)
    size: str = _MODEL.size
    """tiny | small | base | large"""
    horizon: int = _MODEL.horizon
    """action chunk length H"""
    n_exec: int = _MODEL.n_exec
    cameras: tuple[str, ...] = _MODEL.cameras
    image_size: int = _MODEL.image_size
    vision: VisionBackbone = _MODEL.vision
    """image encoder: cnn (from scratch) or efficientnet_lite0 (packaged ImageNet weights)"""
    vision_frozen: bool = _MODEL.vision_frozen
    """efficientnet_lite0: keep the pretrained trunk fixed"""
    image_shift: int = _MODEL.image_shift
    """random-shift augmentation in pixels (0: off)"""
    aux_state_weight: float = _MODEL.aux_state_weight
    """image policies: auxiliary loss predicting the hidden (--ignore-state) entries from the image
    (training only; see PolicyConfig.aux_state_weight)"""
    image_jitter: float = _MODEL.image_jitter
    """colour-jitter augmentation strength (brightness/tint; 0: off)"""
    image_pool: ImagePool = _MODEL.image_pool
    """feature map -> tokens: grid (4x4 average pool) or keypoints (spatial softmax)"""
    vision_cache: bool = False
    """frozen pretrained trunk (--vision efficientnet_lite0 --vision-frozen, --image-shift 0 --image-jitter 0):
    run it once per frame before training and train on its cached maps (float16, in memory; the checkpoint
    is the same, inference runs the trunk on live images; train/feature_cache.py)"""
    fusion: Literal["late", "early"] = _MODEL.fusion
    """late: state and instruction meet only in attention; early: the state encoder also reads the
    instruction (see PolicyConfig.fusion)"""
    state_hidden: int = 0
    """hidden width of the state encoder (0: d_model)"""
    ignore_state: tuple[str, ...] = ()
    """state slices the policy does not read, by name in the env's state layout (shell patterns,
    e.g. '*vel' '*_acc': joint velocities invite copying the previous motion; see PolicyConfig.state_ignore)"""
    relative_state: tuple[str, ...] = ()
    """'SLICES:REF' specs, by name in the env's state layout (SLICES a shell pattern): the policy also
    reads the position (first 3 entries) of every matching slice minus that of REF, e.g.
    '*_cube_pose:extra/tcp_pose' '*_goal_pos:extra/tcp_pose' (see PolicyConfig.state_relative)"""
    estimate_state: tuple[str, ...] = ()
    """state slices the policy reads from a perception head over --cameras instead of the observation,
    by name in the env's state layout, 'NAME[a:b]' for part of a slice (e.g. '*_cube_pose[0:3]'
    '*_goal_pos'); they are hidden from the policy's input. The head trains after the policy, with
    `groundflow train estimator` (see PolicyConfig.estimated_state)"""
    estimator_channels: int = _MODEL.estimator_channels
    """perception head (--estimate-state): channels of its first conv layer per camera"""
    estimator_keypoints: int = _MODEL.estimator_keypoints
    """perception head (--estimate-state): spatial-softmax keypoints per camera"""
    estimate_noise: float = _MODEL.estimate_noise
    """std (state units) of the noise on the true --estimate-state values while the policy trains
    (0: measured best on the tabletop, see PolicyConfig.estimate_noise)"""
    estimate_noise_from: Path | None = None
    """take the noise per --estimate-state entry from this checkpoint's perception head: its held-out
    error (`groundflow train estimator` records it). Measured on the tabletop it hurts (0.57 against
    0.86 with no noise, README): kept for other suites to measure, not recommended"""
    lang_norm: bool = _MODEL.lang_norm
    """centre and scale instruction features on the training instructions (see PolicyConfig.lang_norm)"""
    lang_tokens: Literal["pooled", "tokens"] = _MODEL.lang_tokens
    """pooled: the instruction is one sentence feature; tokens: MiniLM's token features (up to 16), which
    the state and action tokens attend to (token-level conditioning; see PolicyConfig.lang_tokens)"""
    paraphrase_augment: float = 0.0
    """probability that a sample trains on a grammar-made rewrite of its instruction instead of the
    instruction itself (policies.instructions.training_wordings: synonyms, polite and terse forms, word
    order, typos; never one of the suite's held-out wordings); 0: the demos' instructions only"""
    paraphrases_per_instruction: int = 48
    """--paraphrase-augment: rewrites made per trained instruction (seeded by --seed)"""
    steps: int = 2000
    batch_size: int = 64
    """global batch size (split across data-parallel ranks)"""
    lr: float = 3e-4
    weight_decay: float = 1e-4
    warmup_steps: int = 100
    ema: float = 0.995
    """EMA decay of the weights used for evaluation and checkpoints (0: off)"""
    grad_clip: float = 1.0
    n_bins: int = _MODEL.n_bins
    """AR: bins per action dimension"""
    bin_sigma: float = _MODEL.bin_sigma
    """AR: std (in bins) of the Gaussian-smoothed bin targets (0: one-hot; see PolicyConfig.bin_sigma)"""
    instruction_dropout: float = _MODEL.instruction_dropout
    """probability of training on the empty instruction (enables CFG at sampling)"""
    cfg_scale: float = _MODEL.cfg_scale
    """classifier-free guidance scale stored in the checkpoint for sampling"""
    cig: CIGOptions = field(default_factory=CIGOptions)
    seed: int = 0
    out: Path = Path("runs/policy")
    eval_env: str | None = None
    """env for periodic evaluation (default: the dataset's env)"""
    eval_every: int = 0
    """evaluate every N steps (0: only at the end if eval_episodes > 0)"""
    eval_episodes: int = 0
    eval_options: dict[str, Any] = field(default_factory=dict)
    save_every: int = 500
    log_every: int = 50
    wandb: Literal["disabled", "offline", "online"] = "offline"
    resume: bool = False
    """continue from OUT/train_state.pt (the config must be unchanged)"""
    device: str = "auto"
    amp: Literal["auto", "bf16", "fp16", "none"] = "auto"
    init_from: Annotated[Path | None, tyro.conf.arg(aliases=("--from",))] = None
    """start from this checkpoint's weights (CIG continuation stage)"""
    progress: bool = True


MODEL_FIELDS = ("data", "policy", "size", "horizon", "n_exec", "cameras", "image_size", "vision", "vision_frozen",
                "image_shift", "image_jitter", "image_pool", "aux_state_weight", "fusion", "state_hidden",
                "lang_norm", "lang_tokens", "ignore_state", "estimate_state", "estimate_noise", "estimate_noise_from",
                "estimator_channels", "estimator_keypoints",
                "relative_state", "n_bins", "bin_sigma", "instruction_dropout", "seed")


def _dist() -> tuple[int, int]:
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    if ws > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    return (torch.distributed.get_rank(), ws) if ws > 1 else (0, 1)


def _device(name: str, rank: int) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        return torch.device("cpu")
    return torch.device(name)


def warmup_cosine(step: int, lr: float, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from ``lr`` down to ``floor * lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def _lr(step: int, args: TrainArgs) -> float:
    return warmup_cosine(step, args.lr, args.warmup_steps, args.steps, 0.05)


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x


def _layout(data: ChunkData) -> list | None:
    """The state layout the dataset recorded (or, for datasets collected before layouts were
    recorded, the layout of a fresh env)."""
    layout = data.state_layout
    if layout is None and data.env_id:
        env = make_env(data.env_id)
        layout = env.unwrapped.state_layout
        env.close()
    return layout


def _state_ignore(patterns: tuple[str, ...], data: ChunkData) -> list[int]:
    """State indices named by ``--ignore-state`` patterns."""
    if not patterns:
        return []
    return state_indices(_layout(data), tuple(patterns), data.env_id or "")  # PolicyConfig refuses hiding it all


def policy_inputs(config: PolicyConfig, layout: list | None) -> dict[str, Any]:
    """What the checkpoint reads at run time, by name: cameras, the state slices it reads from the
    observation, those it estimates from the images, and whether any read slice is one a physical
    arm cannot measure (``reads_object_state``; None where the data did not name its slices)."""
    if not layout:
        return {"cameras": list(config.cameras), "state": None, "estimated": None, "reads_object_state": None}
    hidden, est = set(config.state_ignore), set(config.estimated_state)
    read, estimated = [], []
    for name, (start, size) in state_slices(layout).items():
        idx = set(range(start, start + size))
        if idx - hidden:
            read.append(name)
        if idx & est:
            estimated.append(name)
    relative = {name for p, r in config.state_relative for name, (st, sz) in state_slices(layout).items()
                if st <= p < st + sz or st <= r < st + sz}
    return {"cameras": list(config.cameras), "state": read, "estimated": estimated,
            "reads_object_state": any(not is_proprio(n) for n in set(read) | relative)}


def _noise_from(ckpt: Path | None) -> tuple[float, ...]:
    """The held-out error per estimated entry of ``ckpt``'s perception head (() without --estimate-noise-from)."""
    if ckpt is None:
        return ()
    rmse = policies.read_checkpoint_meta(ckpt).get("extra", {}).get("estimator", {}).get("heldout_rmse")
    if not rmse:
        raise InvalidOptionError(f"--estimate-noise-from {ckpt}: no measured perception head there (train one "
                                 "with `groundflow train estimator`)")
    return tuple(float(x) for x in rmse)


def _checkpoint_extra(data: ChunkData, args_json: dict, policy: Any) -> dict[str, Any]:
    """What every checkpoint of the run records beside its weights."""
    return {"env_id": data.env_id, "env_options": data.env_options, "instructions": data.instructions,
            "train_args": args_json,
            "inputs": policy_inputs(policy.config, data.state_layout)}


def _state_relative(specs: tuple[str, ...], data: ChunkData) -> list[tuple[int, int]]:
    """(position start, reference start) pairs named by ``--relative-state`` 'SLICES:REF' specs."""
    if not specs:
        return []
    layout, env_id = _layout(data), data.env_id or ""
    slices = state_slices(layout)
    pairs: list[tuple[int, int]] = []
    for spec in specs:
        pattern, sep, ref = spec.partition(":")
        if not (sep and pattern and ref):
            raise InvalidOptionError(f"--relative-state {spec!r}: expected 'SLICES:REF', e.g. "
                                     "'*_cube_pose:extra/tcp_pose'")
        state_indices(layout, (pattern,), env_id)  # refuses unnamed layouts and patterns that match nothing
        if ref not in slices:
            raise InvalidOptionError(f"--relative-state {spec!r}: {env_id or 'the'} state has no slice {ref!r}; "
                                     f"its slices: {list(slices)}")
        for name, (st, size) in slices.items():
            if name == ref or not fnmatch.fnmatchcase(name, pattern):
                continue
            if min(size, slices[ref][1]) < 3:
                raise InvalidOptionError(f"--relative-state {spec!r}: {name!r} and {ref!r} must each start with "
                                         "a 3-D position")
            pairs.append((st, slices[ref][0]))
    return pairs


def _build_policy(args: TrainArgs, data: ChunkData) -> Any:
    """A new policy fitted to the data's statistics, or the ``--init-from`` checkpoint (continuation)."""
    if args.init_from:
        policy = policies.load(args.init_from)
        if (policy.config.state_dim, policy.config.action_dim) != (data.state_dim, data.action_dim):
            raise policies.PolicyMismatchError(
                f"{args.init_from} has state/action dims {(policy.config.state_dim, policy.config.action_dim)}, "
                f"the data has {(data.state_dim, data.action_dim)}")
        if args.cig.weight > 0:  # CIG grounds the instructions the checkpoint already follows
            check_vocabulary(policy, data.instructions, what=f"the CIG data {list(args.data)}")
        if args.instruction_dropout:
            policy.config.instruction_dropout = args.instruction_dropout
    else:
        cfg = PolicyConfig(kind=args.policy, state_dim=data.state_dim, action_dim=data.action_dim,
                           horizon=args.horizon, n_exec=args.n_exec, size=args.size, cameras=tuple(args.cameras),
                           image_size=args.image_size, vision=args.vision,
                           vision_frozen=args.vision_frozen, image_shift=args.image_shift,
                           image_pool=args.image_pool, image_jitter=args.image_jitter,
                           aux_state_weight=args.aux_state_weight, fusion=args.fusion,
                           state_hidden=args.state_hidden,
                           lang_norm=args.lang_norm, lang_tokens=args.lang_tokens,
                           instruction_dropout=args.instruction_dropout,
                           cfg_scale=args.cfg_scale, n_bins=args.n_bins, bin_sigma=args.bin_sigma,
                           state_ignore=tuple(_state_ignore(args.ignore_state + args.estimate_state, data)),
                           estimated_state=tuple(_state_ignore(args.estimate_state, data)),
                           estimate_noise=args.estimate_noise, estimator_channels=args.estimator_channels,
                           estimator_keypoints=args.estimator_keypoints,
                           estimate_noise_per_entry=_noise_from(args.estimate_noise_from),
                           state_relative=tuple(_state_relative(args.relative_state, data)))
        policy = make_policy(cfg)
        policy.fit_normalizer(data.state, data.action, data.instructions)
    policy.config.cfg_scale = args.cfg_scale
    policy.lang.warm(data.instructions)
    return policy


def _resume(args: TrainArgs, args_json: dict, state_path: Path, device: torch.device, policy: Any, ema: Any,
            opt: torch.optim.Optimizer) -> tuple[int, list[dict[str, float]], dict[str, Any] | None]:
    """Load ``train_state.pt`` into policy, EMA and optimizer; (step, history, random states) to
    continue from (random states None for a state saved before they were kept)."""
    if not state_path.is_file():
        raise FileNotFoundError(f"--resume: no {state_path}")
    saved = _load_train_state(state_path, device)
    # a field missing from a run saved before it existed held its default
    defaults = _jsonable(dataclasses.asdict(TrainArgs()))
    changed = {k for k in MODEL_FIELDS if saved["args"].get(k, defaults.get(k)) != args_json.get(k)}
    if changed:
        raise ValueError(f"--resume with a changed config: {sorted(changed)} differ from the saved run")
    policy.load_state_dict(saved["model"])
    if ema is not None and saved.get("ema") is not None:
        ema.load_state_dict(saved["ema"])
    opt.load_state_dict(saved["opt"])
    return saved["step"], saved["history"], saved.get("rng")


def _rng_state(gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """Every random state the training loop draws from, as tensors and plain containers (what
    weights_only unpickling admits): the batch generator (indices, flow times and noise, instruction
    drops, CIG negatives), torch's global CPU and CUDA generators (dropout, image augmentation),
    numpy's and Python's global generators."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    st = {"batch": gen.get_state(), "torch": torch.get_rng_state(),
          "numpy": {"keys": torch.from_numpy(np.asarray(keys, np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
          "python": [int(version), list(internal), gauss_next]}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _set_rng_state(st: dict[str, Any], gen: torch.Generator, device: torch.device) -> None:
    """Put back what :func:`_rng_state` saved, so a resumed run draws what the uninterrupted one would."""
    gen.set_state(st["batch"].cpu())
    torch.set_rng_state(st["torch"].cpu())
    n = st["numpy"]
    np.random.set_state(("MT19937", n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss_next = st["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if device.type == "cuda" and st.get("cuda") is not None:
        torch.cuda.set_rng_state(st["cuda"].cpu(), device)


MAX_HORIZON = 1024
"""the longest action chunk ``--horizon`` accepts (attention cost grows with its square: 1e5 hung)"""


def _check_args(args: TrainArgs) -> None:
    """Refuse numeric flags that would train nothing, divide by zero or never finish, and an --out
    that cannot become a directory, before any data is read (one clear line each)."""
    if not args.data:
        raise ValueError("give at least one dataset with --data")
    if not args.cig.weight >= 0:  # a negative (or NaN) lambda used to train plain BC without a word
        raise ValueError(f"--cig-weight must be >= 0 (0: plain BC), got {args.cig.weight}")
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--save-every", args.save_every), ("--log-every", args.log_every),
                        ("--paraphrases-per-instruction", args.paraphrases_per_instruction)):
        if value < 1:
            raise InvalidOptionError(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.paraphrase_augment <= 1:
        raise InvalidOptionError(f"--paraphrase-augment {args.paraphrase_augment}: a probability in [0, 1] (0: off)")
    if not 1 <= args.horizon <= MAX_HORIZON:
        raise InvalidOptionError(f"--horizon must be in [1, {MAX_HORIZON}], got {args.horizon}")
    if args.vision_cache and args.init_from is None:  # --from: checked on the checkpoint's config once loaded
        check_cache_options(args.vision, args.vision_frozen, args.image_shift, args.image_jitter, args.cameras,
                            bool(args.estimate_state), args.policy)
    out = Path(args.out)
    p = out
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        where = "is a file" if p == out else f"is under {p}, which is a file"
        raise InvalidOptionError(f"--out {out} {where}, not a directory; give a directory path")


def _draw_batch(data: ChunkData, args: TrainArgs, gen: torch.Generator, rank: int, world: int,
                instruction_dropout: float, cache: FeatureCache | None = None,
                wordings: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """This rank's slice of one global batch: every rank draws the randomness of the whole batch
    from the same generator (indices, flow times, noise, instruction drops, in that order, then the
    paraphrase draws with ``wordings``); with a ``cache``, the frames' cached trunk maps in place of
    their images."""
    per = args.batch_size // world
    g_idx = torch.randint(len(data), (args.batch_size,), generator=gen).numpy()
    g_t = torch.rand(args.batch_size, generator=gen)
    g_noise = torch.randn(args.batch_size, args.horizon, data.action_dim, generator=gen)
    g_drop = torch.rand(args.batch_size, generator=gen) < instruction_dropout
    sl = slice(rank * per, (rank + 1) * per)
    batch = data.batch(g_idx[sl]) if cache is None else data.batch(g_idx[sl], images=False)  # maps stand in
    batch.update(flow_t=g_t[sl], flow_noise=g_noise[sl], drop_lang=g_drop[sl])
    if wordings:  # drawn last, so that a run without augmentation draws what it always drew
        g_aug = (torch.rand(args.batch_size, generator=gen) < args.paraphrase_augment)[sl].tolist()
        g_pick = torch.randint(1 << 30, (args.batch_size,), generator=gen)[sl].tolist()
        batch["instruction"] = [wordings[t][k % len(wordings[t])] if a and wordings.get(t) else t
                                for t, a, k in zip(batch["instruction"], g_aug, g_pick)]
    return batch if cache is None else cache.attach(batch)


def _training_wordings(args: TrainArgs, data: ChunkData, policy: Any) -> dict[str, list[str]] | None:
    """--paraphrase-augment's rewrites of each trained instruction, encoded as training-only wordings
    (never the checkpoint's vocabulary); the data's suite's held-out wordings are kept out."""
    if not args.paraphrase_augment:
        return None
    from policies.instructions import training_wordings
    texts = sorted(set(data.instructions) - {NULL_INSTRUCTION})
    table = training_wordings(texts, per_instruction=args.paraphrases_per_instruction, seed=args.seed,
                              exclude=held_out_wordings(data.env_id) if data.env_id else ())
    policy.lang.add_augment(sorted({w for ws in table.values() for w in ws}))
    return table


def _diverged(loss: torch.Tensor, step: int, batch: dict[str, Any], data: ChunkData, args: TrainArgs,
              out: Path, saved_step: int | None) -> TrainingDivergedError:
    """The error for a non-finite loss: which episodes, and which checkpoint survives."""
    eps = sorted(set(data.episode[batch["index"]].tolist()))
    kept = (f"the checkpoint of step {saved_step} is kept in {out / 'ckpt'}" if saved_step is not None
            else f"no checkpoint was written (the first save is at step {min(args.save_every, args.steps)})")
    return TrainingDivergedError(f"non-finite loss {float(loss.detach())} at step {step} on batch of episodes "
                                 f"{eps} (indices {batch['index'][:8].tolist()}...); {kept}")


def train(args: TrainArgs, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train and return a summary (final loss, samples/s, eval results, checkpoint path).

    ``on_step(step)`` is called after each step (train/parallel.py's shared progress bar). One run per
    ``--out``: rank 0 holds a lock on the folder from before anything is read until the run ends, so a
    second run on it (or a --resume of it) is refused in one line naming the process that holds it;
    an --out this run created and left empty (it failed before writing) is removed."""
    rank, _ = _dist()
    _check_args(args)  # before --out is created
    if rank != 0:
        return _train(args, on_step)
    with hold_directory(Path(args.out), "--out"):
        return _train(args, on_step)


def _train(args: TrainArgs, on_step: Callable[[int], None] | None) -> dict[str, Any]:
    rank, world = _dist()
    if args.batch_size % world:
        raise ValueError(f"batch size {args.batch_size} is not divisible by the {world} data-parallel ranks")
    device = _device(args.device, rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    state_path = out / "train_state.pt"
    args_json = _jsonable(dataclasses.asdict(args))

    data = ChunkData(args.data, args.horizon, args.cameras, args.image_size)
    longest = int(data.length.max())
    if args.horizon > longest:  # every chunk would be padding past the end of its episode
        raise InvalidOptionError(f"--horizon {args.horizon} is longer than the longest episode in "
                                 f"{[str(p) for p in args.data]} ({longest} steps); use --horizon <= {longest}")
    policy = _build_policy(args, data)
    wordings = _training_wordings(args, data, policy)
    cig = CIGObjective(policy, data, args.cig, seed=args.seed) if args.cig.weight > 0 else None
    policy.to(device)
    cache = build_feature_cache(policy, data, device, args.progress and rank == 0) if args.vision_cache else None
    ema = copy.deepcopy(policy).eval() if args.ema > 0 else None
    if ema is not None:
        for p in ema.parameters():
            p.requires_grad_(False)
    model = policy
    if world > 1:
        # find_unused_parameters: the null-instruction token only gets gradient on dropped samples
        model = torch.nn.parallel.DistributedDataParallel(
            policy, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=True)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=args.weight_decay)
    step, history, rng_state = 0, [], None
    if args.resume:
        step, history, rng_state = _resume(args, args_json, state_path, device, policy, ema, opt)
    elif rank == 0 and state_path.exists():
        raise FileExistsError(f"{out} already holds a run; use --resume to continue it or another --out")
    saved_step = step if args.resume else None  # the step of the checkpoint in OUT/ckpt, if any

    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        args.amp if args.amp != "auto" else ("bf16" if device.type == "cuda" else "none"))
    logger = Logger(args.wandb, out, args_json, out.name, enabled=rank == 0)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    meta_extra = _checkpoint_extra(data, args_json, policy)
    gen = torch.Generator().manual_seed(args.seed * 1000003 + step)
    if rng_state is not None:  # after everything above that draws (model init): the loop continues exactly
        _set_rng_state(rng_state, gen, device)
    elif args.resume:
        warnings.warn(f"{state_path} was saved before training kept its random states: the resumed run draws "
                      "other batches than an uninterrupted one would")
    bar = tqdm(total=args.steps, initial=step, desc=f"train {args.policy}", disable=not (args.progress and rank == 0))
    t_start, samples = time.time(), 0
    summary: dict[str, Any] = {"vision_cache": cache.stats()} if cache is not None else {}
    policy.train()
    while step < args.steps:
        batch = _draw_batch(data, args, gen, rank, world, policy.config.instruction_dropout, cache, wordings)
        for group in opt.param_groups:
            group["lr"] = _lr(step, args)
        aux = None
        if cig is not None:
            def aux(b, _gen=gen):
                l_cig, m_cig = cig.loss(b, _gen)
                return args.cig.weight * l_cig, m_cig
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss, metrics = model(batch, aux)
        if not torch.isfinite(loss):
            raise _diverged(loss, step, batch, data, args, out, saved_step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
        opt.step()
        if ema is not None:
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), policy.parameters()):
                    pe.lerp_(p.detach(), 1 - args.ema)
        step += 1
        samples += args.batch_size
        logged = loss.detach().float()
        if world > 1:  # report the global-batch loss, not this rank's half
            torch.distributed.all_reduce(logged)
            logged /= world
        metrics.update(loss=float(logged), grad_norm=float(gnorm), lr=_lr(step - 1, args))
        history.append({"step": step, **metrics})
        if step % args.log_every == 0 or step == args.steps:
            logger.log(metrics, step)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        bar.update(1)
        if on_step is not None:
            on_step(step)
        if rank == 0 and args.eval_every and step % args.eval_every == 0 and args.eval_episodes:
            summary["eval"] = _evaluate(ema or policy, data, args)
            summary.setdefault("eval_curve", []).append(  # the learning curve in closed loop
                {"step": step, "success_rate": summary["eval"]["success_rate"], "ci95": summary["eval"]["ci95"]})
            logger.log({"eval/success_rate": summary["eval"]["success_rate"]}, step)
            policy.train()
        if rank == 0 and (step % args.save_every == 0 or step == args.steps):
            _save(out, policy, ema, opt, step, history, args_json, meta_extra, _rng_state(gen, device))
            saved_step = step
    bar.close()
    dt = time.time() - t_start
    # A seed fixes a CPU run bit for bit only at a fixed thread count (1 and 2 threads differ by 1e-4 in the
    # weights after 200 steps, and by a different policy after 24k), so the summary records it.
    summary.update(steps=step, final_loss=float(np.mean([h["loss"] for h in history[-20:]])) if history else None,
                   samples_per_s=samples / max(dt, 1e-9), seconds=dt, ckpt=str(out / "ckpt"),
                   torch_threads=torch.get_num_threads(), torch_version=torch.__version__, history=history)
    if rank == 0 and args.eval_episodes and not args.eval_every:
        summary["eval"] = _evaluate(ema or policy, data, args)
    if rank == 0:
        _write_summary(out, summary)
    logger.finish()
    if world > 1:
        torch.distributed.barrier()
    return summary


def _evaluate(policy, data: ChunkData, args: TrainArgs) -> dict[str, Any]:
    env_id = data.env_id
    opts = {**data.env_options, **args.eval_options}
    if args.cameras:
        opts.update(cameras=tuple(args.cameras), image_size=args.image_size)
    res = evaluate(policy, args.eval_env or env_id, args.eval_episodes, seed=10_000, env_options=opts,
                   progress=False)
    return res.to_dict()


def _load_train_state(path: Path, device: torch.device) -> dict[str, Any]:
    """``train_state.pt`` without running code: weights_only unpickling admits only tensors and
    plain containers (all _save writes), so a crafted file is refused instead of executed."""
    try:
        st = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((ln.split("error:", 1)[-1].split(". ")[0].strip() for ln in str(e).splitlines()
                     if "Unsupported" in ln), "not tensors and plain containers")
        raise CheckpointError(f"{path}: refusing to unpickle it (crafted, or not written by groundflow train): "
                              f"{what}") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {str(e).split('. ')[0]}") from e
    missing = [k for k in ("model", "opt", "step", "history", "args") if not isinstance(st, dict) or k not in st]
    if missing:
        raise CheckpointError(f"{path} is not a groundflow training state (lacks {missing})")
    want = st.pop("sha256", None)  # absent in states saved before the digest was recorded
    if want is not None and want != _tree_sha256(st):
        raise CheckpointError(f"{path} fails its checksum: what it holds changed after it was saved (corrupt "
                              "file); resume from an intact copy or start a new run")
    return st


def _tree_sha256(obj: Any) -> str:
    """sha256 of a training state's contents (tensor bytes, dtypes and shapes, and the plain values
    and containers around them, in order): recorded in the state itself, so it is written in the
    same atomic rename, and a flipped byte that still unpickles is caught when the state loads."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if torch.is_tensor(x):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(f"D{len(x)}|".encode())
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}|".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"{type(x).__name__}:{x!r}|".encode())

    walk(obj)
    return h.hexdigest()


def _resolver_extra(policy: Any, env_id: str | None = None) -> dict[str, Any]:
    """The instruction resolver's calibration for a checkpoint with more than one instruction (what
    eval, serve and deploy resolve a user's wording with; ``policies.model.instruction_resolver``),
    with the colours the training env's scene shows beyond its instructions' words."""
    texts = tuple(sorted(set(policy.lang.cache) - {NULL_INSTRUCTION}))
    return {RESOLVER_KEY: _resolver_json(texts, env_id or "")} if len(texts) > 1 else {}


@functools.lru_cache(maxsize=4)
def _resolver_json(texts: tuple[str, ...], env_id: str) -> dict[str, Any]:
    """Fitted once per instruction set (about 1 s), not at every periodic save."""
    colours = env_spec(env_id).colours if env_id in list_envs() else {}
    return fit_instruction_resolver(list(texts), colours).to_json()


def _save(out: Path, policy, ema, opt, step: int, history, args_json, meta_extra,
          rng: dict[str, Any] | None = None) -> None:
    """OUT/ckpt and OUT/train_state.pt, each written beside the old one and renamed over it. A save
    that finds no room (disk full, quota, file size limit) removes what it had started and raises one
    DiskFullError naming the file, the space left and what earlier saves left intact."""
    tmp, writing = out / "train_state.pt.tmp", out / "ckpt"
    try:
        saved = ema or policy
        extra = {**meta_extra, "step": step, **_resolver_extra(saved, meta_extra.get("env_id"))}
        saved.save(out / "ckpt", extra=extra)  # removes its own .tmp on failure
        writing = out / "train_state.pt"
        st = {"model": policy.state_dict(), "ema": ema.state_dict() if ema is not None else None,
              "opt": opt.state_dict(), "step": step, "history": history, "args": args_json, "rng": rng}
        st["sha256"] = _tree_sha256(st)
        with open(tmp, "wb") as f:  # through a Python file: a full disk is an OSError, not torch's "unexpected pos"
            torch.save(st, f)
        os.replace(tmp, out / "train_state.pt")
    except Exception as e:
        tmp.unlink(missing_ok=True)
        code = disk_full_errno(e)
        if code is None:
            raise
        raise disk_full_error(writing, code, _intact_after_failed_save(out, step)) from e


def _intact_after_failed_save(out: Path, step: int) -> str:
    """What a save that failed at ``step`` left: the checkpoint's step, and whether --resume can go on."""
    try:
        saved = policies.read_checkpoint_meta(out / "ckpt").get("extra", {}).get("step")
        ckpt = f"{out / 'ckpt'} holds step {saved}"
    except Exception:  # noqa: BLE001 - none yet, or unreadable: say so rather than fail again
        ckpt = f"no checkpoint in {out / 'ckpt'}"
    if (out / "train_state.pt").exists():
        return (f"; the save of step {step} was not completed ({ckpt}, {out / 'train_state.pt'} is intact); make room, "
                "then continue with --resume")
    return f"; the save of step {step} was not completed ({ckpt}, no training state to --resume); make room, then rerun"


def _write_summary(out: Path, summary: dict[str, Any]) -> None:
    """OUT/summary.json, written beside and renamed (a full disk leaves the checkpoints and no half file)."""
    path, tmp = out / "summary.json", out / "summary.json.tmp"
    try:
        tmp.write_text(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        code = disk_full_errno(e)
        if code is None:
            raise
        raise disk_full_error(path, code, f"; training finished and its checkpoint is in {out / 'ckpt'}") from e
