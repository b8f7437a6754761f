"""DAgger collection (`groundflow collect --student CKPT`): the student acts, the expert labels."""

import numpy as np
import pytest

import envs
from dataset import Dataset
from envs.errors import InvalidOptionError
from train.bc import TrainArgs, train
from train.collect import CollectArgs, collect

ENV = "maniskill/PushCube-v1"
EE = "pd_ee_delta_pos"  # PushCube's closed-loop scripted expert


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """A barely trained PushCube policy: it wanders where the expert never goes."""
    d = tmp_path_factory.mktemp("dagger")
    collect(CollectArgs(env=ENV, episodes=2, out=d / "demos.h5", control_mode=EE, progress=False))
    train(TrainArgs(data=(d / "demos.h5",), steps=3, batch_size=8, horizon=4, n_exec=4, out=d / "run",
                    wandb="disabled", progress=False))
    return d / "run" / "ckpt"


def test_the_student_drives_and_the_expert_labels(student, tmp_path):
    out = tmp_path / "dagger.h5"
    r = collect(CollectArgs(env=ENV, episodes=3, out=out, control_mode=EE, student=student, progress=False))
    assert r["episodes"] == 3 and r["expert_success_rate"] < 1.0  # failures are written too
    env = envs.make(ENV, control_mode=EE)
    expert = env.make_expert()
    with Dataset(out) as ds:
        assert ds.meta["student"] == str(student)
        for i in range(len(ds)):
            ep = ds.episode(i, images=False)
            obs, _ = env.reset(seed=ep.seed)
            expert.reset(env, obs)
            labels = []
            for t in range(len(ep)):  # the recorded action is the expert's at the state the student reached
                env.set_sim_state(ep.sim_state[t])
                labels.append(expert.act(None))
            np.testing.assert_allclose(ep.action, np.array(labels), atol=1e-5)
    env.close()


def test_a_plan_replaying_expert_cannot_label(student, tmp_path):
    with pytest.raises(InvalidOptionError, match="closed-loop expert"):
        collect(CollectArgs(env=ENV, episodes=1, out=tmp_path / "x.h5", student=student, progress=False))
    with pytest.raises(InvalidOptionError, match="student-beta"):
        collect(CollectArgs(env=ENV, episodes=1, out=tmp_path / "x.h5", control_mode=EE, student=student,
                            student_beta=1.0, progress=False))
