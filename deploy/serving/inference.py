"""The one place a served policy is asked for a chunk: ``PolicyServer`` (over the network) and
``LocalPolicy`` (in process) both call :func:`infer_chunk` and describe the policy with
:func:`policy_metadata`, so the two cannot drift apart and neither imports the other.

A served policy speaks ``policies.base.Policy``: ``predict_action_chunk(obs, prefix=, frozen=,
rtc=)``, ``config``; optionally ``supports_prefix`` (real-time chunking), ``action_range()``
(the trained range chunks are checked against), ``reset()`` and ``needs_instruction`` (False: an
observation may come without an instruction; a bring-up policy has nothing to ground). Scripted
policies may leave the optional parts out.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from deploy.serving import protocol
from deploy.errors import ConstraintRefusedError
from policies.rtc_config import RTCConfig


def supports_prefix(policy: Any) -> bool:
    """Whether ``policy`` can continue a committed plan (real-time chunking)."""
    return bool(getattr(policy, "supports_prefix", False))


def needs_instruction(policy: Any) -> bool:
    """Whether every observation for ``policy`` must carry a non-empty instruction (the protocol's rule,
    unless the policy says it grounds none: ``needs_instruction = False``)."""
    return bool(getattr(policy, "needs_instruction", True))


def action_bounds(policy: Any, margin: float = protocol.ACTION_MARGIN) -> tuple[np.ndarray, np.ndarray] | None:
    """The policy's trained action range widened by ``margin``; None for a policy without one."""
    action_range = getattr(policy, "action_range", None)
    if action_range is None:
        return None
    lo, hi = (np.asarray(x, np.float64).reshape(-1) for x in action_range())
    return protocol.widen_bounds(lo, hi, margin)


def policy_metadata(policy: Any, max_message_bytes: int, margin: float = protocol.ACTION_MARGIN) -> dict[str, Any]:
    """What the server announces on connect (and ``LocalPolicy`` exposes): dims, cameras, chunk
    size, whether it does real-time chunking, the chunk bounds."""
    config = policy.config
    bounds = action_bounds(policy, margin)
    return {"type": "metadata", "protocol": protocol.PROTOCOL, "version": protocol.VERSION,
            "action_dim": int(config.action_dim), "state_dim": int(config.state_dim),
            "cameras": list(config.cameras), "image_size": int(getattr(config, "image_size", 0) or 0),
            "horizon": int(config.horizon), "n_exec": int(getattr(config, "n_exec", config.horizon)),
            "policy_kind": str(getattr(config, "kind", "")), "rtc": supports_prefix(policy),
            "max_message_bytes": int(max_message_bytes),
            "action_low": None if bounds is None else bounds[0].tolist(),
            "action_high": None if bounds is None else bounds[1].tolist(),
            "max_instruction_chars": protocol.MAX_INSTRUCTION_CHARS,
            "needs_instruction": needs_instruction(policy),  # a client with none is refused before it moves
            # by name, where the checkpoint recorded them: cameras, state slices read, slices estimated from
            # the images, and whether it reads object state a physical arm cannot measure
            "inputs": getattr(policy, "inputs", None),
            "env_id": getattr(policy, "env_id", None)}  # the env or suite it was trained on (None: not recorded)


def seed_everything(seed: int) -> None:
    """Seed numpy, and torch when the policy uses it (never import torch just to seed it)."""
    np.random.seed(seed % (2 ** 32))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def resolve_obs_instruction(policy: Any, obs: dict[str, Any], allow_unknown: bool = False) -> dict[str, Any]:
    """``obs`` with its instruction resolved for ``policy`` (``policies.model.resolve_instruction``:
    a trained instruction untouched, a wording the resolver maps replaced by its trained
    instruction, an ungroundable one ``UnknownInstructionError`` unless ``allow_unknown``). Policies
    without a vocabulary (scripted) get ``obs`` unchanged."""
    text = obs.get("instruction")
    if not isinstance(text, str) or getattr(policy, "lang", None) is None:
        return obs
    from policies.model import resolve_instruction
    resolved = resolve_instruction(policy, text, allow_unknown)
    return obs if resolved == text else {**obs, "instruction": resolved}


def infer_chunk(policy: Any, obs: dict[str, Any], prefix: np.ndarray | None = None, frozen: int = 0,
                seed: int | None = None, rtc: RTCConfig | None = None, allow_unknown: bool = False) -> np.ndarray:
    """One (H, A) float32 chunk in env units; ``prefix``/``frozen`` ask for real-time chunking,
    ``seed`` makes the sample reproducible. The instruction is resolved first
    (``resolve_obs_instruction``): served and local policies ground a user's wording alike."""
    obs = resolve_obs_instruction(policy, obs, allow_unknown)
    if seed is not None:
        seed_everything(seed)
    kwargs: dict[str, Any] = {}
    if prefix is not None:  # only then: scripted policies need not know the RTC arguments
        kwargs.update(prefix=prefix, frozen=frozen, rtc=rtc)
    return np.asarray(policy.predict_action_chunk(obs, **kwargs), dtype=np.float32)


def can_constrain(policy: Any) -> str | None:
    """Why ``policy`` cannot take deploy-time obstacles (None: it can): guidance steers a flow policy's
    sampler, so it needs one with ``sample_chunks`` and a normalizer."""
    if not (hasattr(policy, "sample_chunks") and hasattr(policy, "normalizer") and hasattr(policy, "obs_to_batch")
            and getattr(policy.config, "kind", "") == "flow"):
        return (f"obstacles at deploy time steer a flow policy's sampler; this one is "
                f"{getattr(policy.config, 'kind', type(policy).__name__)!r}")
    return None


def infer_constrained(policy: Any, obs: dict[str, Any], constraints: Any, seed: int | None = None,
                      allow_unknown: bool = False) -> Any:
    """``policies.constraints.constrained_chunk`` for one observation, its instruction resolved as
    ``infer_chunk`` resolves it: a chunk (env units) or a hold with its reason. A goal inside an
    obstacle raises ``ConstraintRefusedError``."""
    from policies.constraints import UnsatisfiableError, constrained_chunk
    obs = resolve_obs_instruction(policy, obs, allow_unknown)
    if seed is not None:
        seed_everything(seed)
    policy.eval()
    try:
        return constrained_chunk(policy, obs, constraints)
    except UnsatisfiableError as e:
        raise ConstraintRefusedError(str(e), "unsatisfiable") from None
