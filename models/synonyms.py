"""Answer words in other words, per data set: data, like a label set, not a rule.

The TGS probe's held-out `synonym` family (clients/probes/external.py) writes a data set's
answer words with words its actor was never trained on, to test confidence outside the
wording the consistency reader saw. A data set without a table here simply has no
synonym family (the other held-out families are generic).
"""

from __future__ import annotations

# easy-VQA's answer words (models.data.COLOURS, SHAPES): each with words that name the
# same thing and never occur in the data set's questions or answers.
EASYVQA: dict[str, tuple[str, ...]] = {
    "red": ("crimson", "scarlet"), "green": ("emerald", "lime-coloured"),
    "blue": ("azure", "cobalt"), "black": ("jet", "ebony"), "gray": ("grey", "ashen"),
    "teal": ("blue-green", "turquoise"), "brown": ("chocolate", "umber"),
    "yellow": ("golden", "lemon"), "circle": ("round shape", "disc"),
    "rectangle": ("oblong", "four-sided box"), "triangle": ("three-sided shape", "trigon"),
}

TABLES: dict[str, dict[str, tuple[str, ...]]] = {"easyvqa": EASYVQA}


def table_for(domain: str) -> dict[str, tuple[str, ...]]:
    """The synonym table of a data set (by `Item.domain`); empty when it has none."""
    return TABLES.get(domain, {})
