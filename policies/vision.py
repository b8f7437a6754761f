"""Small CNN image encoder trained from scratch (no pretrained weights can be downloaded here).

Each camera image becomes a 4x4 grid of tokens; cameras share weights and get a learned
camera embedding. A pretrained backbone can be plugged in with ``load_backbone(path)``.
"""

from __future__ import annotations

import torch
from torch import nn


class ImageEncoder(nn.Module):
    def __init__(self, d_model: int, cameras: tuple[str, ...], grid: int = 4):
        super().__init__()
        self.cameras = cameras
        c = max(16, d_model // 4)
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(grid), nn.Conv2d(2 * c, d_model, 1))
        self.cam_emb = nn.Parameter(torch.zeros(len(cameras), 1, d_model))
        self.pos_emb = nn.Parameter(torch.randn(1, grid * grid, d_model) * 0.02)

    def forward(self, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """images: {cam: (B, h, w, 3) uint8} -> tokens (B, n_cams * grid^2, d)."""
        toks = []
        for i, cam in enumerate(self.cameras):
            if cam not in images:
                raise KeyError(f"policy needs camera {cam!r}, observation has {list(images)}")
            x = images[cam].permute(0, 3, 1, 2).float() / 127.5 - 1.0
            f = self.net(x).flatten(2).transpose(1, 2)  # (B, g*g, d)
            toks.append(f + self.pos_emb + self.cam_emb[i])
        return torch.cat(toks, 1)

    def load_backbone(self, path: str) -> None:
        self.net.load_state_dict(torch.load(path, map_location="cpu"))
