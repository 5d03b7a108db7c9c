"""The string-marker reasoning parsers (qwen3, deepseek_r1, granite, gemma4, string), whole and streamed.

The cases port vLLM's tests/reasoning (test_qwen3_reasoning_parser.py @ 049d8df2, test_deepseekr1_reasoning_parser.py
@ e372329d, test_granite_reasoning_parser.py @ d0ac5791, test_gemma4_reasoning_parser.py @ 0c496620,
test_base_thinking_reasoning_parser.py @ 4b387bcb, test_string_based_reasoning_parser.py @ cb95a384) as our own
data: the same shapes (markers where vLLM puts them) with our own words. Where vLLM expects a streamed result that
differs from its whole result for the same reply, a streamed reply here always joins into the whole one; such
cases say which side they follow.
"""

from __future__ import annotations

import pytest
from reasoning_utils import Case, check_deltas, check_streamed, check_whole, make_tokenizer, run_stream, token_texts

from pagellm.reasoning import REASONING_PARSERS, ReasoningBoundaryStrings, ReasoningDelta, get_reasoning_parser

R = "Compare both routes by distance"
C = "Take the river path"
R2 = "Line one of the plan\nline two"
C2 = "First step\nsecond step"
TOOL = "<tool_call>\n<function=ls>\n<parameter=path>\n/srv\n</parameter>\n</function>\n</tool_call>"
PRE = "Let me list the folder.\n\n"
HERE_T, HERE_R = "Here is my thought process:", "Here is my response:"

# ---- qwen3 (vLLM: TEST_CASES, each whole and streamed; MULTI_TOKEN_DELTA_CASES; THINKING_DISABLED_CASES)
QWEN3 = [
    Case("without_start_token", f"{R}</think>{C}", R, C),
    Case("without_start_token_complete_reasoning", f"{R}</think>", R, None),
    Case("with_think", f"<think>{R}</think>{C}", R, C),
    Case("without_think", C, C, None),  # thinking on and no marker: cut short inside reasoning
    Case("complete_reasoning", f"<think>{R}</think>", R, None),
    Case("multiline_reasoning", f"<think>{R2}</think>{C2}", R2, C2),
    Case("only_open_tag", f"<think>{R}", R, None),
    Case("truncated_no_start_token", R, R, None),
    Case("tool_call_no_think_end", PRE + TOOL, PRE, TOOL),
    Case("tool_call_with_think_no_end", "<think>" + PRE + TOOL, PRE, TOOL),
]
QWEN3_DELTAS = [
    ("start_token_grouped_with_text", [f"<think>{R}", "</think>", C], R, C),
    ("end_token_grouped_with_content", [R, f"</think>{C}"], R, C),
    ("start_and_end_in_one_delta_no_content", [f"<think>{R}</think>"], R, None),
    ("no_start_end_grouped_with_content", [R, "</think>done"], R, "done"),
    ("tool_call_implicit_reasoning_end", [PRE, "<tool_call>\n<function=ls>"], PRE, "<tool_call>\n<function=ls>"),
]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
QWEN3_DISABLED = [
    Case("thinking_disabled_plain_content", C, None, C, OFF),
    Case("thinking_disabled_no_think_tokens", R2, None, R2, OFF),
    Case("thinking_disabled_with_tool_call", PRE + TOOL, None, PRE + TOOL, OFF),
]

# ---- deepseek_r1 (vLLM: TEST_CASES; ids as vLLM's)
DEEPSEEK_WHOLE = [
    Case("simple_reasoning", f"{R}</think>{C}", R, C),
    Case("complete_reasoning", f"{R}</think>", R, None),
    Case("no_content_token", C, C, None),
    Case("multiple_lines", f"{R2}</think>{C2}", R2, C2),
    Case("shortest_streaming", f"</think>{C}", "", C),
    Case("reasoning_with_think", f"<think>{R}</think>{C}", R, C),
    Case("complete_reasoning_with_think", f"<think>{R}</think>", R, None),
    Case("multiple_lines_with_think", f"<think>{R2}</think>{C2}", R2, C2),
    Case("shortest_with_think", f"</think>{C}", "", C),
    Case("think_no_end", f"<think>{R}", R, None),
    Case("empty", "", "", None),
    Case("new_line", f"\n<think>{R}</think>\n{C}", R, "\n" + C),
]
DEEPSEEK_STREAMED = [
    Case("simple_reasoning_streaming", f"{R}</think>{C}", R, C),
    Case("complete_reasoning_streaming", f"{R}</think>", R, None),
    Case("no_reasoning_token_streaming", R, R, None),
    Case("multiple_lines_streaming", f"{R2}</think>{C2}", R2, C2),
    Case("shortest", f"</think>{C}", None, C),
    Case("reasoning_with_think_streaming", f"<think>{R}</think>{C}", R, C),
    Case("complete_reasoning_with_think_streaming", f"<think>{R}</think>", R, None),
    Case("multiple_lines_with_think_streaming", f"<think>{R2}</think>{C2}", R2, C2),
    Case("shortest_with_think_streaming", f"</think>{C}", None, C),
    Case("think_no_end_streaming", f"<think>{R}", R, None),
    Case("empty_streaming", "", None, None),
    # vLLM expects reasoning "\n" + R here (its comment: streaming "cannot handle" the newline) and R whole;
    # held back until the marker shows, the newline is dropped streamed too.
    Case("new_line_streaming (follows the whole case)", f"\n<think>{R}</think>\n{C}", R, "\n" + C),
]

