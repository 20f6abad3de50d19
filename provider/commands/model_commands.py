"""`provider models list | pull | rm | verify | load | unload`: the command line's model verbs, over
provider.models, and over the live daemon's control socket for what it holds (load, unload)."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path

from ..drafters import registry
from ..jobs import JobError
from ..models import capability, loader, manifest, store
from ..memory.checkpoint import read_config
from ..models.footprint import estimate_footprint
from ..machine import longest_prefill_read
from ..settings import Settings
from .status_command import EXIT_NOT_RUNNING  # as `provider status`: no daemon runs here
from ..status_file import staying

MiB = 1 << 20
EXIT_REFUSED = 1


def add_parser(sub, config: list) -> None:
    models = sub.add_parser("models", help="list, download, delete, verify, load and unload models", parents=config)
    msub = models.add_subparsers(dest="models_command", required=True)
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="the answer as JSON, for scripts")
    msub.add_parser("list", help="models found (the bundled pair included), their capabilities and footprint",
                    parents=[*config, as_json])
    pull = msub.add_parser("pull", help="download a Hugging Face repo into the HF cache", parents=config)
    pull.add_argument("repo", help="a Hugging Face repo id (owner/name)")
    named = "a model id as `provider models list` shows it"
    rm = msub.add_parser("rm", help="delete a downloaded model", parents=config)
    rm.add_argument("model", help=named)
    rm.add_argument("--yes", action="store_true", help="delete it (without: say what would be deleted)")
    msub.add_parser("verify", help="recompute and print the SHA-256 manifest", parents=config).add_argument(
        "model", help=named)
    load = msub.add_parser("load", help="load a model in the running daemon ahead of work",
                           parents=[*config, as_json])
    load.add_argument("model", help=named)
    load.add_argument("--keep-alive", help='how long it stays once idle: "10m", seconds, -1 for ever (default: '
                      "its idle_timeout_s)")
    unload = msub.add_parser("unload", help="unload a model from the running daemon and give its memory back",
                             parents=[*config, as_json])
    unload.add_argument("model", help=named)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from ..machine import decide_node_budget

    command = args.models_command
    if command == "list":
        return cmd_list(settings, decide_node_budget(settings).usable, args.json)
    if command == "pull":
        return cmd_pull(args.repo)
    if command == "rm":
        return cmd_rm(settings, args.model, args.yes)
    if command in ("load", "unload"):
        body = {"model": args.model} | ({"keep_alive": args.keep_alive} if command == "load" and args.keep_alive
                                        is not None else {})
        return asyncio.run(_ask_daemon(command, body, args.json))
    return cmd_verify(settings, args.model)


async def _ask_daemon(command: str, body: dict, as_json: bool = False) -> int:
    """load / unload in the live daemon; its answer on stdout (a line, or the JSON), or why not on stderr."""
    from . import daemon_client

    try:
        status, answer = await daemon_client.call("POST", f"/provider/v1/models/{command}", body)
    except daemon_client.Unreachable as e:
        print(f"provider: no daemon answers on this state directory ({e}); start one with `provider start`",
              file=sys.stderr)
        return EXIT_NOT_RUNNING
    if status != 200:
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        print(f"provider models {command}: {error.get('message') or answer}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps(answer, indent=2) if as_json else answer_line(command, answer))
    return 0


def answer_line(command: str, answer: dict) -> str:
    """What `models load|unload` print: the model, its state, and what it holds or what is booked now."""
    mib = 1 << 20
    if command == "load":
        took = f", loaded in {answer['load_seconds']:.1f} s" if answer.get("load_seconds") else ""
        held = (answer.get("bytes") or 0) / mib
        return f"{answer['model']}: {answer['state']}, {held:.0f} MiB, {staying(answer)}{took}"
    mem = answer.get("memory") or {}
    booked = f"; {mem['reserved_bytes'] / mib:.0f} of {mem['usable_bytes'] / mib:.0f} MiB booked now" \
        if "reserved_bytes" in mem and "usable_bytes" in mem else ""
    return f"{answer['model']}: {answer['state']}{booked}"


def _served(settings: Settings) -> list[store.StoredModel]:
    """Exactly what `provider start` would serve: the bundled pair or --model first, then the store."""
    from ..models.default import primary_models

    return store.discover(settings, primary_models(settings))


def _find(settings: Settings, model_id: str) -> store.StoredModel:
    for m in _served(settings):
        if m.id == model_id or m.source == model_id:
            return m
    raise SystemExit(f"provider: no model {model_id!r} here; see `provider models list`")


def describe(settings: Settings, m: store.StoredModel, usable: int) -> dict:
    """One row of `models list` / `doctor`: capabilities, estimated footprint, whether it fits."""
    row = {"id": m.id, "origin": m.origin, "path": str(m.path) if m.path else None}
    if m.path is None:
        return row | {"status": "not downloaded"}
    try:
        config = read_config(m.path)
        caps = capability.detect(m.path, config)
        drafter = Path(m.drafter).expanduser() if m.drafter else None  # discovery already paired one
        caps = capability.with_drafter(caps, m.path, drafter, config)
        fp = estimate_footprint(m.path, config, kv_tokens=settings.kv_reserve_tokens,
                                prefill_step=longest_prefill_read(settings))
    except Exception as e:  # a broken checkpoint is reported, not fatal to the listing
        return row | {"status": f"unreadable: {getattr(e, 'message', e)}"}
    return row | {
        "status": "ok" if fp.total <= usable else "too large for the budget",
        "family": caps.family, "quantization": caps.quantization, "context": caps.context_length,
        "weights_mib": round(fp.weights / MiB, 1), "footprint_mib": round(fp.total / MiB, 1),
        "fits": fp.total <= usable, "mtp_capable": caps.mtp_capable, "draft_compatible": caps.draft_compatible,
        "native_mtp_heads": caps.native_mtp_heads, "drafter": str(drafter) if drafter else None,
        "speculates_with": caps.speculates_with,
        "speculation_reason": caps.drafter_reason,
    }


def spec_tag(speculates_with: str) -> str:
    """What `models list` prints after a model that speculates: its drafter kind's tag (drafters.registry)."""
    return f"  [{registry.named(speculates_with).tag}]" if speculates_with else ""


