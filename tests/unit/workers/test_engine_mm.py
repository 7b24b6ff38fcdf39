"""Image prompts: the reference engine's greedy tokens equal Hugging Face LLaVA's.

Reference: ``LlavaForConditionalGeneration.generate(**processor(text=..., images=...),
do_sample=False)`` on the same checkpoint. The engine gets the processor's ``input_ids`` as
its prompt and, per image, the embeddings :class:`workers.vision.VisionEncoder` computes
from the same images, at the offset of the image's placeholder run; the blocks an image
covers carry its content hash (``kvbm.protocol.image_extra_key``).

Requests: 1 to 3 images (PNG, JPEG, GIF, RGBA, grayscale, a 2x3 and a 1600x1200 one),
text before, between and after them, an image repeated, prompts across block boundaries,
one text-only request in the mix. Engines: every request at once, chunked prefill with a
7-token step budget (image spans split across steps), and a KV pool small enough to
preempt (recompute from the same embeddings); each with both decode-attention paths.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from PIL import Image

from kvbm.protocol import Sampling, extra_keys_for_spans, image_extra_key
from tasks.settings import engine_config
from tests.unit.workers.test_disagg_engine import imported
from workers import paged_kernel
from workers.engine import Engine
from workers.engine_api import EngineConfig, EngineRequest, MMInput, RequestOutput
from workers.mock_engine import MockEngine, MockTiming
from workers.model_init import IMAGE, PRESETS, init_model
from workers.vision import VisionEncoder

BLOCK = 16


# ----------------------------------------------------------------------------- images
@dataclass(frozen=True)
class Img:
    name: str
    data: bytes  # the encoded file, as a client would send it

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def open(self) -> Image.Image:
        return Image.open(io.BytesIO(self.data))


def _encode(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def _noise(w: int, h: int, mode: str, seed: int) -> Image.Image:
    chans = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    gen = torch.Generator().manual_seed(seed)
    px = torch.randint(0, 256, (h, w, chans), generator=gen, dtype=torch.uint8)
    return Image.fromarray(px.squeeze(-1).numpy() if chans == 1 else px.numpy(), mode)


def _gradient(w: int, h: int) -> Image.Image:
    x = torch.linspace(0, 255, w)[None, :, None].expand(h, w, 3)
    y = torch.linspace(255, 0, h)[:, None, None].expand(h, w, 3)
    rgb = torch.stack([x[..., 0], y[..., 0], (x[..., 0] + y[..., 0]) / 2], -1)
    return Image.fromarray(rgb.to(torch.uint8).numpy(), "RGB")


IMAGES = {
    "png": Img("png", _encode(_noise(64, 48, "RGB", 1), "PNG")),
    "jpeg": Img("jpeg", _encode(_gradient(120, 80), "JPEG")),
    "rgba": Img("rgba", _encode(_noise(40, 40, "RGBA", 2), "PNG")),
    "gray": Img("gray", _encode(_noise(30, 50, "L", 3), "PNG")),
    "tiny": Img("tiny", _encode(_noise(2, 3, "RGB", 4), "PNG")),
    "large": Img("large", _encode(_gradient(1600, 1200), "JPEG")),
    "gif": Img("gif", _encode(_noise(50, 20, "RGB", 5).convert("P"), "GIF")),
    "png2": Img("png2", _encode(_noise(64, 48, "RGB", 6), "PNG")),
}

# (parts: text or an image name, max new tokens, chat template?) Images sit at offsets
# that are not multiples of the block size and prompts span up to a dozen blocks.
LONG = "The scheduler admits waiting requests while blocks are free and preempts. " * 3
REQUESTS: list[tuple[list[str], int, bool]] = [
    (["@png", "Describe this image."], 12, True),
    (["What is", "@jpeg", "?"], 9, True),
    (["@rgba", "@gray", "Compare the two."], 14, True),
    (["Before", "@tiny", "between", "@large", "after."], 7, True),
    (["@png", "a", "@jpeg", "b", "@gray"], 16, True),
    (["@png", "and again", "@png", "same?"], 11, True),
    ([LONG, "@gif", "What do you see?"], 20, True),
    (["@large", LONG + LONG], 6, True),
    (["USER: @", "@jpeg", "\nASSISTANT:"], 10, False),
    (["@large", "@tiny", "@large"], 13, True),
    (["Hello, world! How are you today? " * 4], 8, True),
    (["x" * 40, "@rgba", "y" * 25, "@png2", LONG], 15, True),
    (["Once upon a time", "@gif"], 5, False),
]


@dataclass
class MMCase:
    prompt: list[int]
    images: list[Img]
    embeds: list[torch.Tensor]  # per image, [image_seq_length, hidden]
    offsets: list[int]
    max_tokens: int
    hf: list[int]  # HF's greedy continuation, max_tokens long

    def request(self, rid: str, with_keys: bool = True) -> EngineRequest:
        params = Sampling(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        return EngineRequest(
            rid,
            list(self.prompt),
            params,
            block_extra_keys=self.extra_keys() if with_keys else None,
            mm_inputs=[MMInput(o, e) for o, e in zip(self.offsets, self.embeds, strict=True)]
            or None,
        )

    def extra_keys(self) -> list[tuple[str, ...]]:
        spans = [
            (o, o + e.shape[0], image_extra_key(im.hash))
            for o, e, im in zip(self.offsets, self.embeds, self.images, strict=True)
        ]
        return extra_keys_for_spans(spans, len(self.prompt), BLOCK)


def _render(proc: object, parts: list[str], chat: bool) -> tuple[str, list[Img]]:
    images = [IMAGES[p[1:]] for p in parts if p.startswith("@") and p[1:] in IMAGES]
    if chat:
        content = [
            {"type": "image"} if p[1:] in IMAGES and p.startswith("@") else
            {"type": "text", "text": p}
            for p in parts
        ]  # fmt: skip
        text = proc.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = "".join("<image>" if p[1:] in IMAGES and p.startswith("@") else p for p in parts)
    return text, images


def _offsets(ids: list[int], n_images: int, seq_len: int) -> list[int]:
    """Start of each image's placeholder run (adjacent images make one longer run)."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == IMAGE:
            out.append(i)
            assert ids[i : i + seq_len] == [IMAGE] * seq_len
            i += seq_len
        else:
            i += 1
    assert len(out) == n_images
    return out


