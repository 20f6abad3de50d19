"""The per-step prefill decision (provider.engine.prefill_plan): pure, over token counts."""

from provider.engine.prefill_plan import (CPU_STEP_TOKENS, GPU_STEP_TOKENS, PrefillPlan, plan_prefill,
                                          prefill_tokens, step_tokens)


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
