"""Evaluation protocols that show whether a policy listens to its instruction.

- :func:`swap_eval` — instruction swap: every seed's initial state rolled out under every
  instruction of the suite. A policy that ignores the instruction can succeed on at most one
  instruction per state (about 1/K of the episodes) and "does a different task" on the rest.
- :func:`correlated_split_eval` — a policy trained on ``layout="correlated"`` (the scene predicts
  the task) evaluated in distribution (correlated) and on the split (``layout="random"``), on
  the same seeds. A policy that reads the task off the scene falls to about 1/K on the split.
- :func:`layout_conflict_eval` — the same policy on the correlated layout of one task while
  another is commanded: the shortcut alone, without unseen layouts (tabletop suite).
- :func:`perturbation_eval` — success under each LIBERO-Plus-style perturbation family of
  :mod:`envs.perturbations`, next to the clean success on the same seeds; families that cannot
  apply to the env (e.g. camera shifts without cameras) are reported as skipped with the reason.
- :func:`switch_eval` — mid-episode instruction switch: start under ``l``, command ``l'`` (a task
  on other objects, still feasible) after a third of the expert's episode; success = ``l'``
  completed. Only switches the reference expert itself solves count (:func:`switch_cases`).
- :func:`paraphrase_eval` — every episode commanded with one of the suite's held-out
  paraphrases (instructions no demo carries), next to the clean success on the same seeds.

All return JSON-ready dicts with success rates and 95% Wilson intervals. Episodes run through
:func:`train.evaluate.rollout` / :func:`train.evaluate.evaluate`; a policy is anything with
``reset()`` and ``select_action(obs)`` (and ``config`` for the dimension check).
:class:`ExpertPolicy` makes a suite's privileged expert into such a policy (the reference
the protocols are checked against).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np
from tqdm import tqdm

import envs
from envs import state_slices
from envs.errors import InstructionError, InvalidOptionError
from envs.metrics import wilson
from envs.perturbations import FAMILIES, EnvWrapper, base_env, check_family, not_applicable, perturb
from policies.model import check_vocabulary
from train.evaluate import EvalResult, check_compatible, evaluate, rollout


# ===================================================================================== #
# The scripted expert as a policy
# ===================================================================================== #
@dataclass
class ExpertConfig:
    """Dimensions of the env an :class:`ExpertPolicy` is bound to (for ``check_compatible``)."""

    state_dim: int
    action_dim: int
    cameras: tuple[str, ...] = ()


class ExpertPolicy:
    """A suite's privileged expert behind the policy interface (``reset``, ``select_action``).

    At the first action of an episode it reads the task from ``obs["instruction"]`` (canonical
    instruction or paraphrase) and makes ``env.make_expert(task_id=...)`` for it; when the
    instruction changes mid-episode (the switch protocol) it makes a new expert for the new task
    from the current state. With ``task`` (id or instruction) it always acts for that task
    whatever it is told: a policy that ignores its instruction. Subclasses can override
    :meth:`task_for`. Protocols call :meth:`bind` with the env the episodes run in (the expert
    reads its simulator).
    """

    def __init__(self, env: Any = None, task: int | str | None = None, noise: float = 0.0,
                 seed: int | None = None):
        self.env: Any = None
        self.fixed_task = task
        self.noise, self.seed = float(noise), seed
        self._expert: Any = None
        self._instruction: str | None = None
        if env is not None:
            self.bind(env)

    def bind(self, env: Any) -> None:
        self.env = env
        suite = getattr(env, "suite", None)
        if self.fixed_task is not None:
            if suite is None:
                raise InvalidOptionError("ExpertPolicy(task=...) needs a suite env, "
                                         f"got {getattr(env, 'env_id', env)!r}")
            suite.task(self.fixed_task)  # validates

    @property
    def config(self) -> ExpertConfig:
        if self.env is None:
            raise RuntimeError("ExpertPolicy is not bound to an env: call bind(env)")
        return ExpertConfig(int(self.env.state_dim), int(self.env.action_space.shape[0]), tuple(self.env.cameras))

    def task_for(self, obs: dict) -> int | None:
        """The task to act for in this episode (None: the expert's own default)."""
        suite = getattr(self.env, "suite", None)
        if suite is None:
            return None
        key = self.fixed_task if self.fixed_task is not None else obs["instruction"]
        return suite.task(key).task_id

    def reset(self) -> None:
        self._expert = None
        self._instruction = None

    def select_action(self, obs: dict) -> np.ndarray:
        if self.env is None:
            raise RuntimeError("ExpertPolicy is not bound to an env: call bind(env)")
        instr = obs.get("instruction")
        if self._expert is not None and self.fixed_task is None and instr != self._instruction:
            self._expert = None  # told something else mid-episode: act for the new task from here
        self._instruction = instr
        if self._expert is None:
            tid = self.task_for(obs)
            opts: dict[str, Any] = {"noise": self.noise, "seed": self.seed}
            if tid is not None:
                opts["task_id"] = tid
            self._expert = self.env.make_expert(**opts)
            self._expert.reset(self.env, obs)
        return self._expert.act(obs)


# ===================================================================================== #
# Helpers
# ===================================================================================== #
class _Tracked(EnvWrapper):
    """What the protocols need around an env: ``info["completed_tasks"]`` as a bool mask over the
    suite's tasks (backends report a mask or a list of task ids), the simulator state at every
    reset (to check that a swap really starts from one state), and extra reset options."""

    def __init__(self, env: Any, reset_options: dict | None = None):
        super().__init__(env)
        self.reset_options = dict(reset_options or {})
        self.initial_states: list[np.ndarray | None] = []
        suite = getattr(env, "suite", None)
        self._n_tasks = len(suite.tasks) if suite is not None else 0

    def _mask(self, info: dict) -> dict:
        done = info.get("completed_tasks")
        if done is None or not self._n_tasks:
            return info
        arr = np.asarray(done)
        if not (arr.dtype == bool and arr.shape == (self._n_tasks,)):
            mask = np.zeros(self._n_tasks, dtype=bool)
            mask[arr.astype(int).reshape(-1)] = True
            arr = mask
        return {**info, "completed_tasks": arr}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options={**self.reset_options, **(options or {})})
        state = base_env(self.env).get_sim_state()
        self.initial_states.append(None if state is None else np.asarray(state).copy())
        return obs, self._mask(info)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, self._mask(info)