def _build_cases(model_dir: Path, requests: list[tuple[list[str], int, bool]]) -> list[MMCase]:
    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    enc = VisionEncoder.from_model_dir(model_dir)
    cases = []
    for parts, max_tokens, chat in requests:
        text, imgs = _render(proc, parts, chat)
        pil = [im.open() for im in imgs]
        # a chat template writes the BOS itself: no second one (as apply_chat_template
        # tokenizes, and as the API does)
        inputs = proc(text=text, images=pil or None, return_tensors="pt",
                      add_special_tokens=not chat)  # fmt: skip
        prompt = inputs["input_ids"][0].tolist()
        with torch.inference_mode():
            out = model.generate(
                **inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
            )
        hf = out[0, len(prompt) :].tolist()
        assert len(hf) == max_tokens
        embeds: list[torch.Tensor] = []
        if pil:
            pixels = enc.preprocess(pil)
            assert torch.equal(pixels, inputs["pixel_values"])
            embeds = list(enc.encode(pixels))
        offsets = _offsets(prompt, len(imgs), enc.image_seq_length)
        cases.append(MMCase(prompt, imgs, embeds, offsets, max_tokens, hf))
    return cases


@pytest.fixture(scope="module")
def cases(tiny_model_dir: Path) -> list[MMCase]:
    cs = _build_cases(tiny_model_dir, REQUESTS)
    assert len(cs) >= 12
    assert {len(c.images) for c in cs} == {0, 1, 2, 3}
    # prompts across block boundaries, images starting mid-block
    assert max(len(c.prompt) for c in cs) > 8 * BLOCK
    assert any(o % BLOCK for c in cs for o in c.offsets)
    return cs


