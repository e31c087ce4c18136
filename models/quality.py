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
TRUNCATED = "truncated (no end of response within max_new_tokens)"


def uses_answer_tag(response_format: str | None) -> bool:
    """Whether an actor card's `response_format` puts the answer inside `<answer>` tags."""
    return bool(response_format) and "<answer>" in response_format


def repeated_run(ids: Sequence[int], max_period: int = MAX_PERIOD,
                 min_repeats: int = MIN_REPEATS) -> bool:
    """True when some block of 1..max_period tokens occurs min_repeats times back to back.

    A block of p tokens repeated m times from s is the same as ids[i] == ids[i + p] for
    the p·(m − 1) positions i from s on, so one pass per period counts runs of matches
    (it runs on every served answer)."""
    n = len(ids)
    for p in range(1, max_period + 1):
        need, run = p * (min_repeats - 1), 0
        if n < p * min_repeats:
            break
        if need == 0:                       # one occurrence is enough
            return True
        for i in range(n - p):
            run = run + 1 if ids[i] == ids[i + p] else 0
            if run >= need:
                return True
    return False


def response_problem(parsed: Parsed, token_ids: Sequence[int], finished: bool,
                     needs_tag: bool) -> str | None:
    """Why this response is not usable as an answer, or None when it parses."""
    ids = list(token_ids)
    # cut off before its answer was written (no tag, or a tag never closed): what used the
    # token budget is the cause to report (a request with max_new_tokens 5 was told "no
    # answer tag"); an answer closed empty stays "empty answer"
    unclosed = not parsed.answer and parsed.close_span == parsed.answer_span
    if not finished and ((needs_tag and not parsed.tagged) or unclosed):
        return "degenerate repetition" if repeated_run(ids) else TRUNCATED
    if needs_tag and not parsed.tagged:
        return "no answer tag"
    if not parsed.answer:
        return "empty answer"
    if repeated_run(ids):
        return "degenerate repetition"
    if not finished:
        return TRUNCATED
    return None
