import pytest

from pagellm.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, SamplingType


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.all_stop_token_ids == set()
    assert p.logprobs is None and p.prompt_logprobs is None and p.seed is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be between 1"),
        ({"n": MAX_N + 1}, "n must be between 1"),
        ({"n": 1.5}, "n must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite number"),
        ({"frequency_penalty": -2.1}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 2\]"),
        ({"repetition_penalty": 2.01}, r"repetition_penalty must be in \(0, 2\]"),
        ({"temperature": -0.1}, r"temperature must be in \[0, 100\]"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.1}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": -1}, "max_tokens must be at least 0"),
        ({"max_tokens": 3.0}, "max_tokens must be at least 0"),
        ({"min_tokens": -1}, "min_tokens must be at least 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be at most max_tokens=4"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"seed": False}, "seed must be an integer"),
        ({"logprobs": -1}, rf"logprobs must be an integer in \[0, {MAX_LOGPROBS}\]"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs must be an integer"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs must be an integer"),
        ({"stop": [""]}, "stop strings must be non-empty strings"),
        ({"stop": ["ok", 3]}, "stop strings must be non-empty strings"),
        ({"stop": ["x" * 1025]}, "at most 1024 characters"),
        ({"stop": [str(i) for i in range(65)]}, "at most 64 stop strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative integers"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids must be non-negative integers"),
        ({"logit_bias": {1: 101.0}}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias must map token ids to numbers"),
    ],
)
def test_invalid_values_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_boundary_values_accepted() -> None:
    p = SamplingParams(n=MAX_N, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                       temperature=100.0, top_p=1.0, top_k=1, min_p=1.0, max_tokens=1, min_tokens=1,
                       logprobs=0, prompt_logprobs=MAX_LOGPROBS, seed=-5)
    assert p.sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_normalization() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[7, 9], top_k=-1, logit_bias={"5": "1.5"})
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.logit_bias == {5: 1.5}
    assert p.all_stop_token_ids == {7, 9}
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy_neutralizes_truncation() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=3)
    assert p.is_greedy and p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    # Penalties do change the argmax, so greedy keeps them.
    q = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
    assert (q.repetition_penalty, q.presence_penalty) == (1.3, 0.5)
    # A non-greedy request keeps its settings.
    r = SamplingParams(temperature=0.7, top_p=0.5, top_k=3, min_p=0.2)
    assert (r.top_p, r.top_k, r.min_p) == (0.5, 3, 0.2)


def test_generation_config_eos_and_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({2})
    assert p.all_stop_token_ids == {2, 5}
    q = SamplingParams(stop_token_ids=[5], ignore_eos=True)
    q.update_from_generation_config({2})
    assert q.all_stop_token_ids == {5}


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    c = p.clone()
    c.stop.append("b")
    c.logit_bias[3] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}
