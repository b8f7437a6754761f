"""Choosing the chunk a guided policy sends: candidates in one batch, a hard check, a hold."""

import pytest
import torch

import envs
from policies.selection import ChunkCheck, choose_chunk
from tests.conftest import tiny_flow_policy

ENV = "maniskill/CollisionAvoidance-v1"


@pytest.fixture(scope="module")
def setup():
    policy, _ = tiny_flow_policy(ENV)
    env = envs.make(ENV)
    obs, _ = env.reset(seed=0)
    env.close()
    return policy, policy.obs_to_batch(obs)


def _candidates(policy, batch, n, seed):
    """The candidates choose_chunk draws first under this seed (one batch of n)."""
    from policies.flow import _expand
    torch.manual_seed(seed)
    with torch.no_grad():
        return policy.sample_chunks(_expand(batch, n))


def test_sends_the_lowest_cost_candidate_that_passes_the_check(setup):
    policy, batch = setup
    cost = lambda x: x[:, :, 0].sum(1)  # noqa: E731
    feasible = lambda x: x[:, :, 1].mean(1) > 0  # noqa: E731
    cands = _candidates(policy, batch, 16, seed=3)
    ok = feasible(cands)
    assert 0 < int(ok.sum()) < 16  # the check bites: some candidates pass, some do not
    torch.manual_seed(3)
    x, st = choose_chunk(policy, batch, ChunkCheck(candidates=16), cost=cost, feasible=feasible)
    best = int(torch.where(ok, cost(cands), torch.tensor(float("inf"))).argmin())
    torch.testing.assert_close(x, cands[best:best + 1])
    assert bool(feasible(x)) and st.rejected == int((~ok).sum()) and not st.held
    assert cost(x) < cost(cands[ok]).max()  # not just any passing one
    assert st.nfe == policy.config.flow_steps and st.cost_evals == 16  # one batched pass per flow step


def test_checks_only_the_steps_that_execute(setup):
    policy, batch = setup
    seen = []
    choose_chunk(policy, batch, ChunkCheck(candidates=4), feasible=lambda x: seen.append(x.shape) or
                 torch.ones(len(x), dtype=torch.bool), n_exec=2)
    assert seen == [(4, 2, policy.config.action_dim)]


def test_holds_when_nothing_passes_after_the_retries(setup):
    policy, batch = setup
    x, st = choose_chunk(policy, batch, ChunkCheck(candidates=4, retries=2),
                         feasible=lambda x: torch.zeros(len(x), dtype=torch.bool))
    assert x is None and st.held and st.draws == 3 and st.rejected == 12


def test_a_retry_draws_its_own_number_of_candidates(setup):
    """A failed first sample is followed by a wider batch (``retry_candidates``), not a second sample of one:
    the chunk sent is the retry batch's lowest-cost passing candidate."""
    policy, batch = setup
    seen = []
    cost = lambda x: x[:, :, 0].sum(1)  # noqa: E731

    def feasible(x):
        seen.append(len(x))
        return torch.full((len(x),), len(seen) > 1)  # the first draw fails, the retry's all pass
    torch.manual_seed(5)
    x, st = choose_chunk(policy, batch, ChunkCheck(retries=1, retry_candidates=8), cost=cost, feasible=feasible)
    assert seen == [1, 8] and not st.held and st.draws == 2 and st.rejected == 1 and st.cost_evals == 9
    torch.manual_seed(5)
    with torch.no_grad():
        policy.sample_chunks(batch)  # the first draw
    retry = _candidates_after(policy, batch, 8)
    torch.testing.assert_close(x, retry[int(cost(retry).argmin())][None])
    assert ChunkCheck(retries=2, retry_candidates=8).draws == 17 and ChunkCheck(candidates=4, retries=1).draws == 8


def _candidates_after(policy, batch, n):
    from policies.flow import _expand
    with torch.no_grad():
        return policy.sample_chunks(_expand(batch, n))


