"""vLLM's own offline ``LLM.generate``: the reference the vLLM engine is compared with.

Run as a script in a process of its own (vLLM spawns its EngineCore; the test process
stays clean): ``python offline_ref.py SPEC.json OUT.json``. SPEC holds the model dir,
vLLM's engine options and the requests (prompt token ids, sampling parameters, and
optionally ``image``: a PNG path; ``params.structured_outputs`` as a dict of vLLM's
``StructuredOutputsParams``; ``lora``: ``{"name", "id", "path"}``, a LoRA adapter, with
``enable_lora`` among the options); OUT gets, per request, the generated token ids, text,
finish reason and stop reason, and the logprobs asked for (per position: the chosen
token's ``[logprob, rank]`` and ``{token id: logprob}`` of the entries vLLM returned).
With ``"embed": true`` in SPEC it runs vLLM's pooling runner instead (``LLM.embed``) and
OUT gets each prompt's ``embedding``; with ``"beam"`` (``BeamSearchParams``' fields) its
``LLM.beam_search``, OUT getting each prompt's best beams (generated tokens, finish
reason, cumulative logprob).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())  # noqa: SIM115
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    # JSON's whitespace as Conveyor's vLLM engine sets it (workers.vllm_engine.engine_args)
    options = {
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        **spec["options"],
    }
    if spec.get("embed"):  # vLLM's pooling runner: LLM.embed, one vector per prompt
        llm = LLM(model=spec["model"], seed=0, runner="pooling", **spec["options"])
        outs = llm.embed([{"prompt_token_ids": r["prompt_token_ids"]} for r in spec["requests"]],
                         use_tqdm=False)  # fmt: skip
        with open(sys.argv[2], "w") as f:
            json.dump([{"embedding": list(o.outputs.embedding)} for o in outs], f)
        llm.llm_engine.engine_core.shutdown()
        return
    llm = LLM(model=spec["model"], seed=0, **options)
    if spec.get("beam"):  # LLM.beam_search: each prompt's best beams' generated tokens
        from vllm.sampling_params import BeamSearchParams

        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in spec["requests"]]
        outs = llm.beam_search(prompts, BeamSearchParams(**spec["beam"]))  # type: ignore[arg-type]
        beams = [[{"tokens": s.tokens[len(p["prompt_token_ids"]):],
                   "finish_reason": s.finish_reason, "cum_logprob": s.cum_logprob}
                  for s in o.sequences] for p, o in zip(prompts, outs, strict=True)]  # fmt: skip
        with open(sys.argv[2], "w") as f:
            json.dump(beams, f)
        llm.llm_engine.engine_core.shutdown()
        return
    prompts, params = [], []
    for r in spec["requests"]:
        prompt: dict = {"prompt_token_ids": r["prompt_token_ids"]}
        if r.get("image"):
            from PIL import Image

            prompt["multi_modal_data"] = {"image": Image.open(r["image"]).convert("RGB")}
        prompts.append(prompt)
        kw = dict(r["params"])
        if kw.get("logit_bias"):  # JSON made its token ids strings
            kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
        if kw.get("structured_outputs") is not None:
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        params.append(SamplingParams(**kw))
    loras = [_lora(r.get("lora")) for r in spec["requests"]]
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=loras if any(loras) else None)  # fmt: skip
    result = [
        {
            "token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "stop_reason": o.outputs[0].stop_reason,
            "logprobs": _positions(o.outputs[0].logprobs, o.outputs[0].token_ids),
            "prompt_logprobs": _positions(o.prompt_logprobs, o.prompt_token_ids),
        }
        for o in outs
    ]
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    llm.llm_engine.engine_core.shutdown()


def _lora(spec):  # type: ignore[no-untyped-def]
    if not spec:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=spec["name"], lora_int_id=spec["id"], lora_path=spec["path"])


def _positions(entries, token_ids):  # type: ignore[no-untyped-def]
    """vLLM's logprobs (a dict per position, or None) as JSON."""
    if entries is None:
        return None
    out = []
    for entry, tok in zip(entries, token_ids, strict=True):
        if entry is None:
            out.append(None)
            continue
        chosen = entry[tok]
        out.append({"logprob": chosen.logprob, "rank": chosen.rank,
                    "entries": {str(t): lp.logprob for t, lp in entry.items()}})  # fmt: skip
    return out


if __name__ == "__main__":
    main()
