"""Prompt building in the API process: chat template + tokenizer, no torch.

Reads the model directory's ``tokenizer.json`` (Rust ``tokenizers``), its chat template
(``tokenizer_config.json`` or ``chat_template.jinja``) and its context window
(``config.json``). The template is rendered in a sandboxed Jinja environment the way Hugging
Face's ``apply_chat_template`` renders it, then encoded without adding special tokens (the
template carries them).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from api.errors import bad_request
from api.protocol import ChatMessage


class PromptBuilder:
    def __init__(self, model_dir: str | Path, max_model_len: int | None = None) -> None:
        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        tcfg_path = d / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
        self.special = {
            k: _token_str(tcfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)
        cfg = json.loads((d / "config.json").read_text())
        text_cfg = cfg.get("text_config", cfg)
        self.max_model_len = max_model_len or int(text_cfg.get("max_position_embeddings", 2048))
        self.vocab_size = self.tokenizer.get_vocab_size()

    # ----------------------------------------------------------------------------------
    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        if self._template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        msgs = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                for part in content:
                    if part.type != "text":
                        raise bad_request(
                            f"content part type {part.type!r} is not supported yet",
                            f"messages.{i}.content",
                            "unsupported_content",
                        )
                content = [{"type": "text", "text": p.text or ""} for p in content]
            msgs.append({"role": m.role, "content": content if content is not None else ""})
        try:
            text = self._template.render(messages=msgs, add_generation_prompt=True, **self.special)
        except TemplateError as e:
            raise bad_request(f"chat template failed: {e}", "messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def completion_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise bad_request("prompt must not be empty", "prompt")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise bad_request(
                        "batched prompts are not supported yet; send one prompt per request",
                        "prompt",
                        "unsupported_parameter",
                    )
                prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        ids = [int(t) for t in prompt]  # type: ignore[union-attr]
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range [0, {self.vocab_size})", "prompt")
        return ids

    def check_length(self, n_prompt: int, max_tokens: int | None, prompt_param: str) -> int:
        """Validate against the context window; returns the effective max_tokens."""
        if n_prompt >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {n_prompt} tokens. Please reduce the length "
                "of the prompt.",
                prompt_param,
                "context_length_exceeded",
            )
        room = self.max_model_len - n_prompt
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                f"prompt, {max_tokens} for the completion). Please reduce the length of the "
                "prompt or the completion.",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens


def _token_str(v: object) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised form
        return v.get("content")
    return v if isinstance(v, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)
