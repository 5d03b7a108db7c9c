"""Chat templates rendered without transformers, against transformers' own rendering of the same
template and conversation (its ``apply_chat_template(..., tokenize=False)``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jinja2
import pytest
from pydantic import BaseModel
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from pagellm.tokenizer.chat_template import compile_chat_template, render_chat_template
from pagellm.tokenizer.fast import FastTokenizer

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}

# ChatML with a default system prompt (SmolLM2's form).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3.1's shape: BOS from the special tokens, tools as indented JSON, a date, raise_exception,
# namespace and loop controls.
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- set ns = namespace(system='', seen_user=false) %}
{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nToday Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "You have these functions:\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{{- ns.system + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{%- continue %}{%- endif %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}{{- raise_exception('bad role ' + message['role']) }}{%- endif %}
    {%- if 'tool_calls' in message %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}{{- call.function | tojson }}{%- break %}{%- endfor %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
# Qwen3's shape: reasoning, enable_thinking, documents, the {% generation %} tag, dict().
QWEN3 = """{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content is defined %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}
{% generation %}{{- message.content }}{% endgeneration %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if documents %}{%- for d in documents %}{{- '[doc] ' + d.title + ': ' + d.text + '\n' }}{%- endfor %}{%- endif %}
{%- set extra = dict(a=1) %}{{- extra | tojson }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "héllo <b>"}],
    "turns": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "tool_calls": None},  # None-valued keys are dropped
        {"role": "user", "content": "  weather?  "},
    ],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    ],
    "reasoning": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning": "Let me see."},  # aliased to reasoning_content
    ],
}


def hf_view(template: str) -> FastTokenizer:
    backend = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    return FastTokenizer(backend, chat_template=template, **SPECIAL)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, FastTokenizer]:
    return {name: hf_view(template) for name, template in (("chatml", CHATML), ("llama3", LLAMA3), ("qwen3", QWEN3))}


# ChatML here concatenates content, which a tool call leaves out.
CASES = [(t, c) for t in ("chatml", "llama3", "qwen3") for c in sorted(CONVERSATIONS) if (t, c) != ("chatml", "tool_call")]


@pytest.mark.parametrize(("template", "conversation"), CASES)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_as_transformers(tokenizers, template: str, conversation: str, add_generation_prompt: bool) -> None:
    tok = tokenizers[template]
    messages = CONVERSATIONS[conversation]
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if template == "llama3":
        kwargs["tools"] = TOOLS
    if template == "qwen3":
        kwargs.update(enable_thinking=False, documents=[{"title": "A", "text": "alpha"}])
    ours = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    theirs = tok.hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    assert isinstance(ours, str) and ours


@pytest.mark.parametrize("continue_final_message", [True, "reasoning_content"])
def test_continue_final_message_as_transformers(tokenizers, continue_final_message) -> None:
    tok = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Part one, ", "reasoning_content": "Hmm "}]
    kwargs = {"continue_final_message": continue_final_message}
    ours = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == tok.hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert not ours.endswith("<|im_end|>\n")


@dataclass
class Message:
    role: str
    content: str
    name: Optional[str] = None


class PydanticMessage(BaseModel):
    role: str
    content: str


def test_message_objects_render_as_their_fields(tokenizers) -> None:
    tok = tokenizers["chatml"]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    objects = [Message("user", "Hi"), PydanticMessage(role="assistant", content="Yo")]
    assert tok.apply_chat_template(objects, tokenize=False) == tok.apply_chat_template(plain, tokenize=False)
    assert tok.apply_chat_template(objects, tokenize=False) == tok.hf.apply_chat_template(objects, tokenize=False)


def test_template_errors_are_jinja_errors() -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        render_chat_template(LLAMA3, [{"role": "robot", "content": "x"}], bos_token="<s>")
    with pytest.raises(jinja2.exceptions.SecurityError):  # no way into Python objects' internals
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{% set ns = namespace(_x=1) %}", [])
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox cannot mutate its inputs
        render_chat_template("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="not compatible"):
        render_chat_template(CHATML, [{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True)


def test_inputs_are_plain_data_and_not_mutated() -> None:
    messages = [{"role": "user", "content": "x", "meta": object()}]
    text = render_chat_template("{{ messages[0].meta }}|{{ messages[0].role }}", messages)
    assert text == "<object>|user"  # an object reaches the template as its type's name
    assert set(messages[0]) == {"role", "content", "meta"}


def test_compiled_templates_are_kept() -> None:
    assert compile_chat_template(CHATML) is compile_chat_template(CHATML)
