"""The embedded actor's trajectory format and easy-VQA ground truth.

    <think>I see a {colour} {shape}. {reasoning}</think><answer>{answer}</answer>
    <confidence>{0..10}</confidence>

The observation names what is seen; the reasoning ties it to the question; so vision,
reasoning and answer can be perturbed separately (TGS).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from models.items import COLOURS, SHAPES, Item


@dataclass(frozen=True)
class Question:
    kind: str                 # "color", "shape" or "yes/no"
    attribute: str | None     # the colour or shape a yes/no question asks about
    negated: bool


def parse_question(q: str) -> Question:
    words = re.findall(r"[a-z]+", q.lower())
    negated = "not" in words or "no" in words
    asked = next((w for w in words if w in COLOURS or w in SHAPES), None)
    if words[0] in ("what",):
        if "color" in words or "colour" in words:
            return Question("color", None, False)
        return Question("shape", None, False)
    return Question("yes/no", asked, negated)


def truth(colour: str, shape: str, q: Question) -> str:
    if q.kind == "color":
        return colour
    if q.kind == "shape":
        return shape
    present = q.attribute in (colour, shape)
    return "yes" if present != q.negated else "no"


def reasoning(colour: str, shape: str, q: Question, answer: str) -> str:
    if q.kind == "color":
        return f"The question asks for the colour, so the answer is {answer}."
    if q.kind == "shape":
        return f"The question asks for the shape, so the answer is {answer}."
    kind = "colour" if q.attribute in COLOURS else "shape"
    seen = colour if kind == "colour" else shape
    noun = f"{q.attribute} shape" if kind == "colour" else q.attribute
    ask = f"no {noun}" if q.negated else f"a {noun}"
    return f"The question asks if there is {ask}; the {kind} is {seen}, so the answer is {answer}."


def trajectory(colour: str, shape: str, question: str, answer: str | None = None,
               confidence: int | None = None) -> str:
    q = parse_question(question)
    ans = answer if answer is not None else truth(colour, shape, q)
    text = (f"<think>I see a {colour} {shape}. {reasoning(colour, shape, q, ans)}</think>"
            f"<answer>{ans}</answer>")
    if confidence is not None:
        text += f"<confidence>{confidence}</confidence>"
    return text


def image_facts(items: list[Item]) -> dict[str, tuple[str, str]]:
    """(colour, shape) of every image, read off the answers of its own questions."""
    colour: dict[str, str] = {}
    shape: dict[str, str] = {}
    for it in items:
        q = parse_question(it.question)
        words = re.findall(r"[a-z]+", it.question.lower())
        if q.kind == "color":
            colour[it.image_id] = it.answer
            for w in (w for w in words if w in SHAPES):
                shape[it.image_id] = w
        elif q.kind == "shape":
            shape[it.image_id] = it.answer
            for w in (w for w in words if w in COLOURS):
                colour[it.image_id] = w
        elif it.answer == ("no" if q.negated else "yes"):   # the attribute is present
            (colour if q.attribute in COLOURS else shape)[it.image_id] = q.attribute
    return {i: (colour[i], shape[i]) for i in colour if i in shape}


def describe_images(items: list[Item]) -> dict[str, str]:
    """What each easy-VQA image shows ("a red circle"), from the gold answers of its own
    questions (`image_facts`): the observation of the TGS probe's gold-conditioned good
    trajectory. Images of other data sets, or whose colour or shape no question settles,
    are left out."""
    facts = image_facts([it for it in items if it.domain == "easyvqa"])
    return {i: f"a {c} {s}" for i, (c, s) in facts.items()}
