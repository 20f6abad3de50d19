"""`provider verify CLAIM.json --model M`: check a claim offline, through the same engine as a verify job.

CLAIM.json is a verify JobRequest in protobuf's JSON form: the original job's request (its input, sampling and
rules), with `verify.outputIds` (the claimed completion's token ids) and `verify.proof` (its outcome's proof).
It is what the reference coordinator sends a verifier (coordinator_client.spot_checks.SpotChecks.verify_request;
`google.protobuf.json_format.MessageToJson` writes it). The verdict is one JSON object on stdout; the exit code
is 0 when the claim passes, 1 when it fails, and a sysexits code when it cannot be checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

from .generate import CAUSE_EXIT, EX_DATAERR, EX_NOINPUT, EX_SOFTWARE, EX_USAGE_FLAG
from ..outputs import Done, Error
from ..types import JobError

EXIT_FAILED = 1


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="check a claim (a verify JobRequest as JSON) against a model, offline",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("claim", type=Path, help="a verify JobRequest in protobuf's JSON form")
    p.add_argument("--model", help="model directory or Hugging Face repo id (default: the bundled model)")
    p.add_argument("--config", type=Path, help="TOML config file")


def run(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from coordinator_client import convert
    from coordinator_client.pb import provider_pb2 as pb

    from ..settings import Settings, SettingsError

    try:
        settings = Settings.load(cli={"model": args.model, "speculation": "off", "log_level": "warning",
                                      "log_format": "console"}, config_file=args.config)
    except SettingsError as e:
        return _fail(f"configuration error: {e}", EX_USAGE_FLAG)
    try:
        request = json_format.Parse(args.claim.read_text(), pb.JobRequest())
    except OSError as e:
        return _fail(f"{args.claim}: {e}", EX_NOINPUT)
    except (json_format.ParseError, ValueError, RecursionError) as e:
        return _fail(f"{args.claim} is not a JobRequest in JSON: {e}", EX_DATAERR)
    if not request.HasField("verify"):
        return _fail(f"{args.claim} has no `verify` (the claimed output ids and proof)", EX_DATAERR)
    request.job_id = request.job_id or "verify"  # a claim written by hand needs none
    try:
        job = convert.job_from_request(request, max_tokens_limit=settings.max_tokens_limit,
                                       default_max_tokens=settings.default_max_tokens)
    except JobError as e:
        return _fail(e.message, EX_DATAERR)
    return asyncio.run(_verify(settings, job))


async def _verify(settings, job) -> int:
    from .. import logs
    from ..models.default import primary_models
    from ..node import Node, build_models

    logs.configure(settings.log_level, settings.log_format, file=settings.log_file)
    node = Node(settings, build_models(settings, primary_models(settings)))
    try:
        job = replace(job, model=node.resolve_model(None))
    except JobError as e:
        return _fail(e.message, CAUSE_EXIT.get(e.cause, EX_SOFTWARE))
    node.start()
    end = None
    try:
        async with node.run(job) as stream:
            async for ev in stream:
                end = ev
    finally:
        await node.stop(grace_s=0, finish_measuring=True)  # one-shot: kept, as generate keeps it
    if isinstance(end, Error):
        return _fail(f"{end.cause.value}: {end.message}", CAUSE_EXIT.get(end.cause, EX_SOFTWARE))
    if not isinstance(end, Done) or end.verdict is None:
        return _fail("the node gave no verdict", EX_SOFTWARE)
    verdict = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(end.verdict).items()}
    print(json.dumps({"model": job.model, **verdict}))
    return 0 if end.verdict.passed else EXIT_FAILED


def _fail(message: str, code: int) -> int:
    print(f"provider verify: {message}", file=sys.stderr)
    return code
