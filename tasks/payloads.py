"""Task payloads: the JSON each stage task receives. Handles and ids, never tensors."""

from __future__ import annotations

from pydantic import BaseModel, Field


class GeneratePayload(BaseModel):
    """Everything a ``generate`` (aggregated) task needs to run one request."""

    request_id: str
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict
    created: float
