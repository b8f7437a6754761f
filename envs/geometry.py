"""Small rotation helpers the scripted experts share (kitchen suite, LIBERO)."""

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