def test_a_nonfinite_cost_never_passes(setup):
    policy, batch = setup
    x, st = choose_chunk(policy, batch, ChunkCheck(candidates=4),
                         cost=lambda x: torch.full((len(x),), float("nan")))
    assert x is None and st.held and st.rejected == 4


def test_bad_options_are_refused(setup):
    policy, batch = setup
    with pytest.raises(ValueError, match="candidates must be an integer >= 1"):
        ChunkCheck(candidates=0)
    with pytest.raises(ValueError, match="retries must be an integer >= 0"):
        ChunkCheck(retries=-1)
    with pytest.raises(ValueError, match="retry_candidates must be an integer >= 1"):
        ChunkCheck(retries=1, retry_candidates=0)
    from policies.flow import _expand
    with pytest.raises(ValueError, match="one observation; the batch has 2"):
        choose_chunk(policy, _expand(batch, 2), ChunkCheck())
    import guidance
    guide = guidance.make("velocity_gradient", cost=lambda x: x.sum((1, 2)), scale=1.0)
    with pytest.raises(ValueError, match="velocity_gradient.*needs them"):
        choose_chunk(policy, batch, ChunkCheck(), guide=guide)


def test_a_goal_inside_an_obstacle_is_refused(setup):
    """A constraint no motion can satisfy (the user puts an obstacle over the goal) is refused with
    the reason, before any chunk is planned; the same obstacle beside the path is accepted."""
    from guidance.geometry import Sphere
    from train.guided_eval import obstacle_cost
    policy, _ = setup
    env = envs.make(ENV)
    try:
        env.reset(seed=0)
        tcp, goal = env.raw.tcp_and_goal()
        on_goal = [Sphere(torch.as_tensor(goal, dtype=torch.float32), 0.05)]
        with pytest.raises(ValueError, match=r"goal .* inside obstacle 0 \(Sphere\): no motion can reach it"):
            obstacle_cost(policy, env.raw, 0.03, goal_weight=100.0, obstacles=on_goal)
        beside = [Sphere(torch.as_tensor((tcp + goal) / 2, dtype=torch.float32), 0.05)]
        cost = obstacle_cost(policy, env.raw, 0.03, goal_weight=100.0, obstacles=beside)
        assert cost(torch.zeros(1, policy.config.horizon, policy.config.action_dim)).shape == (1,)
    finally:
        env.close()


def test_the_margin_never_asks_for_more_room_than_the_goal_leaves():
    """With the margin capped by the goal's room, the cost of standing at the goal is the goal's own (zero
    obstacle term); uncapped, a 3 cm margin penalizes the goal itself when an obstacle is 2 cm from the hand."""
    from guidance.geometry import Box
    from policies.constraints import goal_margin, goal_room
    goal, body = torch.tensor([0.0, 0.3, 0.2]).numpy(), [(0.0, 0.0, 0.0), (0.0, 0.0, 0.1)]
    near = [Box(torch.tensor([0.0, 0.35, 0.2]), torch.tensor([0.03, 0.03, 0.03]))]  # 2 cm from the TCP
    assert goal_room(goal, near, body)[0] == pytest.approx(0.02, abs=1e-6)
    assert goal_margin(0.03, 0.015, goal, near, body) == pytest.approx(0.02, abs=1e-6)
    assert goal_margin(0.03, 0.015, goal, [], body) == 0.03  # nothing near: as asked
    touching = [Box(torch.tensor([0.0, 0.34, 0.2]), torch.tensor([0.03, 0.03, 0.03]))]  # 1 cm: the check's floor
    assert goal_margin(0.03, 0.015, goal, touching, body) == 0.015
    far = [Box(torch.tensor([0.0, 0.5, 0.2]), torch.tensor([0.03, 0.03, 0.03]))]
    assert goal_margin(0.03, 0.015, goal, far, body) == 0.03
