"""train/parallel.py: jobs in worker processes give what they give in-process; a failure names its job."""

import os
import signal
import time
from functools import partial

import pytest
import torch

from train.parallel import Job, JobFailed, run_jobs


def _train_tiny(data, out, seed, report):
    from train.bc import TrainArgs, train
    torch.set_num_threads(1)  # a CPU run is bit-reproducible at a fixed thread count (train/bc.py)
    train(TrainArgs(data=(data,), policy="flow", size="tiny", steps=30, batch_size=32, out=out, seed=seed,
                    wandb="disabled", progress=False), on_step=report)
    import policies
    return {k: v.clone() for k, v in policies.load(out / "ckpt").state_dict().items()}


def test_training_in_workers_gives_the_weights_of_training_in_process(tmp_path):
    from train.collect import CollectArgs, collect
    data = tmp_path / "push.h5"
    collect(CollectArgs(env="maniskill/PushCube-v1", episodes=4, out=data, seed=0, progress=False))
    threads = torch.get_num_threads()
    try:
        here = run_jobs([Job(f"s{s}", partial(_train_tiny, data, tmp_path / f"here{s}", s), 30) for s in (0, 1)], 1)
    finally:
        torch.set_num_threads(threads)
    spawned = run_jobs([Job(f"s{s}", partial(_train_tiny, data, tmp_path / f"spawned{s}", s), 30) for s in (0, 1)], 2)
    for a, b in zip(here, spawned):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(here[0][k], here[1][k]) for k in here[0])  # the seeds differ: the check can fail


def _sleep_and_say_pid(path, report):
    path.write_text(str(os.getpid()))
    for i in range(600):
        report(i)
        time.sleep(0.1)
    path.with_suffix(".finished").touch()  # only if nobody stopped it


def _raise(path, report):
    while not path.exists():  # let the other job start first
        time.sleep(0.05)
    raise ValueError("episode 3 has no actions")


def _killed(report):
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_failing_job_is_named_and_stops_the_others(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(JobFailed, match=r"bad data failed: ValueError: episode 3 has no actions"):
        run_jobs([Job("sleeper", partial(_sleep_and_say_pid, pid_file), 600), Job("bad data", partial(_raise, pid_file))],
                 2)
    assert not pid_file.with_suffix(".finished").exists()  # stopped, not waited for (load-independent)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_killed_worker_is_reported_with_its_exit_code(tmp_path):
    with pytest.raises(JobFailed, match=r"oom victim: worker died with exit code -9"):
        run_jobs([Job("oom victim", _killed), Job("other", partial(_sleep_and_say_pid, tmp_path / "pid"), 600)], 2)
