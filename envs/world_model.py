"""Learned world model: an ensemble of MLPs over the observation state, wrapped as a gymnasium env.

Why: model-based evaluation and counterfactual debugging need a model whose state can be set
exactly and stepped in batches. Here the model state *is* the observation state vector, so
``set_sim_state(x)`` sets it, and a whole batch of states can be stepped at once
(:meth:`WorldModel.predict`).

Each member predicts the normalized state change ``s' - s`` and the reward from ``(s, a)``; a
separate small classifier predicts success from a state alone (so success can be evaluated on a
state that was patched from outside). ``member="mean"`` (default) steps with the ensemble mean,
``member=i`` with one member, ``member="sample"`` with a member drawn per step.

Checkpoint directory (no training code needed to load)::

    config.json          dims, sizes, env id, instruction, action bounds, episode length
    model.safetensors    weights, normalization statistics, initial states for reset
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from envs.base import GroundflowEnv
from envs.errors import GroundflowError, InvalidOptionError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "groundflow-world-model"
VERSION = 1


class WorldModelError(GroundflowError, ValueError):
    """A world-model checkpoint that is missing or inconsistent, or a state of the wrong size."""


@dataclass
class WorldModelConfig:
    state_dim: int
    action_dim: int
    hidden: int = 256
    layers: int = 2
    ensemble: int = 5
    env_id: str = ""
    instruction: str = ""
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)
    max_episode_steps: int = 200
    format: str = FORMAT
    version: int = VERSION

    def validate(self) -> "WorldModelConfig":
        for name in ("state_dim", "action_dim", "hidden", "layers", "ensemble", "max_episode_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise WorldModelError(f"world model config: {name} must be a positive int, got {v!r}")
        if len(self.action_low) != self.action_dim or len(self.action_high) != self.action_dim:
            raise WorldModelError(f"world model config: action bounds need {self.action_dim} values, got "
                                  f"{len(self.action_low)} and {len(self.action_high)}")
        return self


class EnsembleLinear(nn.Module):
    """E independent linear layers applied in one batched matmul: (E, B, i) -> (E, B, o)."""

    def __init__(self, ensemble: int, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ensemble, n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(ensemble, 1, n_out))
        bound = 1.0 / math.sqrt(n_in)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleMLP(nn.Module):
    def __init__(self, ensemble: int, n_in: int, n_out: int, hidden: int, layers: int):
        super().__init__()
        dims = [n_in] + [hidden] * layers + [n_out]
        self.layers = nn.ModuleList(EnsembleLinear(ensemble, a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = torch.baddbmm(layer.bias, x, layer.weight)
            if i < last:
                x = torch.nn.functional.silu(x)
        return x


class WorldModel(nn.Module):
    """Ensemble dynamics + reward model and a success classifier, with their normalization."""

    STAT_KEYS = ("s_mean", "s_std", "a_mean", "a_std", "d_mean", "d_std", "r_mean", "r_std")

    def __init__(self, config: WorldModelConfig):
        super().__init__()
        self.config = config.validate()
        S, A, E = config.state_dim, config.action_dim, config.ensemble
        self.dynamics = EnsembleMLP(E, S + A, S + 1, config.hidden, config.layers)
        self.success_head = EnsembleMLP(1, S, 1, max(32, config.hidden // 4), 1)
        for k, n in zip(self.STAT_KEYS, (S, S, A, A, S, S, 1, 1)):
            self.register_buffer(k, torch.zeros(n) if k.endswith("mean") else torch.ones(n))
        self.register_buffer("init_states", torch.zeros(1, S))

    # ----- normalization ----------------------------------------------------------------------
    def set_stats(self, stats: dict[str, np.ndarray], init_states: np.ndarray) -> None:
        for k in self.STAT_KEYS:
            v = torch.as_tensor(np.asarray(stats[k], dtype=np.float32)).reshape(getattr(self, k).shape)
            if k.endswith("std"):
                v = v.clamp_min(1e-6)
            getattr(self, k).copy_(v)
        self.init_states = torch.as_tensor(np.asarray(init_states, dtype=np.float32))

    def _inputs(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.cat([(s - self.s_mean) / self.s_std, (a - self.a_mean) / self.a_std], dim=-1)

    def raw_outputs(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Normalized (delta, reward) of every member: (E, B, S + 1)."""
        x = self._inputs(s, a)
        return self.dynamics(x.unsqueeze(0).expand(self.config.ensemble, *x.shape))

    def success_logit(self, s: torch.Tensor) -> torch.Tensor:
        x = ((s - self.s_mean) / self.s_std).unsqueeze(0)
        return self.success_head(x)[0, :, 0]

    # ----- inference (numpy: ~5x less per-call overhead than torch for the small batches of rollouts)
    def train(self, mode: bool = True) -> "WorldModel":
        self._np_cache = None  # weights may change (training) or just changed (eval after training)
        return super().train(mode)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._np_cache = None
        return super().load_state_dict(*args, **kwargs)

    def _numpy(self) -> dict[str, Any]:
        """numpy copies of the weights, cached in eval mode (rebuilt on every call while training)."""
        if self.training or getattr(self, "_np_cache", None) is None or self._np_cache["dtype_t"] != self.s_mean.dtype:
            dtype = np.float64 if self.s_mean.dtype == torch.float64 else np.float32
            c = lambda t: t.detach().cpu().numpy().astype(dtype)  # noqa: E731
            self._np_cache = {k: c(getattr(self, k)) for k in self.STAT_KEYS}
            self._np_cache["dyn"] = [(c(l.weight), c(l.bias)) for l in self.dynamics.layers]
            self._np_cache["succ"] = [(c(l.weight), c(l.bias)) for l in self.success_head.layers]
            self._np_cache["dtype"] = dtype
            self._np_cache["dtype_t"] = self.s_mean.dtype
        return self._np_cache

    @staticmethod
    def _mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
        for i, (w, b) in enumerate(layers):
            x = np.matmul(x, w) + b
            if i < len(layers) - 1:
                x = x / (1.0 + np.exp(-x))
        return x

    def predict(self, states: Any, actions: Any, member: int | str = "mean",
                generator: np.random.Generator | None = None, success: bool = True,
                uncertainty: bool = True) -> dict[str, np.ndarray]:
        """Batched step: states (B, S), actions (B, A) -> next_state (B, S), reward (B,), and
        (when asked) success (B,) bool and uncertainty (B,) (ensemble std of the normalized change)."""
        p = self._numpy()
        S, A = self.config.state_dim, self.config.action_dim
        s = np.asarray(states, p["dtype"]).reshape(-1, S)
        a = np.asarray(actions, p["dtype"]).reshape(-1, A)
        x = np.concatenate([(s - p["s_mean"]) / p["s_std"], (a - p["a_mean"]) / p["a_std"]], axis=1)
        out = self._mlp(p["dyn"], x[None])  # (E, B, S + 1)
        if member == "mean":
            o = out.mean(0)
        elif member == "sample":
            rng = generator or np.random.default_rng()
            o = out[rng.integers(0, self.config.ensemble, size=s.shape[0]), np.arange(s.shape[0])]
        else:
            o = out[int(member)]
        nxt = s + o[:, :-1] * p["d_std"] + p["d_mean"]
        res = {"next_state": nxt, "reward": o[:, -1] * p["r_std"][0] + p["r_mean"][0]}
        if success:
            res["success"] = self.success(nxt)
        if uncertainty:
            res["uncertainty"] = (out[..., :-1].std(0).mean(-1) if self.config.ensemble > 1
                                  else np.zeros(s.shape[0], p["dtype"]))
        return res

    def success(self, states: Any) -> np.ndarray:
        p = self._numpy()
        s = np.asarray(states, p["dtype"]).reshape(-1, self.config.state_dim)
        return self._mlp(p["succ"], ((s - p["s_mean"]) / p["s_std"])[None])[0, :, 0] > 0

    # ----- checkpoint -------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write config.json + model.safetensors into ``directory`` (created)."""
        from safetensors.torch import save_file
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(d / WEIGHTS_FILE))
        (d / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2))
        return d

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "WorldModel":
        from safetensors.torch import load_file
        d = Path(directory)
        cfg_path, w_path = d / CONFIG_FILE, d / WEIGHTS_FILE
        if not cfg_path.is_file() or not w_path.is_file():
            raise WorldModelError(f"{d} is not a world-model checkpoint: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
                                  "(write one with `groundflow train world-model --data ... --out DIR`)")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise WorldModelError(f"{cfg_path}: not valid JSON ({e})") from e
        if raw.get("format") != FORMAT:
            raise WorldModelError(f"{cfg_path}: format {raw.get('format')!r} is not {FORMAT!r}")
        known = set(WorldModelConfig.__dataclass_fields__)
        model = cls(WorldModelConfig(**{k: v for k, v in raw.items() if k in known}))
        tensors = load_file(str(w_path))
        if "init_states" in tensors:
            model.init_states = torch.zeros_like(tensors["init_states"])
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise WorldModelError(f"{w_path}: weights do not match the config (missing {missing}, "
                                  f"unexpected {unexpected})")
        return model.to(dtype).eval()


