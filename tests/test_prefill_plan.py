"""The per-step prefill decision (provider.engine.prefill_plan): pure, over token counts; and the one prompt
reader (provider.engine.prompt_reader) that every kind of row reads its prompt by."""

import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from provider.engine.prefill_plan import (CPU_STEP_TOKENS, GPU_STEP_TOKENS, PrefillPlan, plan_prefill,
                                          prefill_tokens, step_tokens)
from provider.jobs import Job
from provider.outputs import Done
from tests.helpers import collect, greedy, make_node, run


def test_the_budget_is_the_configured_one_or_the_devices():
    assert step_tokens(0, "cpu") == CPU_STEP_TOKENS
    assert step_tokens(0, "metal") == GPU_STEP_TOKENS
    assert step_tokens(300, "cpu") == 300
    assert step_tokens(3, "metal") == 16  # a forward of a few tokens would read a prompt forever


def test_beside_decoding_rows_a_step_reads_half_the_budget_and_more_as_they_grow():
    assert prefill_tokens(128, 0) == 128
    assert prefill_tokens(128, 1) == 68
    assert prefill_tokens(128, 8) == 96
    assert prefill_tokens(128, 200) == 128


def test_arrivals_are_read_one_after_another_each_to_its_end():
    # four 511-token prompts arrive together, nothing decodes: the first is read alone, a whole budget a step
    assert plan_prefill([], [511, 511, 511, 511], 0, 128) == PrefillPlan(1, 128)
    # while it is read, nobody else starts, whatever is queued
    assert plan_prefill([383], [511, 511, 511], 0, 128) == PrefillPlan(0, 128)
    # it is read: it gives its first token before the next prompt's forward delays it
    assert plan_prefill([0], [511, 511, 511], 0, 128) == PrefillPlan(0, 128)
    # then the next, beside the first one decoding
    assert plan_prefill([], [511, 511, 511], 1, 128) == PrefillPlan(1, 68)


def test_a_prompt_a_little_over_the_step_is_read_whole():
    assert plan_prefill([], [150], 0, 128) == PrefillPlan(1, 150)  # a 22-token tail would be a forward of its own
    assert plan_prefill([], [170], 0, 128) == PrefillPlan(1, 128)
    assert plan_prefill([80], [], 1, 128) == PrefillPlan(0, 80)  # 68 a step beside one decoding row, 80 <= 85


def test_short_prompts_that_all_end_within_the_step_are_read_together():
    assert plan_prefill([], [30, 30, 30, 30, 500], 0, 128) == PrefillPlan(4, 32)
    assert plan_prefill([], [30, 60, 10], 0, 128) == PrefillPlan(2, 64)  # 3 x 60 padded would pass the budget
    assert plan_prefill([], [0, 0, 0], 4, 128) == PrefillPlan(3, 26)  # prefix hits: nothing left to read


def test_prompts_read_together_share_the_budget():
    assert plan_prefill([40, 0, 90], [10], 0, 128) == PrefillPlan(0, 64)


def test_nothing_queued_nothing_joins():
    assert plan_prefill([], [], 5, 128) == PrefillPlan(0, 84)


def _rule_chunks(tokens: int, budget: int) -> list[int]:
    """The chunk rule spelled out for a prompt read alone: the budget a step, a tail within a quarter over it
    read whole."""
    out = []
    while tokens:
        out.append(tokens if tokens <= budget + budget // 4 else budget)
        tokens -= out[-1]
    return out


def _one_pixel() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1), (200, 30, 90)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant

    root = tmp_path_factory.mktemp("vlm")
    make_gemma4_vlm(root / "gemma4-vlm")
    make_gemma4_vlm_assistant(root / "gemma4-vlm-assistant", root / "gemma4-vlm")
    return root


