"""Where a suite's tasks act alike: the fraction of (sample, other instruction) pairs that
``train.cig.demonstrated_elsewhere`` marks as demonstrated, by fifth of the episode, for pairs of
tasks on the same object and on different objects (the object phrase: words 3-4 of the
instruction, "put the <red cube> ..."), and for all pairs. Writes benchmarks/results/cig_negatives.json.

    .venv/bin/python benchmarks/cig_negatives.py --data data/bench/kitchen_random_600.h5 data/bench/tabletop_random_1200.h5
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402

from train.cig import demonstrated_elsewhere  # noqa: E402
from train.data import ChunkData  # noqa: E402
from train.recipes import recipe_args  # noqa: E402


@dataclass
class Args:
    data: tuple[Path, ...]
    radius: float = 1.25


def fractions(path: Path, radius: float) -> dict:
    d = ChunkData(path, recipe_args("multitask").horizon)
    t = time.time()
    m = demonstrated_elsewhere(d, radius)
    names = d.instructions
    lab = np.array([names.index(l) for l in d.instruction])
    fifth = np.minimum((d.progress * 5).astype(int), 4)
    obj = [" ".join(l.split()[2:4]) for l in names]
    out = {"samples": len(d), "seconds": time.time() - t, "radius": radius}
    for key, keep in (("same_object", lambda i, j: obj[i] == obj[j]), ("other_object", lambda i, j: obj[i] != obj[j]),
                      ("all_pairs", lambda i, j: True)):
        row = []
        for b in range(5):
            vals = [m[(fifth == b) & (lab == i), j].mean() for i in range(len(names)) for j in range(len(names))
                    if i != j and keep(i, j) and ((fifth == b) & (lab == i)).any()]
            row.append(round(float(np.mean(vals)), 2) if vals else None)
        out[key] = row
    return out


def main() -> None:
    a = tyro.cli(Args)
    res = {p.stem: fractions(p, a.radius) for p in a.data}
    for k, v in res.items():
        print(k, json.dumps({x: v[x] for x in ("same_object", "other_object", "all_pairs")}))
    (RESULTS / "cig_negatives.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
