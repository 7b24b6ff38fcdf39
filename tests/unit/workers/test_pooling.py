"""Embeddings in the engine process: the checkpoint's pooling config, the reference
engine's pooled vectors against Hugging Face's hidden states (the test pools them itself),
and the runner that computes them between the engine's steps (a real Engine on a real
EngineLoop; a MockEngine refuses)."""

from __future__ import annotations

import base64
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlavaForConditionalGeneration

from kvbm.protocol import Pooling, Sampling
from tasks.settings import engine_config
from workers.engine import Engine
from workers.engine_api import EngineRequest, RequestOutput
from workers.engine_loop import EngineLoop
from workers.mock_engine import MockEngine, MockTiming
from workers.model_init import PRESETS, init_model, write_pooling_config
from workers.pooling import EmbeddingRunner, PoolingConfig, load_pooling_config

TEXTS = [
    [1, 407, 83, 16, 368, 331, 5, 225, 302, 370, 324, 225, 448, 331, 87, 386],
    [1, 9],
    [1] + [5 + (i * 37) % 500 for i in range(90)],  # several blocks, several chunks
]


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> LlavaForConditionalGeneration:
    return LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()


def hf_pooled(model, ids: list[int], mode: str, normalize: bool = True,  # type: ignore[no-untyped-def]
              dims: int | None = None) -> np.ndarray:  # fmt: skip
    """The test's own pooling of HF's last hidden states (after the final norm)."""
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode].double()
    if dims is not None:
        v = v[:dims]
    if normalize:
        v = v / v.norm()
    return v.numpy()


def engine_vector(engine: Engine, ids: list[int], chunk: int, params: Pooling) -> np.ndarray:
    job = engine.pooler().start(ids, params)
    steps = 0
    while not job.done:
        job.step(chunk)
        steps += 1
    assert steps == -(-len(ids) // chunk)
    return np.frombuffer(job.result(), dtype="<f4")


def pooled_copy(src: Path, dst: Path, mode: str, normalize: bool = True) -> Path:
    shutil.copytree(src, dst)
    write_pooling_config(dst, mode, 128, normalize)
    return dst


# ---------------------------------------------------------------------------- config
def test_pooling_config_default_and_sentence_transformers_layouts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert load_pooling_config(tiny_model_dir) == PoolingConfig("last", True, "default")
    for mode in ("last", "mean", "cls"):
        for norm in (True, False):
            d = tmp_path / f"{mode}-{norm}"
            d.mkdir()
            write_pooling_config(d, mode, 128, norm)
            cfg = load_pooling_config(d)
            assert (cfg.type, cfg.normalize, cfg.unsupported) == (mode, norm, None)
            assert cfg.source == "modules.json + 1_Pooling/config.json"


def test_pooling_config_refuses_what_it_does_not_compute(tmp_path: Path) -> None:
    write_pooling_config(tmp_path, "mean", 128)
    raw = (tmp_path / "1_Pooling" / "config.json").read_text()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        raw.replace('"pooling_mode_mean_tokens": true', '"pooling_mode_max_tokens": true')
    )
    cfg = load_pooling_config(tmp_path)
    assert cfg.unsupported is not None and "pooling_mode_max_tokens" in cfg.unsupported
    # the newer single-key spelling
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode": "lasttoken"}')
    assert load_pooling_config(tmp_path).type == "last"


# ----------------------------------------------------------------- vectors against HF
@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_vectors_match_hf_hidden_states_pooled(
    tiny_model_dir: Path,
    tmp_path: Path,
    hf,
    mode: str,  # type: ignore[no-untyped-def]
) -> None:
    d = tiny_model_dir if mode == "last" else pooled_copy(tiny_model_dir, tmp_path / "m", mode)
    engine = Engine.from_model_dir(d, engine_config(num_kv_blocks=256))
    assert engine.pooling.type == mode
    for ids in TEXTS:
        want = hf_pooled(hf, ids, mode)
        for chunk in (4096, 16, 7, 1):  # whole, block-aligned chunks, ragged chunks
            got = engine_vector(engine, ids, chunk, Pooling())
            assert got.dtype == np.float32 and got.shape == (128,)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5


