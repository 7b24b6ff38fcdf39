"""Prompt building in the API process: chat template + tokenizer, no torch.

Reads the model directory's ``tokenizer.json`` (Rust ``tokenizers``), its chat template
(``tokenizer_config.json`` or ``chat_template.jinja``), its context window and, for a
vision-language model, its image token (``config.json``). The template is rendered in a
sandboxed Jinja environment the way Hugging Face's ``apply_chat_template`` renders it, then
encoded without adding special tokens (the template carries them).

Images: an ``image_url`` content part reaches the template as ``{"type": "image"}`` (it
renders the image token, ``<image>``); after tokenization each image token becomes
``image_seq_length`` placeholder tokens, as Hugging Face's LlavaProcessor expands them, so
the prompt's ids are the ones its processor gives for the same text and images.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from api.errors import bad_request
from api.media import ImageInput
from api.protocol import ChatMessage, ContentPart, ToolCall
from kvbm.protocol import ImageRef, eos_token_ids

IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; a fixed-resolution encoder ignores it
# What the template's own arguments are called: chat_template_kwargs may not replace them
TEMPLATE_ARGS = ("messages", "tools", "documents", "add_generation_prompt")
REQUEST_TEMPLATES = 16  # requests' own chat templates kept compiled
# Marks the end of the message continue_final_message continues; the render is cut there
# (its trailing space tells whether the template trimmed the text: then so is the cut)
CONTINUE_MARK = "\x00CONTINUE\x00 "


@dataclass(slots=True)
class Prompt:
    """A request's prompt: its token ids and, in prompt order, its images and where each
    one's placeholder tokens start."""

    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    image_offsets: list[int] = field(default_factory=list)
    image_tokens: int = 0  # placeholder tokens per image

    def image_refs(self, hashes: list[str]) -> list[ImageRef]:
        """The images as the stage payload carries them, given their content hashes."""
        assert len(hashes) == len(self.image_offsets), "one hash per image"
        return [ImageRef(hash=h, offset=o, num_tokens=self.image_tokens)
                for h, o in zip(hashes, self.image_offsets, strict=True)]  # fmt: skip


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's path, or the template itself (it holds ``{{`` or
    ``{%``); a path that does not exist is an error, not a template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: no file {value!r} (and not a template: no {{{{ or {{%)")


MAX_PROMPTS = 2048  # prompts in one completions request (as OpenAI caps embedding inputs)


class PromptBuilder:
    def __init__(
        self, model_dir: str | Path, max_model_len: int | None = None,
        model_name: str | None = None, chat_template: str | None = None,
        default_template_kwargs: dict | None = None,
    ) -> None:  # fmt: skip
        """``chat_template``: the deployment's template in place of the model's (vLLM's
        --chat-template: a file's path, or the template itself); ``default_template_kwargs``:
        template variables every request gets unless it sets them (vLLM's
        --default-chat-template-kwargs)."""
        d = Path(model_dir)
        self.model_name = model_name or d.name
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        tcfg_path = d / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
        # which end vLLM's truncate_prompt_tokens cuts off (HF's default: the right)
        self.truncation_side = tcfg.get("truncation_side") or "right"
        self.special = {
            k: _token_str(tcfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if chat_template is not None:
            template = load_chat_template(chat_template)
        self.default_template_kwargs = dict(default_template_kwargs or {})
        # the environment Hugging Face renders chat templates in: its tojson (no HTML
        # escaping, keys in order), loop controls, {% generation %} blocks
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _Generation])  # fmt: skip
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._env = env
        self._template = env.from_string(template) if template else None
        self.template_text = template
        self._request_templates: OrderedDict[str, Template] = OrderedDict()  # by their text
        cfg = json.loads((d / "config.json").read_text())
        text_cfg = cfg.get("text_config", cfg)
        self.max_model_len = max_model_len or int(text_cfg.get("max_position_embeddings", 2048))
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.eos_token_ids = eos_token_ids(d)  # what ends a sequence (beam search's ends)
        # a vision-language model names its image token; a text-only one refuses images
        self.image_token_id, self.image_seq_length = _vision(cfg)
        # thinking_token_budget's markers as token ids: (start, forced end, natural end);
        # set from the settings (set_thinking_markers), None: no budget can be served
        self.thinking_markers: tuple[list[int], list[int], list[int]] | None = None
        # whether a request may bring its own chat template (vLLM's
        # --trust-request-chat-template): rendered in the same sandbox
        self.trust_request_templates = False

    def set_thinking_markers(self, markers: tuple[str, str, str] | None) -> None:
        """The reasoning markers' text (``ApiSettings.reasoning_markers``) as token ids,
        encoded without special tokens as vLLM encodes them."""
        if markers is None:
            self.thinking_markers = None
            return
        ids = [self.tokenizer.encode(m, add_special_tokens=False).ids for m in markers]
        if not all(ids):
            raise ValueError(f"the reasoning markers {markers} do not all tokenize")
        self.thinking_markers = (ids[0], ids[1], ids[2])

    @property
    def accepts_images(self) -> bool:
        return self.image_token_id is not None

    # ----------------------------------------------------------------------------------
    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        return self.chat_prompt(messages).token_ids

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        add_special_tokens: bool = False,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> Prompt:
        """Render, tokenize and expand the images' placeholders; a content part the model
        cannot take is a 400 naming it (nothing is fetched here). As Hugging Face's
        ``apply_chat_template`` renders: ``tools`` (OpenAI's tool objects) as the template's
        ``tools``, a call's JSON ``arguments`` as an object (vLLM's conversion),
        ``template_kwargs`` as more template variables; ``continue_final_message`` leaves
        the last message open (the render is cut where its text ends).
        ``add_special_tokens``: the tokenizer's own (a BOS) on top of what the template
        writes (vLLM's field). ``documents``: the template's (retrieval-augmented
        templates'); ``chat_template``: a request's own template instead of the model's
        (refused unless ``trust_request_templates``)."""
        if chat_template is not None and not self.trust_request_templates:
            raise bad_request("a request's own chat_template is refused: the server does not "
                              "trust them (CONVEYOR_TRUST_REQUEST_CHAT_TEMPLATE, vLLM's "
                              "--trust-request-chat-template)", "chat_template")  # fmt: skip
        if self._template is None and chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        msgs = []
        images: list[ImageInput] = []
        for i, m in enumerate(messages):
            content: str | list[dict[str, str]] | None = ""
            if isinstance(m.content, str):
                content = m.content
            elif isinstance(m.content, list):
                parts = []
                for j, part in enumerate(m.content):
                    if part.type == "text":
                        parts.append({"type": "text", "text": part.text or ""})
                    elif part.type == "image_url":
                        images.append(self._image_part(part, f"messages.{i}.content.{j}"))
                        parts.append({"type": "image"})  # what HF chat templates expect
                    else:
                        raise bad_request(
                            f"content part type {part.type!r} is not supported; send "
                            "'text' or 'image_url'",
                            f"messages.{i}.content.{j}.type",
                            "unsupported_content",
                        )
                content = parts
            elif m.tool_calls:
                content = None  # an assistant turn that only calls tools
            msg: dict = {"role": m.role, "content": content}
            if m.tool_calls:
                msg["tool_calls"] = [_call_for_template(c, f"messages.{i}.tool_calls.{j}")
                                     for j, c in enumerate(m.tool_calls)]  # fmt: skip
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                msg["name"] = m.name
            msgs.append(msg)
        text = self.render(msgs, tools, add_generation_prompt, continue_final_message,
                           template_kwargs, documents, chat_template)  # fmt: skip
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not self.accepts_images:
            return Prompt(ids)
        return self._expand(ids, images)

    def render(
        self,
        msgs: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The chat template's text for messages already in the template's form."""
        template = self._template if chat_template is None else self._compiled(chat_template)
        assert template is not None, "render() on a model without a chat template"
        extra = self.template_kwargs(template_kwargs)
        clash = [k for k in extra if k in TEMPLATE_ARGS]
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {clash[0]!r} (the request "
                              "sets it)", "chat_template_kwargs")  # fmt: skip
        if continue_final_message:
            msgs = _mark_final(msgs)
        try:
            text = template.render(
                messages=msgs, tools=tools or None, documents=documents or None,
                add_generation_prompt=add_generation_prompt, **{**self.special, **extra},
            )  # fmt: skip
        except TemplateError as e:
            raise bad_request(f"chat template failed: {e}", "messages") from e
        if continue_final_message:
            at = text.rfind(CONTINUE_MARK.strip())
            if at < 0:
                raise bad_request("continue_final_message: the chat template does not render "
                                  "the final message's text", "continue_final_message")  # fmt: skip
            trimmed = not text.startswith(CONTINUE_MARK, at)
            text = text[:at].rstrip() if trimmed else text[:at]
        return text

    def template_kwargs(self, asked: dict | None) -> dict:
        """A request's template variables over the deployment's defaults."""
        return {**self.default_template_kwargs, **(asked or {})}

    def _compiled(self, text: str) -> Template:
        """A request's chat template, compiled in the model's template environment (the
        sandbox); the last few are kept. A template that does not compile is a 400."""
        template = self._request_templates.get(text)
        if template is None:
            try:
                template = self._env.from_string(text)
            except TemplateError as e:
                raise bad_request(f"chat_template does not compile: {e}", "chat_template") from e
            self._request_templates[text] = template
            while len(self._request_templates) > REQUEST_TEMPLATES:
                self._request_templates.popitem(last=False)
        self._request_templates.move_to_end(text)
        return template

    def _image_part(self, part: ContentPart, param: str) -> ImageInput:
        if not self.accepts_images:
            raise bad_request(
                f"the model `{self.model_name}` does not accept images (it is text-only); "
                "send text content parts",
                param,
                "unsupported_parameter",
            )
        spec = part.image_url
        if isinstance(spec, str):  # some clients send the URL itself
            spec = {"url": spec}
        url = spec.get("url") if isinstance(spec, dict) else None
        if not isinstance(url, str) or not url:
            raise bad_request("an image_url part needs image_url.url (a data: or https:// URL)",
                              f"{param}.image_url", "invalid_value")  # fmt: skip
        detail = spec.get("detail")
        if detail is not None and detail not in IMAGE_DETAILS:
            raise bad_request(f"image_url.detail must be one of {', '.join(IMAGE_DETAILS)}",
                              f"{param}.image_url.detail", "invalid_value")  # fmt: skip
        return ImageInput(url, f"{param}.image_url")

    def _expand(self, ids: list[int], images: list[ImageInput]) -> Prompt:
        """Each image token -> ``image_seq_length`` of them (LlavaProcessor's expansion);
        the image tokens must be exactly one per image part."""
        tok, n = self.image_token_id, self.image_seq_length
        assert tok is not None, "_expand on a model without an image token"
        found = ids.count(tok)
        if found != len(images):
            raise bad_request(
                f"the prompt holds {found} image token(s) for {len(images)} image part(s): "
                f"text must not contain the image token "
                f"{self.tokenizer.id_to_token(tok)!r}",
                "messages",
                "invalid_value",
            )
        if not images:
            return Prompt(ids)
        out: list[int] = []
        offsets: list[int] = []
        for t in ids:
            if t == tok:
                offsets.append(len(out))
                out.extend([tok] * n)
            else:
                out.append(t)
        return Prompt(out, images, offsets, n)

    def completion_prompts(
        self, prompt: str | list[int] | list[str] | list[list[int]], special: bool = True,
    ) -> list[tuple[str | list[int], list[int]]]:  # fmt: skip
        """A completions ``prompt`` as its prompts (one, or a batch: a list of strings or of
        token-id lists), each as sent and as token ids, checked (a 400 names which one is
        empty or holds an id outside the vocabulary). ``special``: a text prompt gets the
        tokenizer's special tokens (vLLM's ``add_special_tokens``)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            items: list[str | list[int]] = list(prompt)
        else:
            items = [prompt]  # type: ignore[list-item]  # one: a string or token ids
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        if len(items) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}",
                              "prompt")  # fmt: skip
        out: list[tuple[str | list[int], list[int]]] = []
        for i, item in enumerate(items):
            which = f"prompt {i}" if len(items) > 1 else "prompt"
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"{which} must not be empty", "prompt")
                out.append((item, self.tokenizer.encode(item, add_special_tokens=special).ids))
                continue
            if not isinstance(item, list) or not all(isinstance(t, int) for t in item):
                raise bad_request("a batch of prompts is a list of strings or a list of token-id "
                                  "lists, not a mix", "prompt")  # fmt: skip
            ids = list(item)
            if not ids:
                raise bad_request(f"{which} must not be empty", "prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} in {which} is out of range "
                                  f"[0, {self.vocab_size})", "prompt")  # fmt: skip
            out.append((ids, ids))
        return out

    def truncation_keep(self, keep: int | None) -> int | None:
        """vLLM's ``truncate_prompt_tokens``, checked: the tokens a prompt keeps at most
        (-1: the context window); None: no truncation."""
        if keep is None:
            return None
        limit = self.max_model_len
        if keep == -1:
            return limit
        if not 1 <= keep <= limit:
            raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {limit}] (the "
                              f"context window), got {keep}", "truncate_prompt_tokens",
                              "invalid_value")  # fmt: skip
        return keep

    def truncated(self, prompt: Prompt, keep: int | None, side: str | None = None) -> Prompt:
        """A generation prompt cut to ``truncate_prompt_tokens`` tokens: its last ones (vLLM's
        left truncation for generation, the default), or its first ones (``side``
        ``right``, vLLM's ``truncation_side``); a cut through an image's placeholders is a
        400."""
        n = self.truncation_keep(keep)
        if n is None or len(prompt.token_ids) <= n:
            return prompt
        if side == "right":
            if prompt.images and prompt.image_offsets[-1] + prompt.image_tokens > n:
                raise bad_request(f"truncate_prompt_tokens={n} would cut the prompt's images "
                                  "off", "truncate_prompt_tokens", "invalid_value")  # fmt: skip
            return Prompt(prompt.token_ids[:n], prompt.images, prompt.image_offsets,
                          prompt.image_tokens)  # fmt: skip
        drop = len(prompt.token_ids) - n
        if prompt.images:
            if prompt.image_offsets[0] < drop:
                raise bad_request(f"truncate_prompt_tokens={n} would cut the prompt's images "
                                  "off", "truncate_prompt_tokens", "invalid_value")  # fmt: skip
            offsets = [o - drop for o in prompt.image_offsets]
            return Prompt(prompt.token_ids[drop:], prompt.images, offsets, prompt.image_tokens)
        return Prompt(prompt.token_ids[drop:])

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


def _vision(cfg: dict) -> tuple[int | None, int]:
    """(image token id, placeholder tokens per image) of a LLaVA-style config; (None, 0)
    for a text-only model. Without ``image_seq_length`` the count is the vision tower's
    patches, plus its CLS token when every feature is kept (``full``), as HF computes it."""
    tok = cfg.get("image_token_index", cfg.get("image_token_id"))
    vision = cfg.get("vision_config")
    if tok is None or not isinstance(vision, dict):
        return None, 0
    n = cfg.get("image_seq_length")
    if n is None:  # CLIPVisionConfig's defaults where the config leaves them out
        n = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
        n += 1 if cfg.get("vision_feature_select_strategy") == "full" else 0
    return int(tok), int(n)


def _token_str(v: object) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised form
        return v.get("content")
    return v if isinstance(v, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson`` for chat templates: plain JSON, not Jinja's HTML-safe one."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (templates that mark the assistant's
    tokens for training): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _call_for_template(call: ToolCall, param: str) -> dict:
    """A tool call as chat templates read it: the arguments as an object (vLLM decodes the
    JSON string OpenAI sends; an empty one is ``{}``)."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request("a tool call's arguments must be a JSON object",
                              f"{param}.function.arguments") from None  # fmt: skip
    out: dict = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def _mark_final(msgs: list[dict]) -> list[dict]:
    """The messages with CONTINUE_MARK after the last message's text (its last text part)."""
    if not msgs:
        raise bad_request("continue_final_message needs a message to continue", "messages")
    last = dict(msgs[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + CONTINUE_MARK
    elif isinstance(content, list) and any(p.get("type") == "text" for p in content):
        parts = [dict(p) for p in content]
        j = max(i for i, p in enumerate(parts) if p.get("type") == "text")
        parts[j]["text"] = parts[j].get("text", "") + CONTINUE_MARK
        last["content"] = parts
    else:
        raise bad_request("continue_final_message: the last message has no text to continue",
                          "continue_final_message")  # fmt: skip
    return [*msgs[:-1], last]
