"""Instruction resolution: map a user's wording to a trained instruction or refuse (#43).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/language.py        # ~1 min on 1 core

Per suite (tabletop 12 instructions, kitchen 6, LIBERO-Goal 10), three evaluation sets, kept apart:
(A) the suites' held-out paraphrases (``Task.paraphrases``: evaluation only); (B) ~30 valid wordings
per suite written by hand before any resolver code or threshold existed (tests/data/
instruction_wordings.json "valid": synonyms, word order, polite/terse forms, left-hand, relative
clauses, typos); (C) hand-written wordings the checkpoint cannot do ("invalid": unknown colour /
object / verb, gibberish, empty, another suite's task, off-task), with ``untrained_combination``
(swapped roles, attributes of two instructions) and ``underspecified`` reported apart as C+.
Thresholds are chosen only on a calibration set generated from each suite's trained instructions
(``policies.instructions.calibration_set``; the other suites' trained instructions as negatives);
``suites.<name>.evaluation_wordings_also_generated`` lists evaluation wordings the generator happens
to produce as well (same styles; the generator never reads the fixture).

Methods. Nearest instruction by MiniLM: ``minilm_pooled`` (cosine of the pooled sentence features),
``minilm_tokens`` (BERTScore-style F1: each content word-piece of the query aligned to its best
contextual token of the instruction and back, IDF-weighted recall), ``minilm_words`` (the same over
whole content words, each encoded alone); as refusers with a threshold refusing 2% of the generated
valid wordings (``_threshold``) or 95% of the generated negatives (``_threshold_neg95``). The
resolver (policies/instructions.py): ``slots+synonyms`` (the design: ``InstructionResolver.fit``'s
defaults), ``slots+synonyms+minilm`` (+ MiniLM word similarity for unknown verbs and nouns, its
threshold calibrated), ``slots+minilm`` and ``slots`` (without the generic synonym table).

Sections of benchmarks/results/language.json:
``encoders``: {method: {"one_word_margin", "retrieval_top1"}}: the nearest trained instruction by the
  method's score, no refusal; one_word_margin: for every ordered pair of trained instructions that
  differ in one word (left/right, red/blue, stove/plate), score(q, right) - score(q, swapped) for
  the instruction itself (``trained``, ``trained_min``) and for its A and B wordings
  (``wordings_mean``, ``wordings_min``, ``wordings_swapped``: share with a gap <= 0). Scores are each
  method's own: cosine / F1; the resolver's is (support - unexplained words) / grounded words.
``refusal``: {method: {"out_of_suite_refused", "valid_refused", "n_out", "n_valid", ...}} on C and A+B.
``resolution``: {method: {suite: {"A", "B", "C_refused", "C+_refused", "C_by_kind", ...}}}: top-1
  accuracy counting a refusal as a miss, with the valid wordings missed and the C wordings accepted.
``timing``: the resolver's ms per call on 1 thread after warm-up (median, p99, max) over A+B+C, and
  the MiniLM variant's with a cold word cache.

``rechecks``: the shipped resolver on wording sets helpers wrote blind (benchmarks/data/
  language_recheck*.json: the trained instructions and scenes only, never the resolver or the other
  sets); valid wordings resolved correctly / refused / resolved to another instruction, out-of-suite
  wordings refused. ``recommended``: the method the multitask recipe ships (the resolver).

What it buys a trained policy (``paraphrase``: P5 of train/protocols.py, every episode commanded with
one of the suite's held-out paraphrases, the same seeds and wordings for every method), on the
recommended recipe of each suite, trained here::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/language.py --part train --suite tabletop       # ~15 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/language.py --part paraphrase --suite tabletop --episodes 120

(likewise ``kitchen`` and ``libero_goal``). ``paraphrase.<suite>.<method>``: ``encoder`` (each paraphrase
encoded as is by the checkpoint's MiniLM, the behaviour before the resolver), ``resolver`` (resolved to
its trained instruction; a refused one holds still and counts as a failure), ``resolver_allow_unknown``
(a refused one encoded as is); each with ``clean`` (the trained instructions on the same seeds),
``paraphrase``, ``ratio``, ``episodes``, ``seeds``, the CI and the wordings resolved or refused.

``--part compositional``: the tabletop recipe trained on 10 of its 12 instructions; success on the
10 (``seen``) and on the 2 pairings no demo shows (``unseen``, encoded as is).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, load_results, machine, md_table, write  # noqa: E402

sys.path.insert(0, str(ROOT))  # `import policies` must find the package, not benchmarks/policies.py
# nor `import libero` (LIBERO-Goal's P5) this folder's libero.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

from policies.instructions import (SYNONYM_GROUPS, InstructionResolver, Lexicon, _split,  # noqa: E402
                                   calibration_set, minilm_word_encoder)

FIXTURE = ROOT / "tests" / "data" / "instruction_wordings.json"
RUNS, DATA = ROOT / "runs" / "language", ROOT / "data" / "language"
RECHECKS = ROOT / "benchmarks" / "data"
GROUNDFLOW = str(ROOT / ".venv" / "bin" / "groundflow")
TRAINING = {  # suite -> (collect flags, demos per file, file seeds, recipe, P5 env options)
    "tabletop": (("--suite", "tabletop", "--layout", "random"), 600, (0, 20000), "multitask", {"layout": "random"}),
    "kitchen": (("--suite", "kitchen", "--layout", "random"), 300, (0, 20000), "multitask", {"layout": "random"}),
    "libero_goal": (("--suite", "libero_goal", "--layout", "sampled", "--dart-noise", "0.1"), 250, (0, 20000),
                    "libero_dart", {"layout": "task"}),
}
"""the recommended recipe per suite, on the demos its benchmark measured it with (grounding: 1200 / 600
random-layout demos; LIBERO-Goal: 500 DART demos from fresh placements, evaluated on LIBERO's init states)"""
CONDITIONING = {  # name -> train flags beside the recipe's (pooled MiniLM + lang_norm, early fusion)
    "pooled": (),
    "tokens": ("--lang-tokens", "tokens"),  # the action and state tokens attend to MiniLM's token features
    "augment": ("--paraphrase-augment", "0.5"),  # half the samples on a grammar-made rewrite of their instruction
    "tokens+augment": ("--lang-tokens", "tokens", "--paraphrase-augment", "0.5"),
}
"""item 4's training-side comparison: each on the same demos, seed and P5 episodes (MiniLM is the only
sentence encoder whose weights ship in a package this machine's registries hold)"""
CORE_KINDS = ("unknown_colour", "unknown_object", "unknown_verb", "gibberish", "empty", "other_suite", "off_task")
EXTRA_KINDS = ("untrained_combination", "underspecified")


@dataclass
class Args:
    suites: tuple[str, ...] = ("tabletop", "kitchen", "libero_goal")
    seed: int = 0
    per_instruction: int = 24
    """generated valid wordings per trained instruction in each calibration set"""
    valid_refusal: float = 0.02
    """threshold methods: the share of generated valid wordings they may refuse"""
    out: str = "language"
    part: Literal["resolution", "train", "paraphrase", "compositional"] = "resolution"
    """resolution: the wording sets above; train: demos and the recommended recipe's checkpoint of
    ``--suite`` (state policies, as the suites are measured in docs/grounding.md and docs/libero.md);
    paraphrase: P5 of a checkpoint with the resolver off and on"""
    suite: str | None = None
    """--part train / paraphrase: the suite (default checkpoint: the train part's)"""
    conditioning: str = "pooled"
    """--part train / paraphrase: how the policy reads the instruction (CONDITIONING: pooled, tokens, augment,
    tokens+augment); the recipe's own is pooled"""
    ckpt: str | None = None
    """--part paraphrase: a trained multi-instruction checkpoint (default: the train part's of --suite)"""
    episodes: int = 48
    """--part paraphrase: episodes per condition (clean, off, on), instructions in turn"""
    p5_seed: int = 4000
    """--part paraphrase: first env seed (train/protocols.py's P5 default)"""
    perturbation_seed: int = 0
    """--part paraphrase: seed of the paraphrase draw (the same for off and on)"""


def load_suites(names: tuple[str, ...]) -> dict[str, dict]:
    """Trained instructions and held-out paraphrases (set A) of each suite, from envs/."""
    import envs
    out = {}
    for name in names:
        if name == "tabletop":
            from envs.maniskill.tasks.tabletop import TABLETOP_SUITE
            tasks = [(t.instruction, t.paraphrases) for t in TABLETOP_SUITE.tasks]
            source = "envs.maniskill.tasks.tabletop.TABLETOP_SUITE"
        elif name == "kitchen":
            from envs.robosuite.kitchen import TASKS
            tasks = [(t.instruction, t.paraphrases) for t in TASKS]
            source = "envs.robosuite.kitchen.TASKS"
        elif name == "libero_goal":
            from envs.libero.env import PARAPHRASES
            try:
                from envs.libero.env import _benchmark
                bench = _benchmark("goal")
                texts = [bench.get_task(i).language.strip().lower() for i in range(bench.n_tasks)]
                source = "LIBERO's libero_goal benchmark + envs.libero.env.PARAPHRASES"
            except Exception:  # noqa: BLE001  (LIBERO not installed: its 10 instructions are PARAPHRASES' keys)
                texts, source = list(PARAPHRASES), "envs.libero.env.PARAPHRASES keys"
            tasks = [(t, PARAPHRASES.get(t, ())) for t in texts]
        else:
            raise SystemExit(f"unknown suite {name!r}")
        # what the training env tells a checkpoint's resolver about its scene (EnvSpec.colours)
        out[name] = {"colours": envs.spec(envs.suite_env_id(name)).colours, "instructions": [t for t, _ in tasks],
                     "A": [(p, t) for t, ps in tasks for p in ps], "source": source}
    fixture = json.loads(FIXTURE.read_text())
    for name in names:
        out[name]["B"] = [tuple(x) for x in fixture[name]["valid"]]
        out[name]["C"] = [tuple(x) for x in fixture[name]["invalid"]]
        bad = [t for _, t in out[name]["B"] if t not in out[name]["instructions"]]
        if bad:
            raise SystemExit(f"{FIXTURE}: {name} wordings name instructions the suite lacks: {bad}")
    return out


# ---- MiniLM features ------------------------------------------------------------------------

class MiniLM:
    """Pooled sentence features, contextual token features and single-word features, each text
    encoded alone on one thread (policies.language ``_encode_with``), cached."""

    def __init__(self):
        from policies.language import _encode_with, _model
        self.m, self._enc = _model(), _encode_with
        self.pooled_cache: dict[str, np.ndarray] = {}
        self.tok_cache: dict[str, tuple[np.ndarray, list[str]]] = {}
        self.words = minilm_word_encoder()
        self.function = Lexicon({}, synonyms=False).function_words

    def pooled(self, text: str) -> np.ndarray:
        if text not in self.pooled_cache:
            self.pooled_cache[text] = self._enc(self.m, [text], "pooled", 1)[text][0].numpy().astype(np.float64)
        return self.pooled_cache[text]

    def tokens(self, text: str) -> tuple[np.ndarray, list[str]]:
        """Normalised contextual features of the content word-pieces of ``text`` and their words."""
        if text not in self.tok_cache:
            feats = self._enc(self.m, [text], "tokens", 256)[text].numpy().astype(np.float64)
            enc = self.m.tokenizer(text)
            keep, words = [], []
            for k, wid in enumerate(enc.word_ids()):
                if wid is None or k >= len(feats):
                    continue
                s, e = enc.word_to_chars(wid)
                w = text[s:e].lower()
                if w in self.function or not any(c.isalnum() for c in w):
                    continue
                keep.append(k)
                words.append(w)
            f = feats[keep] if keep else np.zeros((0, feats.shape[1]))
            f = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-9)
            self.tok_cache[text] = (f, words)
        return self.tok_cache[text]

    def content_words(self, text: str) -> list[str]:
        return [w for w in _split(text) if w != "," and w not in self.function]