class WorldModelEnv(GroundflowEnv):
    """A :class:`WorldModel` as a groundflow env; its simulator state is the state vector.

    ``reset(seed)`` draws an initial state from the training data's initial states (or takes
    ``options={"state": s}``). Stepping is deterministic with ``member="mean"`` or an int.
    """

    backend = "worldmodel"
    sim_state_is_observation = True  # debugging: residuals live in observation-state space

    def __init__(self, model: WorldModel, env_id: str = "worldmodel", member: int | str = "mean",
                 max_episode_steps: int | None = None, instruction: str | None = None):
        cfg = model.config
        if not (member in ("mean", "sample") or (isinstance(member, int) and 0 <= member < cfg.ensemble)):
            raise InvalidOptionError(f"{env_id}: member must be 'mean', 'sample' or an int in "
                                     f"[0, {cfg.ensemble}), got {member!r}")
        super().__init__(cfg.state_dim, np.asarray(cfg.action_low, np.float32), np.asarray(cfg.action_high, np.float32),
                         max_episode_steps=max_episode_steps or cfg.max_episode_steps,
                         instruction=instruction or cfg.instruction or cfg.env_id)
        self.model = model
        self.member = member
        self.env_id = env_id
        self.source_env_id = cfg.env_id
        self._state = model.init_states[0].double().cpu().numpy()
        self._rng = np.random.default_rng(0)

    # ----- hooks -------------------------------------------------------------------------------
    def _reset(self, seed, options):
        unknown = sorted(set(options) - {"state", "instruction"})
        if unknown:
            raise InvalidOptionError(f"{self.env_id}: unknown reset option(s) {unknown}; valid: ['state', 'instruction']")
        self._rng = np.random.default_rng(seed)
        self.instruction = options.get("instruction", self.instruction)
        if "state" in options:
            self.set_sim_state(options["state"])
        else:
            init = self.model.init_states.cpu().numpy()
            self._state = init[int(self._rng.integers(0, init.shape[0]))].astype(np.float64)
        return self._state.copy(), {}, {"success": bool(self.model.success(self._state[None])[0])}

    def _step(self, action):
        out = self.predict_batch(self._state[None], np.asarray(action)[None])
        self._state = out["next_state"][0].astype(np.float64)
        return (self._state.copy(), {}, float(out["reward"][0]), False, False,
                {"success": bool(out["success"][0]), "uncertainty": float(out["uncertainty"][0])})

    def predict_batch(self, states: np.ndarray, actions: np.ndarray, success: bool = True,
                      uncertainty: bool = True) -> dict[str, np.ndarray]:
        """Step a batch of states without touching this env's own state."""
        return self.model.predict(states, actions, member=self.member, generator=self._rng, success=success,
                                  uncertainty=uncertainty)

    def success_batch(self, states: np.ndarray) -> np.ndarray:
        return self.model.success(states)

    # ----- state -------------------------------------------------------------------------------
    def get_sim_state(self) -> np.ndarray:
        return self._state.astype(np.float64).copy()

    def set_sim_state(self, state: np.ndarray) -> None:
        x = np.asarray(state, dtype=np.float64).reshape(-1)
        if x.shape != (self.state_dim,):
            raise WorldModelError(f"{self.env_id}: state has {x.size} values, this world model's state has {self.state_dim}")
        if not np.all(np.isfinite(x)):
            raise WorldModelError(f"{self.env_id}: state contains NaN/inf")
        self._state = x.copy()

    def observe(self) -> dict:
        return self._obs(self._state, {})

    def evaluate_success(self) -> bool:
        return bool(self.model.success(self._state[None])[0])

    def make_expert(self, **options: Any):
        raise NotImplementedError(f"{self.env_id}: a learned world model has no expert; collect demos in "
                                  f"the simulator it was trained on ({self.source_env_id or 'unknown'})")


def load_world_model_env(path: str | Path, member: int | str = "mean", precision: str = "float32",
                         max_episode_steps: int | None = None, instruction: str | None = None,
                         env_id: str | None = None) -> WorldModelEnv:
    """Load a checkpoint directory as an env. ``precision="float64"`` for bit-stable debugging."""
    dtypes = {"float32": torch.float32, "float64": torch.float64}
    if precision not in dtypes:
        raise InvalidOptionError(f"precision must be one of {list(dtypes)}, got {precision!r}")
    model = WorldModel.load(path, dtype=dtypes[precision])
    return WorldModelEnv(model, env_id=env_id or f"worldmodel/{Path(path).name}", member=member,
                         max_episode_steps=max_episode_steps, instruction=instruction)


def make_world_model_env(env_id: str = "worldmodel", path: str | Path | None = None, **options: Any) -> WorldModelEnv:
    """Registry factory: ``envs.make("worldmodel", path=DIR, member="mean")``."""
    if path is None:
        raise InvalidOptionError(f"{env_id}: a learned world model needs path=<checkpoint dir> "
                                 "(written by `groundflow train world-model`)")
    return load_world_model_env(path, env_id=env_id if env_id != "worldmodel" else None, **options)
