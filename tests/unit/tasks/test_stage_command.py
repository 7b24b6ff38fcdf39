"""tasks.stages.stage_command: each stage task's Celery arguments become one typed engine
command (workers.engine_ipc), the same for the task and for begin on receipt, and that
command crosses the pipe as itself (pickled whole)."""

from __future__ import annotations

import pickle

import pytest

from kvbm.protocol import EmbeddingRef, EncodeHandle, PrefillHandle, Sampling, StagePayload
from tasks.stages import stage_command
from workers.engine_ipc import Decode, Embed, Encode, Generate, Prefill

PAYLOAD = StagePayload(request_id="r", model="m", prompt_token_ids=[1, 2, 3],
                       sampling=Sampling(temperature=0), created=0.0)  # fmt: skip
REFS = [EmbeddingRef(hash="a" * 64, transfer={"key": "emb:a"})]


def _args(*before: object) -> tuple[dict, ...]:
    """A task's arguments as Celery's JSON serializer delivers them."""
    return (*(b.model_dump() for b in before), PAYLOAD.model_dump())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("stage", "want"),
    [("generate", Generate(PAYLOAD)), ("prefill", Prefill(PAYLOAD)),
     ("encode", Encode(PAYLOAD)), ("embed", Embed(PAYLOAD))],
)  # fmt: skip
def test_the_payload_alone(stage: str, want: object) -> None:
    cmd = stage_command(stage, _args())
    assert cmd == want and type(cmd) is type(want)
    assert pickle.loads(pickle.dumps(cmd)) == want


@pytest.mark.parametrize(("stage", "run"), [("generate", Generate), ("prefill", Prefill)])
def test_after_an_encode_task_its_embeddings_come_along(stage: str, run: type) -> None:
    enc = EncodeHandle(request_id="r", encode_worker="e1", embeddings=REFS)
    assert stage_command(stage, _args(enc)) == run(PAYLOAD, REFS)


@pytest.mark.parametrize("stage", ["generate", "prefill"])
def test_after_a_failed_encode_task_nothing_runs(stage: str) -> None:
    enc = EncodeHandle(request_id="r", encode_worker="e1", error="image expired")
    assert stage_command(stage, _args(enc)) == PAYLOAD


def test_a_decode_carries_the_prefill_handle() -> None:
    h = PrefillHandle(request_id="r", prefill_worker="p1", first_token=7, emitted_chars=2,
                      transfer={"backend": "redis"})  # fmt: skip
    cmd = stage_command("decode", _args(h))
    assert cmd == Decode(PAYLOAD, h) and cmd.request_id == "r"
    assert pickle.loads(pickle.dumps(cmd)).handle == h


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="generate, prefill, decode, encode or embed"):
        stage_command("pool", _args())


def test_only_an_aggregated_run_takes_a_request_of_choices() -> None:
    many = PAYLOAD.model_copy(update={"sampling": Sampling(n=3)})
    assert Generate(many).payload.sampling.n == 3
    assert Encode(many).request_id == "r"  # the encode stage runs before the choices split
    for run in (Prefill, Embed):
        with pytest.raises(AssertionError, match="n > 1 choices runs aggregated"):
            run(many)