def bertscore(q: np.ndarray, c: np.ndarray, c_weights: np.ndarray) -> float:
    """F1 of greedy alignment: precision over the query's units, IDF-weighted recall over the instruction's."""
    if len(q) == 0 or len(c) == 0:
        return 0.0
    sim = q @ c.T
    p = float(sim.max(axis=1).mean())
    r = float((sim.max(axis=0) * c_weights).sum() / c_weights.sum())
    return 0.0 if p + r <= 0 else 2 * p * r / (p + r)


class Scorer:
    """A method's score of a query against each trained instruction (higher: closer)."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def scores(self, text: str) -> list[float]:
        return self.fn(text)


def build_scorers(instructions: list[str], lm: MiniLM, resolvers: dict[str, InstructionResolver]) -> dict[str, Scorer]:
    n = len(instructions)
    P = np.stack([lm.pooled(s) for s in instructions])
    toks = [lm.tokens(s) for s in instructions]
    words = [lm.content_words(s) for s in instructions]
    df_t: dict[str, int] = {}
    for _, ws in toks:
        for w in set(ws):
            df_t[w] = df_t.get(w, 0) + 1
    df_w: dict[str, int] = {}
    for ws in words:
        for w in set(ws):
            df_w[w] = df_w.get(w, 0) + 1
    tok_w = [np.array([math.log(1 + n / df_t[w]) for w in ws]) for _, ws in toks]
    W = [lm.words(ws) for ws in words]
    word_w = [np.array([math.log(1 + n / df_w[w]) for w in ws]) for ws in words]

    def pooled(text):
        return list(P @ lm.pooled(text)) if text.strip() else [0.0] * n

    def tokens(text):
        q, _ = lm.tokens(text) if text.strip() else (np.zeros((0, 384)), [])
        return [bertscore(q, toks[i][0], tok_w[i]) for i in range(n)]

    def static_words(text):
        ws = lm.content_words(text)
        q = lm.words(ws) if ws else np.zeros((0, 384))
        return [bertscore(q, W[i], word_w[i]) for i in range(n)]

    out = {"minilm_pooled": Scorer("minilm_pooled", pooled), "minilm_tokens": Scorer("minilm_tokens", tokens),
           "minilm_words": Scorer("minilm_words", static_words)}
    for name, r in resolvers.items():
        out[name] = Scorer(name, lambda text, r=r: resolver_scores(r, text))
    return out


def resolver_scores(r: InstructionResolver, text: str) -> list[float]:
    """(support - unexplained grounded words - 0.5 per role swap) / grounded words: 1 when every word
    is the instruction's, comparable across queries."""
    toks, matches, _, exempt = r.analyse(text)
    n = max(1, len([k for k in matches if k not in exempt]))
    return [s / n for s in r.score_all(text)]


