"""TGS trajectories the actor did not write, and perturbation families the consistency
reader never saw (docs/probes.md, "External good trajectory and held-out families").

*Gold-conditioned good trajectory.* The TGS paper's good trajectory comes from another
model given the image, the question and the gold answer; ours is a fixed template that
states the gold answer (and what the data's annotations say the image shows, when they
say it), written in a wording the actor was never trained on:

    <think>The image shows {observation}. That supports {gold}, so the answer is
    {gold}.</think><answer>{gold}</answer>

Its bad trajectories change one axis each, by construction: *vision* one observed value
swapped (`text.swap_value`), *reasoning* the step inverted ("That rules out {gold}") with
the answer kept, *answer* the rule-based flip (`text.flip_answer`). It is the same for
every deployment and exists for every item, answered right or wrong.

*Held-out families.* The consistency reader was fitted on the actor's own trajectories
and on the same trajectories with the answer tag flipped (the in-distribution answer
axis). Each family below rewrites a trajectory in a form that reader never saw; applied
to a good trajectory and to each of its bad variants alike, the pair still differs on one
axis only:
- `synonym`: the data set's answer words written with other words (a per-data-set table,
  `models.synonyms`, data like a label set; yes/no by a generic English table, in the
  answer tag only). Absent for a data set without a table.
- `phrase`: the answer stated in a sentence ("my answer is {a}") instead of a bare word.
- `paraphrase`: the rationale's connective phrases reworded (a generic English table).
"""

from __future__ import annotations

import re

from clients.probes import text

FAMILIES = ("synonym", "phrase", "paraphrase")
SOURCES = ("own", "gold")
NO_OBSERVATION = "what the question asks about"

GOLD = ("<think>The image shows {observation}. That supports {gold}, so the answer is "
        "{gold}.</think><answer>{gold}</answer>")
GOLD_BAD_REASONING = "That rules out {gold}, so the answer is {gold}."

# generic English, used in the answer tag only ("there is no" in a rationale stays)
YES_NO: dict[str, tuple[str, ...]] = {"yes": ("affirmative", "correct"),
                                      "no": ("negative", "incorrect")}

# Connective phrases of the trajectory formats the probes meet (the embedded actor's and
# the gold template's), each reworded; the content words (what is seen, the answer) stay.
PARAPHRASES: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(p), new) for p, new in (
        (r"\bI see\b", "The picture contains"),
        (r"\bThe image shows\b", "In the picture there is"),
        (r"\bThe question asks for the\b", "We are asked about the"),
        (r"\bThe question asks if there is\b", "We must decide whether there is"),
        (r"\bThe question asks\b", "We are asked"),
        (r"\bso the answer is\b", "hence the reply is"),
        (r"\bThat supports\b", "This backs"),
        (r"\bThat rules out\b", "This excludes")))


# ---------------------------------------------------------------- gold-conditioned good
def gold_trajectory(gold: str, observation: str | None) -> str:
    return GOLD.format(observation=observation or NO_OBSERVATION, gold=gold.strip())


def gold_variants(gold: str, observation: str | None, question: str, key: str
                  ) -> dict[str, str | None]:
    """The gold trajectory's three bad variants, one axis each (None where the axis has
    nothing to change: no observation to swap, an answer no rule can flip)."""
    good = gold_trajectory(gold, observation)
    p = text.split(good)
    vision = None
    if observation:
        seg = good[p.vision[0]:p.vision[1]]
        new = text.swap_value(seg, question, key)
        vision = None if new is None or new == seg else good[:p.vision[0]] + new + \
            good[p.vision[1]:]
    seg = good[p.reasoning[0]:p.reasoning[1]]
    reasoning = good[:p.reasoning[0]] + " " + GOLD_BAD_REASONING.format(gold=gold.strip()) + \
        good[p.reasoning[1]:] if seg.strip() else None
    return {"vision": vision, "reasoning": reasoning,
            "answer": text.answer_variant(good, key)}


def observation_of(image_id: str, facts: dict[str, str], answer: str, question: str
                   ) -> str | None:
    """What the template says the image shows: the data's own description of the image
    when it has one (`models.trajectory.describe_images`), else, for an open question, the
    gold answer itself; None for a yes/no question with no description."""
    if image_id in facts:
        return facts[image_id]
    a = answer.strip()
    return None if a.lower() in ("yes", "no") or not a else a


