"""#43: a user's own wording of a trained task runs as that task; an instruction the checkpoint cannot
ground is refused before it reaches the policy (eval up front, serve with a typed error, deploy
with no motion and exit status 3); ``--allow-unknown`` overrides. A tiny untrained tabletop policy
whose instruction features are fixed tensors (no language model)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_flow_policy
from deploy.serving.client import LocalPolicy, PolicyClient
from deploy.errors import EXIT_INSTRUCTION_REFUSED, InstructionRefusedError
from deploy.serving.server import PolicyServer
from groundflow.cli import main

torch = pytest.importorskip("torch")

ENV = "maniskill/TabletopSuite-v1"
TRAINED = [f"push the {c} cube to the {s} goal" for c in ("red", "green", "blue") for s in ("left", "right")]
PARAPHRASE = "nudge the red block over to the left target please"  # -> TRAINED[0]
REFUSED = "push the purple cube to the left goal"  # a colour the suite grounds, not one it was trained on


def _tiny_policy():
    model, layout = tiny_flow_policy(ENV)
    cfg = model.config
    for i, t in enumerate(TRAINED):  # distinct fixed features: a swapped instruction gives another chunk
        model.lang.cache[t] = torch.randn(1, cfg.lang_dim, generator=torch.Generator().manual_seed(i))
    with torch.no_grad():  # chunks that depend on the instruction
        model.action_out.weight.normal_(0, 0.05)
    inputs = {"cameras": [], "state": [name for name, _ in layout], "estimated": [], "reads_object_state": True}
    return model, {"env_id": ENV, "inputs": inputs}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(a checkpoint saved as ``groundflow train`` saves it, with the resolver's calibration; one saved
    before the calibration was stored)."""
    from train.bc import _resolver_extra
    model, extra = _tiny_policy()
    root = tmp_path_factory.mktemp("ckpt")
    model.save(root / "new", extra={**extra, **_resolver_extra(model)})
    model.save(root / "old", extra=extra)
    return root / "new", root / "old"


class Spy:
    """Records the instruction of every observation that reaches the policy."""

    def __init__(self, policy):
        self.seen: list[str] = []
        inner = policy.predict_action_chunk

        def predict(obs, **kw):
            self.seen.append(obs["instruction"])
            return inner(obs, **kw)

        policy.predict_action_chunk = predict


def _obs(policy, instruction: str) -> dict:
    rng = np.random.default_rng(3)
    return {"state": rng.normal(size=policy.config.state_dim).astype(np.float32), "instruction": instruction}


# ---- the calibration in the checkpoint ------------------------------------------------------------

def test_checkpoint_stores_the_calibration_and_an_older_one_gets_the_same_at_load(ckpts):
    import policies
    from policies.model import RESOLVER_KEY, instruction_resolver
    new, old = ckpts
    assert RESOLVER_KEY in policies.read_checkpoint_meta(new)["extra"]
    assert RESOLVER_KEY not in policies.read_checkpoint_meta(old)["extra"]
    stored = instruction_resolver(policies.load(new))
    fitted = [instruction_resolver(policies.load(old)).to_json() for _ in range(2)]
    assert fitted[0] == fitted[1] == stored.to_json()  # deterministic, and what training stored
    assert sorted(stored.instructions) == sorted(TRAINED)


def test_resolve_instruction_passes_maps_refuses_or_allows(ckpts):
    import policies
    from policies.instructions import UnknownInstructionError
    from policies.model import NULL_INSTRUCTION, resolve_instruction
    policy = policies.load(ckpts[0])
    assert resolve_instruction(policy, TRAINED[3]) == TRAINED[3]
    assert resolve_instruction(policy, NULL_INSTRUCTION) == NULL_INSTRUCTION
    assert resolve_instruction(policy, PARAPHRASE) == TRAINED[0]
    with pytest.raises(UnknownInstructionError, match="purple") as e:
        resolve_instruction(policy, REFUSED)
    assert "purple" in e.value.reason and e.value.trained == sorted(TRAINED)
    assert len(str(e.value).splitlines()) == 1
    assert resolve_instruction(policy, REFUSED, allow_unknown=True) == REFUSED
    # an encoded paraphrase (a paraphrase evaluation, --paraphrases) never becomes "trained"
    policy.lang.cache[REFUSED] = torch.zeros(1, policy.config.lang_dim)
    with pytest.raises(UnknownInstructionError):
        resolve_instruction(policy, REFUSED)


