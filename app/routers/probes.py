"""Probe endpoints: counterfactual pairs (docs/method.md §2, §5) and teacher-forced scoring
(docs/method.md §3)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from app.deps import get_serving, request_id, require_heads, require_json, require_key
from app.errors import InvalidInput
from app.routers.common import ERRORS, confidence
from app.schemas import (
    CounterfactualRequest,
    CounterfactualResponse,
    MaskRequest,
    Run,
    ScoreBatchRequest,
    ScoreBatchResponse,
    ScoreRequest,
    ScoreResponse,
    TrajectoryScore,
)
from app.serving import AnswerItem, AnswerResult, ScoreResult, Serving
from clients.grounding import classify_pair
from models.actor import Actor
from models.canon import canon, is_correct
from models.counterfactuals import blank_image
from models.masking import MaskSpec

router = APIRouter(tags=["probes"], dependencies=[Depends(require_key), Depends(require_json),
                                                  Depends(require_heads)])


def run(r: AnswerResult, correct: bool | None) -> Run:
    return Run(answer=r.answer, canonical=r.canonical, response=r.response,
               confidence=confidence(r.confidence), correct=correct, defer=r.defer,
               defer_reason=r.defer_reason, defer_reasons=list(r.defer_codes))


def mask_spec(m: MaskRequest | None, response: str) -> MaskSpec | None:
    if m is None:
        return None
    target = tuple(m.target) if isinstance(m.target, list | tuple) else m.target
    if isinstance(target, tuple):
        # A span is a slice of the response as scored, the text before its confidence cue
        # (the cue is appended again after it, and masking it would change what μ(C)
        # reads): `text[start:end]`, cut at the text's end as Python cuts. A slice with
        # nothing in it (start >= end, or past the end) masks nothing (masked_tokens 0);
        # (0, 0) is the empty span the masking code reads as such, where an empty span
        # inside a token would mask that token.
        scored = len(Actor.score_text(response, cue=False))
        start, end = min(target[0], scored), min(target[1], scored)
        target = (start, end) if start < end else (0, 0)
    try:
        return MaskSpec(target, m.ratio, m.seed)
    except ValueError as e:
        raise InvalidInput(f"mask: {e}") from None


def trajectory_score(r: ScoreResult) -> TrajectoryScore:
    return TrajectoryScore(confidence=confidence(r.confidence), mu_c=r.mu_c, answer=r.answer,
                           masked_tokens=r.masked_tokens, digits=r.digits)


@router.post("/probe/counterfactual", response_model=CounterfactualResponse, responses=ERRORS)
async def counterfactual(request: Request, body: CounterfactualRequest,
                         serving: Serving = Depends(get_serving)) -> CounterfactualResponse:
    """Run the same question on the real image and a counterfactual one (docs/method.md §2, §5)."""
    serving.admit(request)
    question = serving.question(body.question)
    limit = serving.max_new_tokens(body.max_new_tokens)
    ref, cf_ref = body.reference_answer, body.counterfactual_reference_answer
    for field, value in (("reference_answer", ref), ("counterfactual_reference_answer", cf_ref)):
        # no answer can equal an empty reference: it would grade every answer wrong
        if value is not None and not canon(value):
            raise InvalidInput(f"{field} is empty once normalised (no letter or digit); "
                               "leave it out to skip grading")
    real = await serving.image_b64(body.image)
    cf = blank_image() if body.counterfactual == "blank" else \
        await serving.image_b64(body.counterfactual, "counterfactual")
    a, b = await serving.answer([AnswerItem(real, question, limit),
                                 AnswerItem(cf, question, limit)],
                                gone=request.is_disconnected)
    ra, rb = a.result, b.result
    z_real = is_correct(ra.answer, ref) if ref is not None else None
    z_cf = is_correct(rb.answer, cf_ref) if cf_ref is not None else None
    pair = classify_pair(z_real, z_cf, ra.canonical, rb.canonical)
    request.scope["state"]["batch_size"] = max(a.batch, b.batch)
    return CounterfactualResponse(
        real=run(ra, z_real), counterfactual=run(rb, z_cf),
        confidence_difference=confidence(ra.confidence.minus(rb.confidence)),
        answer_changed=ra.canonical != rb.canonical, decisive=pair.decisive,
        strict=pair.strict, request_id=request_id(request))


@router.post("/probe/score", response_model=ScoreResponse, responses=ERRORS)
async def score(request: Request, body: ScoreRequest, serving: Serving = Depends(get_serving)
                ) -> ScoreResponse:
    """Teacher-forced confidence of a supplied trajectory, optionally masked (docs/method.md §3)."""
    serving.admit(request)
    question = serving.question(body.question)
    mask = mask_spec(body.mask, body.response)
    image = await serving.image_b64(body.image)
    [item] = await serving.score_items(image, question, [(body.response, mask)])
    [served] = await serving.score([item], gone=request.is_disconnected)
    request.scope["state"]["batch_size"] = served.batch
    r = trajectory_score(served.result)
    return ScoreResponse(**r.model_dump(), request_id=request_id(request))


@router.post("/probe/score_batch", response_model=ScoreBatchResponse, responses=ERRORS)
async def score_batch(request: Request, body: ScoreBatchRequest,
                      serving: Serving = Depends(get_serving)) -> ScoreBatchResponse:
    """Several trajectories of one (image, question), scored as jobs that share batches;
    results in the order given."""
    serving.admit(request)
    question = serving.question(body.question)
    masks = [mask_spec(t.mask, t.response) for t in body.trajectories]
    image = await serving.image_b64(body.image)
    items = await serving.score_items(
        image, question, [(t.response, m) for t, m in zip(body.trajectories, masks)],
        batch=True)
    served = await serving.score(items, gone=request.is_disconnected)
    request.scope["state"]["batch_size"] = max(s.batch for s in served)
    return ScoreBatchResponse(results=[trajectory_score(s.result) for s in served],
                              request_id=request_id(request))
