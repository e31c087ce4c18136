"""One deterministic grader (docs/method.md `canon`), used for rewards and labels alike."""

from __future__ import annotations

import re

_ARTICLES = ("the ", "a ", "an ")
# Small fixed equivalence table. Laterality is deliberately absent: left != right.
_EQUIV = {
    "y": "yes",
    "yeah": "yes",
    "yep": "yes",
    "true": "yes",
    "correct": "yes",
    "n": "no",
    "nope": "no",
    "false": "no",
    "incorrect": "no",
    "ct": "ct",
    "ct scan": "ct",
    "computed tomography": "ct",
    "mri": "mri",
    "mr": "mri",
    "mri scan": "mri",
    "magnetic resonance imaging": "mri",
    "x ray": "x-ray",
    "xray": "x-ray",
    "x-ray": "x-ray",
    "radiograph": "x-ray",
    "cxr": "x-ray",
    "us": "ultrasound",
    "ultrasound": "ultrasound",
    "sonography": "ultrasound",
    "grey": "gray",
}
# Words whose trailing "s" is not a plural marker (guards the singular fold).
_NO_FOLD = {"yes", "is", "was", "has", "this", "its", "us", "gas", "lens", "axis", "pelvis",
            "bus", "plus", "thus", "less", "mass", "glass", "cross", "abscess", "sinus",
            "thorax", "fetus", "uterus", "virus", "bronchus", "crisis", "diagnosis", "series",
            "status", "bias", "iris"}
_OPTION = re.compile(r"^\(?([a-h])[\).:]\s*(.*)$")
_PUNCT = re.compile(r"[^\w\s\-/]")


def _fold_plural(word: str) -> str:
    if word in _NO_FOLD or len(word) <= 3 or not word.endswith("s") or word.endswith("ss"):
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("ches", "shes", "xes")):
        return word[:-2]
    return word[:-1]


def canon(text: str | None, options: dict[str, str] | None = None) -> str:
    """Canonical form of an answer; "" when nothing gradable is left.

    `options` maps option letters to option texts (multiple-choice data): a bare letter
    and its option text canonicalise to the same string.
    """
    if text is None:
        return ""
    s = " ".join(str(text).lower().strip().split())
    m = _OPTION.match(s)
    if options:
        letters = {k.lower(): v for k, v in options.items()}
        if m and m.group(1) in letters and (not m.group(2) or canon(m.group(2)) ==
                                             canon(letters[m.group(1)])):
            s = letters[m.group(1)].lower()
        elif s in letters:
            s = letters[s].lower()
    s = _PUNCT.sub(" ", s)
    s = " ".join(s.replace("_", " ").split()).strip(" -/")
    for art in _ARTICLES:
        if s.startswith(art) and len(s) > len(art):
            s = s[len(art):]
            break
    if s in _EQUIV:
        return _EQUIV[s]
    words = s.split()
    if words:
        words[-1] = _fold_plural(words[-1])
    s = " ".join(words)
    return _EQUIV.get(s, s)


def is_correct(answer: str | None, reference: str | None,
               options: dict[str, str] | None = None) -> bool:
    """z = 1[canon(answer) = canon(reference) != empty]."""
    a, r = canon(answer, options), canon(reference, options)
    return bool(a) and a == r
