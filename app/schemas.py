"""The API's bodies live in `clients.schemas` (pydantic only); re-exported for app code."""

from clients.schemas import (
    B64_EXAMPLE,
    MAX_NEW_TOKENS,
    MAX_RESPONSE_CHARS,
    MAX_TRAJECTORIES,
    AnswerRequest,
    AnswerResponse,
    Confidence,
    ConfidenceDifference,
    CounterfactualRequest,
    CounterfactualResponse,
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    MaskRequest,
    Run,
    ScoreBatchRequest,
    ScoreBatchResponse,
    ScoreRequest,
    ScoreResponse,
    Timings,
    Trajectory,
    TrajectoryScore,
)

__all__ = [
    "B64_EXAMPLE", "MAX_NEW_TOKENS", "MAX_RESPONSE_CHARS", "MAX_TRAJECTORIES", "AnswerRequest",
    "AnswerResponse", "Confidence", "ConfidenceDifference", "CounterfactualRequest",
    "CounterfactualResponse", "ErrorResponse", "FeedbackRequest", "FeedbackResponse",
    "MaskRequest", "Run", "ScoreBatchRequest", "ScoreBatchResponse", "ScoreRequest",
    "ScoreResponse", "Timings", "Trajectory", "TrajectoryScore",
]