# ---- evaluation -----------------------------------------------------------------------------

def one_word_pairs(instructions: list[str]) -> list[tuple[int, int]]:
    toks = [s.split() for s in instructions]
    return [(a, b) for a in range(len(toks)) for b in range(len(toks)) if a != b and len(toks[a]) == len(toks[b])
            and sum(x != y for x, y in zip(toks[a], toks[b])) == 1]


def margins(scorer: Scorer, instructions: list[str], wordings: list[tuple[str, str]]) -> dict:
    pairs = one_word_pairs(instructions)
    if not pairs:
        return {"pairs": 0}
    trained, worded = [], []
    cache: dict[str, list[float]] = {}

    def sc(t):
        if t not in cache:
            cache[t] = scorer.scores(t)
        return cache[t]

    for a, b in pairs:
        s = sc(instructions[a])
        trained.append(s[a] - s[b])
        for text, target in wordings:
            if target == instructions[a]:
                s = sc(text)
                worded.append(s[a] - s[b])
    return {"pairs": len(pairs), "trained": float(np.mean(trained)), "trained_min": float(np.min(trained)),
            "wordings_mean": float(np.mean(worded)), "wordings_min": float(np.min(worded)),
            "wordings_swapped": float(np.mean(np.array(worded) <= 0)), "n_wordings": len(worded)}


def top1(scorer: Scorer, instructions: list[str], wordings: list[tuple[str, str]]) -> float:
    hits = 0
    for text, target in wordings:
        s = scorer.scores(text)
        hits += instructions[int(np.argmax(s))] == target  # ties: the first instruction
    return hits / max(1, len(wordings))


@dataclass
class Decider:
    """Accept-or-refuse + top-1 for one refusal method on one suite."""
    name: str
    decide: object  # text -> (index or None, reason or None)


