"""The README and the reports in docs/ quote results only from the results files, so they cannot go stale.

The rule a report follows: a decimal figure outside code is either a link to the JSON value it quotes,
``[0.93](../benchmarks/results/pixels.json#/suites/tabletop/head_dr_nonoise/success)`` (a JSON pointer,
RFC 6901, after the ``#``; a space in a key is ``%20``), or sits in a table copied from a benchmark's rendered markdown and marked
``<!-- table: benchmarks/results/pixels.md -->`` on the line above. Settings and versions go in code
spans (`--rho 0.9`, `robosuite 1.5`). Relative links must resolve.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import json_file, json_pointer

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) if (ROOT / "docs").is_dir() else []
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
COMMENT = re.compile(r"<!--(?!\s*table:).*?-->", re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
TABLE_MARK = re.compile(r"^<!--\s*table:\s*(\S+)\s*-->\s*$")
DECIMAL = re.compile(r"(?<![\w.\-/])-?\d*\.\d+(?![\w.])")
FIGURE = re.compile(r"^\s*(-?\d*\.\d+|-?\d+)(%?)\s*$")
PAIR = re.compile(r"^\s*\[\s*(-?\d*\.?\d+)\s*,\s*(-?\d*\.?\d+)\s*\]\s*$")


def _matches(text: str, value) -> bool:
    """The shown figure is the value at the precision shown (a percent is the fraction x 100)."""
    pair = PAIR.match(text)
    if pair:
        return isinstance(value, list) and len(value) == 2 and all(
            _matches(t, v) for t, v in zip(pair.groups(), value))
    m = FIGURE.match(text)
    if not m or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    shown, percent = m.groups()
    v = float(value) * (100 if percent else 1)
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return math.isclose(float(shown), v, abs_tol=0.5 * 10 ** -decimals + 1e-9)


def check_markdown(path: Path) -> list[str]:
    """Problems with one markdown file under the rule in this module's docstring."""
    problems: list[str] = []
    text = COMMENT.sub("", FENCE.sub("", path.read_text()))
    # marked tables first, verbatim (their rows may hold code spans and links, as the rendered markdown does)
    kept: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        mark = TABLE_MARK.match(lines[i])
        if not mark:
            kept.append(lines[i])
            i += 1
            continue
        rows = []
        i += 1
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            rows.append(lines[i].strip())
            i += 1
        kept.append("")
        source = ROOT / mark.group(1)
        if not source.exists():
            problems.append(f"{path.name}: table source {mark.group(1)} does not exist")
            continue
        have = {line.strip() for line in source.read_text().splitlines()}
        if not rows:
            problems.append(f"{path.name}: table mark for {mark.group(1)} with no table under it")
        for row in rows:
            if not (set(row) <= set("|-: ") or row in have):
                problems.append(f"{path.name}: table row not in {mark.group(1)}: {row[:100]}")
    text = CODE_SPAN.sub("``", "\n".join(kept))

    def link(m: re.Match) -> str:
        _, label, target = m.groups()
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return label if not DECIMAL.search(label) else "<external figure>"
        file, _, pointer = target.partition("#")
        pointer = unquote(pointer)  # a key with a space is written %20, as in any markdown link
        dest = (path.parent / file).resolve()
        if not dest.exists():
            problems.append(f"{path.name}: link to a missing file {target}")
            return ""
        if pointer and dest.suffix == ".json":
            try:
                value = json_pointer(json_file(dest), pointer)
            except (KeyError, IndexError, ValueError, TypeError) as e:
                problems.append(f"{path.name}: {target} names nothing in the JSON ({e})")
                return ""
            if not _matches(label, value):
                problems.append(f"{path.name}: [{label}] quotes {target}, which holds {value!r}")
            return ""
        return label

    for n, line in enumerate(LINK.sub(link, text).splitlines(), 1):
        for number in DECIMAL.findall(line):
            problems.append(f"{path.name}: figure {number} is neither linked to a results JSON nor in a marked "
                            f"table: {line.strip()[:100]}")
    return problems


def test_readme_is_short_and_its_figures_are_sourced():
    readme = ROOT / "README.md"
    n = len(readme.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the user's guide stays within {README_MAX_LINES}"
    assert check_markdown(readme) == []


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_report_figures_match_their_results(doc: Path):
    assert check_markdown(doc) == []


def test_the_checker_catches_a_stale_figure(tmp_path: Path):
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"a/b": {"success": 0.934, "ci95": [0.86, 0.96]}}))
    good = tmp_path / "good.md"
    good.write_text("Success [0.93](r.json#/a~1b/success) [[0.86, 0.96]](r.json#/a~1b/ci95), "
                    "[93%](r.json#/a~1b/success), with `--rho 0.9`.\n")
    assert check_markdown(good) == []
    stale = tmp_path / "stale.md"
    stale.write_text("Success [0.91](r.json#/a~1b/success) and a bare 0.95, [x](r.json#/nope).\n")
    problems = check_markdown(stale)
    assert len(problems) == 3, problems
