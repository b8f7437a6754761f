"""Differentiable forward kinematics of one MuJoCo site, read from the compiled model.

Guidance costs on a *position* (keep the palm out of a region) must differentiate that position
with respect to the commanded joint targets of an action chunk; MuJoCo's own kinematics are not
differentiable from torch. ``SiteKinematics`` walks the body chain from the world to the site's
body once, stores each body's fixed offset and its joints, and then maps batched joint positions
to the site's world position in torch, exactly as ``mj_kinematics`` does for slide and hinge
joints (checked against MuJoCo to 1e-6 in the tests). Joints the chain does not contain do not
move the site; free and ball joints on the chain are refused (Adroit hands have neither).
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np
import torch
from torch import Tensor

from envs.errors import InvalidOptionError


def _quat_to_mat(q: np.ndarray) -> np.ndarray:
    m = np.zeros(9)
    mujoco.mju_quat2Mat(m, np.asarray(q, dtype=np.float64))
    return m.reshape(3, 3)


def _axis_angle(axis: Tensor, angle: Tensor) -> Tensor:
    """Rotation matrices (..., 3, 3) about a unit ``axis`` (3,) by ``angle`` (...) (Rodrigues)."""
    x, y, z = axis
    k = torch.stack([torch.stack([torch.zeros(()), -z, y]), torch.stack([z, torch.zeros(()), -x]),
                     torch.stack([-y, x, torch.zeros(())])]).to(angle.dtype)
    s, c = torch.sin(angle)[..., None, None], torch.cos(angle)[..., None, None]
    eye = torch.eye(3, dtype=angle.dtype)
    return eye + s * k + (1 - c) * (k @ k)


@dataclass(frozen=True)
class _Joint:
    kind: str          # "slide" or "hinge"
    qpos_adr: int
    qpos0: float
    pos: Tensor        # (3,) anchor in the body frame
    axis: Tensor       # (3,) unit axis in the body frame


@dataclass(frozen=True)
class _Body:
    pos: Tensor        # (3,) offset from the parent frame
    rot: Tensor        # (3, 3) orientation relative to the parent
    joints: tuple[_Joint, ...]


class SiteKinematics:
    """World position of ``site`` as a differentiable function of the model's ``qpos``."""

    def __init__(self, model: mujoco.MjModel, site: str) -> None:
        sid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, site)
        if sid < 0:
            names = [model.site(i).name for i in range(model.nsite)]
            raise InvalidOptionError(f"no site {site!r} in the model; sites: {', '.join(names)}")
        self.site, self.nq = site, int(model.nq)
        self.site_pos = torch.as_tensor(model.site_pos[sid], dtype=torch.float64)
        self.site_rot = torch.as_tensor(_quat_to_mat(model.site_quat[sid]), dtype=torch.float64)
        chain, body = [], int(model.site_bodyid[sid])
        while body != 0:
            joints = []
            for j in range(model.body_jntadr[body], model.body_jntadr[body] + model.body_jntnum[body]):
                kind = {int(mujoco.mjtJoint.mjJNT_SLIDE): "slide", int(mujoco.mjtJoint.mjJNT_HINGE): "hinge"}.get(
                    int(model.jnt_type[j]))
                if kind is None:
                    raise InvalidOptionError(f"site {site!r}: joint {model.joint(j).name!r} is not a slide or "
                                             "hinge joint; SiteKinematics handles serial chains of those only")
                adr = int(model.jnt_qposadr[j])
                joints.append(_Joint(kind, adr, float(model.qpos0[adr]),
                                     torch.as_tensor(model.jnt_pos[j], dtype=torch.float64),
                                     torch.as_tensor(model.jnt_axis[j], dtype=torch.float64)))
            chain.append(_Body(torch.as_tensor(model.body_pos[body], dtype=torch.float64),
                               torch.as_tensor(_quat_to_mat(model.body_quat[body]), dtype=torch.float64),
                               tuple(joints)))
            body = int(model.body_parentid[body])
        self.chain = tuple(reversed(chain))
        self.qpos_adr = sorted(j.qpos_adr for b in self.chain for j in b.joints)
        """the qpos entries that move the site (all others do not)"""

    def __call__(self, qpos: Tensor) -> Tensor:
        """Site world positions (..., 3) for joint positions ``qpos`` (..., nq)."""
        if qpos.shape[-1] != self.nq:
            raise InvalidOptionError(f"qpos has {qpos.shape[-1]} entries; the model has nq = {self.nq}")
        dt = qpos.dtype
        lead = qpos.shape[:-1]
        rot = torch.eye(3, dtype=dt).expand(*lead, 3, 3)
        pos = torch.zeros(*lead, 3, dtype=dt)
        for body in self.chain:
            pos = pos + (rot @ body.pos.to(dt)[:, None])[..., 0]
            rot = rot @ body.rot.to(dt)
            for j in body.joints:
                q = qpos[..., j.qpos_adr] - j.qpos0
                if j.kind == "slide":
                    pos = pos + (rot @ j.axis.to(dt)[:, None])[..., 0] * q[..., None]
                else:  # rotate the body frame about the axis through the joint anchor
                    anchor = pos + (rot @ j.pos.to(dt)[:, None])[..., 0]
                    rot = rot @ _axis_angle(j.axis.to(dt), q)
                    pos = anchor - (rot @ j.pos.to(dt)[:, None])[..., 0]
        return pos + (rot @ self.site_pos.to(dt)[:, None])[..., 0]


__all__ = ["SiteKinematics"]