def test_unnormalised_and_cut_vectors(tiny_model_dir: Path, tmp_path: Path, hf) -> None:  # type: ignore[no-untyped-def]
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256))
    ids = TEXTS[0]
    raw = engine_vector(engine, ids, 5, Pooling(normalize=False))
    np.testing.assert_allclose(raw, hf_pooled(hf, ids, "last", normalize=False), atol=1e-4)
    assert abs(np.linalg.norm(raw) - 1.0) > 0.1  # it really is not normalised
    cut = engine_vector(engine, ids, 5, Pooling(dimensions=32))  # cut, then normalised
    np.testing.assert_allclose(cut, hf_pooled(hf, ids, "last", dims=32), atol=1e-4)
    # a sentence-transformers layout without Normalize: not normalised unless asked
    d = pooled_copy(tiny_model_dir, tmp_path / "m", "mean", normalize=False)
    plain = Engine.from_model_dir(d, engine_config(num_kv_blocks=256))
    np.testing.assert_allclose(
        engine_vector(plain, ids, 8, Pooling()),
        hf_pooled(hf, ids, "mean", normalize=False),
        atol=1e-4,
    )
    np.testing.assert_allclose(engine_vector(plain, ids, 8, Pooling(normalize=True)),
                               hf_pooled(hf, ids, "mean"), atol=1e-4)  # fmt: skip


def test_the_pooler_leaves_the_block_pool_alone(tiny_model_dir: Path) -> None:
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256))
    before = engine.stats()
    engine_vector(engine, TEXTS[2], 16, Pooling())
    after = engine.stats()
    assert (after.blocks_used, after.blocks_cached, after.prompt_tokens_seen) == (
        before.blocks_used, before.blocks_cached, before.prompt_tokens_seen)  # fmt: skip


# --------------------------------------------------------------------------- runner
class Sink:
    """Collects what the loop and the runner publish, in order."""

    def __init__(self) -> None:
        self.outs: list[RequestOutput] = []
        self.cv = threading.Condition()

    def __call__(self, outs: list[RequestOutput]) -> None:
        with self.cv:
            self.outs.extend(outs)
            self.cv.notify_all()

    def wait_done(self, rid: str, timeout: float = 60.0) -> RequestOutput:
        end = time.monotonic() + timeout
        with self.cv:
            while True:
                done = [o for o in self.outs if o.request_id == rid and o.finished]
                if done:
                    return done[0]
                left = end - time.monotonic()
                assert left > 0, f"{rid} did not finish"
                self.cv.wait(left)