# ----------------------------------------------------------------------------- engine
@pytest.fixture(params=["kernel", "torch"])
def decode_attention(request: pytest.FixtureRequest) -> str:
    if request.param == "kernel":
        try:
            paged_kernel.load(Path(engine_config().kernel_dir))
        except paged_kernel.KernelUnavailable as e:
            pytest.skip(f"the C decode-attention kernel cannot be built here: {e}")
    return request.param


def _drive(engine: Engine, reqs: list[EngineRequest], waves: list[int], steps_between: int
           ) -> dict[str, list[RequestOutput]]:  # fmt: skip
    outs: dict[str, list[RequestOutput]] = {}
    pending = list(reqs)
    waves = list(waves)
    while pending:
        n = waves.pop(0) if waves else len(pending)
        for r in pending[:n]:
            assert engine.add_request(r) is None
        pending = pending[n:]
        for _ in range(steps_between):
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
    for _ in range(10_000):
        if not engine.has_unfinished:
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    assert outs[-1].finished and outs[-1].finish_reason == "length", outs[-1]
    return [t for o in outs for t in o.token_ids]


def _check(engine: Engine, cases: list[MMCase], outs: dict[str, list[RequestOutput]]) -> None:
    bad = [
        (i, c.hf, _tokens(outs[str(i)]))
        for i, c in enumerate(cases)
        if _tokens(outs[str(i)]) != c.hf
    ]
    assert not bad, f"engine != HF for {len(bad)} of {len(cases)} requests: {bad[:3]}"
    assert engine.stats().blocks_used == 0


def _spy_chunks(engine: Engine) -> list[tuple[str, int, int]]:
    """Record every scheduled (request, start, end); the real scheduler still runs."""
    log: list[tuple[str, int, int]] = []
    real: Callable = engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        sched = real()
        log.extend((s.id, s.num_computed, s.num_computed + n) for s, n in sched)
        return sched

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return log


def test_matches_hf_all_at_once(
    tiny_model_dir: Path, cases: list[MMCase], decode_attention: str
) -> None:
    engine = Engine.from_model_dir(
        tiny_model_dir, engine_config(num_kv_blocks=256, decode_attention=decode_attention)
    )
    assert engine.decode_attention == decode_attention
    outs = _drive(engine, [c.request(str(i)) for i, c in enumerate(cases)], [len(cases)], 0)
    _check(engine, cases, outs)
    # image 2 of request 5 is image 1 again; still, each request got its own images
    assert cases[5].images[0] == cases[5].images[1]


def test_matches_hf_chunked_across_images(
    tiny_model_dir: Path, cases: list[MMCase], decode_attention: str
) -> None:
    engine = Engine.from_model_dir(
        tiny_model_dir,
        engine_config(num_kv_blocks=256, max_num_batched_tokens=7, max_num_seqs=6,
                     decode_attention=decode_attention),
    )  # fmt: skip
    log = _spy_chunks(engine)
    outs = _drive(engine, [c.request(str(i)) for i, c in enumerate(cases)], [3, 4, 2], 5)
    _check(engine, cases, outs)
    # some prefill chunks began or ended strictly inside an image's placeholder run
    seq_len = cases[0].embeds[0].shape[0]
    inside = 0
    for rid, start, end in log:
        for o in cases[int(rid)].offsets:
            inside += o < start < o + seq_len or o < end < o + seq_len
    assert inside >= 10


def test_matches_hf_under_preemption(
    tiny_model_dir: Path, cases: list[MMCase], decode_attention: str
) -> None:
    engine = Engine.from_model_dir(
        tiny_model_dir,
        engine_config(num_kv_blocks=24, max_model_len=320, max_num_batched_tokens=64,
                     decode_attention=decode_attention, enable_prefix_caching=False),
    )  # fmt: skip
    keep = [i for i, c in enumerate(cases) if len(c.prompt) + c.max_tokens <= 320]
    assert len(keep) >= 10
    sub = [cases[i] for i in keep]
    outs = _drive(engine, [c.request(str(i)) for i, c in enumerate(sub)], [len(sub)], 0)
    assert engine.stats().preemptions > 0
    _check(engine, sub, outs)