# ---- granite (vLLM: TEST_CASES, 7 whole and the same 7 streamed; STREAMING_SUBCASES)
GRANITE = [
    Case("simple_reasoning", f"{HERE_T}{R}{HERE_R}{C}", R, C),
    Case("complete_reasoning", f"{HERE_T}{R}{HERE_R}", R, None),
    Case("no_reasoning", C, None, C),
    Case("multiple_lines", f"{HERE_T}{R2}{HERE_R}{C2}", R2, C2),
    Case("reasoning_with_think", f"{HERE_T} {R} {HERE_R} {C}", f" {R} ", f" {C}"),
    Case("complete_reasoning_with_think", f"{HERE_T}\n{R}\n{HERE_R}", f"\n{R}\n", None),
    Case("multiple_lines_with_think", f"Here's my thought process:{R2}Here's my response:{C2}", R2, C2),
]
# (id, previous text, delta, reasoning of the delta, content of the delta); vLLM's STREAMING_3 is left out:
# its current_text is not previous_text + delta_text.
GRANITE_DELTAS = [
    ("starting_reasoning_sequence", None, "Here", None, None),
    ("unexpected_start_reasoning_sequence", "Here is my thought", " went wrong", None, "Here is my thought went wrong"),
    ("only_start_reasoning_sequence", "Here is my thought", " process:", None, None),
    ("reasoning_has_started", HERE_T, " plan", " plan", None),
    ("response_sequence_has_started", f"{HERE_T} plan", " Here is", " ", None),
    ("response_sequence_reset", f"{HERE_T} plan Here is", " Here", "Here is ", None),
    ("response_text_has_started", f"{HERE_T} plan {HERE_R}", " answer", None, " answer"),
    ("delta_contains_everything", None, f"{HERE_T} plan {HERE_R} answer", " plan ", " answer"),
    ("delta_mixes_reasoning_and_response", f"{HERE_T} plan", f" more {HERE_R} answer", " more ", " answer"),
    ("delta_starts_response_sequence", f"{HERE_T} {R} ", "Here", None, None),
    ("delta_finishes_response_sequence", f"{HERE_T} plan Here is my response", ":", None, None),
    ("delta_breaks_potential_response_sequence", f"{HERE_T} plan Here", " was", "Here was", None),
]

