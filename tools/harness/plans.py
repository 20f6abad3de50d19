"""A step plan that uses every kind of field a plan can carry (sampling, a JSON schema, a tool forced by name,
a cancel), for the group wire's tests and its fuzz campaign."""

from __future__ import annotations

from provider.constraints import OutputRules, ResponseFormat, Tool, ToolChoice
from provider.group.plan import CancelRow, StartRow, StepPlan
from provider.jobs import Job, SamplingParams
from provider.speculation import SpecPlan
from provider.types import SpecMode, SpecReason

CHAT_LINE = "a line of the chat"  # stays on rank 0: a plan carries the rendered ids


def a_plan() -> StepPlan:
    rules = OutputRules(ResponseFormat("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}},
                                       "thing"),
                        (Tool("get", {"type": "object", "properties": {"x": {"type": "string"}}}, "gets"),),
                        ToolChoice("function", "get"))
    job = Job("job-1", "m", SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=12345, stop=("\n\n",),
                                           stop_token_ids=(3,), logit_bias=((5, -1.5),), logprobs=2),
              messages=({"role": "user", "content": CHAT_LINE},), rules=rules)
    start = StartRow(job, (1, 2, 3, 4), 9, SpecPlan(SpecMode.OFF, SpecReason.GROUP_MODE), 2)
    return StepPlan((start, CancelRow("job-0")))