def test_runner_interleaves_chunks_with_decode_steps(tiny_model_dir: Path, hf) -> None:  # type: ignore[no-untyped-def]
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256))
    sink = Sink()
    loop = EngineLoop(engine, sink).start()
    chunk = 4
    runner = EmbeddingRunner(engine, loop, sink, chunk)
    try:
        gen = EngineRequest("gen", [1, 5, 6], Sampling(max_tokens=1500, ignore_eos=True,
                                                       temperature=0.0))  # fmt: skip
        loop.submit(gen)
        while not any(o.request_id == "gen" for o in sink.outs):
            time.sleep(0.01)
        ids = TEXTS[2]
        runner.submit("emb", ids, Pooling())
        out = sink.wait_done("emb")
        with sink.cv:
            at = sink.outs.index(out)
            during = [o for o in sink.outs[:at] if o.request_id == "gen"]
        vector = np.frombuffer(base64.b64decode(out.embedding or ""), "<f4")
        np.testing.assert_allclose(vector, hf_pooled(hf, ids, "last"), atol=1e-4)
        assert (out.finish_reason, out.num_prompt_tokens, out.error) == ("stop", len(ids), None)
        chunks = -(-len(ids) // chunk)
        assert runner.chunks == chunks
        # one decode step ran between every two chunks: the stream kept its pace
        tokens_during = sum(len(o.token_ids) for o in during)
        assert tokens_during >= chunks - 1, (tokens_during, chunks)
        assert not any(o.finished for o in during)
    finally:
        loop.abort("gen")
        runner.close()
        loop.stop()


def test_runner_abort_and_refusals(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256))
    sink = Sink()
    loop = EngineLoop(engine, sink).start()
    runner = EmbeddingRunner(engine, loop, sink, 1)  # one token per chunk: time to abort
    try:
        runner.submit("long", TEXTS[2], Pooling())
        assert runner.abort("long") and not runner.abort("someone-else")
        out = sink.wait_done("long")
        assert (out.finish_reason, out.embedding) == ("abort", None)
        assert runner.chunks < len(TEXTS[2])
    finally:
        runner.close()
        loop.stop()
    # a pooling this engine does not compute: refused as the request's fault (400)
    d = pooled_copy(tiny_model_dir, tmp_path / "m", "mean")
    (d / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    engines = [
        Engine.from_model_dir(d, engine_config(num_kv_blocks=256)),
        MockEngine.from_model_dir(
            tiny_model_dir, engine_config(num_kv_blocks=256), MockTiming()
        ),  # fmt: skip
    ]
    for engine, why in zip(engines, ["pooling_mode_max_tokens", "mock engine does not serve"],
                           strict=True):  # fmt: skip
        sink = Sink()
        loop = EngineLoop(engine, sink).start()
        runner = EmbeddingRunner(engine, loop, sink, 64)
        try:
            runner.submit("e", [1, 2, 3], Pooling())
            out = sink.wait_done("e")
        finally:
            runner.close()
            loop.stop()
        assert (out.finish_reason, out.error_code) == ("error", "unsupported_parameter")
        assert why in (out.error or ""), out.error


def test_runner_hands_a_self_pooling_engines_request_to_it(tiny_model_dir: Path) -> None:
    """An engine that pools in its own scheduling (vLLM's pooling runner) gets the whole
    request in one call, on the runner's thread, and its output is the request's frame."""

    class SelfPooling(MockEngine):
        def embed_prompt(self, request_id: str, token_ids: list[int],
                         params: Pooling) -> RequestOutput:  # fmt: skip
            calls.append((request_id, token_ids, params, threading.current_thread().name))
            return RequestOutput(request_id, [], "", finished=True, finish_reason="stop",
                                 num_prompt_tokens=len(token_ids),
                                 embedding="AACAPw==")  # fmt: skip

    calls: list[tuple] = []
    engine = SelfPooling.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256),
                                        MockTiming())  # fmt: skip
    sink = Sink()
    loop = EngineLoop(engine, sink).start()
    runner = EmbeddingRunner(engine, loop, sink, 64)
    try:
        runner.submit("v", [1, 2, 3], Pooling(normalize=False))
        out = sink.wait_done("v")
    finally:
        runner.close()
        loop.stop()
    assert (out.finish_reason, out.embedding) == ("stop", "AACAPw==")
    assert [c[:3] for c in calls] == [("v", [1, 2, 3], Pooling(normalize=False))]
    assert calls[0][3].startswith("embed") and runner.chunks == 0  # no chunks of ours


# --------------------------------------------------------------------------- classifier
@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny-classifier",
                      PRESETS["classifier"])  # fmt: skip


def test_a_classifiers_logits_are_hugging_faces(classifier_dir: Path) -> None:
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    engine = Engine.from_model_dir(classifier_dir, engine_config(num_kv_blocks=256))
    for ids in TEXTS:
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
        for chunk in (4096, 16, 7):  # the head reads the last token, however it is chunked
            got = engine_vector(engine, ids, chunk, Pooling(task="classify"))
            assert got.dtype == np.float32 and got.shape == (2,)
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_a_classifier_generates_nothing_and_an_lm_classifies_nothing(
    classifier_dir: Path, tiny_model_dir: Path
) -> None:
    engine = Engine.from_model_dir(classifier_dir, engine_config(num_kv_blocks=256))
    out = engine.add_request(EngineRequest("g", [1, 5, 6], Sampling(max_tokens=4)))
    assert out is not None and (out.finish_reason, out.error_code, out.error_param) == (
        "error", "unsupported_parameter", "model")  # fmt: skip
    assert not engine.has_unfinished
    lm = Engine.from_model_dir(tiny_model_dir, engine_config(num_kv_blocks=256))
    sink = Sink()
    loop = EngineLoop(lm, sink).start()
    runner = EmbeddingRunner(lm, loop, sink, 64)
    try:
        runner.submit("c", [1, 2, 3], Pooling(task="classify"))
        out = sink.wait_done("c")
    finally:
        runner.close()
        loop.stop()
    assert (out.finish_reason, out.error_code) == ("error", "unsupported_parameter")
    assert "no classification head" in (out.error or "")