# ---- gemma4 (vLLM: TEST_CASES)
CH, END = "<|channel>", "<channel|>"
GEMMA4_WHOLE = [
    # vLLM splits at a stray end marker whole, but streams the text as content with the marker dropped;
    # the streamed semantics are followed (a reply with no channel open is content).
    Case("invalid_simple (follows the streamed case)", f"{R}{END}{C}", None, R + C),
    Case("invalid_complete (follows the streamed case)", f"{R}{END}", None, R),
    Case("no_content", f"{CH}{R}", R, None),
    Case("no_reasoning", C, None, C),
    Case("reasoning", f"{CH}{R}{END}{C}", R, C),
    Case("complete_reasoning", f"{CH}{R}{END}", R, None),
    Case("multiple_lines", f"{CH}{R2}{END}{C2}", R2, C2),
    Case("no_end", f"{CH}{R}", R, None),
    Case("empty", "", None, None),
    Case("new_line", f"Before\n{CH}{R}{END}\n{C}", R, f"Before\n\n{C}"),
    Case("thought_prefix", f"{CH}thought\n{R}{END}{C}", R, C),
    Case("thought_prefix_only", f"{CH}thought\n{END}", None, None),
    Case("thought_prefix_multiline", f"{CH}thought\n{R2}{END}{C2}", R2, C2),
    Case("thought_prefix_diverge", f"{CH}thousands of reasons{END}Settled", "thousands of reasons", "Settled"),
    Case("tool_call_started", "<|tool_call>", None, "<|tool_call>"),
]
GEMMA4_STREAMED = [
    Case("invalid_simple_streaming", f"{R}{END}{C}", None, R + C),
    Case("invalid_complete_streaming", f"{R}{END}", None, R),
    Case("reasoning_streaming", f"{CH}{R}{END}{C}", R, C),
    Case("complete_reasoning_streaming", f"{CH}{R}{END}", R, None),
    Case("multiple_lines_streaming", f"{CH}{R2}{END}{C2}", R2, C2),
    Case("no_end_streaming", f"{CH}{R}", R, None),
    Case("new_line_streaming", f"Before\n{CH}{R}{END}\n{C}", R, f"Before\n\n{C}"),
    Case("thought_prefix_streaming", f"{CH}thought\n{R}{END}{C}", R, C),
    Case("thought_prefix_only_streaming", f"{CH}thought\n{END}", None, None),
    Case("thought_prefix_multiline_streaming", f"{CH}thought\n{R2}{END}{C2}", R2, C2),
    Case("thought_prefix_diverge_streaming", f"{CH}thousands of reasons{END}Settled", "thousands of reasons", "Settled"),
    Case("tool_call_started_streaming", "<|tool_call>", None, "<|tool_call>"),
]

# ---- string, vLLM's base <think> semantics (test_base_thinking_reasoning_parser.py) with configured markers
X = {"reasoning_config": {"reasoning_start_str": "<start:x>", "reasoning_end_str": "<end:x>"}}
ALT = {"reasoning_config": {"reasoning_start_str": "<alt:a>", "reasoning_end_str": "<alt:b>"}}
BASE_WHOLE = [
    Case("with_both_tokens", f"<start:x>{R}<end:x>{C}", R, C, X),
    Case("only_end_token", f"{R}<end:x>{C}", R, C, X),
    Case("no_end_token", C, C, None, X),
    Case("empty_output", "", "", None, X),
    Case("only_tokens", "<start:x><end:x>", "", None, X),
    Case("simple_reasoning_extraction[False]", "<start:x>Some thinking here<end:x>Final words", "Some thinking here", "Final words", X),
    Case("different_token_implementations_1", "Thinking one<end:x>Answer one", "Thinking one", "Answer one", X),
    Case("different_token_implementations_2", "Thinking two<alt:b>Answer two", "Thinking two", "Answer two", ALT),
    Case("multiple_end_tokens", "Early<end:x>Middle<end:x>Late", "Early", "Middle<end:x>Late", X),
    Case("nested_tokens", "<start:x>Outside<start:x>Inside<end:x>After", "Outside<start:x>Inside", "After", X),
    Case("malformed_tokens", "<start:xy>Not a marker</start:xy>After", "<start:xy>Not a marker</start:xy>After", None, X),
]
BASE_DELTAS = [
    (
        "simple_reasoning_extraction[True]",
        ["<start:x>", "Some ", "thinking ", "here", "<end:x>", "Final ", "words"],
        "Some thinking here",
        "Final words",
    ),
    ("streaming_with_incremental_deltas", ["<start:x>", "Step ", "by ", "step", "<end:x>", "The ", "end"], "Step by step", "The end"),
    ("streaming_with_start_token", ["<start:x>", "Short ", "thought", "<end:x>", "Reply"], "Short thought", "Reply"),
    ("streaming_no_end_token", ["<start:x>", "Never ", "ending ", "train ", "of thought"], "Never ending train of thought", None),
    ("streaming_only_end_token", ["<start:x>", "Brief ", "idea", "<end:x>", "Done"], "Brief idea", "Done"),
]
# ---- string with <think> markers: vLLM's old string-based (nemotron) parser's cases. That parser required the
# start marker (a reply without it was content); the base semantics above, which vLLM's <think> parsers all
# share, make such a reply reasoning, so no_reasoning follows them.
T = {"reasoning_config": {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}}
NEMOTRON = [
    Case("simple_reasoning", f"<think>{R}</think>{C}", R, C, T),
    Case("complete_reasoning", f"<think>{R}</think>", R, None, T),
    Case("no_reasoning (base semantics: reasoning)", C, C, None, T),
    Case("multiple_lines", f"<think>{R2}</think>{C2}", R2, C2, T),
    Case("reasoning_with_think", f"<think> {R} </think> {C}", f" {R} ", f" {C}", T),
    Case("complete_reasoning_with_think", f"<think>\n{R}\n</think>", f"\n{R}\n", None, T),
    Case("multiple_lines_with_think", f"<think>{R2}\n</think>\n{C2}", R2 + "\n", "\n" + C2, T),
]
NEMOTRON_DELTAS = [  # STREAMING_2 (needs the start marker) and STREAMING_3 (inconsistent data) left out
    ("starting_reasoning_sequence", None, "<thin", None, None),
    ("only_start_reasoning_sequence", "<thin", "k>", None, None),
    ("reasoning_has_started", "<think>", " plan", " plan", None),
    ("response_sequence_has_started", "<think> plan", " </thin", " ", None),
    ("response_sequence_reset", "<think> plan </thin", " </thin", "</thin ", None),
    ("response_text_has_started", "<think> plan </think>", " answer", None, " answer"),
    ("delta_contains_everything", None, "<think> plan </think> answer", " plan ", " answer"),
    ("delta_mixes_reasoning_and_response", "<think> plan", " more </think> answer", " more ", " answer"),
    ("delta_starts_response_sequence", f"<think> {R} ", "</thin", None, None),
    ("delta_finishes_response_sequence", "<think> plan </thin", "k>", None, None),
    ("delta_breaks_potential_response_sequence", "<think> plan </thin", " was", "</thin was", None),
]

