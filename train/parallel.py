"""Independent jobs (trainings, evaluations, collections) in worker processes under one progress bar.

Why: the tiny policies and the CPU simulators use one core each (one torch thread; more threads do not
speed them up), so on a 2-core machine two jobs side by side take the time of the longer one. Each job
runs in a fresh ``spawn`` process and is seeded by itself, so its result is the same as in-process.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue as queue_mod
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from tqdm import tqdm

from envs.errors import BAD_INPUT_ERRORS, GroundflowError

Report = Callable[[int], None]
"""a job calls ``report(n)`` with the units (steps, episodes) it has done so far"""


@dataclass
class Job:
    name: str
    fn: Callable[[Report], Any]
    """picklable (a module-level function or a functools.partial of one); called with ``report``"""
    units: int = 1
    """the work it reports against (its steps); the bar's total is the sum over jobs"""


class JobFailed(GroundflowError):
    """A job raised: the message names the job and its error in one line; ``traceback`` is the worker's."""

    def __init__(self, message: str, traceback: str = ""):
        super().__init__(message)
        self.traceback = traceback


def _worker(i: int, fn: Callable[[Report], Any], q: Any) -> None:
    last = [-1]

    def report(n: int) -> None:
        if n != last[0]:
            last[0] = n
            q.put(("step", i, n))

    try:
        # plain pickle: the queue's torch-aware pickler would send tensors as shared memory that dies with this process
        q.put(("done", i, pickle.dumps(fn(report))))
    except BaseException as e:  # noqa: BLE001 - forwarded to the parent, which raises it
        q.put(("error", i, (f"{type(e).__name__}: {' '.join(str(e).splitlines())}", traceback.format_exc(),
                            isinstance(e, BAD_INPUT_ERRORS))))


def run_jobs(jobs: list[Job], workers: int, desc: str = "jobs") -> list[Any]:
    """The jobs' results, in order. ``workers`` <= 1 (or one job) runs them here, one after another.

    A failing job stops the others (their finished outputs stay on disk) and raises ``JobFailed``.
    """
    bar = tqdm(total=sum(j.units for j in jobs), desc=desc)
    done = [0] * len(jobs)

    def advance(i: int, n: int) -> None:
        n = min(n, jobs[i].units)
        if n > done[i]:
            bar.update(n - done[i])
            done[i] = n

    try:
        if workers <= 1 or len(jobs) <= 1:
            results = []
            for i, job in enumerate(jobs):
                results.append(job.fn(lambda n, i=i: advance(i, n)))
                advance(i, jobs[i].units)
            return results
        return _run_spawned(jobs, workers, advance, bar)
    finally:
        bar.close()


def _run_spawned(jobs: list[Job], workers: int, advance: Callable[[int, int], None], bar: tqdm) -> list[Any]:
    ctx = mp.get_context("spawn")  # fresh interpreters: no forked simulator or torch thread state
    q = ctx.Queue()
    pending = list(range(len(jobs)))
    running: dict[int, Any] = {}
    results: dict[int, Any] = {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                i = pending.pop(0)
                running[i] = ctx.Process(target=_worker, args=(i, jobs[i].fn, q), name=jobs[i].name, daemon=False)
                running[i].start()
            dead = [i for i, p in running.items() if p.exitcode not in (None, 0)]
            if dead:  # killed (OOM, a signal) before it could say why
                raise JobFailed(f"{jobs[dead[0]].name}: worker died with exit code {running[dead[0]].exitcode}")
            try:
                kind, i, payload = q.get(timeout=0.5)
            except queue_mod.Empty:
                continue
            if kind == "step":
                advance(i, payload)
            elif kind == "done":
                advance(i, jobs[i].units)
                results[i] = pickle.loads(payload)
                running.pop(i).join()
                bar.write(f"  done: {jobs[i].name}")
            else:
                error, tb, expected = payload
                if not expected:  # a bug, not bad input: show where
                    bar.write(tb)
                raise JobFailed(f"{jobs[i].name} failed: {error}", tb)
    finally:
        for p in running.values():  # on failure or Ctrl-C: stop the rest
            if p.is_alive():
                p.terminate()
            p.join()
    return [results[i] for i in range(len(jobs))]
