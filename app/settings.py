"""Service settings: CLI flags and DUALREAD_* environment variables."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DUALREAD_")

    actor: str | None = Field(None, description="actor folder; default: the embedded actor")
    heads: str | None = Field(None, description="heads folder; default: the embedded heads")
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = Field(8, ge=1, le=256)
    batch_wait_ms: float = Field(10.0, ge=0)
    queue_limit: int = Field(64, ge=1)
    request_timeout_s: float = Field(30.0, gt=0)
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(40_000_000, ge=1)
    max_new_tokens: int = Field(64, ge=1, le=1024)
    max_question_chars: int = Field(2000, ge=1)
    api_key: str | None = Field(None, description="bearer token required when set")
    feedback_window: int = Field(500, ge=10)