# ---- groundflow eval ------------------------------------------------------------------------------

def test_eval_refuses_an_ungroundable_instruction_before_any_episode(ckpts, monkeypatch, capsys):
    import train.evaluate as ev
    runs: list = []

    def fake_evaluate(policy, env_id, episodes, seed, opts, instructions=None, **kw):
        runs.append(instructions)
        return ev.EvalResult(env_id, 1, 1)

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    monkeypatch.setattr(ev.envs, "make", lambda *a, **k: pytest.fail("an env was made for a refused instruction"))
    out = ckpts[0].parent / "eval.json"
    base = ["eval", "--ckpt", str(ckpts[0]), "--episodes", "1", "--out", str(out)]
    assert main([*base, "--instruction", REFUSED]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "purple" in err[0] and "--allow-unknown" in err[0]
    assert runs == [] and not out.exists()
    # a paraphrase runs as its trained instruction; --allow-unknown runs the refused one as is
    assert main([*base, "--instruction", PARAPHRASE]) == 0
    assert main([*base, "--instruction", REFUSED, "--allow-unknown"]) == 0
    assert runs == [[TRAINED[0]], [REFUSED]]


# ---- groundflow serve -----------------------------------------------------------------------------

def test_server_refuses_with_a_typed_error_keeps_serving_and_serves_a_paraphrase_as_trained(ckpts):
    import policies
    policy = policies.load(ckpts[0])
    spy = Spy(policy)
    with PolicyServer(policy, port=0) as srv, PolicyClient(port=srv.port) as c:
        with pytest.raises(InstructionRefusedError, match="unknown_instruction") as e:
            c.infer(_obs(policy, REFUSED))
        assert e.value.code == "unknown_instruction" and "purple" in e.value.reason
        with pytest.raises(InstructionRefusedError):
            c.resolve_instruction(REFUSED)
        assert spy.seen == []  # never reached the policy
        assert c.resolve_instruction(PARAPHRASE) == TRAINED[0]
        para = c.infer(_obs(policy, PARAPHRASE), seed=11).actions  # the same connection still serves
        trained = c.infer(_obs(policy, TRAINED[0]), seed=11).actions
        other = c.infer(_obs(policy, TRAINED[1]), seed=11).actions
        assert srv.stats["requests"] == 3 and srv.stats["errors"] == 2
    np.testing.assert_array_equal(para, trained)
    assert not np.allclose(para, other)  # the instruction matters to this policy
    assert spy.seen == [TRAINED[0], TRAINED[0], TRAINED[1]]
    # in process (LocalPolicy, the same inference path): the same chunk, the same refusal
    from policies.instructions import UnknownInstructionError
    local = LocalPolicy(policies.load(ckpts[1]))
    np.testing.assert_allclose(local.infer(_obs(policy, PARAPHRASE), seed=11).actions, trained, atol=1e-6)
    with pytest.raises(UnknownInstructionError):
        local.infer(_obs(policy, REFUSED))


def test_serve_allow_unknown_keeps_the_old_behaviour(ckpts):
    import policies
    policy = policies.load(ckpts[0])
    with PolicyServer(policy, port=0, allow_unknown=True) as srv, PolicyClient(port=srv.port) as c:
        # not resolved, so it is "not trained on" it, and without --paraphrases it is not encoded either
        with pytest.raises(InstructionRefusedError, match="serve with --paraphrases"):
            c.infer(_obs(policy, REFUSED))
        assert c.infer(_obs(policy, PARAPHRASE)).actions.shape[1] == policy.config.action_dim


# ---- groundflow deploy ----------------------------------------------------------------------------

def test_deploy_refusal_sends_no_motion_and_exits_3(ckpts, monkeypatch, capsys):
    import policies
    from deploy.robots.sim import SimRobot
    sent: list = []
    monkeypatch.setattr(SimRobot, "send_action", lambda self, a: sent.append(a))
    policy = policies.load(ckpts[0])
    spy = Spy(policy)
    with PolicyServer(policy, port=0) as srv:
        with pytest.raises(SystemExit) as e:
            main(["deploy", "--robot", "sim", "--env", ENV, "--server", srv.address, "--lockstep", "--episodes", "1",
                  "--max-steps", "3", "--instruction", REFUSED, "--no-status"])
        assert e.value.code == EXIT_INSTRUCTION_REFUSED == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert "instruction refused, no motion sent" in err[-1] and "purple" in err[-1]
        assert sent == [] and spy.seen == [] and srv.stats["requests"] == 0
        # a wording it grounds runs, as its trained instruction (the suite is commanded that task)
        assert main(["deploy", "--robot", "sim", "--env", ENV, "--server", srv.address, "--lockstep",
                     "--episodes", "1", "--max-steps", "2", "--instruction", PARAPHRASE, "--no-status"]) == 0
    assert len(sent) == 2 and set(spy.seen) == {TRAINED[0]}
    assert f"-> trained instruction {TRAINED[0]!r}" in capsys.readouterr().err


def test_a_real_arm_given_no_instruction_is_refused_before_motion(ckpts, capsys):
    """A real arm's instruction comes only from --instruction: with none, a policy that follows one is refused
    at connect time (exit 3), not at its first request mid-run. A bring-up policy that reads none runs."""
    import policies
    from deploy.commands import DeployArgs, _check_instruction
    from deploy.robots.franka import FrankaRobot
    from deploy.scripted import JointTargetPolicy
    arm = FrankaRobot("127.0.0.1")  # not connected: only its (empty) instruction is read
    with PolicyServer(policies.load(ckpts[0]), port=0) as srv, PolicyClient(port=srv.port) as c:
        assert c.metadata["needs_instruction"] is True
        with pytest.raises(SystemExit) as e:
            _check_instruction(c, DeployArgs(robot="franka", server=srv.address), arm)
        assert e.value.code == EXIT_INSTRUCTION_REFUSED
        assert "none was given, no motion sent" in capsys.readouterr().err
        assert srv.stats["requests"] == 0
    bring_up = JointTargetPolicy(9, 8, (0.0,) * 8, needs_instruction=False)
    with PolicyServer(bring_up, port=0) as srv, PolicyClient(port=srv.port) as c:
        assert c.metadata["needs_instruction"] is False
        assert _check_instruction(c, DeployArgs(robot="franka", server=srv.address), arm) is None


# ---- P5 with the resolver (train/protocols.py) ----------------------------------------------------

def test_resolving_policy_acts_on_the_trained_instruction_and_holds_on_refusal(ckpts):
    import policies
    from train.protocols import ResolvingPolicy
    policy = policies.load(ckpts[0])
    spy = Spy(policy)
    acting = ResolvingPolicy(policy)
    acting.reset()
    acting.select_action(_obs(policy, PARAPHRASE))
    for _ in range(2):  # one episode refused, however many steps
        acting.reset()
        for _ in range(3):
            assert not np.any(acting.select_action(_obs(policy, REFUSED)))  # held still
    assert spy.seen == [TRAINED[0]] and acting.refused_episodes == 2 and list(acting.refused) == [REFUSED]
    assert acting.resolved == {PARAPHRASE: TRAINED[0]}
    policy.lang.cache[REFUSED] = torch.zeros(1, policy.config.lang_dim)  # as if encoded (no language model here)
    allowing = ResolvingPolicy(policy, allow_unknown=True)
    allowing.reset()
    allowing.select_action(_obs(policy, REFUSED))
    assert spy.seen[-1] == REFUSED and allowing.refused_episodes == 1
