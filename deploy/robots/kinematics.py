"""Forward kinematics of the Franka arm (Panda and FR3 share it), for workspace limits.

Modified Denavit-Hartenberg parameters as published in Franka's robot documentation; the
flange is 0.107 m after joint 7 and the Franka Hand's TCP 0.1034 m further along the flange z
axis. Pure numpy; vectorized over leading dimensions.
"""

from __future__ import annotations

import numpy as np

# (a_{i-1}, d_i, alpha_{i-1}) for joints 1..7, then the flange (theta = 0)
FRANKA_DH = np.array([
    [0.0, 0.333, 0.0],
    [0.0, 0.0, -np.pi / 2],
    [0.0, 0.316, np.pi / 2],
    [0.0825, 0.0, np.pi / 2],
    [-0.0825, 0.384, -np.pi / 2],
    [0.0, 0.0, np.pi / 2],
    [0.088, 0.0, np.pi / 2],
    [0.0, 0.107, 0.0],
])
HAND_TCP_OFFSET = 0.1034


def _mdh(a: float, d: float, alpha: float, theta: np.ndarray) -> np.ndarray:
    ct, st = np.cos(theta), np.sin(theta)
    ca, sa = np.cos(alpha), np.sin(alpha)
    T = np.zeros(theta.shape + (4, 4))
    T[..., 0, 0], T[..., 0, 1], T[..., 0, 3] = ct, -st, a
    T[..., 1, 0], T[..., 1, 1], T[..., 1, 2], T[..., 1, 3] = st * ca, ct * ca, -sa, -sa * d
    T[..., 2, 0], T[..., 2, 1], T[..., 2, 2], T[..., 2, 3] = st * sa, ct * sa, ca, ca * d
    T[..., 3, 3] = 1.0
    return T


def franka_fk(q: np.ndarray, tcp_offset: float = HAND_TCP_OFFSET) -> np.ndarray:
    """Base-frame pose (4x4) of the TCP for joint angles ``q`` (..., 7) in radians."""
    q = np.asarray(q, np.float64)
    if q.shape[-1] < 7:
        raise ValueError(f"franka_fk needs 7 joint angles, got shape {q.shape}")
    q = q[..., :7]
    T = np.broadcast_to(np.eye(4), q.shape[:-1] + (4, 4)).copy()
    for i, (a, d, alpha) in enumerate(FRANKA_DH):
        theta = q[..., i] if i < 7 else np.zeros(q.shape[:-1])
        T = T @ _mdh(a, d, alpha, theta)
    tcp = np.eye(4)
    tcp[2, 3] = tcp_offset
    return T @ tcp


def franka_tcp_position(action: np.ndarray) -> np.ndarray:
    """TCP position (m) of a joint-position action (first 7 entries); the safety layer's ``fk``."""
    return franka_fk(np.asarray(action)[..., :7])[..., :3, 3]
