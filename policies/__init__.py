"""groundflow policies: flow-matching and autoregressive VLAs behind one interface.

    from policies import FlowMatchingVLA, PolicyConfig, load
    policy = load("runs/flow/ckpt")          # no training code needed
    chunk = policy.predict_action_chunk(obs)  # (H, A) in env units
"""

from __future__ import annotations

import os

from envs.errors import CheckpointError
from policies.autoregressive import AutoregressiveVLA
from policies.base import Policy
from policies.config import SIZES, PolicyConfig
from policies.flow import FlowMatchingVLA
from policies.mlp import MLPPolicy
from policies.model import PolicyMismatchError, VLAModel, load_weights, read_checkpoint_meta

CLASSES = {"flow": FlowMatchingVLA, "ar": AutoregressiveVLA, "mlp": MLPPolicy}


def make_policy(config: PolicyConfig) -> VLAModel:
    return CLASSES[config.kind](config)


def load(directory: str | os.PathLike, device: str = "cpu", to_act: bool = False) -> VLAModel:
    """Load a checkpoint written by ``policy.save(dir)``. ``to_act``: refuse one that cannot act yet
    (a perception head never trained: it would steer by noise)."""
    meta = read_checkpoint_meta(directory)
    if to_act and meta.get("config", {}).get("estimated_state") and "estimator" not in meta.get("extra", {}):
        raise CheckpointError(f"{directory}: its perception head is untrained (the policy reads "
                              f"--estimate-state entries from it); run `groundflow train estimator --from "
                              f"{directory} --out DIR` and use DIR/ckpt")
    try:
        config = PolicyConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as e:  # an edited or foreign config.json
        raise CheckpointError(f"{directory}/config.json holds no valid policy config: {e}") from e
    model = make_policy(config)
    load_weights(model, directory, meta)
    # what it reads at run time, by name (cameras, state slices, estimated slices), where training recorded it
    model.inputs = meta.get("extra", {}).get("inputs")
    model.env_id = meta.get("extra", {}).get("env_id")
    return model.to(device)


__all__ = ["FlowMatchingVLA", "AutoregressiveVLA", "MLPPolicy", "PolicyConfig", "SIZES", "Policy", "VLAModel",
           "PolicyMismatchError", "make_policy", "load", "read_checkpoint_meta"]
