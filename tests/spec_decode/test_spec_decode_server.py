"""``pagellm serve --speculative-config``: the OpenAI API streams the same text, /metrics counts drafts."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "entrypoints"))
from openai_server_utils import SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 3


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def spec_server():
    srv = RemoteServer([*SERVER_ARGS, "--dtype", "float32", "--speculative-config", json.dumps(SPEC)], use_cli=True)
    yield srv
    assert srv.terminate() == 0, srv.read_log()
    srv.cleanup()


def test_streamed_and_whole_answers_agree_and_drafts_are_counted(spec_server):
    client = spec_server.openai_client()
    messages = [{"role": "user", "content": f"Repeat exactly: {TEXT}"}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0)
    chunks = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=60, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert 20 < whole.usage.completion_tokens <= 60
    text = httpx.get(f"{spec_server.url}/metrics").text
    drafts = metric(text, "pagellm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "pagellm:spec_decode_num_accepted_tokens_total")
    assert metric(text, "pagellm:spec_decode_num_drafts_total") > 0 and 0 < accepted <= drafts
    assert metric(text, "pagellm:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') >= metric(
        text, "pagellm:spec_decode_num_accepted_tokens_per_pos_total", 'position="3"'
    )


def test_a_bad_speculative_config_is_refused_at_start():
    with pytest.raises(RuntimeError, match="num_speculative_tokens"):
        RemoteServer([*SERVER_ARGS, "--speculative-config", '{"method": "ngram"}'], use_cli=True, startup_timeout_s=120)
