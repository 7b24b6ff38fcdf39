"""The deployment's chat template (a file or the template itself) and its default template
variables, under a request's own (vLLM's --chat-template, --default-chat-template-kwargs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.protocol import ChatMessage
from api.tokenization import PromptBuilder, load_chat_template

TEMPLATE = "{% for m in messages %}[{{ tag }}]{{ m['content'] }}{% endfor %}"


def test_a_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="no file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_default_variables_under_the_requests_own(tiny_model_dir: Path) -> None:
    b = PromptBuilder(tiny_model_dir, chat_template=TEMPLATE,
                      default_template_kwargs={"tag": "d", "other": 1})  # fmt: skip
    msgs = [ChatMessage(role="user", content="x")]
    assert b.render([m.model_dump() for m in msgs]) == "[d]x"
    assert b.render([m.model_dump() for m in msgs], template_kwargs={"tag": "r"}) == "[r]x"
    assert b.template_kwargs({"tag": "r"}) == {"tag": "r", "other": 1}
    assert b.template_text == TEMPLATE
    plain = PromptBuilder(tiny_model_dir)
    assert plain.template_text != TEMPLATE and plain.template_kwargs(None) == {}
