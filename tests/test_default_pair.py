"""The bundled demo pair: the default model of `provider start --local`, speculating out of the box; and its chat
variant beside it, which ends its turn (a coding agent's turn completes on it: tools/scripts/agents_check.py
--bundled)."""

import anthropic
import openai

from provider.models import capability
from provider.models.default import DEMO_ASSISTANT, DEMO_CHAT, DEMO_TARGET, default_pair, primary_models
from provider.settings import Settings
from tests.helpers import LocalServer


def test_the_demo_pair_ships_paired_and_small():
    assert default_pair() == (DEMO_TARGET, DEMO_ASSISTANT)
    assert capability.pair_assistant(DEMO_TARGET, DEMO_ASSISTANT).paired
    size = sum(f.stat().st_size for d in (DEMO_TARGET, DEMO_ASSISTANT) for f in d.iterdir())
    assert size <= 20 * 2**20
    assert sum(f.stat().st_size for f in DEMO_CHAT.iterdir()) <= 12 * 2**20
    # the chat variant is the local API's (agents'): a coordinator-only node offers the demo target alone
    assert [m.id for m in primary_models(Settings(local=True))] == ["gemma4-demo", "gemma4-demo-chat"]
    assert [m.id for m in primary_models(Settings(coordinator="grpcs://c.example:443"))] == ["gemma4-demo"]


def test_local_node_defaults_to_the_pair_and_speculates_losslessly(tmp_path):
    srv = LocalServer(None, tmp_path)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.token, max_retries=0)
        assert [m.id for m in client.models.list()] == ["gemma4-demo", "gemma4-demo-chat"]
        prompt = "Returns the value of the attribute"
        # `on`: whether auto speculates depends on what it measures on this (shared, noisy) machine.
        spec = client.completions.create(model="gemma4-demo", prompt=prompt, max_tokens=48, temperature=0,
                                         extra_body={"speculation": "on"})
        plain = client.completions.create(model="gemma4-demo", prompt=prompt, max_tokens=48, temperature=0,
                                          extra_body={"speculation": "off"})
        s = spec.model_extra["telemetry"]["speculation"]
        assert s["mode"] == "mtp" and s["reason"] == "ok" and s["accepted"] > 0
        assert spec.choices[0].text == plain.choices[0].text
        # The chat variant, loaded on its first request, ends its turn with no max_tokens asked (the default is
        # 1,024), greedy and sampled, over OpenAI's API and Anthropic's (agents take an answer cut short for an error)
        for i, question in enumerate(("Say hello in one line.", "Now say goodbye.", "What does this project do?")):
            # Seeded: an unseeded sampled answer may run long (178 tokens once, still ending its turn).
            chat = client.chat.completions.create(model="gemma4-demo-chat", temperature=i / 2, seed=7,
                                                  messages=[{"role": "user", "content": question}])
            assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens < 100, chat
        claude = anthropic.Anthropic(base_url=srv.url, api_key=srv.token, max_retries=0)
        turn = claude.messages.create(model="gemma4-demo-chat", max_tokens=4096,
                                      system="You are a coding agent. " * 200,
                                      messages=[{"role": "user", "content": "Say hello in one line."}])
        assert turn.stop_reason == "end_turn" and turn.content[0].text, turn
    finally:
        assert srv.stop() == 0
