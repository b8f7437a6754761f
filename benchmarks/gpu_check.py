"""GPU path check (run on a CUDA machine): training steps in fp32 and bf16, base/large throughput,
chunk latency, and a real `train()` run with bf16 autocast on collected demos.

    python benchmarks/gpu_check.py --data data/bench/maniskill_PushCube-v1_150_s0.h5 --out gpu.json

Synthetic throughput uses random instruction features (no language model needed); the real run
uses the instruction features cached in .assets/lang_cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import policies  # noqa: E402


def synthetic(kind: str, size: str, B: int, amp: bool, steps: int = 20) -> dict:
    dev = torch.device("cuda")
    cfg = policies.PolicyConfig(kind=kind, size=size, state_dim=52, action_dim=8, horizon=16, n_exec=8)
    p = policies.make_policy(cfg)
    instrs = [f"task {i}" for i in range(12)]
    for s in instrs:
        p.lang.cache[s] = torch.nn.functional.normalize(torch.randn(1, 384), dim=-1)
    p.to(dev).train()
    opt = torch.optim.AdamW(p.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    batch = {"state": rng.normal(size=(B, 52)).astype(np.float32),
             "action": rng.uniform(-1, 1, (B, 16, 8)).astype(np.float32),
             "instruction": [instrs[i % 12] for i in range(B)]}
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss, _ = p.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    p.eval()
    obs = {"state": batch["state"][0], "instruction": instrs[0]}
    lat = []
    for i in range(13):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            p.predict_action_chunk(obs)
        torch.cuda.synchronize()
        if i >= 3:
            lat.append((time.perf_counter() - t) * 1000)
    step = float(np.median(times))
    return {"kind": kind, "size": size, "batch": B, "bf16": amp, "step_ms": step * 1000, "samples_per_s": B / step,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9, "loss": float(loss.detach()),
            "chunk_latency_ms_p50": float(np.median(lat)),
            "params_m": sum(x.numel() for x in p.parameters()) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("gpu.json"))
    a = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "synthetic": []}
    for kind in ("flow", "ar"):
        for size, B in (("base", 256), ("large", 256)):
            for amp in (False, True):
                r = synthetic(kind, size, B, amp)
                res["synthetic"].append(r)
                print(json.dumps(r), flush=True)
    if a.data is not None:
        from train.bc import TrainArgs, train
        out = Path("/tmp/gpu_run")
        shutil.rmtree(out, ignore_errors=True)
        t = time.time()
        s = train(TrainArgs(data=(a.data,), policy="flow", size="base", steps=300, batch_size=256, out=out,
                            wandb="disabled", progress=False, amp="bf16", device="cuda"))
        h = s["history"]
        res["real_train"] = {"policy": "flow", "size": "base", "steps": 300, "batch": 256, "amp": "bf16",
                             "first_loss": h[0]["loss"], "final_loss": s["final_loss"],
                             "samples_per_s": s["samples_per_s"], "seconds": time.time() - t}
        print(json.dumps(res["real_train"]), flush=True)
    a.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