def _make(policy: Any, env_id: str, env_options: dict | None) -> Any:
    """``envs.make`` with the cameras the policy reads (unless the options name them)."""
    opts = dict(env_options or {})
    config = None if isinstance(policy, ExpertPolicy) else getattr(policy, "config", None)
    cams = tuple(getattr(config, "cameras", ()) or ())
    if cams and "cameras" not in opts:
        opts["cameras"] = cams
        opts.setdefault("image_size", getattr(config, "image_size", 128))
    return envs.make(env_id, **opts)


def _prepare(policy: Any, env: Any) -> None:
    if hasattr(policy, "bind"):
        policy.bind(env)
    if hasattr(policy, "config"):
        check_compatible(policy, env)


def _rate(k: int, n: int) -> dict[str, Any]:
    return {"rate": k / n if n else 0.0, "ci95": list(wilson(k, n))}


def _check_seeds(seeds: Iterable[int]) -> list[int]:
    out = list(seeds)
    if not out or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in out):
        raise InvalidOptionError(f"seeds must be a non-empty list of ints, got {out!r}")
    return [int(s) for s in out]


# ===================================================================================== #
# Instruction swap
# ===================================================================================== #
def swap_eval(policy: Any, env_id: str, seeds: Iterable[int], instructions: list[str] | None = None,
              env_options: dict | None = None, env: Any = None, progress: bool = False) -> dict[str, Any]:
    """Roll every seed's initial state out under every instruction (default: all of the suite's).

    Success only when the commanded task is done. Reports the swap success rate, the rate of
    episodes that completed a different task of the suite instead, the rate of seeds on which
    every instruction succeeded, per-instruction and per-seed results, and whether each seed
    really started from one simulator state under every instruction (``same_initial_state``:
    false e.g. under ``layout="correlated"``, where the swap is not a swap).
    """
    seeds = _check_seeds(seeds)
    own = env is None
    env = _make(policy, env_id, env_options) if own else env
    try:
        suite = getattr(env, "suite", None)
        if suite is None:
            raise InvalidOptionError(f"{env_id}: the swap protocol needs a multi-instruction suite env; "
                                     f"suites: {envs.list_envs(kind='suite')}")
        instrs = list(instructions or suite.instructions)
        if len(instrs) < 2:
            raise InstructionError(f"the swap protocol needs >= 2 instructions, got {instrs}")
        for instruction in instrs:
            suite.task(instruction)
        if hasattr(policy, "lang"):
            check_vocabulary(policy, instrs, suite, what=f"the {suite.name} suite")
        tracked = _Tracked(env)
        _prepare(policy, tracked)
        res = EvalResult(env_id, 0, 0)
        per_seed: dict[str, dict[str, Any]] = {}
        t0 = time.time()
        bar = tqdm(total=len(seeds) * len(instrs), desc=f"swap {env_id}", disable=not progress, unit="ep")
        for seed in seeds:
            tracked.initial_states.clear()
            wins = others = 0
            for instr in instrs:
                out = rollout(policy, tracked, seed, options={"instruction": instr})
                res.episodes += 1
                res.successes += out["success"]
                res.other_task += out["other_task"]
                wins += out["success"]
                others += out["other_task"]
                stats = res.per_instruction.setdefault(instr, {"episodes": 0, "successes": 0, "did_other_task": 0})
                stats["episodes"] += 1
                stats["successes"] += int(out["success"])
                stats["did_other_task"] += int(out["other_task"])
                bar.update()
            states = tracked.initial_states
            same = None if states[0] is None else all(np.allclose(s, states[0], rtol=0, atol=1e-6) for s in states)
            per_seed[str(seed)] = {"successes": wins, "did_other_task": others, "all_success": wins == len(instrs),
                                   "same_initial_state": same}
        bar.close()
        res.seconds = time.time() - t0
    finally:
        if own:
            env.close()
    for stats in res.per_instruction.values():
        stats["success_rate"] = stats["successes"] / stats["episodes"]
        stats["ci95"] = list(wilson(stats["successes"], stats["episodes"]))
        stats["did_other_task_rate"] = stats["did_other_task"] / stats["episodes"]
    out = res.to_dict()
    all_ok = sum(v["all_success"] for v in per_seed.values())
    sames = [v["same_initial_state"] for v in per_seed.values()]
    return {
        "protocol": "instruction_swap", "env_id": env_id, "seeds": seeds, "n_instructions": len(instrs),
        "episodes": out["episodes"], "successes": out["successes"],
        "swap_success_rate": out["success_rate"], "ci95": out["ci95"],
        "did_other_task_rate": out["did_other_task_rate"],
        "did_other_task_ci95": list(wilson(res.other_task, res.episodes)),
        "chance_rate": 1.0 / len(instrs),
        "all_instructions_success_rate": all_ok / len(seeds), "all_instructions_ci95": list(wilson(all_ok, len(seeds))),
        "same_initial_state": None if None in sames else all(sames),
        "per_instruction": out["per_instruction"], "per_seed": per_seed, "seconds": out["seconds"],
    }


