"""vLLM's own offline ``LLM.generate``: the reference the vLLM engine is compared with.

Run as a script in a process of its own (vLLM spawns its EngineCore; the test process
stays clean): ``python offline_ref.py SPEC.json OUT.json``. SPEC holds the model dir,
vLLM's engine options and the requests (prompt token ids, sampling parameters, and
optionally ``image``: a PNG path); OUT gets, per request, the generated token ids, text,
finish reason and stop reason.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())  # noqa: SIM115
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], seed=0, **spec["options"])
    prompts, params = [], []
    for r in spec["requests"]:
        prompt: dict = {"prompt_token_ids": r["prompt_token_ids"]}
        if r.get("image"):
            from PIL import Image

            prompt["multi_modal_data"] = {"image": Image.open(r["image"]).convert("RGB")}
        prompts.append(prompt)
        params.append(SamplingParams(**r["params"]))
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = [
        {
            "token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "finish_reason": o.outputs[0].finish_reason,
            "stop_reason": o.outputs[0].stop_reason,
        }
        for o in outs
    ]
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
