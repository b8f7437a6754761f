"""groundflow policies: flow-matching and autoregressive VLAs behind one interface.

    from policies import FlowMatchingVLA, PolicyConfig, load
    policy = load("runs/flow/ckpt")          # no training code needed
    chunk = policy.predict_action_chunk(obs)  # (H, A) in env units

Names are imported lazily (as in ``deploy``): ``import policies`` (or ``policies.rtc_config``, which
the robot side imports) pulls in no torch; the first use of a class, ``make_policy`` or ``load`` does.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from envs.errors import CheckpointError

if TYPE_CHECKING:
    from policies.config import PolicyConfig
    from policies.model import VLAModel

_EXPORTS = {
    "FlowMatchingVLA": "policies.flow", "AutoregressiveVLA": "policies.autoregressive", "MLPPolicy": "policies.mlp",
    "Policy": "policies.base", "PolicyConfig": "policies.config", "SIZES": "policies.config",
    "PolicyMismatchError": "policies.model", "VLAModel": "policies.model", "load_weights": "policies.model",
    "read_checkpoint_meta": "policies.model",
}
_CLASSES = {"flow": "FlowMatchingVLA", "ar": "AutoregressiveVLA", "mlp": "MLPPolicy"}
"""``PolicyConfig.kind`` -> class name; ``CLASSES`` (kind -> class) is built from it on first use"""


def __getattr__(name: str) -> Any:
    if name == "CLASSES":
        value: Any = {kind: __getattr__(cls) for kind, cls in _CLASSES.items()}
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'policies' has no attribute {name!r}")
    globals()[name] = value  # once: later reads (and a caller's edits of CLASSES) find it here
    return value


def make_policy(config: PolicyConfig) -> VLAModel:
    classes = globals().get("CLASSES") or __getattr__("CLASSES")
    return classes[config.kind](config)


def load(directory: str | os.PathLike, device: str = "cpu", to_act: bool = False) -> VLAModel:
    """Load a checkpoint written by ``policy.save(dir)``. ``to_act``: refuse one that cannot act yet
    (a perception head never trained: it would steer by noise)."""
    from policies.config import PolicyConfig
    from policies.model import load_weights, read_checkpoint_meta
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
