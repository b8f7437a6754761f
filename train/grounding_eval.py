"""The grounding protocols in one call: does a policy do what it is told where only the
instruction says what to do?

    from train.grounding_eval import evaluate_protocols
    res = evaluate_protocols("runs/tt/ckpt", "tabletop", episodes=24, swap_seeds=4)
    res["summary"]   # {"p1_success": {"rate", "ci95", "n"}, "p3_swap": ..., "p4_switch": ..., "p5_paraphrase": ...}

Every protocol runs on the random layout (the scene does not name the task), whatever layout the
policy was trained on:

- **P1** random layouts, every instruction in turn: success, and "did another task" (completed
  some other task of the suite instead: the policy did something competent, just not what it
  was told).
- **P3** instruction swap (:func:`train.protocols.swap_eval`): each seed's one initial state under
  every instruction.
- **P4** mid-episode switch (:func:`train.protocols.switch_eval`): the instruction changes to a
  task on other objects after a third of the expert's episode; only switches the expert solves
  count. Pass ``switch_cases`` (from :func:`train.protocols.switch_cases`) to reuse the expert's
  pass across policies.
- **P5** unseen paraphrases (:func:`train.protocols.paraphrase_eval`).

(P2, the shortcut data where the layout names the task with probability rho, is a training-data
condition: ``groundflow collect --layout correlated --layout-rho 0.9``.) Rates come with 95%
Wilson intervals; seeds of the protocols are disjoint (``seed``, ``+1000``, ``+2000``, ``+3000``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable

import envs
import policies
from envs.errors import InvalidOptionError
from envs.metrics import wilson
from train.evaluate import evaluate
from train.protocols import (ExpertPolicy, SwitchCase, _make, _prepare, _Tracked, paraphrase_eval, swap_eval,
                             switch_eval)

PROTOCOLS = ("p1", "p3", "p4", "p5")


def _policy(policy_or_ckpt: Any) -> Any:
    if isinstance(policy_or_ckpt, (str, os.PathLike)):
        return policies.load(Path(policy_or_ckpt))
    return policy_or_ckpt


def _rate(k: int, n: int) -> dict[str, Any]:
    return {"rate": k / n if n else 0.0, "ci95": list(wilson(k, n)), "n": n}


def evaluate_protocols(policy_or_ckpt: Any, suite: str, episodes: int = 24, seed: int = 5000, swap_seeds: int = 4,
                       switch_episodes: int | None = None, paraphrase_episodes: int | None = None,
                       instructions: list[str] | None = None, protocols: Iterable[str] = PROTOCOLS,
                       switch_cases: list[SwitchCase] | None = None, env_options: dict | None = None,
                       env: Any = None, progress: bool = False) -> dict[str, Any]:
    """Run P1 / P3 / P4 / P5 (any subset, ``protocols``) for a policy (or a checkpoint path) on a
    suite (``tabletop``, ``kitchen`` or its env id).

    ``episodes``: P1 episodes (instructions cycled), also the default for P4 and P5;
    ``swap_seeds``: P3 initial states (each under every instruction); ``instructions``: restrict
    every protocol to these (e.g. the ones the policy was trained on). ``env``: reuse an env
    (random layout). Returns each protocol's full result and ``summary``: rate, 95% CI and n per
    headline number.
    """
    policy = _policy(policy_or_ckpt)
    env_id = envs.suite_env_id(suite)
    todo = list(protocols)
    bad = sorted(set(todo) - set(PROTOCOLS))
    if bad or not todo:
        raise InvalidOptionError(f"unknown protocol(s) {bad or todo}; valid: {list(PROTOCOLS)}")
    opts = dict(env_options or {})
    if opts.get("layout", "random") != "random" or "layout_rho" in opts:
        raise InvalidOptionError("the grounding protocols run on the random layout (where the scene does not "
                                 f"name the task); remove layout options from env_options: {opts}")
    own = env is None
    env = _make(policy, env_id, opts) if own else env
    if getattr(env, "suite", None) is None:
        raise InvalidOptionError(f"{env_id} is not a multi-instruction suite")
    raw_layout = getattr(env, "layout", None) or getattr(getattr(env, "raw", None), "layout", None)
    if raw_layout not in (None, "random"):
        raise InvalidOptionError(f"the env given has layout={raw_layout!r}; the grounding protocols need 'random'")
    instrs = [env.suite.task(l).instruction for l in (instructions or env.suite.instructions)]
    out: dict[str, Any] = {"env_id": env_id, "suite": env.suite.name, "instructions": instrs, "seed": seed}
    summary: dict[str, Any] = {}
    t0 = time.time()
    try:
        if "p1" in todo:
            tracked = _Tracked(env)
            _prepare(policy, tracked)
            eval_result = evaluate(policy, env_id, episodes, seed, env=tracked, instructions=instrs, progress=progress)
            row = eval_result.to_dict()
            row["did_other_task_ci95"] = list(wilson(eval_result.other_task, eval_result.episodes))
            out["p1_random_layout"] = row
            summary["p1_success"] = _rate(eval_result.successes, eval_result.episodes)
            summary["p1_did_other_task"] = _rate(eval_result.other_task, eval_result.episodes)
        if "p3" in todo:
            swap = swap_eval(policy, env_id, list(range(seed + 1000, seed + 1000 + swap_seeds)), instructions=instrs,
                             env=env, progress=progress)
            out["p3_swap"] = swap
            summary["p3_swap"] = _rate(swap["successes"], swap["episodes"])
            summary["p3_did_other_task"] = {"rate": swap["did_other_task_rate"], "ci95": swap["did_other_task_ci95"],
                                            "n": swap["episodes"]}
        if "p4" in todo:
            switch = switch_eval(policy, env_id, switch_episodes or episodes, seed + 2000, instructions=instrs,
                                 cases=switch_cases, env=env, progress=progress)
            out["p4_switch"] = switch
            summary["p4_switch"] = _rate(switch["successes"], switch["episodes"])
            summary["p4_old_task_completed"] = {"rate": switch["old_task_completed_rate"],
                                                "ci95": switch["old_task_ci95"], "n": switch["episodes"]}
            summary["p4_expert"] = {"rate": switch["expert_success_rate"], "ci95": switch["expert_ci95"],
                                    "n": switch["cases"]}
        if "p5" in todo:
            paraphrase = paraphrase_eval(policy, env_id, paraphrase_episodes or episodes, seed + 3000,
                                         instructions=instrs, env=env, progress=progress)
            out["p5_paraphrase"] = paraphrase
            summary["p5_paraphrase"] = _rate(paraphrase["successes"], paraphrase["episodes"])
            if "clean" in paraphrase:
                summary["p5_clean"] = _rate(paraphrase["clean"]["successes"], paraphrase["clean"]["episodes"])
    finally:
        if own:
            env.close()
    out["summary"] = summary
    out["seconds"] = time.time() - t0
    return out


def expert_reference(suite: str, **kwargs: Any) -> dict[str, Any]:
    """:func:`evaluate_protocols` for the suite's privileged expert (the ceiling of every number)."""
    return evaluate_protocols(ExpertPolicy(), suite, **kwargs)
