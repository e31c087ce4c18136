"""Service settings: CLI flags and DUALREAD_* environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DUALREAD_")

    actor: str | None = Field(None, description="actor folder; default: the embedded actor")
    heads: str | None = Field(None, description="heads folder; default: the embedded heads")
    heads_mismatch: Literal["refuse", "answer-only"] = Field(
        "refuse", description="heads fitted for another actor: refuse to start, or serve "
        "answers without confidence (confidence null, defer true, reason no_heads)")
    device: str = Field("cpu", description="cpu or cuda")
    dtype: str = Field("float32", description="float32, bfloat16 or float16")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads of the worker; default: torch's own")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, description="port to listen on")
    max_batch_size: int = Field(16, ge=1, le=256, description="jobs per model batch")
    batch_wait_ms: float = Field(10.0, ge=0, description="how long a batch waits to fill")
    # ge=2: a counterfactual probe is two jobs, admitted together
    queue_limit: int = Field(64, ge=2, description="queued jobs before 429")
    request_timeout_s: float = Field(30.0, gt=0, description="deadline of every job (504)")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024,
                                description="request body limit (413 before reading more)")
    body_timeout_s: float = Field(30.0, gt=0,
                                  description="time to receive a whole request body (408)")
    # uvicorn's h11 parser buffers at most this much of a request line and its headers,
    # then answers 400 and closes; httptools has no bound (a 96 MB header took 17.8 s)
    max_header_bytes: int = Field(16384, ge=1024,
                                  description="request line and headers (400 from the parser "
                                              "while they arrive; once read whole 431, or "
                                              "414 when the request line is the longer)")
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1, description="per image (413)")
    # 4096² (the largest side the processors keep): a 40 M-pixel PNG of 117 KB cost
    # 2.4 s and 420 MB to decode and resize
    max_image_pixels: int = Field(4096 * 4096, ge=1,
                                  description="per image, DICOM frames included (413)")
    max_decodes: int = Field(4, ge=1, description="images decoded at once; the others wait "
                             "(bounds decoding memory, which the queue limit does not)")
    max_new_tokens: int = Field(64, ge=1, le=1024, description="generation cap per answer")
    max_question_chars: int = Field(2000, ge=1, description="question length (422)")
    max_question_tokens: int = Field(512, ge=1, description="question tokens (422)")
    max_response_tokens: int = Field(1024, ge=1,
                                     description="tokens of a scored trajectory (422)")
    api_key: str | None = Field(None, description="bearer token required when set")
    metrics_require_key: bool = Field(False, description="with an API key, /metrics needs it")
    docs_require_key: bool = Field(
        True, description="with an API key, /docs, /redoc and /openapi.json need it")
    feedback_window: int = Field(500, ge=10, description="answers in the feedback window")
    # re-certification of the defer rule (heads.recert, app.recertify)
    operator_key: str | None = Field(
        None, description="key (header X-Operator-Key) whose verdicts count toward "
                          "re-certifying the defer rule; none: verdicts never count")
    recert_window: int = Field(1000, ge=20, le=100_000,
                               description="new operator verdicts between two "
                                           "re-certification tests")
    recert_max_window: int = Field(
        1000, ge=20, le=100_000,
        description="operator verdicts a re-certification test reads at most: the last ones, "
                    "kept across tests when above recert_window (read as recert_window when "
                    "below it)")
    recert_min_per_class: int = Field(
        10, ge=1, description="correct and wrong verdicts each needed in a window")
    recert_state: str | None = Field(
        None, description="rule state file; default: recert_state.json in the heads folder")
    drift_window: int = Field(500, ge=20, le=100_000, description="answers in the drift window")


def apply_threads(settings: Settings) -> None:
    """Set torch's CPU thread count when `threads` is given (process-wide, at startup).

    On a CPU shared with other work, one thread per worker is much faster than torch's
    default of one per core: its threads spin waiting for each other when cores are busy.
    """
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
