"""Rules on trajectory text: TGS bad variants (docs/method.md §3), hesitation cuts (TGS paper A.3)
and novel visual claims (docs/method.md §5).

A trajectory is `<think>{observation}. {reasoning}</think><answer>{a}</answer>...`; the
first sentence of the think block is the vision rationale v, the rest is the reasoning r.
Each variant changes one axis and copies the other two byte for byte; a rule that does
not apply returns None (the item then has no pair on that axis).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from models.data import COLOURS, SHAPES

_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")
SIDES = {"left": "right", "right": "left", "upper": "lower", "lower": "upper",
         "top": "bottom", "bottom": "top"}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten")
CATEGORIES: dict[str, tuple[str, ...]] = {"colour": COLOURS, "shape": SHAPES}


def _pick(options: list[str], key: str) -> str:
    """A deterministic choice among `options`, seeded by `key`."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return options[h % len(options)]


def _sub_word(text: str, old: str, new: str) -> str:
    """Replace the first whole-word `old` (case kept for a capitalised word)."""
    def repl(m: re.Match) -> str:
        w = m.group(0)
        return new.capitalize() if w[:1].isupper() else new
    return re.sub(rf"\b{re.escape(old)}\b", repl, text, count=1, flags=re.I)


def question_kind(question: str) -> str | None:
    """Which attribute a question is about: "colour", "shape" or None."""
    words = re.findall(r"[a-z]+", question.lower())
    if "color" in words or "colour" in words:
        return "colour"
    if "shape" in words and words[:1] == ["what"]:
        return "shape"
    asked = next((w for w in words if w in COLOURS or w in SHAPES), None)
    if asked is None:
        return None
    return "colour" if asked in COLOURS else "shape"


@dataclass(frozen=True)
class Parts:
    think: tuple[int, int]        # character span of the think content
    vision: tuple[int, int]       # the first sentence of it
    reasoning: tuple[int, int]    # the rest of it
    answer: tuple[int, int]       # the answer content


def split(text: str) -> Parts | None:
    t, a = _THINK.search(text), _ANSWER.search(text)
    if not t or not a:
        return None
    s, e = t.span(1)
    end = _SENTENCE_END.search(text, s, e)
    cut = end.end() if end else e
    return Parts((s, e), (s, cut), (cut, e), a.span(1))


def _replace(text: str, span: tuple[int, int], new: str) -> str:
    return text[:span[0]] + new + text[span[1]:]


def swap_value(segment: str, question: str, key: str) -> str | None:
    """Swap one observed value (colour, shape, side, count) for a different one,
    preferring the attribute the question is about."""
    low = segment.lower()
    found = [(cat, w) for cat, vocab in CATEGORIES.items() for w in vocab
             if re.search(rf"\b{w}\b", low)]
    prefer = question_kind(question)
    found.sort(key=lambda cw: (cw[0] != prefer, low.find(cw[1])))
    if found:
        cat, w = found[0]
        return _sub_word(segment, w, _pick([v for v in CATEGORIES[cat] if v != w], key))
    for w, other in SIDES.items():
        if re.search(rf"\b{w}\b", low):
            return _sub_word(segment, w, other)
    m = re.search(r"\b(\d+)\b", segment)
    if m:
        return segment[:m.start()] + str(int(m.group(1)) + 1) + segment[m.end():]
    for i, w in enumerate(NUMBER_WORDS[:-1]):
        if re.search(rf"\b{w}\b", low):
            return _sub_word(segment, w, NUMBER_WORDS[i + 1])
    return None


def vision_variant(text: str, question: str, key: str) -> str | None:
    p = split(text)
    if p is None:
        return None
    seg = text[p.vision[0]:p.vision[1]]
    new = swap_value(seg, question, key)
    return None if new is None or new == seg else _replace(text, p.vision, new)


_REASONING_RULES: list[tuple[re.Pattern, str]] = [
    # misread what the question asks for; the stated conclusion no longer follows
    (re.compile(r"\basks for the colou?r\b"), "asks for the shape"),
    (re.compile(r"\basks for the shape\b"), "asks for the colour"),
    # invert the question's polarity
    (re.compile(r"\bthere is no\b"), "there is a"),
    (re.compile(r"\bthere is an?\b"), "there is no"),
    # negate (or un-negate) the first statement
    (re.compile(r"\bis not\b"), "is"),
    (re.compile(r"\bis\b"), "is not"),
]


