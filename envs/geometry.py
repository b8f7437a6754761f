"""Small geometry helpers: rotations the scripted experts share (kitchen suite, LIBERO) and points on a
box's surface (a robot's body for the collision cost and check)."""

from __future__ import annotations

import numpy as np


def rotvec(R: np.ndarray) -> np.ndarray:
    """Axis-angle vector of rotation matrix ``R``."""
    cos = np.clip((np.trace(R) - 1) / 2, -1.0, 1.0)
    angle = np.arccos(cos)
    if angle < 1e-8:
        return np.zeros(3)
    axis = np.array([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]])
    n = np.linalg.norm(axis)
    if n < 1e-8:  # angle ~ pi: axis from the symmetric part
        _, v = np.linalg.eigh((R + np.eye(3)) / 2)
        return v[:, -1] * angle
    return axis / n * angle


def box_surface(lo: np.ndarray, hi: np.ndarray, spacing: float) -> np.ndarray:
    """(P, 3) points on the surface of the box [lo, hi], at most ``spacing`` apart along each axis."""
    axes = [np.linspace(a, b, max(2, int(np.ceil((b - a) / spacing)) + 1)) for a, b in zip(lo, hi)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1)
    on_face = np.zeros(grid.shape[:3], bool)
    for d in range(3):
        idx = [slice(None)] * 3
        for end in (0, -1):
            idx[d] = end
            on_face[tuple(idx)] = True
    return grid[on_face]
