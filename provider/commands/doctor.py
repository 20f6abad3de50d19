"""`provider doctor`: what this machine can serve, and what blocks it. Exit 1 when serving is blocked."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import socket
from urllib.parse import urlparse

from ..memory.budget import decide_budget, system_facts
from . import model_commands
from ..models import store
from ..settings import SettingsError

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


def run(settings_loader, as_json: bool = False) -> int:
    """Check, then print the report (text, or one JSON object with --json); 1 when serving is blocked."""
    report = check(settings_loader)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_text(report)
    return 1 if report["problems"] else 0


def check(settings_loader) -> dict:
    """What this machine is, what it can serve and what blocks it, as plain data."""
    report: dict = {"platform": {"os": f"{platform.system()} {platform.release()} {platform.machine()}",
                                 "python": platform.python_version()}, "problems": []}
    problems = report["problems"]
    try:
        settings = settings_loader()
    except SettingsError as e:
        report["config_error"] = str(e)
        problems.append(f"configuration: {e}")
        return report
    facts = system_facts()
    report["platform"] |= {"mlx": _version("mlx"), "backend": facts.backend, "mlx_lm": _version("mlx-lm")}
    gib = 1 << 30
    budget = decide_budget(facts, fraction=settings.memory_fraction,
                           reserve_bytes=int(settings.memory_reserve_gb * gib),
                           override_bytes=int(settings.memory_budget_gb * gib))
    report["memory"] = {"total_bytes": facts.total_memory, "available_bytes": facts.available_memory,
                        "budget_bytes": budget.total, "budget_source": budget.source, "reserve_bytes": budget.reserve,
                        "usable_bytes": budget.usable}
    if budget.usable <= 0:
        problems.append("the memory budget leaves nothing usable; lower memory_reserve_gb")
    from ..models.default import primary_models

    found = store.discover(settings, primary_models(settings))
    report["models"] = [model_commands.describe(settings, m, budget.usable) for m in found]
    fitting = sum(bool(r.get("fits")) for r in report["models"])
    if not found:
        problems.append("no models found; `provider models pull ORG/NAME` or set `model`")
    elif not fitting:
        problems.append("no model fits the memory budget")
    report["speculation"] = speculation_costs(settings, budget) if fitting else None
    report["coordinator"] = None
    if settings.coordinator:
        ok, detail = coordinator_reachable(settings.coordinator)
        report["coordinator"] = {"url": settings.coordinator, "reachable": ok, "detail": detail}
        if not ok:
            problems.append(f"coordinator {settings.coordinator} is unreachable")
    return report


def print_text(report: dict) -> None:
    plat, gib = report["platform"], 1 << 30
    print("platform")
    print(f"  os         {plat['os']}")
    print(f"  python     {plat['python']}")
    if "config_error" in report:
        print(f"config\n  ERROR      {report['config_error']}")
        return
    print(f"  mlx        {plat['mlx']} (backend: {plat['backend']})")
    print(f"  mlx-lm     {plat['mlx_lm']}")
    mem = report["memory"]
    print("memory")
    print(f"  system     {mem['total_bytes'] / gib:.1f} GiB total, {mem['available_bytes'] / gib:.1f} GiB available")
    print(f"  budget     {mem['budget_bytes'] / gib:.2f} GiB from {mem['budget_source']}")
    print(f"  reserve    {mem['reserve_bytes'] / gib:.2f} GiB  ->  usable {mem['usable_bytes'] / gib:.2f} GiB")
    print("models")
    for r in report["models"]:
        spec = " mtp-capable" if r.get("mtp_capable") else " draft-compatible" if r.get("draft_compatible") else ""
        if "footprint_mib" in r:
            print(f"  {r['id']:28} {r['family']:12} footprint {r['footprint_mib']:>9} MiB  {r['status']}{spec}"
                  f"  (speculation: {r['speculation_reason']})")
        else:
            print(f"  {r['id']:28} {r['status']}")
    if report["speculation"] is not None:
        print("speculation")
        for line in report["speculation"]["lines"]:
            print(f"  {line}")
    print("coordinator")
    c = report["coordinator"]
    print(f"  {c['url']}: {c['detail']}" if c else "  not configured (local mode only)")
    print("verdict")
    for p in report["problems"]:
        print(f"  BLOCKING   {p}")
    if not report["problems"]:
        print("  ok: this node can serve")


def speculation_costs(settings, budget) -> dict:
    """Load the default model's pair as the node would, and say what speculation costs here and the k auto picks
    (the live node refines its acceptance with traffic; `provider status` shows that): the profile and its lines."""
    from ..engine import profile
    from ..models.default import primary_models
    from ..node import build_models

    models = build_models(settings, primary_models(settings), budget)
    models.profiler = profile.Profiler()
    model_id = models.catalog.default_id
    try:
        lm = models.request(model_id).result(timeout=600)
    except Exception as e:
        return {"model": model_id, "profile": None, "lines": [f"{model_id}: could not load it to measure: {e}"]}
    finally:
        models.close(finish_measuring=True)  # the auto measurement under way is what it prints, and kept
    if lm.drafter is None:
        return {"model": model_id, "profile": None,
                "lines": [f"{model_id}: no drafter ({lm.drafter_reason}); plain decoding"]}
    p = (lm.spec_profile or profile.measure(lm)).as_dict()  # measured at load only under auto
    rounds = ", ".join(f"k={k} {ms}" for k, ms in enumerate(p["round_ms"], 1))
    lines = [f"{model_id} ({lm.drafter_mode.value}): plain {p['plain_token_ms']} ms/token; a round: {rounds} ms"]
    rounds = ", ".join(f"k={k} {ms}" for k, ms in enumerate(p["round_rows_ms"], 1))
    lines.append(f"{p['rows']} rows together: plain {p['plain_rows_ms']} ms a step; a round: {rounds} ms")
    for scheme in ("greedy", "speculative_sampling"):
        d = p[scheme]
        gains = ", ".join(f"k={k} {v}x" for k, v in d["expected_speedup"].items())
        verdict = f"k = {d['k']}" if d["k"] else "off (not_profitable)"
        lines.append(f"{scheme:21} acceptance {d['acceptance']:.3f}: expected {gains} -> auto uses {verdict} alone")
    return {"model": model_id, "mode": lm.drafter_mode.value, "profile": p, "lines": lines}