ALL_TEXTS = [c.output for group in (QWEN3, QWEN3_DISABLED, DEEPSEEK_WHOLE, GRANITE, GEMMA4_WHOLE, BASE_WHOLE, NEMOTRON) for c in group]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(ALL_TEXTS + [R, C, R2, C2, TOOL, PRE])


def ids(cases):
    return [pytest.param(c, id=c.id) for c in cases]


@pytest.mark.parametrize("case", ids(QWEN3 + QWEN3_DISABLED))
def test_qwen3_whole(tok, case):
    check_whole(get_reasoning_parser("qwen3"), tok, case)


@pytest.mark.parametrize("case", ids(QWEN3))
def test_qwen3_streamed(tok, case):
    check_streamed(get_reasoning_parser("qwen3"), tok, case)


@pytest.mark.parametrize("deltas, reasoning, content", [pytest.param(*d[1:], id=d[0]) for d in QWEN3_DELTAS])
def test_qwen3_multi_token_deltas(tok, deltas, reasoning, content):
    assert run_stream(get_reasoning_parser("qwen3")(tok), deltas) == (reasoning or "", content or "")


@pytest.mark.parametrize("case", ids(DEEPSEEK_WHOLE))
def test_deepseek_r1_whole(tok, case):
    check_whole(get_reasoning_parser("deepseek_r1"), tok, case)


@pytest.mark.parametrize("case", ids(DEEPSEEK_STREAMED))
def test_deepseek_r1_streamed(tok, case):
    check_streamed(get_reasoning_parser("deepseek_r1"), tok, case)


@pytest.mark.parametrize("case", ids(GRANITE))
def test_granite_whole(tok, case):
    check_whole(get_reasoning_parser("granite"), tok, case)


@pytest.mark.parametrize("case", ids(GRANITE))
def test_granite_streamed(tok, case):
    check_streamed(get_reasoning_parser("granite"), tok, case)


@pytest.mark.parametrize("before, delta, reasoning, content", [pytest.param(*d[1:], id=d[0]) for d in GRANITE_DELTAS])
def test_granite_streaming_subcases(tok, before, delta, reasoning, content):
    check_deltas(get_reasoning_parser("granite"), tok, before, delta, reasoning, content)


@pytest.mark.parametrize("case", ids(GEMMA4_WHOLE))
def test_gemma4_whole(tok, case):
    check_whole(get_reasoning_parser("gemma4"), tok, case)


@pytest.mark.parametrize("case", ids(GEMMA4_STREAMED))
def test_gemma4_streamed(tok, case):
    check_streamed(get_reasoning_parser("gemma4"), tok, case)


@pytest.mark.parametrize("case", ids(BASE_WHOLE + NEMOTRON))
def test_string_whole(tok, case):
    check_whole(get_reasoning_parser("string"), tok, case)


@pytest.mark.parametrize("case", ids(NEMOTRON))
def test_string_streamed(tok, case):
    check_streamed(get_reasoning_parser("string"), tok, case)


@pytest.mark.parametrize("deltas, reasoning, content", [pytest.param(*d[1:], id=d[0]) for d in BASE_DELTAS])
def test_string_deltas(tok, deltas, reasoning, content):
    assert run_stream(get_reasoning_parser("string")(tok, **X), deltas) == (reasoning or "", content or "")