# ===================================================================================== #
# Correlated split
# ===================================================================================== #
SPLIT_LAYOUTS = {"in_distribution": "correlated", "split": "random"}


def correlated_split_eval(policy: Any, env_id: str, episodes: int = 24, seed: int = 1000,
                          env_options: dict | None = None, env: Any = None,
                          progress: bool = False, instructions: list[str] | None = None) -> dict[str, Any]:
    """Success on ``layout="correlated"`` (in distribution for a policy trained there) and on
    ``layout="random"`` (the split), same seeds and instruction cycle; ``gap`` = difference.

    Without ``env``, one env per layout is made (``layout`` as a constructor option, works for
    both suites). With ``env``, it is reused and the layout goes into every reset's options
    (envs that take it there, e.g. the tabletop suite).
    """
    if isinstance(episodes, bool) or not isinstance(episodes, (int, np.integer)) or episodes <= 0:
        raise InvalidOptionError(f"episodes must be a positive int, got {episodes!r}")
    opts = dict(env_options or {})
    if "layout" in opts:
        raise InvalidOptionError("correlated_split_eval sets the layout itself; remove 'layout' from env_options")
    out: dict[str, Any] = {"protocol": "correlated_split", "env_id": env_id, "episodes": int(episodes), "seed": seed}
    for key, layout in SPLIT_LAYOUTS.items():
        own = env is None
        layout_env = _make(policy, env_id, {**opts, "layout": layout}) if own else env
        try:
            tracked = _Tracked(layout_env, reset_options=None if own else {"layout": layout})
            _prepare(policy, tracked)
            result = evaluate(policy, env_id, int(episodes), seed, env=tracked, progress=progress,
                              instructions=instructions).to_dict()
        finally:
            if own:
                layout_env.close()
        out[key] = {"layout": layout, **result}
    out["gap"] = out["in_distribution"]["success_rate"] - out["split"]["success_rate"]
    return out


CONFLICT_ENVS = ("maniskill/TabletopSuite-v1",)
"""suites whose reset takes ``layout_task_id`` (lay the scene out for one task, command another)"""


APPROACH_RADIUS = 0.05
"""metres from the gripper's centre to an object's centre that count as going for the object (a
successful tabletop push comes within 3-4.7 cm of its cube; a pick or stack within 2.5 cm)"""


class _FirstApproach:
    """An ``act`` hook for :func:`rollout`: acts with ``act`` and records which object the gripper
    went for first, the first whose centre it came within :data:`APPROACH_RADIUS` of. Positions come
    from the observed state through the env's ``state_layout`` (``extra/tcp_pose`` and every
    ``extra/<name>_cube_pose``). Why: a failure that went for the commanded object is an execution
    failure; one that went for another object is a grounding failure, which CIG can act on."""

    def __init__(self, env: Any, act: Any):
        slices = state_slices(getattr(base_env(env), "state_layout", None))
        if "extra/tcp_pose" not in slices:
            raise InvalidOptionError("which object the gripper went for needs 'extra/tcp_pose' in the env's state "
                                     f"layout; got {list(slices)}")
        self._tcp = slices["extra/tcp_pose"][0]
        self._objects = {n[len("extra/"):-len("_cube_pose")]: i for n, (i, _) in slices.items()
                         if n.startswith("extra/") and n.endswith("_cube_pose")}
        self._act = act
        self.first: str | None = None

    def __call__(self, obs: dict) -> np.ndarray:
        if self.first is None:
            s = np.asarray(obs["state"], dtype=np.float64)
            tcp = s[self._tcp:self._tcp + 3]
            dist = {n: float(np.linalg.norm(s[i:i + 3] - tcp)) for n, i in self._objects.items()}
            nearest = min(dist, key=dist.get, default=None)
            if nearest is not None and dist[nearest] < APPROACH_RADIUS:
                self.first = nearest
        return self._act(obs)


def _slot_of(env: Any, obj: str | None) -> int | None:
    """The slot ``obj`` starts in this episode, where the env lays objects out in slots (tabletop:
    0 nearest the robot, the commanded cube's slot in every correlated layout); None elsewhere.
    Why: it splits random-layout results into placements the shortcut data shows often and rarely."""
    slot_of = getattr(getattr(base_env(env), "raw", None), "slot_of", None)
    return None if slot_of is None or obj is None else int(slot_of(obj))


