"""Image content parts in the prompt (api/tokenization.py): the ids equal what Hugging
Face's LlavaProcessor gives for the same rendered text and images, placeholders counted in
the context window, the image refs the payload carries, and what a text-only model says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from api.errors import OpenAIError
from api.protocol import ChatMessage
from api.tokenization import PromptBuilder
from kvbm.protocol import block_hashes, model_namespace, request_extra_keys
from tests.media_server import picture

URL = "data:image/png;base64,AAAA"  # never fetched here: prompts are built without bytes


def img(url: str = URL, **extra: object) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def msgs(*contents: object) -> list[ChatMessage]:
    """One message per content; roles alternate user / assistant, a system one first."""
    out = [ChatMessage(role="system", content="Look closely.")]
    for i, c in enumerate(contents):
        out.append(ChatMessage(role="user" if i % 2 == 0 else "assistant", content=c))
    return out


def hf_processor(model_dir: Path):  # type: ignore[no-untyped-def]
    """The model dir's own processor where it ships one; else one built as the hub's
    llava-hf checkpoints configure it, from the config's vision tower."""
    from transformers import AutoProcessor, AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    if (model_dir / "preprocessor_config.json").is_file():
        proc = AutoProcessor.from_pretrained(model_dir)
        if getattr(proc, "patch_size", None):
            return proc
    cfg = json.loads((model_dir / "config.json").read_text())
    v = cfg["vision_config"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    side = v["image_size"]
    ip = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=v["patch_size"],
        vision_feature_select_strategy=cfg["vision_feature_select_strategy"],
        num_additional_image_tokens=1,  # CLIP's CLS token
        chat_template=tok.chat_template,
    )


CASES = [
    # (message contents, images) — text before / between / after images, images alone,
    # several per message and across messages, a plain-string image_url
    ([[text("What is in"), img(), text(" this picture?")]], 1),
    ([[img(), text("Describe it.")]], 1),
    ([[text("Compare"), img(), text("with"), img(), text(".")]], 2),
    ([[img(), img(), img()]], 3),
    ([[text("First:"), img()], "It is a cat.", [text("And now"), img(detail="low")]], 2),
    ([[text("String URL:"), {"type": "image_url", "image_url": URL}, text("ok")]], 1),
    ([[text("The quick brown fox jumps over the lazy dog. " * 3), img(), text("end")]], 1),
]


@pytest.mark.parametrize(("contents", "n_images"), CASES)
def test_prompt_ids_equal_the_hf_processors(
    tiny_model_dir: Path, contents: list, n_images: int
) -> None:
    proc = hf_processor(tiny_model_dir)
    pb = PromptBuilder(tiny_model_dir)
    messages = msgs(*contents)
    prompt = pb.chat_prompt(messages)
    # HF renders the same text from the same messages (image parts as {"type": "image"})
    hf_msgs = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                [{"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text}
                 for p in m.content]} for m in messages]  # fmt: skip
    rendered = proc.apply_chat_template(hf_msgs, add_generation_prompt=True, tokenize=False)
    images = [picture(40 + 10 * i, 30, seed=i) for i in range(n_images)]
    expected = proc(text=rendered, images=images, add_special_tokens=False)["input_ids"][0]
    assert prompt.token_ids == list(expected)
    # one placeholder run per image, where the refs say
    n = pb.image_seq_length
    assert n == 16 and prompt.image_tokens == n and len(prompt.images) == n_images
    for off in prompt.image_offsets:
        assert prompt.token_ids[off : off + n] == [pb.image_token_id] * n
    assert prompt.token_ids.count(pb.image_token_id) == n * n_images
    assert [im.param for im in prompt.images][0].startswith("messages.1.content.")


def test_image_refs_and_the_routers_block_hashes(tiny_model_dir: Path) -> None:
    pb = PromptBuilder(tiny_model_dir)
    prompt = pb.chat_prompt(msgs([text("Compare"), img(), text("with"), img()]))
    refs = prompt.image_refs(["a" * 64, "b" * 64])
    assert [(r.offset, r.num_tokens) for r in refs] == [(o, 16) for o in prompt.image_offsets]
    ids = prompt.token_ids
    ns = model_namespace("tiny-llava")
    plain = block_hashes(ids, 16, ns)
    keyed = block_hashes(ids, 16, ns, request_extra_keys(refs, len(ids), 16))
    first_image_block = refs[0].offset // 16
    assert keyed[:first_image_block] == plain[:first_image_block]  # text before: shared
    assert all(a != b for a, b in zip(keyed[first_image_block:], plain[first_image_block:],
                                      strict=True))  # fmt: skip
    other = block_hashes(ids, 16, ns, request_extra_keys(
        prompt.image_refs(["a" * 64, "c" * 64]), len(ids), 16))  # fmt: skip
    second = refs[1].offset // 16
    assert other[:second] == keyed[:second] and other[second] != keyed[second]