@pytest.mark.parametrize("before, delta, reasoning, content", [pytest.param(*d[1:], id=d[0]) for d in NEMOTRON_DELTAS])
def test_string_streaming_subcases(tok, before, delta, reasoning, content):
    cls = get_reasoning_parser("string")
    check_deltas(lambda t: cls(t, **T), tok, before, delta, reasoning, content)


# ---- pagellm's own: the prompt, the budget's strings, token counts, the registry


@pytest.mark.parametrize(
    "name, prompt, output, want",
    [
        # The template opened <think> (DeepSeek-R1, Qwen 3.5): the reply is reasoning until </think>.
        ("deepseek_r1", "<|user|>Hi<|assistant|><think>\n", f"{R}</think>{C}", (R, C)),
        # Thinking closed in the prompt (Qwen 3 with enable_thinking off): all content...
        ("qwen3", "<|assistant|><think>\n\n</think>\n\n", C, (None, C)),
        # ...unless the model opens <think> itself.
        ("qwen3", "<think>old</think>old answer<|user|>Next?<|assistant|>", f"<think>{R}</think>{C}", (R, C)),
        # Gemma 4 with the channel opened in the prompt: reasoning first.
        ("gemma4", "<|turn>model\n<|channel>", f"thought\n{R}<channel|>{C}", (R, C)),
    ],
)
def test_prompt_decides_where_the_reply_begins(tok, name, prompt, output, want):
    cls = get_reasoning_parser(name)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert cls(tok, prompt_token_ids=prompt_ids).extract_reasoning(output) == want
    got = run_stream(cls(tok, prompt_token_ids=prompt_ids), token_texts(tok, output))
    assert got == (want[0] or "", want[1] or "")


def test_thinking_disabled_still_reads_a_think_block(tok):
    p = get_reasoning_parser("qwen3")(tok, chat_template_kwargs={"enable_thinking": False})
    assert p.extract_reasoning(f"<think>{R}</think>{C}") == (R, C)


def test_num_reasoning_tokens(tok):
    text = f"<think>{R}</think>{C}"
    out_ids = tok.encode(text, add_special_tokens=False)
    want = len(tok.encode(R, add_special_tokens=False))
    assert get_reasoning_parser("qwen3")(tok).num_reasoning_tokens(out_ids) == want
    assert get_reasoning_parser("qwen3")(tok, **OFF).num_reasoning_tokens(tok.encode(C, add_special_tokens=False)) == 0
    granite = get_reasoning_parser("granite")(tok)
    assert granite.num_reasoning_tokens(tok.encode(f"{HERE_T}{R}{HERE_R}{C}", add_special_tokens=False)) > 0
    assert granite.num_reasoning_tokens(tok.encode(C, add_special_tokens=False)) == 0


def test_boundary_strings():
    assert get_reasoning_parser("qwen3").boundary_strings() == ReasoningBoundaryStrings("<think>", "</think>", "</think>")
    forced = {"reasoning_end_str": "Enough thinking.</think>"}
    assert get_reasoning_parser("deepseek_r1").boundary_strings(forced) == ReasoningBoundaryStrings(
        "<think>", "</think>", "Enough thinking.</think>"
    )
    assert get_reasoning_parser("gemma4").boundary_strings().end == "<channel|>"
    assert get_reasoning_parser("granite").boundary_strings().start == HERE_T
    assert get_reasoning_parser("string").boundary_strings(X["reasoning_config"]) == ReasoningBoundaryStrings(
        "<start:x>", "<end:x>", "<end:x>"
    )
    oss = get_reasoning_parser("gpt_oss").boundary_strings()
    assert (oss.end, oss.forced_end) == ("<|channel|>final<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")


def test_registry_and_bad_input(tok):
    assert {"qwen3", "deepseek_r1", "granite", "gemma4", "gpt_oss", "openai_gptoss", "string"} <= set(REASONING_PARSERS)
    assert get_reasoning_parser("gpt_oss") is get_reasoning_parser("openai_gptoss")
    with pytest.raises(ValueError, match="available: .*qwen3"):
        get_reasoning_parser("no_such_parser")
    with pytest.raises(ValueError, match="reasoning_start_str"):
        get_reasoning_parser("string")(tok)
    with pytest.raises(ValueError, match="unknown reasoning_config keys"):
        get_reasoning_parser("qwen3")(tok, reasoning_config={"reasoning_end": "x"})
    assert not ReasoningDelta() and ReasoningDelta(content="x")
