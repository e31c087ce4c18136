"""`defer_reasons`: the defer rule's verdict on one answer as stable codes (`DeferCode`).

The prose `defer_reason` is for people; clients branch on these. They are read off the
same rule that decides `defer` (`Heads.defer_reasons`), so an answer is deferred exactly
when it has a code.
"""

from __future__ import annotations

from clients.schemas import DeferCode
from heads.dualread import Heads
from models.quality import TRUNCATED

# `Heads.defer_reasons` key → code; "problem" is coded by the problem itself (below).
# (DeferCode.image_flagged, the retired image check's, is no longer emitted.)
RULE_CODES: dict[str, DeferCode] = {
    "novelty": DeferCode.novel_states,
    "tau": DeferCode.low_confidence,
}

# `models.quality.response_problem` → code
PROBLEM_CODES: dict[str, DeferCode] = {
    "no answer tag": DeferCode.no_answer_tag,
    "empty answer": DeferCode.empty_answer,
    "degenerate repetition": DeferCode.degenerate_repetition,
    TRUNCATED: DeferCode.truncated,
}

NO_HEADS_REASON = "no heads for this model"


def problem_code(problem: str) -> DeferCode:
    """The code of a response problem; one without a code of its own is still coded."""
    return PROBLEM_CODES.get(problem, DeferCode.unusable_response)


def defer_codes(heads: Heads, p_dualread: float, novelty_p: float | None,
                problem: str | None) -> list[DeferCode]:
    """Every reason the rule defers this answer, problem first, then the flag in the
    order of the prose, then low confidence; [] when it is released."""
    why = heads.defer_reasons([p_dualread], [novelty_p], [problem])
    codes = [problem_code(problem)] if problem is not None and bool(why["problem"][0]) else []
    codes += [code for key, code in RULE_CODES.items() if bool(why[key][0])]
    return codes


def answer_only_codes(problem: str | None) -> list[DeferCode]:
    """Answer-only mode (no heads): always deferred, and why the response is unusable."""
    return [DeferCode.no_heads] + ([problem_code(problem)] if problem is not None else [])