APPROACHED = ("commanded", "layout's", "another", "none")
"""what the gripper went for first, per episode: the commanded object, the one the conflict layout
puts first (when that is another), another object, or none"""


def layout_conflict_eval(policy: Any, env_id: str, episodes: int = 24, seed: int = 5000,
                         instructions: list[str] | None = None, progress: bool = False,
                         env: Any = None) -> dict[str, Any]:
    """P2's shortcut test without its layout-generalization confound.

    P2 tests a policy trained where the layout names the task on random layouts, which mixes two
    failures: following the layout instead of the instruction, and not acting well on layouts
    rarely seen. Here every episode's scene is the correlated layout of another task (one the
    policy trained on) while instruction ``j`` is commanded: only the instruction says what to do.
    ``conflict``: success, ``did_layout_task_rate`` (the task the layout names was done at some
    step instead) and other tasks; ``in_distribution``: the same seeds and instructions on their
    own layouts.
    ``random``: the same seeds and instructions on random layouts (P2's own test scenes).
    Every condition also says which object the gripper went for first (``approached_first``:
    counts over :data:`APPROACHED`, for all episodes and for the failures), so a failure splits into
    going for the wrong object (grounding) and failing at the right one (execution).
    ``by_commanded_slot`` splits each condition by the slot the commanded object started in (envs
    with slots: tabletop, 0 nearest the robot, where every correlated layout puts it).
    Episode ``e`` commands ``instructions[e % n]`` on the layout of the suite's tasks other than
    it, in turn. ``env``: reuse an env of ``env_id`` (the caller closes it)."""
    if env_id not in CONFLICT_ENVS:
        raise InvalidOptionError(f"layout_conflict_eval needs a suite whose reset takes layout_task_id "
                                 f"({', '.join(CONFLICT_ENVS)}); got {env_id!r}")
    episodes = _check_positive("episodes", episodes)
    own = env is None
    env = envs.make(env_id) if own else env
    try:
        _prepare(policy, env)
        suite = env.suite
        instrs = list(instructions or suite.instructions)
        if hasattr(policy, "lang"):
            check_vocabulary(policy, instrs, suite, what=f"the {suite.name} suite")
        n = len(instrs)
        keys = ("conflict", "in_distribution", "random")
        per_episode = []
        t0 = time.time()
        for e in tqdm(range(episodes), desc="layout conflict", disable=not progress, unit="ep"):
            task = suite.task(instrs[e % n])
            others = [t.task_id for t in suite.tasks if t.task_id != task.task_id]
            layout_task = others[(e // n) % len(others)]
            same = _primary(task) == _primary(suite.tasks[layout_task])  # the scene puts the commanded object first
            row = {"instruction": instrs[e % n], "layout_task": suite.tasks[layout_task].instruction,
                   "same_object": same}
            for k, lt in zip(keys, (layout_task, task.task_id, None)):
                opts = {"instruction": instrs[e % n], "layout": "random"} if lt is None else {
                    "instruction": instrs[e % n], "layout": "correlated", "layout_task_id": lt}
                track = _FirstApproach(env, policy.select_action)
                out = rollout(policy, env, seed + e, options=opts, act=track)
                did_layout = k == "conflict" and not out["success"] and lt in out["completed_ever"]
                went = ("none" if track.first is None else "commanded" if track.first == _primary(task)
                        else "layout's" if k == "conflict" and track.first == _primary(suite.tasks[lt]) else "another")
                row[k] = {"success": bool(out["success"]), "did_layout_task": did_layout,
                          "did_other_task": out["other_task"] and not did_layout, "completed": out["completed_ever"],
                          "approached_first": went, "commanded_slot": _slot_of(env, _primary(task))}
            per_episode.append(row)
    finally:
        if own:
            env.close()
    res: dict[str, Any] = {"protocol": "layout_conflict", "env_id": env_id, "episodes": episodes, "seed": seed,
                           "seconds": time.time() - t0, "per_episode": per_episode}
    for k in keys:
        succ, layout, other = (sum(r[k][f] for r in per_episode) for f in ("success", "did_layout_task", "did_other_task"))
        res[k] = {"success_rate": succ / episodes, "ci95": list(wilson(succ, episodes)),
                  "did_layout_task_rate": layout / episodes, "did_layout_task_ci95": list(wilson(layout, episodes)),
                  "did_other_task_rate": other / episodes, "episodes": episodes}
        for name, rows in (("approached_first", per_episode),
                           ("failures_approached_first", [r for r in per_episode if not r[k]["success"]])):
            res[k][name] = {w: sum(r[k]["approached_first"] == w for r in rows) for w in APPROACHED}
        slots = sorted({r[k]["commanded_slot"] for r in per_episode} - {None})
        res[k]["by_commanded_slot"] = {str(sl): {
            "successes": sum(r[k]["success"] for r in per_episode if r[k]["commanded_slot"] == sl),
            "went_for_commanded_first": sum(r[k]["approached_first"] == "commanded"
                                            for r in per_episode if r[k]["commanded_slot"] == sl),
            "episodes": sum(r[k]["commanded_slot"] == sl for r in per_episode)} for sl in slots}
    by = res["conflict"]["by_layout_object"] = {}
    for name, flag in (("commanded object", True), ("another object", False)):
        rows = [r for r in per_episode if r["same_object"] == flag]
        by[name] = {"successes": sum(r["conflict"]["success"] for r in rows), "episodes": len(rows)}
    return res


# ===================================================================================== #
# Perturbations
# ===================================================================================== #
def perturbation_eval(policy: Any, env_id: str, families: Iterable[str] | None = None, episodes: int = 20,
                      seed: int = 1000, env_options: dict | None = None, env: Any = None,
                      params: dict[str, dict[str, Any]] | None = None, perturbation_seed: int = 0,
                      clean: bool = True, progress: bool = False,
                      instructions: list[str] | None = None) -> dict[str, Any]:
    """Success under each perturbation family (default: all) on the same seeds as the clean run.

    ``params`` maps a family to its wrapper options (``{"camera": {"magnitude": 0.1}}``). A
    family that cannot act on the env is reported as ``{"skipped": True, "reason": ...}``.
    """
    fams = list(FAMILIES if families is None else families)
    for family in fams:
        check_family(family)
    params = dict(params or {})
    bad = sorted(set(params) - set(fams))
    if bad:
        raise InvalidOptionError(f"params given for family(ies) {bad} that are not evaluated; evaluated: {fams}")
    if isinstance(episodes, bool) or not isinstance(episodes, (int, np.integer)) or episodes <= 0:
        raise InvalidOptionError(f"episodes must be a positive int, got {episodes!r}")
    own = env is None
    env = _make(policy, env_id, env_options) if own else env
    out: dict[str, Any] = {"protocol": "perturbation", "env_id": env_id, "episodes": int(episodes), "seed": seed,
                           "perturbation_seed": perturbation_seed, "families": {}}
    t0 = time.time()
    try:
        if clean:
            tracked = _Tracked(env)
            _prepare(policy, tracked)
            out["clean"] = evaluate(policy, env_id, int(episodes), seed, env=tracked, progress=progress,
                                    instructions=instructions).to_dict()
        for fam in fams:
            reason = not_applicable(env, fam)
            if reason:
                out["families"][fam] = {"skipped": True, "reason": reason}
                continue
            wrapped = perturb(env, fam, seed=perturbation_seed, **params.get(fam, {}))
            try:
                tracked = _Tracked(wrapped)
                _prepare(policy, tracked)
                result = evaluate(policy, env_id, int(episodes), seed, env=tracked, progress=progress,
                                  instructions=instructions).to_dict()
            finally:
                wrapped.restore()
            result["perturbation"] = wrapped.describe()
            if clean:
                result["delta_vs_clean"] = result["success_rate"] - out["clean"]["success_rate"]
            out["families"][fam] = {"skipped": False, **result}
    finally:
        if own:
            env.close()
    out["seconds"] = time.time() - t0
    return out


# ===================================================================================== #
# Mid-episode instruction switch
# ===================================================================================== #
@dataclass
class SwitchCase:
    """One switch episode: reset with ``seed`` under ``old``; from step ``switch_after`` on, every
    observation carries ``new`` instead."""

    seed: int
    old: str
    new: str
    switch_after: int
    expert_success: bool | None = None
    """the reference expert (following the current instruction) completed ``new`` (None: not run)"""
    expert_steps: int | None = None
    """steps the expert's episode took (to ``new`` done, or the step limit)"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _objects(task: Any) -> set[str]:
    """The objects a task touches: tabletop ``cube`` (+ ``base`` for a stack), kitchen ``object``."""
    return {str(task.args[k]) for k in ("cube", "base", "object") if k in task.args}


def _primary(task: Any) -> str | None:
    args = task.args
    return str(args.get("cube", args.get("object"))) if ("cube" in args or "object" in args) else None


def switch_targets(suite: Any, old: str | int, pool: Iterable[str] | None = None) -> list[str]:
    """Instructions of ``pool`` (default: the suite's) worth switching to from ``old``: tasks that
    touch none of ``old``'s objects (tabletop: another cube, and for stacks neither cube of the
    pair; kitchen: another object), so the new task is still feasible wherever ``old`` got to and
    doing ``old`` is no progress on it. Falls back to tasks with another main object, then to any
    other task."""
    old_task = suite.task(old)
    cands = [suite.task(p) for p in (suite.instructions if pool is None else pool)]
    cands = [t for t in cands if t.task_id != old_task.task_id]
    for keep in (lambda t: not (_objects(t) & _objects(old_task)), lambda t: _primary(t) != _primary(old_task),
                 lambda t: True):
        tier = [t.instruction for t in cands if keep(t)]
        if tier:
            return tier
    raise InstructionError(f"no instruction to switch to from {old_task.instruction!r} in {list(pool or [])}")


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise InvalidOptionError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _suite_of(env: Any, env_id: str, what: str) -> Any:
    suite = getattr(env, "suite", None)
    if suite is None:
        raise InvalidOptionError(f"{env_id}: the {what} protocol needs a multi-instruction suite env; "
                                 f"suites: {envs.list_envs(kind='suite')}")
    return suite


def _switch_rollout(policy: Any, env: Any, case: SwitchCase, replan: bool = True) -> dict[str, Any]:
    """One switch episode on a ``_Tracked`` env. Runs until ``new`` is done or the step limit; the
    env's own termination (its commanded task, ``old``, done) does not end it."""
    suite = env.suite
    old_id, new_id = suite.task(case.old).task_id, suite.task(case.new).task_id
    obs, info = env.reset(seed=case.seed, options={"instruction": case.old})
    policy.reset()
    out = {"success": False, "old_completed": False, "other_task": False, "new_before_switch": False, "steps": 0,
           "held_at_switch": None, "other_tasks": [], "reach": None}
    objs = [suite.task(x).args.get("object_index") for x in (case.old, case.new)]
    reach: list[list[float]] = []  # gripper distance to [old, new] object per step from the switch on
    for step in range(env.max_episode_steps):
        if step >= case.switch_after and "eef_distance" in info and None not in objs and objs[0] != objs[1]:
            reach.append([float(info["eef_distance"][o]) for o in objs])
        if step == case.switch_after:
            held = info.get("grasped")  # what the gripper holds when the command changes (None: not reported)
            out["held_at_switch"] = None if held is None else bool(np.asarray(held).any())
            if replan:
                policy.reset()  # drop queued actions: the new command is acted on from this step
        if step >= case.switch_after:
            obs = {**obs, "instruction": case.new}
        obs, _, _, trunc, info = env.step(policy.select_action(obs))
        out["steps"] = step + 1
        done = info.get("completed_tasks")
        if done is not None:
            done = np.asarray(done, bool)
            out["old_completed"] |= bool(done[old_id])
            others = [i for i in np.flatnonzero(done) if i not in (old_id, new_id)]
            out["other_task"] |= bool(others)
            out["other_tasks"] = sorted(set(out["other_tasks"]) | {suite.tasks[i].instruction for i in others})
            if done[new_id]:
                if step + 1 <= case.switch_after:
                    out["new_before_switch"] = True  # done before it was asked for: never a success
                elif not out["new_before_switch"]:
                    out["success"] = True
                    break
        if trunc:
            break
    if reach:
        r = np.array(reach)
        k = min(REACH_STEPS, len(r) - 1)
        out["reach"] = {"at_switch": r[0].tolist(), f"after_{REACH_STEPS}": r[k].tolist(), "end": r[-1].tolist(),
                        "went_to_old": bool(r[k, 0] < REACH_NEAR),
                        "toward_new": bool(r[k, 1] < r[0, 1] - REACH_TOWARD)}
    return out


REACH_STEPS, REACH_NEAR, REACH_TOWARD = 20, 0.035, 0.02
"""switch rollouts on envs that report ``eef_distance`` (the kitchen): REACH_STEPS steps after the
switch the gripper is within REACH_NEAR m of the old task's object ("went to old": it kept at the old
task), and REACH_TOWARD m closer to the new task's object than at the switch ("toward new")"""


def switch_cases(env_id: str, episodes: int = 24, seed: int = 3000, instructions: list[str] | None = None,
                 switch_after: int | None = None, switch_fraction: float = 1 / 3, check_expert: bool = True,
                 env_options: dict | None = None, env: Any = None, progress: bool = False) -> list[SwitchCase]:
    """The episodes of the switch protocol, with the reference expert's result on each.

    Case ``i`` resets with ``seed + i`` under instruction ``i mod K`` of ``instructions`` (default:
    the suite's) and switches to a target drawn (seeded by ``seed + i``) from
    :func:`switch_targets` within the same instructions. ``switch_after`` (steps) defaults to
    ``switch_fraction`` of the expert's mean episode length under the old instruction over these
    cases (measured by running the expert). ``check_expert`` rolls :class:`ExpertPolicy`
    (following the current instruction) through every case: :func:`switch_eval` counts only
    the switches it solves. Compute the cases once and pass them to every policy's evaluation.
    """
    episodes = _check_positive("episodes", episodes)
    if not 0 < switch_fraction < 1:
        raise InvalidOptionError(f"switch_fraction must be in (0, 1), got {switch_fraction!r}")
    if switch_after is not None:
        switch_after = _check_positive("switch_after", switch_after)
    own = env is None
    env = envs.make(env_id, **(env_options or {})) if own else env
    try:
        suite = _suite_of(env, env_id, "switch")
        instrs = [suite.task(l).instruction for l in (instructions or suite.instructions)]
        if len(set(instrs)) < 2:
            raise InstructionError(f"the switch protocol needs >= 2 instructions, got {instrs}")
        tracked = _Tracked(env)
        plan: list[tuple[int, str, str]] = []
        for case_index in range(episodes):
            old = instrs[case_index % len(instrs)]
            targets = switch_targets(suite, old, instrs)
            plan.append((seed + case_index, old,
                         targets[int(np.random.default_rng(seed + case_index).integers(len(targets)))]))
        after: dict[str, int] = {}
        if switch_after is None:  # a fraction of the expert's own episode under the old instruction
            lengths: dict[str, list[int]] = {}
            expert = ExpertPolicy()
            _prepare(expert, tracked)
            for case_seed, old, _ in tqdm(plan, desc="switch: expert lengths", disable=not progress, unit="ep"):
                steps = _expert_steps(expert, tracked, case_seed, old)
                if steps is not None:
                    lengths.setdefault(old, []).append(steps)
            every = [n for v in lengths.values() for n in v]
            if not every:
                raise InvalidOptionError(f"{env_id}: the expert solved none of the old instructions; pass switch_after")
            for old in instrs:
                mean = float(np.mean(lengths.get(old) or every))
                after[old] = max(1, int(round(switch_fraction * mean)))
        cases = [SwitchCase(s, old, new, switch_after or after[old]) for s, old, new in plan]
        if check_expert:
            expert = ExpertPolicy()
            _prepare(expert, tracked)
            for case in tqdm(cases, desc="switch: expert check", disable=not progress, unit="ep"):
                result = _switch_rollout(expert, tracked, case)
                case.expert_success, case.expert_steps = bool(result["success"]), int(result["steps"])
    finally:
        if own:
            env.close()
    return cases


def _expert_steps(expert: ExpertPolicy, env: Any, seed: int, instruction: str) -> int | None:
    """Steps the expert needs for ``instruction`` from ``seed`` (None: not done within the limit)."""
    obs, _ = env.reset(seed=seed, options={"instruction": instruction})
    expert.reset()
    for step in range(env.max_episode_steps):
        obs, _, term, trunc, info = env.step(expert.select_action(obs))
        if info["success"]:
            return step + 1
        if term or trunc:
            break
    return None


def switch_eval(policy: Any, env_id: str, episodes: int = 24, seed: int = 3000, switch_after: int | None = None,
                switch_fraction: float = 1 / 3, instructions: list[str] | None = None,
                cases: list[SwitchCase] | None = None, skip_expert_failures: bool = True,
                replan_at_switch: bool = True, env_options: dict | None = None, env: Any = None,
                progress: bool = False) -> dict[str, Any]:
    """Mid-episode instruction switch: start under ``l``, from ``switch_after`` steps on command
    ``l'`` (a task on other objects, see :func:`switch_targets`); success = ``l'`` completed
    before the episode ends (the step limit; ``l'`` done before the switch does not count).

    ``cases`` (from :func:`switch_cases`) fix the episodes; without them they are made here from
    ``episodes``/``seed``/``switch_after``/``switch_fraction``/``instructions``. With
    ``skip_expert_failures`` the rates are over the cases the reference expert solves (the
    switches a policy can be blamed for); ``expert_success_rate`` says how many that is.
    ``replan_at_switch`` calls ``policy.reset()`` at the switch (queued actions of a chunk are
    dropped, as a robot given a new command would); False lets the queued chunk run out first.
    Also reported: how often the OLD task was completed (the policy kept doing what it was first
    told), how often some third task was, per-case results (with what the gripper held at the switch
    and the old task's family).
    """
    own = env is None
    env = _make(policy, env_id, env_options) if own else env
    try:
        suite = _suite_of(env, env_id, "switch")
        if cases is None:
            cases = switch_cases(env_id, episodes, seed, instructions, switch_after, switch_fraction,
                                 check_expert=skip_expert_failures, env=env, progress=progress)
        if not cases:
            raise InvalidOptionError("switch_eval needs at least one case")
        if skip_expert_failures and any(c.expert_success is None for c in cases):
            raise InvalidOptionError("skip_expert_failures needs cases with the expert's result "
                                     "(switch_cases(..., check_expert=True))")
        if hasattr(policy, "lang"):
            check_vocabulary(policy, sorted({l for c in cases for l in (c.old, c.new)}), suite,
                             what=f"the {suite.name} switch cases")
        tracked = _Tracked(env)
        _prepare(policy, tracked)
        t0 = time.time()
        per_case = []
        for case in tqdm(cases, desc=f"switch {env_id}", disable=not progress, unit="ep"):
            counted = not skip_expert_failures or bool(case.expert_success)
            result = _switch_rollout(policy, tracked, case, replan=replan_at_switch) if counted else None
            per_case.append({**case.to_dict(), "old_family": suite.task(case.old).family, "counted": counted,
                             **(result or {})})
    finally:
        if own:
            env.close()
    run = [p for p in per_case if p["counted"]]
    n_counted = len(run)
    successes = sum(p["success"] for p in run)
    old_k = sum(p["old_completed"] for p in run)
    other_k = sum(p["other_task"] for p in run)
    checked = [c for c in cases if c.expert_success is not None]
    ex_k = sum(bool(c.expert_success) for c in checked)
    return {
        "protocol": "instruction_switch", "env_id": env_id, "cases": len(cases), "episodes": n_counted,
        "skipped_expert_failures": len(cases) - n_counted, "successes": successes,
        "switch_success_rate": successes / n_counted if n_counted else 0.0,
        "ci95": list(wilson(successes, n_counted)),
        "old_task_completed_rate": old_k / n_counted if n_counted else 0.0,
        "old_task_ci95": list(wilson(old_k, n_counted)),
        "did_other_task_rate": other_k / n_counted if n_counted else 0.0,
        "did_other_task_ci95": list(wilson(other_k, n_counted)),
        "expert_success_rate": ex_k / len(checked) if checked else None,
        "expert_ci95": list(wilson(ex_k, len(checked))) if checked else None,
        "mean_switch_after": float(np.mean([c.switch_after for c in cases])),
        "replan_at_switch": replan_at_switch, "per_case": per_case, "seconds": time.time() - t0,
    }


# ===================================================================================== #
# Unseen paraphrases
# ===================================================================================== #
class ResolvingPolicy:
    """``policy`` with each observation's instruction resolved as ``groundflow eval``/``serve``/``deploy``
    resolve it (``policies.model.resolve_instruction``): a wording the resolver maps is acted on as its
    trained instruction; an episode whose wording it refuses is held still (a zero action: the
    suites' end-effector delta controllers stay put) and counted in ``refused_episodes`` (a refusal
    is a failed episode: the user's robot would not have moved), or with ``allow_unknown`` acted on
    with the wording as is (encoded on demand; still counted)."""

    def __init__(self, policy: Any, allow_unknown: bool = False):
        self.policy = policy
        self.allow_unknown = allow_unknown
        self.refused_episodes = 0
        self.refused: dict[str, str] = {}
        """refused wording -> the resolver's reason"""
        self.resolved: dict[str, str] = {}
        """wording -> the trained instruction it was acted on as"""
        self._counted = False
        self._seen: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def reset(self) -> None:
        self._counted = False
        self.policy.reset()

    def select_action(self, obs: dict[str, Any]) -> np.ndarray:
        from policies.instructions import UnknownInstructionError
        from policies.model import resolve_instruction
        text = obs.get("instruction")
        if text not in self.refused and text not in self._seen:  # resolved once per wording, not per step
            try:
                self._seen[text] = resolve_instruction(self.policy, text)
            except UnknownInstructionError as e:
                self.refused[text] = e.reason
                if self.allow_unknown:
                    self._seen[text] = text
        if text in self.refused:
            if not self._counted:
                self.refused_episodes += 1
                self._counted = True
            if not self.allow_unknown:
                return np.zeros(self.policy.config.action_dim, np.float32)
        trained = self._seen[text]
        if trained != text:
            self.resolved[text] = trained
        return self.policy.select_action({**obs, "instruction": trained})


def paraphrase_eval(policy: Any, env_id: str, episodes: int = 24, seed: int = 4000,
                    instructions: list[str] | None = None, env_options: dict | None = None, env: Any = None,
                    clean: bool = True, perturbation_seed: int = 0, progress: bool = False,
                    resolve: bool = False, allow_unknown: bool = False) -> dict[str, Any]:
    """Success when every episode's task is commanded with one of the suite's held-out paraphrases
    (the ``paraphrase`` family of :func:`perturbation_eval` at probability 1), next to the clean
    success on the same seeds and instruction cycle.

    Demonstrations (``collect``, ``relabel``) carry canonical instructions only, so the
    paraphrases are unseen in training; a checkpoint encodes them with its (frozen) language
    encoder on demand. ``paraphrases_in_vocabulary`` lists any the checkpoint already carries
    (then this is not an unseen-paraphrase test for those). ``resolve``: each wording goes through
    the checkpoint's instruction resolver first, as eval/serve/deploy do (``ResolvingPolicy``): a
    resolved paraphrase is acted on as its trained instruction, a refused one holds still and fails,
    or with ``allow_unknown`` runs as is (``refused_episodes``, ``refused``, ``resolved`` report what
    happened).
    """
    own = env is None
    env = _make(policy, env_id, env_options) if own else env
    acting = ResolvingPolicy(policy, allow_unknown) if resolve else policy
    try:
        suite = _suite_of(env, env_id, "paraphrase")
        instrs = [suite.task(l).instruction for l in (instructions or suite.instructions)]
        paras = {p for l in instrs for p in suite.task(l).paraphrases}
        known = sorted(paras & set(getattr(getattr(policy, "lang", None), "cache", {}) or {}))
        result = perturbation_eval(acting, env_id, ["paraphrase"], episodes, seed, env=env,
                                   params={"paraphrase": {"magnitude": 1.0}}, perturbation_seed=perturbation_seed,
                                   clean=clean, progress=progress, instructions=instrs)
    finally:
        if own:
            env.close()
    fam = result["families"]["paraphrase"]
    out = {"protocol": "paraphrase", "env_id": env_id, "episodes": fam["episodes"], "seed": seed,
           "successes": fam["successes"], "success_rate": fam["success_rate"], "ci95": fam["ci95"],
           "did_other_task_rate": fam["did_other_task_rate"], "per_instruction": fam["per_instruction"],
           "paraphrases_in_vocabulary": known, "seconds": result["seconds"], "resolve": bool(resolve),
           "allow_unknown": bool(resolve and allow_unknown)}
    if resolve:
        out.update(refused_episodes=acting.refused_episodes, refused=dict(sorted(acting.refused.items())),
                   resolved=dict(sorted(acting.resolved.items())))
    if clean:
        out["clean"] = {k: result["clean"][k] for k in ("episodes", "successes", "success_rate", "ci95",
                                                         "did_other_task_rate")}
        out["delta_vs_clean"] = fam["delta_vs_clean"]
    return out
