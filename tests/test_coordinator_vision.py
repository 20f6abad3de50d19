"""Images over the coordinator session: content parts with the image bytes on JobRequest, plain and sealed,
give mlx-vlm's own greedy tokens; the registration says which models take images; a hostile image is
INVALID_REQUEST naming its part and the session keeps serving. Against the reference coordinator on loopback."""

from __future__ import annotations

import pytest

from coordinator_client.pb import provider_pb2 as pb
from tools.fixtures.vision import make_gemma4_vlm, make_gemma4_vlm_assistant
from tests.helpers import run
from tests.test_vision import MAX_TOKENS, image, reference
from tools.harness.nodes import harness, job


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-coord")
    make_gemma4_vlm(root / "gemma4-vlm")
    make_gemma4_vlm_assistant(root / "gemma4-vlm-assistant", root / "gemma4-vlm")
    return root


def _image_job(job_id: str, data: bytes, speculation=pb.SPECULATION_POLICY_OFF, **image) -> pb.JobRequest:
    parts = [pb.ContentPart(image=pb.ImagePart(data=data, **image)), pb.ContentPart(text="What is it?")]
    return pb.JobRequest(job_id=job_id, model="vlm", max_tokens=MAX_TOKENS, speculation=speculation,
                         sampling=pb.SamplingParams(temperature=0.0),
                         chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", parts=parts)]))


def test_image_jobs_plain_and_sealed_equal_mlx_vlm(vlm, fixtures_dir, tmp_path):
    data, pil = image(80, 48, 7)
    want = reference(vlm, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
                     [pil])
    models = {"vlm": vlm / "gemma4-vlm", "text": fixtures_dir / "gemma4-tiny"}

    async def main():
        async with harness(models, tmp_path, manager_kw={"drafters": {"vlm": vlm / "gemma4-vlm-assistant"}}) \
                as (coord, node, session):
            s = await coord.wait_for_node()
            takes_images = {m.id: m.capabilities.vision for m in s.registration.models}
            assert takes_images == {"vlm": True, "text": False}
            coord.dispatch(s, _image_job("plain", data, mime_type="image/png"))
            coord.dispatch_sealed(s, _image_job("sealed", data, pb.SPECULATION_POLICY_ON))
            for job_id in ("plain", "sealed"):
                assert (await coord.outcome(job_id)).job_done.finish_reason in ("length", "stop")
                assert coord.completion(job_id)[1] == want, job_id
            wire = [f.token_chunk for _, kind, f in coord.frames if kind == "token_chunk"
                    and f.token_chunk.job_id == "sealed"]
            assert wire and all(c.sealed and not c.token_ids for c in wire)
            bad = {"svg": _image_job("svg", b"<svg/>", mime_type="image/svg+xml"),
                   "corrupt": _image_job("corrupt", b"\x89PNG\r\n\x1a\n" + b"\0" * 100),
                   "no-tower": _image_job("no-tower", data)}
            bad["no-tower"].model = "text"
            for job_id, request in bad.items():
                coord.dispatch(s, request)
                err = (await coord.outcome(job_id)).job_error
                assert err.cause == pb.ERROR_CAUSE_INVALID_REQUEST, (job_id, err)
                assert "chat.messages[0]" in err.message or "takes no images" in err.message, (job_id, err)
            coord.dispatch(s, job("after", "vlm", max_tokens=4))
            assert (await coord.outcome("after")).job_done.finish_reason == "length"

    run(main())