def threshold_decider(name: str, scorer: Scorer, cal: dict, valid_refusal: float | None) -> tuple[Decider, float]:
    """Refuse when the best score is under a threshold: the one refusing ``valid_refusal`` of the
    generated valid wordings, or (None) the one refusing 95% of the generated negatives."""
    if valid_refusal is not None:
        thr = float(np.quantile([max(scorer.scores(t)) for t, _ in cal["positive"]], valid_refusal))
    else:
        thr = float(np.quantile([max(scorer.scores(t)) for t, _ in cal["negative"] if t.strip()], 0.95))

    def decide(text):
        if not text.strip():
            return None, "empty"
        s = scorer.scores(text)
        i = int(np.argmax(s))
        return (i, None) if s[i] >= thr else (None, f"no trained instruction is close (best {s[i]:.2f} < {thr:.2f})")
    return Decider(name, decide), thr


def resolver_decider(name: str, r: InstructionResolver) -> Decider:
    def decide(text):
        res = r.resolve(text)
        return res.index, res.reason
    return Decider(name, decide)


def evaluate(d: Decider, suite: dict) -> dict:
    ins = suite["instructions"]
    out: dict = {"valid_missed": []}
    for set_name in ("A", "B"):
        ok = refused = 0
        for text, target in suite[set_name]:
            i, reason = d.decide(text)
            refused += i is None
            ok += i is not None and ins[i] == target
            if i is None or ins[i] != target:
                out["valid_missed"].append({"set": set_name, "text": text, "target": target,
                                            "got": f"refused: {reason}" if i is None else f"wrong: {ins[i]!r}"})
        n = len(suite[set_name])
        out[set_name] = ok / max(1, n)
        out[f"{set_name}_refused"] = refused / max(1, n)
        out[f"n_{set_name}"] = n
    kinds: dict[str, list[int]] = {}
    examples: list[dict] = []
    for text, kind in suite["C"]:
        i, reason = d.decide(text)
        kinds.setdefault(kind, []).append(int(i is None))
        if i is not None:
            examples.append({"text": text, "kind": kind, "accepted_as": ins[i]})
    core = [v for k in CORE_KINDS for v in kinds.get(k, [])]
    extra = [v for k in EXTRA_KINDS for v in kinds.get(k, [])]
    out["C_refused"] = float(np.mean(core)) if core else None
    out["C+_refused"] = float(np.mean(extra)) if extra else None
    out["n_C"], out["n_C+"] = len(core), len(extra)
    out["C_by_kind"] = {k: float(np.mean(v)) for k, v in kinds.items()}
    out["C_accepted"] = examples
    return out


def _suite_run(suite: str, conditioning: str = "pooled") -> Path:
    if conditioning not in CONDITIONING:
        raise SystemExit(f"--conditioning {conditioning!r}: one of {', '.join(CONDITIONING)}")
    return RUNS / (suite if conditioning == "pooled" else f"{suite}_{conditioning.replace('+', '_')}")


