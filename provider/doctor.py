"""`provider doctor`: what this machine can serve, and what blocks it. Exit 1 when serving is blocked."""

from __future__ import annotations

import importlib.metadata as md
import platform
import socket
from urllib.parse import urlparse

from .memory.budget import decide_budget, system_facts
from . import model_commands as commands
from .models import store
from .settings import SettingsError

MiB = 1 << 20


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def coordinator_reachable(url: str, timeout: float = 3.0) -> tuple[bool, str]:
    u = urlparse(url if "://" in url else f"grpc://{url}")
    port = u.port or (443 if u.scheme in ("https", "grpcs") else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=timeout):
            return True, f"TCP connect to {u.hostname}:{port} ok"
    except OSError as e:
        return False, f"cannot reach {u.hostname}:{port}: {e}"


def run(settings_loader) -> int:
    problems: list[str] = []
    print("platform")
    print(f"  os         {platform.system()} {platform.release()} {platform.machine()}")
    print(f"  python     {platform.python_version()}")
    try:
        settings = settings_loader()
    except SettingsError as e:
        print(f"config\n  ERROR      {e}")
        return 1
    facts = system_facts()
    print(f"  mlx        {_version('mlx')} (backend: {facts.backend})")
    print(f"  mlx-lm     {_version('mlx-lm')}")
    gib = 1 << 30
    budget = decide_budget(facts, fraction=settings.memory_fraction, reserve_bytes=int(settings.memory_reserve_gb * gib),
                           override_bytes=int(settings.memory_budget_gb * gib))
    print("memory")
    print(f"  system     {facts.total_memory / gib:.1f} GiB total, {facts.available_memory / gib:.1f} GiB available")
    print(f"  budget     {budget.total / gib:.2f} GiB from {budget.source}")
    print(f"  reserve    {budget.reserve / gib:.2f} GiB  ->  usable {budget.usable / gib:.2f} GiB")
    if budget.usable <= 0:
        problems.append("the memory budget leaves nothing usable; lower memory_reserve_gb")

    print("models")
    from .models.default import primary_models

    found = store.discover(settings, primary_models(settings))
    fitting = 0
    for m in found:
        r = commands.describe(settings, m, budget.usable)
        spec = " mtp-capable" if r.get("mtp_capable") else " draft-compatible" if r.get("draft_compatible") else ""
        if "footprint_mib" in r:
            print(f"  {r['id']:28} {r['family']:12} footprint {r['footprint_mib']:>9} MiB  {r['status']}{spec}"
                  f"  (speculation: {r['speculation_reason']})")
        else:
            print(f"  {r['id']:28} {r['status']}")
        fitting += bool(r.get("fits"))
    if not found:
        problems.append("no models found; `provider models pull ORG/NAME` or set `model`")
    elif not fitting:
        problems.append("no model fits the memory budget")

    if fitting:
        speculation_costs(settings, budget)

    print("coordinator")
    if settings.coordinator:
        ok, detail = coordinator_reachable(settings.coordinator)
        print(f"  {settings.coordinator}: {detail}")
        if not ok:
            problems.append(f"coordinator {settings.coordinator} is unreachable")
    else:
        print("  not configured (local mode only)")

    print("verdict")
    for p in problems:
        print(f"  BLOCKING   {p}")
    if not problems:
        print("  ok: this node can serve")
    return 1 if problems else 0


def speculation_costs(settings, budget) -> None:
    """Load the default model's pair as the node would, and print what speculation costs here and the k
    auto picks (the live node refines its acceptance with traffic; `provider status` shows that)."""
    from .engine import profile
    from .models.default import primary_models
    from .node import build_models

    print("speculation")
    models = build_models(settings, primary_models(settings), budget)
    models.profiler = profile.Profiler()
    model_id = models.catalog.default_id
    try:
        lm = models.request(model_id).result(timeout=600)
    except Exception as e:
        print(f"  {model_id}: could not load it to measure: {e}")
        return
    finally:
        models.close()
    if lm.drafter is None:
        print(f"  {model_id}: no drafter ({lm.drafter_reason}); plain decoding")
        return
    p = (lm.spec_profile or profile.measure(lm)).as_dict()  # measured at load only under auto
    rounds = ", ".join(f"k={k} {ms}" for k, ms in enumerate(p["round_ms"], 1))
    print(f"  {model_id} ({lm.drafter_mode.value}): plain {p['plain_token_ms']} ms/token; a round: {rounds} ms")
    rounds = ", ".join(f"k={k} {ms}" for k, ms in enumerate(p["round_rows_ms"], 1))
    print(f"  {p['rows']} rows together: plain {p['plain_rows_ms']} ms a step; a round: {rounds} ms")
    for scheme in ("greedy", "speculative_sampling"):
        d = p[scheme]
        gains = ", ".join(f"k={k} {v}x" for k, v in d["expected_speedup"].items())
        verdict = f"k = {d['k']}" if d["k"] else "off (not_profitable)"
        print(f"  {scheme:21} acceptance {d['acceptance']:.3f}: expected {gains} -> auto uses {verdict} alone")
