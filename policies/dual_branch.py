"""Training-free dual-branch sampling for flow policies (CAG-like language-contrast baseline).

At every Euler step the commanded velocity is pushed away from a language-free reference, the
mean velocity over the *other* instructions the checkpoint knows:

    v = v(x | o, l*) + w * (v(x | o, l*) - v_marg(x | o)),   v_marg = mean_{l != l*} v(x | o, l)

Unlike classifier-free guidance it needs no instruction dropout in training (the checkpoint's own
instructions stand in for "no instruction"); ``w = 0`` is the plain conditional policy. Cost: one
extra batched network call per step over the K other instructions.

    policy = DualBranchFlow(policies.load("runs/tt/ckpt"), weight=1.0, suite=env.suite)
    chunk = policy.predict_action_chunk(obs)            # (H, A), env units

The wrapper speaks the policy interface (``predict_action_chunk``, ``select_action``, ``reset``,
``config``, ``lang``, ``normalizer``) and delegates everything else to the wrapped policy, so the
evaluation protocols take it as they take the policy. The policy's own ``cfg_scale`` is not
applied here.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from envs.errors import InvalidOptionError
from envs.suite import normalize
from guidance.sampler import sample
from policies.flow import FlowMatchingVLA, _expand
from policies.model import NULL_INSTRUCTION, VLAModel


class DualBranchFlow:
    """A :class:`FlowMatchingVLA` sampled with the dual-branch (language-contrast) velocity.

    ``weight``: contrast strength ``w`` (0: the plain policy). ``instructions``: the set whose mean
    is ``v_marg`` (default: the instructions the checkpoint was trained on, i.e. its language
    cache when wrapped; paraphrases encoded later are not added). The commanded instruction is
    left out of the mean; with ``suite``, by task (so a paraphrase leaves out its canonical
    instruction), else by exact (normalized) string.
    """

    def __init__(self, policy: FlowMatchingVLA, weight: float = 1.0, instructions: Iterable[str] | None = None,
                 suite: Any = None):
        if not isinstance(policy, FlowMatchingVLA):
            raise InvalidOptionError(f"dual-branch sampling needs a flow-matching policy, got {type(policy).__name__}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight):
            raise InvalidOptionError(f"weight must be a finite number, got {weight!r}")
        self.policy, self.weight, self.suite = policy, float(weight), suite
        vocab = list(policy.lang.cache) if instructions is None else list(instructions)
        self.instructions = sorted({s for s in vocab if s != NULL_INSTRUCTION})
        if len(self.instructions) < 2:
            raise InvalidOptionError("dual-branch sampling needs >= 2 known instructions for the language-free "
                                     f"mean (got {self.instructions}); pass instructions=...")
        self._queue: list[np.ndarray] = []

    # ----- delegation -------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.policy.config

    @property
    def lang(self) -> Any:
        return self.policy.lang

    @property
    def normalizer(self) -> Any:
        return self.policy.normalizer

    def __getattr__(self, name: str) -> Any:  # only reached for attributes not defined here
        if name == "policy":
            raise AttributeError(name)
        return getattr(self.policy, name)

    # ----- the contrast set -------------------------------------------------------------------
    def _key(self, s: str) -> Any:
        if self.suite is not None:
            try:
                return self.suite.task(s).task_id
            except Exception:  # an instruction outside the suite: compare the text
                pass
        return normalize(s)

    def others(self, commanded: str) -> list[str]:
        """The instructions averaged into ``v_marg`` for ``commanded``."""
        own = self._key(commanded)
        out = [s for s in self.instructions if self._key(s) != own]
        if not out:
            raise InvalidOptionError(f"no instruction other than {commanded!r} to contrast with")
        return out

    # ----- sampling ---------------------------------------------------------------------------
    def sample_chunks(self, batch: dict[str, Any], noise: torch.Tensor | None = None, guide: Any = None,
                      n_steps: int | None = None, weight: float | None = None,
                      return_stats: bool = False) -> Any:
        """Normalized chunks (B, H, A) from the dual-branch velocity (``guide``: as the policy's)."""
        p, c = self.policy, self.policy.config
        w = self.weight if weight is None else float(weight)
        prefix, pad = p.prefix(batch)
        B = prefix.shape[0]
        instr = batch["instruction"]
        instr = [instr] * B if isinstance(instr, str) else list(instr)
        others = [self.others(s) for s in instr]
        K = len(others[0])
        if any(len(o) != K for o in others):  # e.g. one commanded instruction outside the set
            raise InvalidOptionError("the commanded instructions of this batch leave out different numbers of "
                                     "instructions from the contrast set; sample them one at a time")
        if w != 0.0:
            rep = {k: v for k, v in batch.items() if k in ("state", "images")}
            flat = _expand(rep, K)
            flat["instruction"] = [l for o in others for l in o]
            mprefix, mpad = p.prefix(flat)

        def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            vc = p.velocity(prefix, pad, x, t)
            if w == 0.0:
                return vc
            vm = p.velocity(mprefix, mpad, x.repeat_interleave(K, 0), t.repeat_interleave(K, 0))
            vm = vm.view(B, K, *x.shape[1:]).mean(1)
            return vc + w * (vc - vm)

        x0 = torch.randn(B, c.horizon, c.action_dim, device=p.device) if noise is None else noise.to(p.device)
        return sample(velocity, x0, n_steps=n_steps or c.flow_steps, guide=guide, return_stats=return_stats)

    # the policy's own chunk serving, over this sampler (eval/obs_to_batch/normalizer delegate)
    predict_action_chunk = VLAModel.predict_action_chunk
    select_action = VLAModel.select_action

    def reset(self) -> None:
        self._queue = []
        self.policy.reset()
