"""Response parsing: `<think>…</think><answer>…</answer><confidence>N</confidence>` or plain."""

from __future__ import annotations

import re
from dataclasses import dataclass

_CONF = re.compile(r"<confidence>\s*(\d{1,2})\s*</confidence>")
_THINK = re.compile(r"<think>(.*?)</think>", re.S)
TAGS = ("think", "answer", "confidence")
_TAG = re.compile(r"</?(?:think|answer|confidence)>")
# a response cut off inside a tag ends in a piece of it ("<ans", "</thi", "<")
_CUT_TAG = re.compile(r"</?([a-z]*)$")


def _untagged(text: str, blocks: bool) -> str:
    """`text` less the format's tags (and, with `blocks`, closed reasoning blocks), removed
    until none is left: dropping one can join its neighbours into another
    (`<ans</answer>wer>`). Each round removes at least one tag, and the text is a bounded
    response."""
    while True:
        out = _TAG.sub("", _THINK.sub("", text) if blocks else text)
        if out == text:
            return out
        text = out


def clean_answer(text: str, tagged: bool, finished: bool = True) -> str:
    """Answer text without the format's markup, stripped: what `answer` holds whether or
    not the response parses, so it never carries a tag. `tagged`: the content of an
    `<answer>` tag (a closed reasoning block in it goes, a stray tag is dropped); else a
    whole response without one, whose answer is what follows its reasoning (none when the
    reasoning was never closed). `finished`: the response ended on its own; one cut off
    by the token limit loses a trailing piece of a tag (`<ans`), which a finished one
    keeps, as its text (`a <c`)."""
    if tagged:
        return _untagged(text, blocks=True).strip()
    if "</think>" in text:
        text = text[text.rindex("</think>") + len("</think>"):]
    if "<think>" in text:
        text = text[:text.index("<think>")]        # reasoning never closed: no answer
    text = _untagged(text, blocks=False)
    cut = None if finished else _CUT_TAG.search(text)
    if cut and any(name.startswith(cut.group(1)) for name in TAGS):
        text = text[:cut.start()]
    return text.strip()


@dataclass(frozen=True)
class Parsed:
    answer: str                      # "" when empty, duplicated or unclosed; never a tag
    think: str | None
    confidence: int | None           # 0..10, None when absent or invalid
    # characters of the answer content in the response; untagged, the raw body's span,
    # which `answer` (the cleaned text) need not match: the heads read the span's tokens
    answer_span: tuple[int, int]
    close_span: tuple[int, int]      # characters of the token(s) that close the answer
    tagged: bool                     # the response uses the answer tag
    well_formed: bool                # think, answer and confidence all parse

    @property
    def verbalized(self) -> float:
        """Verbalized confidence in [0, 1]; invalid or missing is kept at 0.5 (docs/method.md)."""
        return 0.5 if self.confidence is None else self.confidence / 10


def parse_response(text: str, finished: bool = True) -> Parsed:
    """`text` parsed; `finished`: it ended on its own, not cut off by the token limit."""
    conf_m = _CONF.search(text)
    conf = int(conf_m.group(1)) if conf_m and int(conf_m.group(1)) <= 10 else None
    think_m = _THINK.search(text)
    think = think_m.group(1).strip() if think_m else None
    n_open = text.count("<answer>")
    if n_open == 0:
        body = text.split("<confidence>")[0]
        start = len(body) - len(body.lstrip())
        end = len(body.rstrip())
        # no answer tag: the text is the answer (a plain-format actor), less any markup
        return Parsed(clean_answer(body, False, finished), think, conf, (start, end),
                      (start, end), False, False)
    s = text.index("<answer>") + len("<answer>")
    close = text.find("</answer>", s)
    e = close if close >= 0 else len(text.split("<confidence>")[0])
    answer = clean_answer(text[s:e], True) if n_open == 1 and close >= 0 else ""
    close_span = (close, close + len("</answer>")) if close >= 0 else (s, e)
    well = bool(answer) and think is not None and conf is not None
    return Parsed(answer, think, conf, (s, e), close_span, True, well)
