"""gpt-oss's harmony format end to end, with the official ``openai`` client: a tiny random GptOss
checkpoint on gpt-oss's o200k_harmony vocabulary (built here from o200k_base.tiktoken and harmony's
special tokens, no network), served with ``--reasoning-parser openai_gptoss --enable-auto-tool-choice
--tool-call-parser openai``.

The chat template's generation prompt opens the analysis channel (``<|start|>assistant<|channel|>
analysis<|message|>``): a random model never writes a harmony header itself, so its own tokens are the
analysis text. The thinking budget then forces ``<|end|><|start|>assistant<|channel|>final<|message|>``
and what follows is the final channel: content, or a forced tool call's JSON. Harmony's own parser
(``parse_messages_from_completion_tokens``) is the oracle for the split.

The weights come from ``SEED``; with it, greedy decoding writes no harmony special token of its own
(asserted), which would otherwise end or reshape the channels the assertions read.
"""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from openai_server_utils import SERVER_ARGS, RemoteServer

from pagellm.reasoning.gpt_oss import ANALYSIS_OPEN, FORCED_FINAL
from pagellm.reasoning.harmony_vocab import FILE_NAME, NUM_RANKS, SHA256, sha256_of

pytestmark = pytest.mark.slow

SHARE = Path(sys.prefix) / "share" / "tiktoken"
VOCAB_SIZE = 201088  # o200k's 199998 ranks, then harmony's special tokens (<|startoftext|> ... <|reserved_201087|>)
RETURN_ID = 200002  # <|return|>: the eos
SEED = 0
BUDGET = 6
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# tiktoken's o200k_base split pattern.
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# A minimal harmony template: each turn <|start|>ROLE<|message|>TEXT<|end|>, tools in a developer
# message, and a generation prompt that opens the assistant's analysis channel.
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|end|>{%- endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant" + ANALYSIS_OPEN + "{%- endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": SCHEMA}}


def _o200k_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    assert len(ranks) == NUM_RANKS
    return ranks


def _save_harmony_tokenizer(directory: Path, encoding) -> None:
    """o200k_base as a byte-level BPE (merges recovered from the ranks, as transformers' TikTokenConverter
    does), harmony's special tokens at their ids, the template and the eos <|return|>."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = _o200k_ranks(SHARE / FILE_NAME)
    byte_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = sorted((ranks[a], ranks[b], a, b) for a, b in splits if a in ranks and b in ranks)
        merges.extend((rank, left, right) for _, _, left, right in pairs)
    merges.sort(key=lambda m: m[0])  # stable: a token's splits stay in their order
    bpe = BPE({text(t): r for t, r in ranks.items()}, [(text(a), text(b)) for _, a, b in merges], fuse_unk=False, ignore_merges=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order, they take the ids right after the ranks: 199998 <|startoftext|> ... 201087.
    specials = [encoding.decode([i]) for i in range(NUM_RANKS, VOCAB_SIZE)]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert all(tokenizer.token_to_id(t) == encoding.encode(t, allowed_special="all")[0] for t in ("<|start|>", "<|return|>", "<|call|>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|return|>", pad_token="<|endoftext|>", bos_token="<|startoftext|>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(directory)


def _save_gpt_oss_checkpoint(directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_oss",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
            "rope_theta": 150000.0,
        },
        bos_token_id=199998,
        eos_token_id=RETURN_ID,
        pad_token_id=199999,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # O(0.1) weights everywhere, norms near 1, so the greedy path is not flat
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0.0, 0.1)
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def harmony():
    if not (SHARE / FILE_NAME).is_file() or sha256_of(SHARE / FILE_NAME) != SHA256:
        pytest.skip(f"{SHARE / FILE_NAME} is absent (or not o200k_base): run scripts/fetch_o200k.sh to test gpt-oss's harmony format")
    pytest.importorskip("openai_harmony")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(SHARE))
        from pagellm.reasoning.harmony_vocab import harmony_encoding

        yield harmony_encoding()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, harmony) -> Path:
    # One folder: pagellm loads a --tokenizer folder only where it has a config.json.
    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    _save_harmony_tokenizer(path, harmony)
    _save_gpt_oss_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    args = [str(checkpoint), "--tokenizer", str(checkpoint)]
    args += ["--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice", "--tool-call-parser", "openai"]
    srv = RemoteServer([*args, *SERVER_ARGS], env={"TIKTOKEN_ENCODINGS_BASE": str(SHARE)})
    yield srv
    srv.stop_and_check()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|start|>assistant" + ANALYSIS_OPEN)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def forced_ids(tokenizer, harmony) -> list[int]:
    ids = tokenizer.encode(FORCED_FINAL, add_special_tokens=False)
    assert ids == harmony.encode(FORCED_FINAL, allowed_special="all")  # <|end|><|start|> assistant <|channel|> final <|message|>
    return ids


def _chat(client, stream: bool = False, **kwargs):
    extra = kwargs.pop("extra_body", {})
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    else:
        kwargs["logprobs"] = True
        extra = {"return_tokens_as_token_ids": True, **extra}
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        temperature=0.0,
        stream=stream,
        extra_body={"thinking_token_budget": BUDGET, **extra},
        **kwargs,
    )


def _token_ids(choice) -> list[int]:
    return [int(t.token.split(":")[1]) for t in choice.logprobs.content]


def _joined(stream) -> dict:
    """A streamed reply's deltas joined: reasoning, content, tool calls by index, finish reason, usage."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None, "usage": None}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for c in chunk.choices:
            delta = c.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            out["reasoning"] += delta.get("reasoning") or ""
            out["content"] += delta.get("content") or ""
            for call in c.delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            out["finish_reason"] = c.finish_reason or out["finish_reason"]
    return out


def _harmony_split(harmony, reply_ids: list[int]) -> dict[str, str]:
    """Harmony's own reading of the reply after the prompt's ``<|start|>assistant<|channel|>analysis<|message|>``."""
    from openai_harmony import Role

    opened = harmony.encode(ANALYSIS_OPEN, allowed_special="all")
    messages = harmony.parse_messages_from_completion_tokens(opened + reply_ids, Role.ASSISTANT)
    return {m.channel: "".join(c.text for c in m.content) for m in messages}


def _check_own_tokens(ids: list[int]) -> None:
    assert all(i < NUM_RANKS for i in ids), f"the random model wrote a harmony special token in {ids}: pick another SEED"


def test_budget_forces_the_final_channel_after_the_models_own_analysis(client, tokenizer, harmony, prompt_ids, forced_ids):
    from pagellm.reasoning.gpt_oss import GptOssReasoningParser

    r = _chat(client, max_tokens=16)
    choice = r.choices[0]
    ids = _token_ids(choice)
    assert len(ids) == 16 and choice.finish_reason == "length"
    own, forced, answer = ids[:BUDGET], ids[BUDGET : BUDGET + len(forced_ids)], ids[BUDGET + len(forced_ids) :]
    _check_own_tokens(own + answer)
    # Exactly the budget of the model's own tokens, then exactly the forced end, then the final channel.
    assert forced == forced_ids
    message = choice.message.model_dump()
    assert message["reasoning"] == message["reasoning_content"] == tokenizer.decode(own)
    assert message["content"] == tokenizer.decode(answer)
    assert "<|" not in message["content"]  # the harmony markers read, not passed on
    assert not message["tool_calls"]
    assert _harmony_split(harmony, ids) == {"analysis": message["reasoning"], "final": message["content"]}
    assert r.usage.prompt_tokens == len(prompt_ids)
    # The analysis text's own tokens, as the parser counts them: not the forced header.
    counted = GptOssReasoningParser(tokenizer, prompt_ids).num_reasoning_tokens(ids)
    assert counted == BUDGET
    assert r.usage.completion_tokens_details.reasoning_tokens == counted


def test_streamed_reasoning_and_content_join_into_the_whole(client):
    whole = _chat(client, max_tokens=16)
    streamed = _joined(_chat(client, stream=True, max_tokens=16))
    message = whole.choices[0].message
    assert streamed["reasoning"] == message.reasoning_content and streamed["content"] == message.content
    assert not streamed["calls"] and streamed["finish_reason"] == "length"
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == BUDGET


def test_forced_tool_call_after_the_thinking_is_valid_json(client, tokenizer, forced_ids):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, max_tokens=80, tools=[TOOL], tool_choice=named)
    choice = r.choices[0]
    ids = _token_ids(choice)
    _check_own_tokens(ids[:BUDGET])
    assert ids[BUDGET : BUDGET + len(forced_ids)] == forced_ids
    # The JSON grammar starts after the forced end: the arguments fill the final channel, then <|return|>.
    assert ids[-1] == RETURN_ID and choice.finish_reason == "stop"
    assert choice.message.reasoning_content == tokenizer.decode(ids[:BUDGET])
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMA)
    assert arguments == json.loads(tokenizer.decode(ids[BUDGET + len(forced_ids) : -1]))
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET

    streamed = _joined(_chat(client, stream=True, max_tokens=80, tools=[TOOL], tool_choice=named))
    assert streamed["reasoning"] == choice.message.reasoning_content and not streamed["content"]
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert streamed["finish_reason"] == "stop"
    assert streamed["usage"].completion_tokens_details.reasoning_tokens == BUDGET


def test_auto_tool_choice_without_a_call_reads_the_reasoning(client):
    plain = _chat(client, max_tokens=16).choices[0].message
    r = _chat(client, max_tokens=16, tools=[TOOL])  # tool_choice "auto": the `openai` tool parser reads the reply
    message = r.choices[0].message
    assert message.reasoning_content == plain.reasoning_content
    assert not message.tool_calls and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_auto_tool_choice_without_a_call_keeps_the_final_channel_as_content(client):
    plain = _chat(client, max_tokens=16).choices[0].message
    assert plain.content and "<|" not in plain.content
    auto = _chat(client, max_tokens=16, tools=[TOOL]).choices[0].message
    streamed = _joined(_chat(client, stream=True, max_tokens=16, tools=[TOOL]))
    assert (auto.content, streamed["content"]) == (plain.content, plain.content)
