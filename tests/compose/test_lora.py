"""LoRA adapters in the compose deployment: an adapter written by PEFT into the host's
``CONVEYOR_ADAPTERS_DIR`` (mounted read-only at ``/adapters`` in the API and the workers)
and named in ``CONVEYOR_LORA_MODULES`` is a model of ``/v1/models`` and answers through
the published port with its own output."""

from __future__ import annotations

import os

import pytest

from tests.compose.stack import Stack
from tests.lora_util import write_adapter
from workers.model_init import init_model

pytestmark = pytest.mark.integration


def test_an_adapter_from_the_mounted_directory(
    stack: Stack, model: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # the image's model is `conveyor model init`'s default checkpoint: the same shapes here
    base = init_model(tmp_path_factory.mktemp("model") / model)
    adapters = tmp_path_factory.mktemp("adapters")
    write_adapter(base, adapters / "ad1", seed=1)
    for p in [adapters, *adapters.rglob("*")]:  # the containers' user reads them
        p.chmod(0o755 if p.is_dir() else 0o644)
    adapters.parent.chmod(0o755)
    settings = {"CONVEYOR_ADAPTERS_DIR": str(adapters),
                "CONVEYOR_LORA_MODULES": "ad1=/adapters/ad1"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        stack.up()
        client = stack.client()
        cards = {m.id: m for m in client.models.list().data}
        assert cards["ad1"].model_extra["parent"] == model  # type: ignore[index]
        msgs = [{"role": "user", "content": "Hello!"}]
        kw = dict(messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        tuned = client.chat.completions.create(model="ad1", **kw)  # type: ignore[call-overload]
        plain = client.chat.completions.create(model=model, **kw)  # type: ignore[call-overload]
        assert tuned.model == "ad1" and tuned.usage.completion_tokens == 12
        assert tuned.choices[0].message.content != plain.choices[0].message.content
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stack.up()  # back to the deployment without adapters
    # Redis's volume keeps the registry; the API started without the setting dropped ad1
    assert [m.id for m in stack.client().models.list().data] == [model]
