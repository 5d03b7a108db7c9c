"""Structured output offline: the manager's masking, and grammars surviving preemption."""
from __future__ import annotations

import json

import pytest
import torch

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.models.loader import default_model_path
from pagellm.structured_output import StructuredOutputManager
from pagellm.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(load_tokenizer(default_model_path()), 49152, {2})


def test_mask_only_touches_constrained_rows_and_eos_waits_for_the_end(manager):
    tok = manager.tokenizer
    manager.add_request("a", SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), [1], [])
    logits = torch.zeros(3, 49152)
    out = manager.apply_bitmask(logits, ["x", "a", "y"])
    assert torch.equal(out[0], torch.zeros(49152)) and torch.equal(out[2], torch.zeros(49152))
    allowed = set(torch.nonzero(out[1] > -1e30)[:, 0].tolist())
    assert 2 not in allowed and tok.encode("yes")[0] in allowed
    for t in tok.encode("yes"):
        manager.accept("a", t)
    out = manager.apply_bitmask(torch.zeros(1, 49152), ["a"])
    assert set(torch.nonzero(out[0] > -1e30)[:, 0].tolist()) == {2}  # only EOS once the choice is complete
    # With ignore_eos, generation goes on past the grammar's end, unconstrained.
    manager.accept("a", 2)
    manager.accept("a", 2)
    assert torch.equal(manager.apply_bitmask(torch.zeros(1, 49152), ["a"]), torch.zeros(1, 49152))
    manager.remove_request("a")
    assert not manager.states


def test_grammar_cache_and_bad_spec(manager):
    spec = StructuredOutputsParams(json=SCHEMA)
    assert manager.backend.compile(spec) is manager.backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, sort_keys=True)))
    with pytest.raises(ValueError, match="regex"):
        manager.validate(StructuredOutputsParams(regex="(a"))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")


@pytest.mark.slow
def test_json_schema_survives_preemption():
    llm = LLM(max_model_len=96, block_size=8, num_kv_blocks=14, enable_prefix_caching=False)
    prompts = ["A JSON record:", "Some data:", "Output:", "Here is the object:", "Result ="]
    params = [SamplingParams(max_tokens=60, temperature=0.9, seed=i, structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    import jsonschema

    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
