"""Whether a generated response can be trusted as an answer at all, before any confidence.

A confidence head reads hidden states; it can be sure of garbage. A response that does not
parse is deferred whatever the heads say, with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from models.parse import Parsed

# A token n-gram (n ≤ MAX_PERIOD) repeated this many times in a row is degenerate looping.
MAX_PERIOD = 4
MIN_REPEATS = 4


def uses_answer_tag(response_format: str | None) -> bool:
    """Whether an actor card's `response_format` puts the answer inside `<answer>` tags."""
    return bool(response_format) and "<answer>" in response_format


def repeated_run(ids: Sequence[int], max_period: int = MAX_PERIOD,
                 min_repeats: int = MIN_REPEATS) -> bool:
    """True when some block of 1..max_period tokens occurs min_repeats times back to back."""
    n = len(ids)
    for p in range(1, max_period + 1):
        need = p * min_repeats
        for start in range(0, n - need + 1):
            block = ids[start: start + p]
            if all(ids[start + k * p: start + (k + 1) * p] == block
                   for k in range(1, min_repeats)):
                return True
    return False


def response_problem(parsed: Parsed, token_ids: Sequence[int], finished: bool,
                     needs_tag: bool) -> str | None:
    """Why this response is not usable as an answer, or None when it parses."""
    if needs_tag and not parsed.tagged:
        return "no answer tag"
    if not parsed.answer:
        return "empty answer"
    if repeated_run(list(token_ids)):
        return "degenerate repetition"
    if not finished:
        return "truncated (no end of response within max_new_tokens)"
    return None
