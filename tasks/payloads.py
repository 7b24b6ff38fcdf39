"""Task payloads: the JSON each stage task receives. Handles and ids, never tensors."""

from __future__ import annotations

from pydantic import BaseModel, Field


class GeneratePayload(BaseModel):
    """Everything a stage task needs to run one request (the same payload for every stage;
    a decode task gets the prefill task's handle in front of it)."""

    request_id: str
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict
    created: float
    attempt: int = 0  # disagg: how many times the prefill was redone after a failed pull
    forced_first_token: int | None = None  # a redo keeps the first token already streamed