def test_the_runner_routes_image_prompts_by_their_image_keyed_hashes(tiny_model_dir: Path) -> None:
    """The hashes the API's router scores are the ones the workers' block pools name the
    blocks with (kvbm.protocol.request_extra_keys): two requests with the same text and
    different images share only the blocks before the first image."""
    import redis.asyncio as aioredis

    from api.metrics import ApiMetrics
    from api.runner import Runner
    from tasks.settings import Settings

    pb = PromptBuilder(tiny_model_dir)
    prompt = pb.chat_prompt(msgs([text("The quick brown fox jumps over the lazy dog."), img(),
                                  text("What is it?")]))  # fmt: skip
    s = Settings(model=tiny_model_dir, redis_url="redis://127.0.0.1:9/0")  # never connected
    runner = Runner(s, aioredis.Redis.from_url(s.redis_url), None, ApiMetrics())  # type: ignore[arg-type]
    ids, ns = prompt.token_ids, model_namespace(s.model_name)
    cat, dog = prompt.image_refs(["c" * 64]), prompt.image_refs(["d" * 64])
    a = runner.route_request(ids, cat, "w1")
    assert a.pin == "w1" and a.prompt_len == len(ids)
    assert a.block_hashes == block_hashes(ids, 16, ns, request_extra_keys(cat, len(ids), 16))
    b = runner.route_request(ids, dog).block_hashes
    first = cat[0].offset // 16
    assert first >= 1 and a.block_hashes[:first] == b[:first]
    assert all(x != y for x, y in zip(a.block_hashes[first:], b[first:], strict=True))
    assert runner.route_request(ids, []).block_hashes == block_hashes(ids, 16, ns)


def test_placeholders_count_in_the_context_window(tiny_model_dir: Path) -> None:
    pb = PromptBuilder(tiny_model_dir, max_model_len=60)
    prompt = pb.chat_prompt(msgs([text("hi"), img(), img()]))
    assert len(prompt.token_ids) > 32  # two images alone are 32 tokens
    with pytest.raises(OpenAIError) as e:
        pb.check_length(len(prompt.token_ids), 60 - len(prompt.token_ids) + 1, "messages")
    assert e.value.code == "context_length_exceeded"


def test_bad_image_parts(tiny_model_dir: Path) -> None:
    pb = PromptBuilder(tiny_model_dir)
    for part, param in [({"type": "image_url", "image_url": {}}, "messages.1.content.1.image_url"),
                        ({"type": "image_url"}, "messages.1.content.1.image_url"),
                        (img(detail="huge"), "messages.1.content.1.image_url.detail"),
                        ({"type": "input_audio"}, "messages.1.content.1.type")]:  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            pb.chat_prompt(msgs([text("x"), part]))
        assert e.value.status == 400 and e.value.param == param, e.value.body()
    # the image token typed as text would be a placeholder without an image
    with pytest.raises(OpenAIError) as e:
        pb.chat_prompt(msgs([text("see <image> here"), img()]))
    assert e.value.param == "messages" and "<image>" in e.value.message
    with pytest.raises(OpenAIError):
        pb.chat_prompt(msgs("just <image> text"))


def test_a_text_only_model_refuses_image_parts_naming_itself(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = tmp_path / "tiny-llama"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    text_cfg = cfg["text_config"]  # the language model alone: no vision tower, no image token
    (d / "config.json").write_text(json.dumps(text_cfg))
    pb = PromptBuilder(d, model_name="my-llama")
    assert not pb.accepts_images
    with pytest.raises(OpenAIError) as e:
        pb.chat_prompt(msgs([text("look"), img()]))
    err = e.value
    assert err.status == 400 and err.code == "unsupported_parameter"
    assert err.param == "messages.1.content.1" and "my-llama" in err.message
    plain = pb.chat_prompt(msgs([text("look")]))  # text parts still work
    assert plain.images == [] and plain.token_ids


def test_seq_length_without_image_seq_length_in_the_config(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    for strategy, expected in (("default", 16), ("full", 17)):
        d = tmp_path / strategy
        shutil.copytree(tiny_model_dir, d)
        cfg = json.loads((d / "config.json").read_text())
        del cfg["image_seq_length"]
        cfg["vision_feature_select_strategy"] = strategy
        (d / "config.json").write_text(json.dumps(cfg))
        pb = PromptBuilder(d)
        assert pb.image_seq_length == expected
        prompt = pb.chat_prompt(msgs([img()]))
        assert prompt.token_ids.count(pb.image_token_id) == expected
