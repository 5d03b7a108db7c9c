"""Rendering a chat template as transformers' ``apply_chat_template(..., tokenize=False)`` does,
without importing transformers (a large share of a server's start-up, most of it its model registry).

The Jinja environment is transformers' own: a sandbox that cannot mutate its inputs, ``trim_blocks``
and ``lstrip_blocks``, loop controls, the ``{% generation %}`` tag (rendered as its body here, since
no assistant mask is asked for), and the same ``tojson``, ``raise_exception``, ``strftime_now``,
``dict`` and ``namespace``. The conversation goes through the same steps first: message objects to
dicts, keys with a None value dropped, everything the template sees rebuilt from plain JSON types,
the reasoning fields aliased, and ``continue_final_message`` cut after the final message. The tests
render real templates both ways and compare the text.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning is passed under; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's text for training
    masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """``dict`` for templates, without the class's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` for templates, refusing underscore names (a way into Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store the attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes HTML characters, which a prompt must keep.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled template (kept: a server renders the same one for every request)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (pydantic models and dataclasses as dicts); anything
    else becomes an inert ``"<TypeName>"``, so the sandbox never sees an object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):  # np.bool_(False) would otherwise be a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message_dict(message: Any) -> dict:
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {field.name: getattr(message, field.name) for field in dataclasses.fields(message)}
    if not isinstance(message, Mapping):
        raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    # APIs send content=None or tool_calls=None; templates handle a missing key, not a None.
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tool_schemas(tools: list | None) -> list | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif callable(tool):  # a Python function: its signature and docstring, as transformers reads them
            from transformers.utils.chat_template_utils import get_json_schema

            schemas.append(get_json_schema(tool))
        else:
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints and a docstring.")
    return schemas


def render_chat_template(
    template: str,
    messages: list[Any],
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: list | None = None,
    documents: list | None = None,
    **kwargs: Any,
) -> str:
    """The text ``template`` makes of ``messages``; ``kwargs`` (special tokens, ``enable_thinking``...)
    are the template's variables. ``continue_final_message`` ends the text inside the last message
    (its ``"content"``, or the field it names) instead of closing it."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    if documents is not None and any(not isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = [_alias_reasoning(message) for message in _plain([_message_dict(m) for m in messages])]
    final_message = None
    if continue_final_message:
        if not chat:
            raise ValueError("continue_final_message is set but the conversation is empty!")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_message] if field in _REASONING_FIELDS else [field]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template')
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    rendered = compile_chat_template(template).render(
        messages=chat,
        tools=_plain(_tool_schemas(tools)),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(kwargs),
    )
    if final_message is None:
        return rendered
    if final_message.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the rendered chat.")
    tag_at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[tag_at : tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_at]
    return rendered[:tag_at].rstrip()  # the template trimmed the message's trailing space