# ---------------------------------------------------------------- prefill -> decode
def _prefill_and_import(
    prefill: Engine, decode: Engine, cases: list[MMCase], decode_mm: bool
) -> dict[str, list[int]]:
    """Prefill every image request on one engine and add it to the other as imported, with
    or without its embeddings: its KV source (a pull) copies the prefill's pinned blocks
    into the blocks the decode engine allocates for it. Returns each request's first
    token (from the prefill engine); the prefill engine keeps the blocks pinned."""
    first: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        r = c.request(str(i))
        r.prefill_only = True
        assert prefill.add_request(r) is None
    while prefill.has_unfinished:
        for o in prefill.step():
            assert o.prefilled and o.kv_block_ids, o
            r = cases[int(o.request_id)].request(o.request_id)
            _, r.imported = imported(o, prefill, decode)
            if not decode_mm:
                r.mm_inputs = None
            assert decode.add_request(r) is None
            first[o.request_id] = o.token_ids
    return first


def _decode_pool(cases: list[MMCase]) -> EngineConfig:
    """A pool that holds every prompt and little more: decoding must preempt."""
    blocks = sum(-(-len(c.prompt) // BLOCK) for c in cases) + 2
    return engine_config(num_kv_blocks=blocks, max_model_len=blocks * BLOCK,
                        enable_prefix_caching=False)  # fmt: skip


def test_prefill_then_decode_with_preemption(tiny_model_dir: Path, cases: list[MMCase]) -> None:
    """Image requests prefilled on one engine and decoded on another equal HF; a decode
    engine that preempts recomputes them from the embeddings the imported requests carry,
    and refuses to recompute an image prompt whose embeddings it was not given."""
    sub = [c for c in cases if c.images and c.max_tokens >= 10][:5]
    assert len(sub) == 5
    prefill = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256))
    decode = Engine.from_model_dir(tiny_model_dir, _decode_pool(sub))
    first = _prefill_and_import(prefill, decode, sub, decode_mm=True)
    outs: dict[str, list[int]] = dict(first)
    while decode.has_unfinished:
        for o in decode.step():
            outs[o.request_id] = outs[o.request_id] + o.token_ids
    assert decode.stats().preemptions > 0
    assert [outs[str(i)] for i in range(len(sub))] == [c.hf for c in sub]
    assert all(prefill.release_pinned(rid) for rid in first)  # every one pulled
    assert decode.stats().blocks_used == 0 and prefill.stats().blocks_used == 0

    decode = Engine.from_model_dir(tiny_model_dir, _decode_pool(sub))
    _prefill_and_import(prefill, decode, sub, decode_mm=False)
    # step until it preempts (or ends), not a number of steps: while the imports' KV loads
    # on the loader thread, a step has nothing to do, and a slow machine spent 10,000 of
    # them before the first load was in
    deadline = time.monotonic() + 600
    with pytest.raises(RuntimeError, match="carries no mm_inputs"):
        while decode.has_unfinished and time.monotonic() < deadline:
            if not decode.step():
                time.sleep(0.001)


# ------------------------------------------------------------------------ prefix cache
def _one(engine: Engine, req: EngineRequest) -> list[RequestOutput]:
    return _drive(engine, [req], [1], 0)[req.request_id]