def test_every_kind_of_row_reads_a_prompt_in_the_same_chunks_and_is_booked_alike(vlm, monkeypatch):
    """The same prompt length read by a plain row (mlx-lm's generator), a scored row (PromptScorer), a speculating
    row (Speculator.read) and a row with an image (MediaRead): the same chunk boundaries, by the one rule (its tail
    of 19 tokens read whole at 16 a step), and at every chunk the ledger books the same reading scratch for it,
    plus only what its own hook holds (a scored chunk's logits; the image's arrays and embeddings)."""
    from mlx_lm.models.gemma4_text import Gemma4TextModel

    from provider.content import IMAGE_PART, ImageInput
    from provider.engine.logprobs import SCORE_SCRATCH_BYTES
    from provider.engine.prompt_reader import reading_bytes
    budget, words = 16, 4  # the image prompt: 80 tokens and `words`; the text prompt as long: BOS and its words
    node = make_node({"vlm": vlm / "gemma4-vlm"}, manager_kw={"drafters": {"vlm": vlm / "gemma4-vlm-assistant"}},
                     prefill_step_size=budget, speculation="on", prefix_cache_gb=0)
    running = node.engine._running
    seen: list[tuple[int, int, int]] = []  # each text-model forward: its width, the reading term, what hooks hold
    real_call, real_step, stepping = Gemma4TextModel.__call__, running.step, threading.local()

    def step():  # the engine's passes: forwards elsewhere (loading, measuring) are not the rows'
        stepping.on = True
        try:
            return real_step()
        finally:
            stepping.on = False

    def spy(self, inputs=None, cache=None, input_embeddings=None, per_layer_inputs=None):
        if getattr(stepping, "on", False):
            plain, spec = running._layout("vlm")
            lm = next(iter([*running._batches.values(), *running._speculating.values(), *running._media.rows()])).lm
            unreserved = SimpleNamespace(act_shape=lm.act_shape, act_reserve=0)  # a whole chunk's scratch, booked
            bare = dataclasses.replace(plain, scoring=False, media=0, vision=0)
            term = reading_bytes(unreserved, bare, spec, budget)
            seen.append(((inputs if inputs is not None else input_embeddings).shape[1], term,
                         reading_bytes(unreserved, plain, spec, budget) - term))
        return real_call(self, inputs, cache=cache, input_embeddings=input_embeddings,
                         per_layer_inputs=per_layer_inputs)

    monkeypatch.setattr(running, "step", step)
    monkeypatch.setattr(Gemma4TextModel, "__call__", spy)
    image = ({"role": "user", "content": [dict(IMAGE_PART), {"type": "text", "text": " ".join(["cache"] * words)}]},)
    text = " ".join(["cache"] * (80 + words - 1))
    jobs = {"plain": Job("plain", "vlm", greedy(2), prompt=text, speculation="off"),
            "scored": Job("scored", "vlm", greedy(2, logprobs=0, prompt_logprobs=True), prompt=text, speculation="off"),
            "speculating": Job("speculating", "vlm", greedy(2), prompt=text, speculation="on"),
            "media": Job("media", "vlm", greedy(2), messages=image, images=(ImageInput(_one_pixel(), "low"),),
                         speculation="off")}

    async def main():
        out = {}
        for name, job in jobs.items():
            seen.clear()
            _, _, end, _ = await collect(node, job)
            assert isinstance(end, Done), end
            read, forwards = end.usage.prompt_tokens - 1, []
            for width, term, held in seen:  # the forwards that read the prompt: up to its last token
                if sum(f[0] for f in forwards) >= read:
                    break
                forwards.append((width, term, held))
            out[name] = (end.usage.prompt_tokens, end.telemetry.speculation.mode, forwards)
        await node.stop()
        return out

    out = run(main())
    assert {n for n, _, _ in out.values()} == {80 + words}
    assert out["speculating"][1] == "mtp" and out["plain"][1] == "off"
    want = _rule_chunks(79 + words, budget)
    assert want[-1] > budget  # the tail read whole: a reader chunking on its own would read 16 and 3
    for name, (_, _, forwards) in out.items():
        assert [w for w, _, _ in forwards] == want, name
    terms = {name: {t for _, t, _ in forwards} for name, (_, _, forwards) in out.items()}
    assert terms["plain"] == terms["scored"] == terms["speculating"] == terms["media"], terms
    assert min(terms["plain"]) > 0
    held = {name: {h for _, _, h in forwards} for name, (_, _, forwards) in out.items()}
    assert held["plain"] == held["speculating"] == {0} and held["scored"] == {SCORE_SCRATCH_BYTES}, held
    assert min(held["media"]) > 0, held
