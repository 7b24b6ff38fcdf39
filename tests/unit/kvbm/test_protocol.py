"""The wire contract (kvbm/protocol.py): block hashes pinned to the values plain text
always had, per-block extra keys entering exactly the blocks they cover, token frames
surviving the wire, and one namespace for the API and the block pools."""

from __future__ import annotations

import pytest

from kvbm.block_pool import KVCacheManager
from kvbm.protocol import (
    ImageRef,
    StagePayload,
    TokenFrame,
    Usage,
    block_hashes,
    extra_keys_for_spans,
    image_extra_key,
    image_spans,
    media_key,
    model_namespace,
    namespace_hash,
    request_extra_keys,
)

TOKENS = list(range(1, 41))  # two full blocks of 16, and 8 tokens over


def test_plain_text_hashes_are_the_values_they_always_were() -> None:
    # computed with kvbm/hashing.py before extra keys existed (commit 4fd0f0e)
    assert block_hashes(TOKENS, 16) == [3677224691707619483, 11370773922563188450]
    assert block_hashes(TOKENS, 16, namespace_hash("tiny-llava")) == [
        4878259425475106202, 14072419122137228528]  # fmt: skip
    assert namespace_hash("tiny-llava") == 16367157378762951175
    assert namespace_hash("a", "b") == 10279775118918739289
    assert block_hashes([5] * 33, 4, 7, start=2, parent=123)[:3] == [
        16051680550144784207, 17467226701275859245, 2915311237973905409]  # fmt: skip
    # no extra keys, or empty ones, change nothing
    assert block_hashes(TOKENS, 16, 0, [(), ()]) == block_hashes(TOKENS, 16)


def test_an_extra_key_enters_its_block_and_everything_after_it() -> None:
    plain = block_hashes(TOKENS + TOKENS, 16)  # 5 blocks
    img = block_hashes(TOKENS + TOKENS, 16, 0, [(), ("img:a",)])
    assert img[0] == plain[0]  # blocks before the key are shared with plain text
    assert all(a != b for a, b in zip(img[1:], plain[1:], strict=True))  # chained after
    other = block_hashes(TOKENS + TOKENS, 16, 0, [(), ("img:b",)])
    assert other[0] == img[0] and other[1] != img[1]  # a different image: different KV
    assert block_hashes(TOKENS + TOKENS, 16, 0, [(), ("img:a",)]) == img  # stable


def test_spans_map_to_the_blocks_they_overlap() -> None:
    # an image's placeholders at tokens 10..37 cover blocks 0, 1 and 2 (of 16 tokens each);
    # the partial fourth block has no hash, so no keys either
    keys = extra_keys_for_spans([(10, 38, "img:a"), (40, 41, "img:b")], 60, 16)
    assert keys == [("img:a",), ("img:a",), ("img:a", "img:b")]
    assert extra_keys_for_spans([], 60, 16) == [(), (), ()]
    with pytest.raises(ValueError):
        extra_keys_for_spans([(5, 5, "x")], 60, 16)


def test_a_requests_images_key_the_blocks_their_placeholders_cover() -> None:
    a, b = "a" * 64, "b" * 64
    images = [ImageRef(hash=a, offset=10, num_tokens=28), ImageRef(hash=b, offset=40, num_tokens=1)]
    assert image_extra_key(a) == "img:" + a
    assert image_spans(images) == [(10, 38, "img:" + a), (40, 41, "img:" + b)]
    assert request_extra_keys(images, 60, 16) == [("img:" + a,), ("img:" + a,),
                                                  ("img:" + a, "img:" + b)]  # fmt: skip
    assert request_extra_keys([], 60, 16) == [(), (), ()]  # plain text hashes as always
    assert block_hashes(TOKENS, 16, 0, request_extra_keys([], 40, 16)) == block_hashes(TOKENS, 16)
    assert media_key(a) == f"conveyor:media:{a}"
    # the payload carries them through JSON (a Celery message) unchanged; none by default
    p = StagePayload(request_id="r", model="m", prompt_token_ids=[1], sampling={}, created=0.0,
                     images=images)  # fmt: skip
    assert StagePayload.model_validate_json(p.model_dump_json()).images == images
    assert StagePayload(request_id="r", model="m", prompt_token_ids=[1], sampling={},
                        created=0.0).images == []  # fmt: skip
    with pytest.raises(ValueError):
        ImageRef(hash=a, offset=0, num_tokens=0)


def test_the_block_pool_names_blocks_with_their_extra_keys() -> None:
    keys = extra_keys_for_spans([(16, 32, "img:a")], len(TOKENS), 16)
    m = KVCacheManager(8, 16)
    assert m.find_prefix("a", TOKENS, keys) == 0
    assert m.allocate_slots("a", len(TOKENS)) is not None
    m.cache_blocks("a", TOKENS, len(TOKENS))
    m.free("a")
    # the same text with the same image hits both blocks; with another image only the first
    assert m.find_prefix("b", TOKENS + [9], keys) == 32
    other = extra_keys_for_spans([(16, 32, "img:b")], len(TOKENS), 16)
    assert m.find_prefix("c", TOKENS + [9], other) == 16
    assert m.find_prefix("d", TOKENS + [9]) == 16  # plain text: no image, first block only


def test_frames_survive_the_wire() -> None:
    delta = TokenFrame(3, [7, 8], "ab")
    assert TokenFrame.decode(delta.encode()) == delta
    done = TokenFrame(4, [9], "c", True, "stop", "\n", Usage(5, 6, 2))
    assert TokenFrame.decode(done.encode()) == done
    err = TokenFrame.failure(1, "KV transfer failed", "kv_transfer_failed")
    back = TokenFrame.decode(err.encode())
    assert back.done and back.error is not None and back.error.code == "kv_transfer_failed"
    assert back.finish_reason is None and back.error.type == "server_error"
    with pytest.raises(ValueError):
        TokenFrame.decode(b'{"text": "no seq"}')
    # an embedding request's one frame carries its vector (base64 float32), only it
    vec = TokenFrame(0, [], "", True, "stop", None, Usage(7, 0, 0), embedding="AACAPwAAAEA=")
    assert TokenFrame.decode(vec.encode()) == vec
    assert b"embedding" not in done.encode()
    # a predicted output's counts, only where it was drafted from
    predicted = TokenFrame(5, [1], "d", True, "length", None, Usage(5, 6, 2, 4, 1))
    assert TokenFrame.decode(predicted.encode()) == predicted
    assert b"prediction" not in done.encode()


def test_one_namespace_function_for_the_api_and_the_pools() -> None:
    assert model_namespace("tiny-llava") == namespace_hash("tiny-llava")
    assert model_namespace("") == 0
    # a cache salt names blocks apart (with and without an adapter); none changes nothing
    plain = model_namespace("m")
    lora = model_namespace("m", "ad")
    assert model_namespace("m", None, None) == model_namespace("m", None, "") == plain
    assert model_namespace("m", "ad", None) == lora == namespace_hash("m", "lora", "ad")
    names = {plain, lora, model_namespace("m", None, "a"), model_namespace("m", None, "b"),
             model_namespace("m", "ad", "a"), model_namespace("x", None, "a")}  # fmt: skip
    assert len(names) == 6
