"""benchmarks/results/ holds one results file (+ markdown and plots) per benchmark: every file there is one a
benchmark script names, or one benchmarks/results/manifest.json accounts for; per-run pieces go to the
git-ignored benchmarks/results/runs/ and, once they left the tree, live on as manifest entries with their
provenance. Checked on the source and the files (no benchmark module is imported).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST = RESULTS / "manifest.json"
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]+")
"""a string constant that can be part of a file name (no spaces, two characters or more)"""
FILE = re.compile(r"\.(json|md|png)$")


def _parts(node: ast.AST) -> list[str | None] | None:
    """A name the script builds, as fixed text and holes (None): an f-string, or ``+`` of strings and
    other expressions (``path.stem + "_collapse.png"``); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _parts(node.left) or [None], _parts(node.right) or [None]
        return left + right if any(isinstance(p, str) for p in left + right) else None
    return None


def _imported_words(tree: ast.Module) -> set[str]:
    """The string constants behind project names a script imports (``from guidance.testbed import
    TESTBEDS``: the testbed names that fill ``guidance_{name}.png``), following module-level names."""
    words: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
            continue
        path = ROOT.joinpath(*node.module.split(".")).with_suffix(".py")
        if not path.is_file():
            continue
        assigned = {t.id: a.value for a in ast.parse(path.read_text()).body if isinstance(a, ast.Assign)
                    for t in a.targets if isinstance(t, ast.Name)}
        todo, seen = [a.name for a in node.names], set()
        while todo:
            name = todo.pop()
            if name in seen or name not in assigned:
                continue
            seen.add(name)
            for sub in ast.walk(assigned[name]):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and WORD.fullmatch(sub.value):
                    words.add(sub.value)
                elif isinstance(sub, ast.Name):
                    todo.append(sub.id)
    return words


@lru_cache(maxsize=1)
def _vocabulary() -> tuple[frozenset[str], tuple[tuple[str | None, ...], ...]]:
    """(words, templates) of the benchmark scripts: every string constant, f-string or ``+`` chain that
    ends in a results file's extension is a template; its holes are filled by the scripts' words."""
    words: set[str] = set()
    templates: set[tuple[str | None, ...]] = set()
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        words |= _imported_words(tree)
        for node in ast.walk(tree):
            parts = _parts(node) if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) else None
            if parts is None:
                continue
            words.update(p for p in parts if p and WORD.fullmatch(p))
            if isinstance(parts[-1], str) and FILE.search(parts[-1]):
                templates.add(tuple(p for p in parts if p != ""))
    return frozenset(words), tuple(sorted(templates, key=str))


def _filled(text: str, words: frozenset[str]) -> bool:
    """``text`` is words of the scripts, each after an optional underscore (or nothing at all)."""
    ok = [True] + [False] * len(text)
    for j in range(1, len(text) + 1):
        ok[j] = any(ok[i] and (text[i:j] in words or (text[i] == "_" and text[i + 1:j] in words))
                    for i in range(j))
    return ok[-1]


def _fits(name: str, parts: tuple[str | None, ...], words: frozenset[str]) -> bool:
    if not parts:
        return not name
    head, rest = parts[0], parts[1:]
    if head is not None:
        return name.startswith(head) and _fits(name[len(head):], rest, words)
    return any(_filled(name[:j], words) and _fits(name[j:], rest, words) for j in range(len(name) + 1))


def named_by_a_script(name: str) -> bool:
    """``name`` (relative to benchmarks/results) is a file name some benchmark script builds."""
    words, templates = _vocabulary()
    return any(_fits(name, t, words) for t in templates if all(p is None or p in name for p in t))


@lru_cache(maxsize=1)
def _manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def _entries() -> dict[str, dict]:
    m = _manifest()
    return {**m["pieces"], **m["copied_outputs"]}


def _results_files() -> list[str]:
    """Tracked files under benchmarks/results and untracked ones git does not ignore (the per-run
    pieces in runs/ and pixels_parts/ are ignored), relative to it."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", str(RESULTS)],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    prefix = "benchmarks/results/"
    return sorted({f[len(prefix):] for f in out if f.startswith(prefix)})


def test_every_results_file_is_named_by_a_script_or_the_manifest():
    in_manifest = {f for e in _entries().values() for f in e["files"]} | {MANIFEST.name}
    stray = [f for f in _results_files() if f not in in_manifest and not named_by_a_script(f)]
    assert not stray, (f"benchmarks/results holds files no benchmark script names and manifest.json does not "
                       f"list (a per-run piece belongs in benchmarks/results/runs/): {stray[:20]}")


def test_the_name_check_tells_pieces_from_results_files():
    assert named_by_a_script("grounding.json") and named_by_a_script("grounding_confusion.png")
    assert named_by_a_script("guidance_gmm2d_linear_oracle.png") and named_by_a_script("cig_collapse.png")
    assert named_by_a_script("guidance_seeds_exact_oracle.json")
    for piece in ("g19_flow_p2_bc_s0.json", "gk_switch_relabel_s1.md", "g3_comp_ar_confusion.png",
                  "grounding_with_velocities/grounding.json"):
        assert not named_by_a_script(piece), piece
    grounding = [f for e in _manifest()["pieces"].values() if e["benchmark"] == "benchmarks/grounding.py"
                 for f in e["files"]]
    assert grounding and not [f for f in grounding if named_by_a_script(f)]


def test_manifest_entries_carry_their_provenance():
    m = _manifest()
    assert m["about"] and m["pieces"]
    for key, e in _entries().items():
        assert isinstance(e.get("command"), str) and e["command"], key
        assert re.fullmatch(r"[0-9a-f]{40}", e.get("commit", "")), key
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", e.get("date", "")), key
        assert e["files"], key


def test_pieces_in_the_manifest_left_the_tree():
    here = set(_results_files())
    back = [f for e in _manifest()["pieces"].values() for f in e["files"] if f in here]
    assert not back, f"manifest.json records these pieces as gone, yet they are in benchmarks/results: {back[:20]}"


def test_merged_results_name_an_existing_manifest():
    merged = []
    for path in sorted(RESULTS.glob("*.json")):
        text = path.read_text()
        if '"manifest"' not in text or path == MANIFEST:
            continue
        ref = json.loads(text).get("manifest")
        if ref is not None:
            merged.append(path.name)
            assert isinstance(ref, str) and (RESULTS / ref).is_file(), f"{path.name}: manifest {ref!r} is not a file"
    assert merged, "no merged results file names the manifest"
    into = {e["merged_into"] for e in _manifest()["pieces"].values() if e.get("merged_into")}
    assert into <= set(merged), f"pieces merged into {sorted(into - set(merged))}, which do not name the manifest"
