"""Output rules over the coordinator session: response_format, tools and tool_choice on JobRequest, tool calls
on the chunks and in the completion, sealed like the rest; bad rules refused with INVALID_REQUEST naming them.
Against the reference coordinator on loopback."""

import json

import jsonschema

from coordinator_client.pb import provider_pb2 as pb
from tests.helpers import run
from tools.harness.nodes import harness, job

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"]}
CHAT = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")])


def _call_job(job_id: str, **kw) -> pb.JobRequest:
    return pb.JobRequest(job_id=job_id, model="demo", chat=CHAT, max_tokens=120,
                         sampling=pb.SamplingParams(temperature=0.7, seed=3), parallel_tool_calls=False,
                         tools=[pb.Tool(name="get_weather", description="weather", parameters_json=json.dumps(PARAMS))],
                         **kw)


def test_tool_calls_and_json_over_the_session_plain_and_sealed(tmp_path, demo_f32):
    async def main():  # the demo model in float32 (conftest's demo_f32)
        async with harness({"demo": demo_f32[0]}, tmp_path) as (coord, node, session):
            s = await coord.wait_for_node()
            coord.dispatch(s, _call_job("named", tool_choice="get_weather"))
            coord.dispatch_sealed(s, _call_job("sealed", tool_choice="required"))
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
            coord.dispatch(s, pb.JobRequest(job_id="json", model="demo", chat=CHAT, max_tokens=60,
                                            response_format=pb.ResponseFormat(type="json_schema", schema_name="r",
                                                                              schema_json=json.dumps(schema))))
            for job_id in ("named", "sealed"):
                done = (await coord.outcome(job_id)).job_done
                assert done.finish_reason == "tool_calls", job_id
                assert done.telemetry.constraint == "tool_call" and done.telemetry.mask_ms_per_token > 0
                calls = coord.tool_calls(job_id)
                assert [c.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")
                jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
            wire = [f.token_chunk for _, kind, f in coord.frames if kind == "token_chunk"
                    and f.token_chunk.job_id == "sealed"]
            assert wire and all(c.sealed and not c.tool_calls for c in wire)  # the calls are sealed too
            assert (await coord.outcome("json")).job_done.finish_reason == "stop"
            assert json.loads(coord.completion("json")[0])["ok"] in (True, False)
            bad = {"bad-schema": pb.ResponseFormat(type="json_schema", schema_name="r", schema_json="{not json"),
                   "bad-keyword": pb.ResponseFormat(type="json_schema", schema_name="r",
                                                    schema_json='{"type": "object", "if": {}}')}
            for job_id, rf in bad.items():
                coord.dispatch(s, pb.JobRequest(job_id=job_id, model="demo", chat=CHAT, response_format=rf))
                err = (await coord.outcome(job_id)).job_error
                assert err.cause == pb.ERROR_CAUSE_INVALID_REQUEST and "response_format" in err.message, err
            coord.dispatch(s, _call_job("unknown-tool", tool_choice="no_such_tool"))
            err = (await coord.outcome("unknown-tool")).job_error
            assert err.cause == pb.ERROR_CAUSE_INVALID_REQUEST and "tool_choice" in err.message
            coord.dispatch(s, job("after", "demo", max_tokens=4))
            assert (await coord.outcome("after")).job_done.finish_reason == "length"

    run(main())