def reasoning_variant(text: str) -> str | None:
    """One logical error in the reasoning; observation and answer untouched."""
    p = split(text)
    if p is None:
        return None
    seg = text[p.reasoning[0]:p.reasoning[1]]
    for pattern, new in _REASONING_RULES:
        if pattern.search(seg):
            return _replace(text, p.reasoning, pattern.sub(new, seg, count=1))
    return None


def flip_answer(answer: str, key: str) -> str | None:
    """Rule-based wrong answer: yes↔no, another colour or shape, the other side, n±1."""
    a = answer.strip().lower()
    if a in ("yes", "no"):
        return "no" if a == "yes" else "yes"
    for vocab in CATEGORIES.values():
        if a in vocab:
            return _pick([v for v in vocab if v != a], key)
    if a in SIDES:
        return SIDES[a]
    if re.fullmatch(r"-?\d+", a):
        return str(int(a) + 1)
    return None


def answer_variant(text: str, key: str) -> str | None:
    m = _ANSWER.search(text)
    if not m:
        return None
    new = flip_answer(m.group(1), key)
    return None if new is None else _replace(text, m.span(1), new)


# ---------------------------------------------------------------- hesitation (TGS A.3)
HESITATION = ("wait", "hold on", "hmm", "actually", "let me reconsider", "on second thought",
              "let me recheck", "let me recalculate", "let me re-examine", "i made a mistake",
              "i made an error", "that's not right", "no, that's wrong", "correction",
              "i should reconsider")
_HES = re.compile(r"\b(" + "|".join(re.escape(h) for h in
                                    sorted(HESITATION, key=len, reverse=True)) + r")\b", re.I)


def hesitations(text: str) -> list[tuple[str, str]]:
    """(pre, post) cuts around each hesitation marker in the think block, answer kept:
    pre ends right before the marker; post at the next sentence boundary after it (no
    later than the next marker)."""
    p = split(text)
    if p is None:
        return []
    s, e = p.think
    think = text[s:e]
    answer = text[p.answer[0]:p.answer[1]]
    marks = list(_HES.finditer(think))
    cuts = []
    for i, m in enumerate(marks):
        stop = marks[i + 1].start() if i + 1 < len(marks) else len(think)
        end = _SENTENCE_END.search(think, m.end(), stop)
        post_end = end.end() if end else stop

        def traj(body: str) -> str:
            return f"<think>{body.rstrip()}</think><answer>{answer}</answer>"

        cuts.append((traj(think[:m.start()]), traj(think[:post_end])))
    return cuts


# ---------------------------------------------------------------- novel visual claims (§5)
PRESENCE = ("see", "sees", "seen", "show", "shows", "showing", "shown", "visible", "appear",
            "appears", "present", "observe", "observed", "depicted", "evident", "reveals",
            "demonstrates", "contains")
LOCATION = ("left", "right", "upper", "lower", "top", "bottom", "middle", "centre", "center",
            "corner", "above", "below", "anterior", "posterior", "medial", "lateral",
            "superior", "inferior")
APPEARANCE = ("irregular", "spiculated", "round", "rounded", "oval", "smooth", "dense",
              "bright", "dark", "opaque", "heterogeneous", "homogeneous", "enhancing",
              "hypodense", "hyperdense", *COLOURS, *SHAPES)
SEVERITY = ("mild", "moderate", "severe", "extensive", "marked", "minimal", "diffuse",
            "focal", "large", "small")
VISUAL_WORDS = frozenset(PRESENCE + LOCATION + APPEARANCE + SEVERITY)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?", text.lower())


def novel_visual_claim(rationale: str, question: str, max_n: int = 5) -> bool:
    """Visual-observation language in the rationale that is not copied from the question:
    words covered by any 1..max_n-word phrase shared with the question are ignored."""
    r, q = _words(rationale), _words(question)
    qgrams = {tuple(q[i:i + n]) for n in range(1, max_n + 1) for i in range(len(q) - n + 1)}
    copied = [False] * len(r)
    for n in range(1, max_n + 1):
        for i in range(len(r) - n + 1):
            if tuple(r[i:i + n]) in qgrams:
                copied[i:i + n] = [True] * n
    return any(w in VISUAL_WORDS and not c for w, c in zip(r, copied))


def rationale(text: str) -> str:
    """The think block's content, or the whole response without tags."""
    m = _THINK.search(text)
    return m.group(1) if m else re.sub(r"<[^>]+>", " ", text)