def test_different_image_same_text_shares_no_kv(tiny_model_dir: Path) -> None:
    a, b = _build_cases(
        tiny_model_dir,
        [(["@png", "Describe this image. " * 6], 12, True),
         (["@png2", "Describe this image. " * 6], 12, True)],
    )  # fmt: skip
    assert a.prompt == b.prompt and a.offsets == b.offsets == [a.offsets[0]]
    assert a.offsets[0] < BLOCK  # the image starts in the first block: nothing before it
    assert a.hf != b.hf
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=128))
    out_a = _one(engine, a.request("a"))
    out_b = _one(engine, b.request("b"))
    assert _tokens(out_a) == a.hf and _tokens(out_b) == b.hf
    assert out_b[-1].num_cached_tokens == 0
    assert engine.stats().prompt_tokens_cached == 0
    # the same image again hits every full block the first one left, and decodes the same
    again = _one(engine, a.request("a2"))
    assert _tokens(again) == a.hf
    cached = again[-1].num_cached_tokens
    assert cached >= (len(a.prompt) - 1) // BLOCK * BLOCK - BLOCK and cached > 2 * BLOCK
    assert engine.stats().prompt_tokens_cached == cached


def test_hit_ending_inside_an_image(tiny_model_dir: Path) -> None:
    """A cached prefix whose last block ends mid-image: the rest of the image's rows come
    from its embeddings, the cached part from KV."""
    first, longer = _build_cases(
        tiny_model_dir,
        [(["Look:", "@jpeg"], 3, False), (["Look:", "@jpeg", "@gray", "and more"], 10, False)],
    )
    off = first.offsets[0]
    assert off % BLOCK and (off + 16) // BLOCK * BLOCK <= len(first.prompt)
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=128))
    assert _tokens(_one(engine, first.request("first"))) == first.hf
    out = _one(engine, longer.request("longer"))
    assert _tokens(out) == longer.hf
    hit = out[-1].num_cached_tokens
    assert off < hit < off + 16  # the hit ends inside the jpeg's placeholder run


def test_bad_mm_inputs_fail_the_request(tiny_model_dir: Path, cases: list[MMCase]) -> None:
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=128))
    c = cases[0]

    def fail(req: EngineRequest, match: str) -> None:
        out = engine.add_request(req)
        assert out is not None and out.finished and out.finish_reason == "error"
        assert match in (out.error or ""), out.error

    fail(c.request("nokeys", with_keys=False), "block_extra_keys")
    req = c.request("wide")
    req.mm_inputs = [MMInput(c.offsets[0], torch.zeros(16, 7))]
    fail(req, "[tokens, 128]")
    req = c.request("out")
    req.mm_inputs = [MMInput(len(c.prompt) - 3, c.embeds[0])]
    fail(req, "outside")
    two = cases[4]
    req = two.request("overlap")
    o = two.offsets[0]
    req.mm_inputs = [MMInput(o, two.embeds[0]), MMInput(o + 5, two.embeds[1])]
    fail(req, "overlap")
    assert not engine.has_unfinished
    # without prefix caching no key is needed
    plain = Engine.from_model_dir(
        tiny_model_dir, engine_config(num_kv_blocks=128, enable_prefix_caching=False)
    )
    assert _tokens(_one(plain, c.request("nokeys", with_keys=False))) == c.hf


def test_mock_engine_ignores_mm_inputs(tiny_model_dir: Path, cases: list[MMCase]) -> None:
    timing = MockTiming(decode_step_ms=0, prefill_us_per_token=0, speedup=1000)
    engine = MockEngine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=128), timing)
    c = cases[4]
    outs = _drive(engine, [c.request("m")], [1], 0)["m"]  # type: ignore[arg-type]
    assert outs[-1].finished and outs[-1].num_output_tokens == c.max_tokens


# ----------------------------------------------------------------------------- preset
def test_preset_matches_hf(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = init_model(tmp_path_factory.mktemp("models") / "l15", PRESETS["llava-1.5-like"])
    cases = _build_cases(
        d,
        [(["What is in", "@jpeg", "?"], 8, True), (["@png", "x", "@large", LONG], 6, True)],
    )
    assert [len(c.embeds) for c in cases] == [1, 2]
    assert cases[0].embeds[0].shape == (576, 256)
    engine = Engine.from_model_dir(
        d,
        engine_config(num_kv_blocks=256, max_num_batched_tokens=512),  # 576-token images split
    )
    outs = _drive(engine, [c.request(str(i)) for i, c in enumerate(cases)], [2], 0)
    _check(engine, cases, outs)