# ---------------------------------------------------------------- held-out families
_ARTICLE = re.compile(r"\b([Aa]) ([aeiouAEIOU]\w*)")


def _swap_words(segment: str, table: dict[str, tuple[str, ...]], key: str) -> str:
    """Every whole word of `table` in `segment` written as one of its synonyms (the same
    pick for the same word and key, so a good trajectory and its variants stay aligned)."""
    if not table:
        return segment
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in
                                           sorted(table, key=len, reverse=True)) + r")\b",
                         re.I)

    def repl(m: re.Match) -> str:
        w = m.group(0)
        new = text._pick(list(table[w.lower()]), f"{key}:syn:{w.lower()}")
        return new.capitalize() if w[:1].isupper() else new
    out = pattern.sub(repl, segment)
    # "a crimson" stays, "a azure" becomes "an azure" (only in a segment that changed)
    return _ARTICLE.sub(lambda m: m.group(1) + "n " + m.group(2), out) if out != segment \
        else out


def synonym(trajectory: str, table: dict[str, tuple[str, ...]], key: str) -> str | None:
    """The data set's answer words in other words, everywhere; yes/no in the answer tag.
    None unless the answer itself is reworded."""
    p = text.split(trajectory)
    if p is None or not table:
        return None
    think = _swap_words(trajectory[p.think[0]:p.think[1]], table, key)
    answer = trajectory[p.answer[0]:p.answer[1]]
    new_answer = _swap_words(_swap_words(answer, table, key), YES_NO, key)
    if new_answer == answer:
        return None
    return (trajectory[:p.think[0]] + think + trajectory[p.think[1]:p.answer[0]] + new_answer
            + trajectory[p.answer[1]:])


def phrase(trajectory: str, key: str = "") -> str | None:
    """The answer stated in a sentence instead of a bare word."""
    p = text.split(trajectory)
    if p is None:
        return None
    a = trajectory[p.answer[0]:p.answer[1]].strip()
    if not a:
        return None
    return trajectory[:p.answer[0]] + f"my answer is {a}" + trajectory[p.answer[1]:]


def paraphrase(trajectory: str, key: str = "") -> str | None:
    """The rationale's connective phrases reworded; None when none of them occurs."""
    p = text.split(trajectory)
    if p is None:
        return None
    think = trajectory[p.think[0]:p.think[1]]
    new = think
    for pattern, repl in PARAPHRASES:
        new = pattern.sub(repl, new)
    if new == think:
        return None
    return trajectory[:p.think[0]] + new + trajectory[p.think[1]:]


def family(name: str, trajectory: str, key: str, table: dict[str, tuple[str, ...]]
           ) -> str | None:
    if name == "synonym":
        return synonym(trajectory, table, key)
    if name == "phrase":
        return phrase(trajectory)
    if name == "paraphrase":
        return paraphrase(trajectory)
    raise ValueError(f"unknown family {name!r}")


def plan(own: str | None, own_variants: dict[str, str | None], gold: str,
         gold_bad: dict[str, str | None], key: str, table: dict[str, tuple[str, ...]]
         ) -> list[tuple[str, str]]:
    """(label, trajectory) pairs to score: the gold trajectory and its bad variants
    (`gold`, `gold:AXIS`), and every held-out family applied to each good trajectory and
    its variants (`FAMILY:SOURCE:good`, `FAMILY:SOURCE:AXIS`). A family's variant is kept
    only when the family applies to the good trajectory too."""
    out = [("gold", gold)] + [(f"gold:{a}", v) for a, v in gold_bad.items() if v is not None]
    sources = {"gold": (gold, gold_bad)}
    if own is not None:
        sources["own"] = (own, own_variants)
    for fam in FAMILIES:
        for src, (good, bad) in sources.items():
            g = family(fam, good, key, table)
            if g is None or g == good:
                continue
            out.append((f"{fam}:{src}:good", g))
            for axis, v in bad.items():
                t = family(fam, v, key, table) if v is not None else None
                if t is not None and t != g:
                    out.append((f"{fam}:{src}:{axis}", t))
    return out