def list_line(r: dict) -> str:
    """One row of `models list` (describe's) as printed."""
    return (f"{r['id'][:32]:32} {r['origin']:10} {str(r.get('family', '-')):12} {str(r.get('quantization') or '-'):10}"
            f" {str(r.get('context', '-')):>7} {str(r.get('weights_mib', '-')) + ' MiB':>9}"
            f" {str(r.get('footprint_mib', '-')) + ' MiB':>10}  {r['status']}"
            + spec_tag(r.get("speculates_with") or ""))


def cmd_list(settings: Settings, usable: int, as_json: bool = False) -> int:
    rows = [describe(settings, m, usable) for m in _served(settings)]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no models found; `provider models pull ORG/NAME` downloads one")
        return 0
    print(f"{'id':32} {'origin':10} {'family':12} {'quant':10} {'ctx':>7} {'weights':>9} {'footprint':>10}  status")
    for r in rows:
        print(list_line(r))
    return 0


def cmd_pull(repo_id: str) -> int:
    try:
        path = loader.resolve(repo_id, allow_download=True)  # huggingface_hub: progress bar, resumable
    except JobError as e:
        print(f"provider: {e.message}", file=sys.stderr)
        return 1
    print(f"{repo_id}: {path}")
    print(f"sha256 {manifest.model_hash(manifest.manifest(path))}")
    return 0


def cmd_rm(settings: Settings, model_id: str, yes: bool) -> int:
    m = _find(settings, model_id)
    if m.origin == "configured":
        print(f"provider: {m.id} is configured in the config file; remove it there", file=sys.stderr)
        return 1
    if not yes:
        print(f"would delete {m.path}; pass --yes to confirm")
        return 1
    if m.origin == "hf_cache":
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir()
        revs = [r.commit_hash for repo in info.repos if repo.repo_id == m.id for r in repo.revisions]
        info.delete_revisions(*revs).execute()
    else:
        shutil.rmtree(m.path)
    print(f"deleted {m.id}")
    return 0


def cmd_verify(settings: Settings, model_id: str) -> int:
    m = _find(settings, model_id)
    if m.path is None:
        print(f"provider: {m.id} is not downloaded", file=sys.stderr)
        return 1
    files = manifest.manifest(m.path, recompute=True)
    digest = manifest.model_hash(files)
    for rel, sha in sorted(files.items()):
        print(f"{sha}  {rel}")
    print(f"model sha256 {digest}")
    if m.sha256 and m.sha256 != digest:
        print(f"MISMATCH: pinned {m.sha256}", file=sys.stderr)
        return 1
    if m.sha256:
        print("matches the pinned hash")
    return 0
