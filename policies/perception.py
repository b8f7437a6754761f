"""A perception head that estimates object positions from camera images and proprioception.

Why: a policy for a physical arm may read only cameras, its own joints and the instruction, yet
every multi-instruction policy that works here reads the simulator's object poses. End to end, the
behaviour-cloning loss alone did not make an image encoder find small objects (README, "Policies
from pixels": PushCube scratch CNN 0.22 = blind). Here the object state the simulator records
supervises a small estimator instead (the demos carry it; the checkpoint never reads it at run
time), and the policy reads the estimate in place of the true value. The policy trains on the true
value: noise on it (``PolicyConfig.estimate_noise``) was measured to hurt on the tabletop (README).
Colour and camera-pose robustness come from the head's training images (``collect --randomize``).

The estimator: per camera a small CNN with coordinate channels (CoordConv, Liu et al. 2018) and a
spatial softmax (Levine et al. 2016) that reads out where its keypoints are, to sub-pixel
precision, plus the mean feature (what is there); an MLP maps all cameras' keypoints and the
proprioception to the estimated entries (standardized units). Cameras are cheap here: a 96 px
frame costs ~10 M multiply-adds.
"""

from __future__ import annotations

import torch
from torch import nn

from policies.vision import SpatialSoftmax, camera_input


def _coords(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, C + 2, h, w) with the pixel's row and column in [-1, 1] appended."""
    B, _, h, w = x.shape
    ys = torch.linspace(-1, 1, h, device=x.device).view(1, 1, h, 1).expand(B, 1, h, w)
    xs = torch.linspace(-1, 1, w, device=x.device).view(1, 1, 1, w).expand(B, 1, h, w)
    return torch.cat([x, ys, xs], 1)


class CameraKeypoints(nn.Module):
    """One camera's image -> keypoint coordinates and mean features, (B, 2k + 2c)."""

    def __init__(self, channels: int, keypoints: int):
        super().__init__()
        c = channels
        self.trunk = nn.Sequential(
            nn.Conv2d(5, c, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(2 * c, 2 * c, 3, stride=1, padding=1), nn.GELU())
        self.keypoints = SpatialSoftmax(2 * c, keypoints)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.trunk(_coords(x))
        return torch.cat([self.keypoints(f).flatten(1), f.mean((2, 3))], 1)


class StateEstimator(nn.Module):
    """{camera: (B, h, w, 3) uint8} + proprioception (B, P) standardized -> (B, n_out) standardized."""

    def __init__(self, cameras: tuple[str, ...], proprio_dim: int, n_out: int, channels: int = 16,
                 keypoints: int = 32, hidden: int = 256, shift: int = 4, jitter: float = 0.2):
        super().__init__()
        self.cameras, self.shift, self.jitter = tuple(cameras), int(shift), float(jitter)
        self.per_camera = nn.ModuleList([CameraKeypoints(channels, keypoints) for _ in self.cameras])
        width = len(self.cameras) * (2 * keypoints + 2 * channels) + proprio_dim
        self.head = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                  nn.Linear(hidden, n_out))

    def forward(self, images: dict[str, torch.Tensor], proprio: torch.Tensor) -> torch.Tensor:
        feats = []
        for cam, net in zip(self.cameras, self.per_camera):  # training: a camera moved a little, a light changed
            feats.append(net(camera_input(images[cam], self.training, self.shift, self.jitter)))
        return self.head(torch.cat(feats + [proprio], 1))