def _groundflow(*args: str) -> subprocess.Popen:
    """A ``groundflow`` command, started with one torch thread (as the results were measured)."""
    print("$", " ".join(args), flush=True)
    return subprocess.Popen([GROUNDFLOW, *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait(*procs: subprocess.Popen) -> None:
    if any(p.wait() for p in procs):
        raise SystemExit("a groundflow command failed")


def _train(data: list[Path], out: Path, recipe: str, seed: int, flags: tuple[str, ...] = ()) -> None:
    """Train ``recipe`` (and ``flags``) on ``data`` into ``out`` unless done (a killed run resumes)."""
    if not (out / "summary.json").exists():
        _wait(_groundflow("train", "--recipe", recipe, *flags, "--data", *map(str, data), "--out", str(out),
                          "--seed", str(seed), "--no-progress", "--wandb", "disabled",
                          *(["--resume"] if (out / "train_state.pt").exists() else [])))


def train_part(args: Args) -> None:
    """Collect the suite's demos (two processes, one per seed) and train its recommended recipe."""
    if args.suite not in TRAINING:
        raise SystemExit(f"--part train needs --suite, one of {', '.join(TRAINING)}")
    flags, n, seeds, recipe, _ = TRAINING[args.suite]
    DATA.mkdir(parents=True, exist_ok=True)
    files = [DATA / f"{args.suite}_s{s}.h5" for s in seeds]
    _wait(*[_groundflow("collect", *flags, "--episodes", str(n), "--seed", str(s), "--out", str(f), "--no-progress")
            for s, f in zip(seeds, files) if not f.exists()])
    _train(files, _suite_run(args.suite, args.conditioning), recipe, args.seed, CONDITIONING[args.conditioning])


HELD_OUT_PAIRS = ("push the red cube to the left goal", "push the blue cube to the right goal")
"""compositional part: the two tabletop instructions left out of training; every word and every
(colour, side) of the other pushes is demonstrated, these two pairings never are"""


def compositional_part(args: Args) -> None:
    """Train the tabletop recipe on 10 of its 12 instructions and evaluate the 2 held-out pairings (encoded
    as is: the resolver refuses an untrained combination, ``--allow-unknown`` runs it) beside the 10."""
    import policies
    from envs.maniskill.tasks.tabletop import TABLETOP_SUITE
    from train.evaluate import evaluate
    from envs.metrics import wilson
    seen = [t.instruction for t in TABLETOP_SUITE.tasks if t.instruction not in HELD_OUT_PAIRS]
    data, out = DATA / "tabletop_comp10_s100000.h5", RUNS / "tabletop_comp10"
    if not data.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        _wait(_groundflow("collect", "--suite", "tabletop", "--layout", "random", "--episodes", "1000", "--seed",
                          "100000", "--out", str(data), "--no-progress", "--instructions", *seen))
    _train([data], out, "multitask", args.seed)
    torch.set_num_threads(1)
    policy = policies.load(out / "ckpt", to_act=True)
    rows = {}
    for name, instrs in (("seen", seen), ("unseen", list(HELD_OUT_PAIRS))):
        torch.manual_seed(args.p5_seed)
        n = args.episodes if name == "seen" else args.episodes // 2
        res = evaluate(policy, "maniskill/TabletopSuite-v1", n, seed=args.p5_seed, env_options={"layout": "random"},
                       instructions=instrs, progress=False, allow_unknown=(name == "unseen"))
        d = res.to_dict()
        rows[name] = {"success": res.successes / res.episodes, "ci95": list(wilson(res.successes, res.episodes)),
                      "episodes": res.episodes, "did_other_task": d["did_other_task_rate"],
                      "per_instruction": {k: v["success_rate"] for k, v in d["per_instruction"].items()},
                      "confusion": d.get("confusion")}
        print(name, rows[name]["success"], flush=True)
    old = load_results(args.out)
    old["compositional"] = {"multitask": {"seen": rows["seen"]["success"], "unseen": rows["unseen"]["success"],
                                          "held_out": list(HELD_OUT_PAIRS), "rows": rows, "demos": 1000,
                                          "command": "benchmarks/language.py --part compositional"}}
    write(args.out, old, table(old, list(old.get("suites", {}))))


PARAPHRASE_METHODS = {  # name in language.json -> (resolve, allow_unknown)
    "encoder": (False, False),  # each paraphrase encoded as is by the checkpoint's MiniLM (before the resolver)
    "resolver": (True, False),  # resolved to a trained instruction; a refused one holds still: a failure
    "resolver_allow_unknown": (True, True),  # a refused one encoded as is
}


def paraphrase_part(args: Args) -> None:
    """P5 with the resolver off and on, on the same seeds and paraphrase draws (a fresh load each), into
    ``paraphrase.<suite>.<method>``."""
    import policies
    from train.protocols import paraphrase_eval
    if args.suite not in TRAINING:
        raise SystemExit(f"--part paraphrase needs --suite, one of {', '.join(TRAINING)}")
    ckpt = Path(args.ckpt) if args.ckpt else _suite_run(args.suite, args.conditioning) / "ckpt"
    if not ckpt.exists():
        raise SystemExit(f"no checkpoint at {ckpt}: train it first (--part train --suite {args.suite} "
                         f"--conditioning {args.conditioning})")
    torch.set_num_threads(1)
    meta = policies.read_checkpoint_meta(ckpt)
    env_id, trained = meta.get("extra", {}).get("env_id"), list(meta["instructions"])  # the suite's tasks it knows
    opts = TRAINING[args.suite][4]
    runs = {}
    for name, (resolve, allow) in PARAPHRASE_METHODS.items():
        if allow and runs.get("resolver", {}).get("refused_episodes") == 0:  # nothing refused: the same episodes
            runs[name] = {**runs["resolver"], "allow_unknown": True}
            continue
        runs[name] = paraphrase_eval(policies.load(ckpt, to_act=True), env_id, args.episodes, args.p5_seed,
                                     instructions=trained, env_options=opts, clean=(name == "encoder"),
                                     perturbation_seed=args.perturbation_seed, resolve=resolve, allow_unknown=allow)
        print(args.suite, args.conditioning, name, runs[name]["success_rate"], flush=True)
    clean = runs["encoder"]["clean"]
    command = (f"benchmarks/language.py --part paraphrase --suite {args.suite}" + (f" --ckpt {args.ckpt}" if args.ckpt
               else "") + ("" if args.conditioning == "pooled" else f" --conditioning {args.conditioning}")
               + f" --episodes {args.episodes} --p5-seed {args.p5_seed} "
               f"--perturbation-seed {args.perturbation_seed}")
    out = {}
    for name, r in runs.items():
        if args.conditioning != "pooled":  # the recipe's rows keep their names; another conditioning's are prefixed
            name = args.conditioning + ("" if name == "encoder" else "+" + name)
        out[name] = {"clean": clean["success_rate"], "conditioning": args.conditioning, "paraphrase": r["success_rate"],
                     "ratio": r["success_rate"] / clean["success_rate"] if clean["success_rate"] else None,
                     "episodes": r["episodes"], "seeds": 1, "ci95": r["ci95"], "successes": r["successes"],
                     "clean_ci95": clean["ci95"], "clean_successes": clean["successes"],
                     "did_other_task_rate": r["did_other_task_rate"], "per_instruction": r["per_instruction"],
                     "seconds": r["seconds"], "ckpt": str(ckpt.relative_to(ROOT) if ckpt.is_relative_to(ROOT) else ckpt),
                     "env_id": env_id, "env_options": opts, "env_seed": args.p5_seed,
                     "perturbation_seed": args.perturbation_seed, "command": command,
                     "paraphrases_in_vocabulary": runs["encoder"]["paraphrases_in_vocabulary"],
                     **{k: r[k] for k in ("refused_episodes", "refused", "resolved") if k in r}}
    old = load_results(args.out)
    old["paraphrase"] = {k: v for k, v in old.get("paraphrase", {}).items() if k in TRAINING}  # suites only
    old["paraphrase"][args.suite] = {**old["paraphrase"].get(args.suite, {}), **out}
    write(args.out, old, table(old, list(old.get("suites", {}))))


def main(args: Args) -> None:
    if args.part == "train":
        return train_part(args)
    if args.part == "paraphrase":
        return paraphrase_part(args)
    if args.part == "compositional":
        return compositional_part(args)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    suites = load_suites(args.suites)
    lm = MiniLM()
    enc = lm.words
    all_instructions = {k: v["instructions"] for k, v in suites.items()}
    # leakage checks: the calibration pools and generated wordings must not contain evaluation wordings
    res: dict = {"machine": machine(), "args": {k: getattr(args, k) for k in Args.__dataclass_fields__},
                 "suites": {}, "encoders": {}, "refusal": {}, "resolution": {}, "calibration": {}}
    fitted: dict[str, dict[str, InstructionResolver]] = {}
    cal_sets = {}
    for name, s in suites.items():
        others = [t for k, v in all_instructions.items() if k != name for t in v]
        cal = calibration_set(s["instructions"], others=others, seed=args.seed, per_instruction=args.per_instruction)
        cal_sets[name] = cal
        evaluation = {" ".join(_split(t)) for t, _ in s["A"] + s["B"] + s["C"]}
        generated = {" ".join(_split(t)) for t, _ in cal["positive"] + cal["negative"]}
        overlap = sorted(t for t in evaluation & generated if t.strip(" ,"))
        res["suites"][name] = {"instructions": s["instructions"], "source": s["source"], "n_A": len(s["A"]),
                               "n_B": len(s["B"]), "n_C": len(s["C"]), "n_calibration_positive": len(cal["positive"]),
                               "n_calibration_negative": len(cal["negative"]),
                               "evaluation_wordings_also_generated": overlap,
                               "one_word_pairs": [[s["instructions"][a], s["instructions"][b]]
                                                  for a, b in one_word_pairs(s["instructions"])]}
        t = time.perf_counter()
        kw = dict(others=others, seed=args.seed, per_instruction=args.per_instruction, colours=s["colours"])
        variants = {  # name -> resolver; "slots+synonyms" is the design (InstructionResolver.fit's defaults)
            "slots+synonyms": InstructionResolver.fit(s["instructions"], **kw),
            "slots+synonyms+minilm": InstructionResolver.fit(s["instructions"], soft=True, encoder=enc, **kw),
            "slots+minilm": InstructionResolver.fit(s["instructions"], synonyms=False, soft=True, encoder=enc, **kw),
            "slots": InstructionResolver.fit(s["instructions"], synonyms=False, **kw),
        }
        fitted[name] = variants
        res["calibration"][name] = {k: {"thresholds": v.thresholds, "stats": v.calibration}
                                    for k, v in variants.items()}
        print(f"[{name}] fitted in {time.perf_counter() - t:.1f} s: " +
              ", ".join(f"{k} {v.thresholds}" for k, v in variants.items()), flush=True)
    # encoders: retrieval top-1 and one-word margins
    for name, s in suites.items():
        scorers = build_scorers(s["instructions"], lm, fitted[name])
        wordings = s["A"] + s["B"]
        for sname, sc in scorers.items():
            e = res["encoders"].setdefault(sname, {"retrieval_top1": {}, "one_word_margin": {}})
            e["retrieval_top1"][name] = {"A": top1(sc, s["instructions"], s["A"]),
                                         "B": top1(sc, s["instructions"], s["B"])}
            e["one_word_margin"][name] = margins(sc, s["instructions"], wordings)
        # refusal methods
        deciders = []
        for sname in ("minilm_pooled", "minilm_tokens", "minilm_words"):
            d, thr = threshold_decider(f"{sname}_threshold", scorers[sname], cal_sets[name], args.valid_refusal)
            d95, thr95 = threshold_decider(f"{sname}_threshold_neg95", scorers[sname], cal_sets[name], None)
            res["calibration"][name][f"{sname}_threshold"] = {"threshold": thr, "threshold_neg95": thr95}
            deciders += [d, d95]
        for k in variants:
            deciders.append(resolver_decider(k, fitted[name][k]))
        for d in deciders:
            ev = evaluate(d, s)
            res["resolution"].setdefault(d.name, {})[name] = ev
        print(f"[{name}] evaluated ({time.perf_counter() - t0:.0f} s)", flush=True)
    # pooled over suites
    for sname, e in res["encoders"].items():
        for key in ("A", "B"):
            num = sum(e["retrieval_top1"][n][key] * len(suites[n][key]) for n in suites)
            e["retrieval_top1"].setdefault("all", {})[key] = num / sum(len(suites[n][key]) for n in suites)
    for method, per in res["resolution"].items():
        n_valid = sum(per[n]["n_A"] + per[n]["n_B"] for n in suites)
        valid_ref = sum(per[n]["A_refused"] * per[n]["n_A"] + per[n]["B_refused"] * per[n]["n_B"] for n in suites)
        n_out = sum(per[n]["n_C"] for n in suites)
        out_ref = sum(per[n]["C_refused"] * per[n]["n_C"] for n in suites)
        n_extra = sum(per[n]["n_C+"] for n in suites)
        extra_ref = sum(per[n]["C+_refused"] * per[n]["n_C+"] for n in suites)
        correct = sum(per[n]["A"] * per[n]["n_A"] + per[n]["B"] * per[n]["n_B"] for n in suites)
        res["refusal"][method] = {"out_of_suite_refused": out_ref / n_out, "valid_refused": valid_ref / n_valid,
                                  "n_out": n_out, "n_valid": n_valid, "valid_resolved_correctly": correct / n_valid,
                                  "untrained_or_underspecified_refused": extra_ref / n_extra, "n_extra": n_extra,
                                  "valid_refused_by_suite": {
                                      n: (per[n]["A_refused"] * per[n]["n_A"] + per[n]["B_refused"] * per[n]["n_B"])
                                      / (per[n]["n_A"] + per[n]["n_B"]) for n in suites},
                                  "out_of_suite_refused_by_suite": {n: per[n]["C_refused"] for n in suites}}
    # timing (1 thread, after warm-up): the design, and the MiniLM variant with a cold word cache
    times = []
    for name, s in suites.items():
        r = InstructionResolver.from_json(fitted[name]["slots+synonyms"].to_json())
        texts = [t for t, _ in s["A"] + s["B"] + s["C"]]
        for t in texts:
            r.resolve(t)
        for _ in range(3):
            for t in texts:
                a = time.perf_counter()
                r.resolve(t)
                times.append((time.perf_counter() - a) * 1e3)
    fresh = []
    for name, s in suites.items():  # each call may encode its unknown words with MiniLM
        r = InstructionResolver.from_json(fitted[name]["slots+synonyms+minilm"].to_json(),
                                          encoder=minilm_word_encoder())
        r.warm()
        for t, _ in s["A"] + s["B"] + s["C"]:
            a = time.perf_counter()
            r.resolve(t)
            fresh.append((time.perf_counter() - a) * 1e3)
    res["timing"] = {"ms_per_call": {"median": float(np.median(times)), "p99": float(np.percentile(times, 99)),
                                     "max": float(np.max(times)), "n": len(times)},
                     "ms_per_call_minilm_cold_words": {"median": float(np.median(fresh)),
                                                       "p99": float(np.percentile(fresh, 99)),
                                                       "max": float(np.max(fresh)), "n": len(fresh)},
                     "torch_threads": torch.get_num_threads()}
    # examples of refusal reasons
    res["reasons"] = {name: {t: fitted[name]["slots+synonyms"].resolve(t).reason for t, _ in s["C"]}
                      for name, s in suites.items()}
    res["rechecks"] = rechecks({name: fitted[name]["slots+synonyms"] for name in suites})
    res["recommended"] = "slots+synonyms"
    res["synonym_table_words"] = sorted({w for g in SYNONYM_GROUPS for w in g})
    res["wall_s"] = time.perf_counter() - t0
    old = load_results(args.out)  # keep the paraphrase section of an earlier --part paraphrase
    if "compositional" in old:
        res["compositional"] = old["compositional"]
    if "paraphrase" in old:  # one section per suite (an older single-checkpoint section is dropped)
        res["paraphrase"] = {k: v for k, v in old["paraphrase"].items() if k in TRAINING}
    write(args.out, res, table(res, list(suites)))


def table(res: dict, names: list[str]) -> str:
    if "encoders" not in res:  # only --part paraphrase has run
        return "# Instruction resolution (benchmarks/language.py)\n\n" + paraphrase_table(res["paraphrase"]) + "\n"
    out = ["# Instruction resolution (benchmarks/language.py)\n",
           "Suites: " + ", ".join(f"{n} ({len(res['suites'][n]['instructions'])} instructions)" for n in names) + ". "
           "A: held-out paraphrases; B: hand-written valid wordings; C: hand-written out-of-suite wordings "
           "(C+: untrained combinations and underspecified, apart). Thresholds chosen on generated wordings only.\n",
           "## Retrieval (nearest trained instruction, no refusal) and one-word margin\n"]
    rows = []
    for sname, e in res["encoders"].items():
        rt = e["retrieval_top1"]
        mg = [e["one_word_margin"][n] for n in names if e["one_word_margin"][n].get("pairs")]
        rows.append([sname, rt["all"]["A"], rt["all"]["B"], *[f"{rt[n]['A']:.2f} / {rt[n]['B']:.2f}" for n in names],
                     f"{np.mean([m['trained'] for m in mg]):.3f} / {np.min([m['trained_min'] for m in mg]):.3f}",
                     f"{np.mean([m['wordings_mean'] for m in mg]):.3f} / {np.min([m['wordings_min'] for m in mg]):.3f}",
                     float(np.mean([m["wordings_swapped"] for m in mg]))])
    out.append(md_table(["method", "top1 A", "top1 B", *[f"{n} A / B" for n in names], "margin trained mean / min",
                         "margin wordings mean / min", "share swapped"], rows))
    out.append("\n## Refusal and resolution (A+B valid, C out-of-suite)\n")
    rows = []
    for m, r in res["refusal"].items():
        per = res["resolution"][m]
        rows.append([m, r["valid_resolved_correctly"], r["valid_refused"], r["out_of_suite_refused"],
                     r["untrained_or_underspecified_refused"],
                     *[f"{per[n]['A']:.2f} / {per[n]['B']:.2f} / {per[n]['C_refused']:.2f}" for n in names]])
    out.append(md_table(["method", "valid correct", "valid refused", "C refused", "C+ refused",
                         *[f"{n} A / B / C ref" for n in names]], rows))
    n_valid = next(iter(res["refusal"].values()))["n_valid"]
    n_out = next(iter(res["refusal"].values()))["n_out"]
    out.append(f"\nn_valid = {n_valid}, n_out = {n_out}. ")
    t = res["timing"]
    ms, cold = t["ms_per_call"], t["ms_per_call_minilm_cold_words"]
    out.append(f"Resolver (slots+synonyms) ms per call, 1 thread, after warm-up: median {ms['median']:.3f}, "
               f"p99 {ms['p99']:.3f}, max {ms['max']:.2f}; slots+synonyms+minilm with a cold word cache (MiniLM "
               f"encodes each unknown word): median {cold['median']:.2f}, max {cold['max']:.1f}.\n")
    out.append("\n## Out-of-suite wordings the resolver (slots+synonyms) accepted\n")
    for n in names:
        for ex in res["resolution"]["slots+synonyms"][n]["C_accepted"]:
            out.append(f"- {n}: {ex['text']!r} ({ex['kind']}) -> {ex['accepted_as']!r}")
    out.append("\n## Valid wordings it refused or resolved wrongly\n")
    for n in names:
        for ex in res["resolution"]["slots+synonyms"][n]["valid_missed"]:
            out.append(f"- {n} {ex['set']}: {ex['text']!r} -> {ex['got']}")
    out.append("")
    if res.get("rechecks"):
        rows = [[name, f"{r['n_valid']}", f"{r['valid_correct_rate']:.3f}", f"{r['valid_refused_rate']:.3f}",
                 f"{r['valid_wrong_rate']:.3f}", f"{r['n_invalid']}", f"{r['invalid_refused_rate']:.3f}"]
                for name, r in res["rechecks"].items()]
        out += ["## Blind re-checks: wordings written by helpers who never saw the resolver\n",
                md_table(["set", "valid", "resolved correctly", "refused", "wrong instruction", "out-of-suite",
                          "refused"], rows), ""]
        for name, r in res["rechecks"].items():
            for suite, v in r["suites"].items():
                out += [f"- {name} {suite}: refused {t!r}: {why}" for t, why in v["refused_valid"].items()]
                out += [f"- {name} {suite}: accepted {t!r} ({k}) as {i!r}" for t, (k, i) in v["accepted_invalid"].items()]
        out.append("")
    if "compositional" in res:
        c = res["compositional"]["multitask"]
        rows = [[k, f"{r['success']:.3f}", f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]", r["episodes"],
                 f"{r['did_other_task']:.3f}"] for k, r in c["rows"].items()]
        out += ["## Compositional: trained on 10 tabletop instructions, evaluated on the 2 pairings never shown\n",
                f"Held out: {', '.join(repr(t) for t in c['held_out'])} (encoded as is, as --allow-unknown runs "
                f"them; the resolver refuses an untrained combination). `{c['command']}`\n",
                md_table(["instructions", "success", "95% CI", "episodes", "did another task"], rows), ""]
    if "paraphrase" in res:
        out.append(paraphrase_table(res["paraphrase"]))
    return "\n".join(out) + "\n"


def rechecks(resolvers: dict[str, InstructionResolver]) -> dict:
    """The shipped resolver on the wording sets helpers wrote blind (benchmarks/data/language_recheck*.json:
    they saw the trained instructions and the scenes, never the resolver or the other sets)."""
    out = {}
    for path in sorted(RECHECKS.glob("language_recheck*.json")):
        data = json.loads(path.read_text())
        per: dict = {}
        for suite, r in resolvers.items():
            if suite not in data:
                continue
            valid, invalid = data[suite]["valid"], data[suite]["invalid"]
            got = [(r.resolve(t), target) for t, target in valid]
            accepted = [(t, kind, r.resolve(t)) for t, kind in invalid]
            per[suite] = {"n_valid": len(valid), "n_invalid": len(invalid),
                          "valid_correct": sum(g.instruction == w for g, w in got),
                          "valid_refused": sum(not g.ok for g, _ in got),
                          "valid_wrong": sum(g.ok and g.instruction != w for g, w in got),
                          "invalid_refused": sum(not a.ok for _, _, a in accepted),
                          "refused_valid": {g.text: g.reason for g, _ in got if not g.ok},
                          "accepted_invalid": {t: [kind, a.instruction] for t, kind, a in accepted if a.ok}}
        n_valid = sum(v["n_valid"] for v in per.values())
        n_invalid = sum(v["n_invalid"] for v in per.values())
        out[path.stem] = {"about": data.get("about", ""), "suites": per, "n_valid": n_valid, "n_invalid": n_invalid,
                          **{f"{k}_rate": sum(v[k] for v in per.values()) / max(1, n)
                             for k, n in (("valid_correct", n_valid), ("valid_refused", n_valid),
                                          ("valid_wrong", n_valid), ("invalid_refused", n_invalid))}}
    return out


def paraphrase_table(p: dict) -> str:
    """The ``paraphrase`` section (``--part paraphrase``, one checkpoint per suite) as markdown."""
    labels = {"encoder": "encoded as is (no resolver)", "resolver": "resolver (a refused one holds still: a failure)",
              "resolver_allow_unknown": "resolver, --allow-unknown (a refused one as is)"}
    rows, notes = [], []
    for suite, methods in p.items():
        for name, r in methods.items():
            cond = r.get("conditioning", "pooled")
            base = name if cond == "pooled" else ("encoder" if name == cond else name[len(cond) + 1:])
            label = labels.get(base, base) if cond == "pooled" else f"{cond} conditioning, {labels.get(base, base)}"
            rows.append([suite, label, f"{r['clean_successes']}/{r['episodes']}",
                         f"{r['clean']:.3f}", f"{r['successes']}/{r['episodes']}", f"{r['paraphrase']:.3f}",
                         f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]",
                         "" if r["ratio"] is None else f"{r['ratio']:.2f}", r.get("refused_episodes", "")])
        for first in {r.get("conditioning", "pooled"): r for r in reversed(methods.values())}.values():
            notes.append(f"- {suite}: checkpoint `{first['ckpt']}` ({first['env_id']}), env seeds {first['env_seed']}.."
                         f"{first['env_seed'] + first['episodes'] - 1}, paraphrase draw seed "
                         f"{first['perturbation_seed']}; `OMP_NUM_THREADS=1 .venv/bin/python {first['command']}`")
        for t, why in (methods.get("resolver", {}).get("refused") or {}).items():
            notes.append(f"  - refused {t!r}: {why}")
    return "\n".join(["## What the resolver buys a policy: P5 (held-out paraphrases)\n",
                      "Every episode commanded with one of the suite's held-out paraphrases; the same seeds and "
                      "wordings in every row of a suite; clean: the trained instructions on the same seeds.\n",
                      md_table(["suite", "method", "clean", "clean success", "paraphrase", "paraphrase success",
                                "95% CI", "ratio", "refused episodes"], rows), "", *notes, ""])


if __name__ == "__main__":
    main(tyro.cli(Args))
