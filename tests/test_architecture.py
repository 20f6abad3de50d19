"""The house rules that can be checked mechanically: layers talk downward only, no import cycles, the product never
imports tools/ (test support, benchmarks, scripts), small modules, and one NodeStatus behind /health, heartbeats and
registration."""

import ast
from pathlib import Path

import httpx

from coordinator_client.identity import Identity
from coordinator_client.registration import heartbeat, registration
from provider.jobs import Job
from tests.helpers import collect, greedy, make_node, run

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("provider", "coordinator_client")
TRANSPORTS = ("coordinator_client", "provider.local")
BELOW_TRANSPORTS = ("provider.engine", "provider.models", "provider.drafters", "provider.memory", "mlx", "mlx_lm")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "pb" in path.relative_to(ROOT).parts:
                continue  # generated code
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    """Every module this one imports, at any depth of the file: function-level imports, and those made only for
    type checking (a cycle in annotations is still a cycle in the design)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name not in modules and "." in name and name.split(".")[0] in PACKAGES:
                name = name.rpartition(".")[0]
            found.add(name)
    return found - {module}


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


# The floors of the packages under the node, from the top (docs/architecture.md): a package imports only those on
# the floors below its own. `drafters`, the registry of drafter kinds and their model code, sits below `models`,
# whose capability, loader, footprint, load needs and residency ask it, and above `memory` (which reads
# checkpoints). `proofs` (the hidden-state tap, the commitment) sits lowest: models and drafters install taps, the
# engine commits, the verifier reads them back. `media` (decoding, processors, a job's media plan) only reads the
# vocabulary, so it sits just above `proofs`. The command line (provider.commands) is above them all and nothing
# imports it (test_nothing_below_the_command_line_imports_it).
FLOORS = ("provider.group", "provider.verification", "provider.engine", "provider.models", "provider.drafters",
          "provider.memory", "provider.media", "provider.proofs")


def _floor(module: str) -> int | None:
    return next((i for i, pkg in enumerate(FLOORS) if module == pkg or module.startswith(pkg + ".")), None)


def test_packages_import_only_the_floors_below_them():
    bad = {}
    for m, targets in _graph().items():
        own = _floor(m)
        if own is None:
            continue
        for t in targets:
            floor = _floor(t)
            if floor is not None and floor < own:
                bad.setdefault(m, []).append(t)
    assert not bad, bad


def test_the_floor_checker_sees_models_imported_by_drafters(tmp_path):
    fake = tmp_path / "x.py"
    fake.write_text("def load():\n    from ..models.loader import load\n")
    found = _imports("provider.drafters.x", fake, _modules())
    assert "provider.models.loader" in found and _floor("provider.models.loader") < _floor("provider.drafters.x")


def test_transports_do_not_reach_below_the_node():
    bad = {m: sorted(t for t in targets if t.startswith(BELOW_TRANSPORTS))
           for m, targets in _graph().items() if m.startswith(TRANSPORTS)}
    assert not {m: t for m, t in bad.items() if t}, bad


def test_nothing_below_the_command_line_imports_it():
    """The `provider` command and its subcommands (provider.commands) drive the node from above: the daemon, the
    transports and everything under them import no command (only `python -m provider` starts one)."""
    bad = {m: sorted(t for t in ts if t.startswith("provider.commands")) for m, ts in _graph().items()
           if not m.startswith("provider.commands") and m != "provider.__main__"}
    assert not {m: t for m, t in bad.items() if t}, bad


def test_the_group_sits_beside_the_node_tied_one_way():
    """The node leads a group and the group drives the engine: nothing below the group imports it (the engine owns
    the failure type the group raises), and the group imports nothing above it (a worker rank is built from the
    parts below the node)."""
    below = ("provider.engine", "provider.models", "provider.drafters", "provider.memory", "provider.machine")
    above = ("provider.node", "provider.daemon", "provider.commands", "provider.local", "coordinator_client")
    graph = _graph()
    bad = {m: sorted(t for t in ts if t.startswith("provider.group")) for m, ts in graph.items() if m.startswith(below)}
    bad |= {m: sorted(t for t in ts if t.startswith(above)) for m, ts in graph.items()
            if m.startswith("provider.group")}
    assert not {m: t for m, t in bad.items() if t}, bad


def test_tools_do_not_import_tests():
    # What tools and tests share lives in tools/harness/; tests may import it, not the reverse.
    found = {str(p.relative_to(ROOT)): sorted(t for t in _imports(_tool_module(p), p, {}) if t.split(".")[0] == "tests")
             for p in (ROOT / "tools").rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}, found


def _tool_module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _tools_imported(module: str, path: Path) -> list[str]:
    """What of tools/ this module imports: any import statement (at any depth, as _imports reads them), and
    importlib.import_module / __import__ called with a literal name."""
    found = {t for t in _imports(module, path, {}) if t.split(".")[0] == "tools"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__") \
                and str(node.args[0].value).split(".")[0] == "tools":
            found.add(node.args[0].value)
    return sorted(found)


def test_the_product_never_imports_tools():
    # Fixture factories, cheat models and harnesses live in tools/ (not installed); the daemon never loads them.
    found = {m: _tools_imported(m, p) for m, p in _modules().items()}
    assert not {m: t for m, t in found.items() if t}, {m: t for m, t in found.items() if t}


def test_the_checker_sees_an_import_of_tools(tmp_path):
    fake = tmp_path / "x.py"
    fake.write_text("import json\nfrom .store import discover\n\n\ndef build(root):\n"
                    "    from tools.fixtures import factory\n    import tools.harness.nodes\n"
                    "    return importlib.import_module('tools.fixtures.mtp')\n")
    assert _tools_imported("provider.models.x", fake) == [
        "tools.fixtures", "tools.fixtures.factory", "tools.fixtures.mtp", "tools.harness.nodes"]
    fake.write_text("import json\nfrom .store import discover\nfrom ..tools_of_mine import x\n")
    assert _tools_imported("provider.models.x", fake) == []


def test_no_import_cycles():
    graph = {m: {t for t in ts if t.split(".")[0] in PACKAGES} for m, ts in _graph().items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m, stack):
        state[m] = 1
        for t in graph.get(m, ()):
            if state.get(t) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(t):] + [t])}")
            if t in graph and not state.get(t):
                visit(t, stack + [t])
        state[m] = 2

    for m in graph:
        if not state.get(m):
            visit(m, [m])


def test_the_checker_sees_a_wrong_way_import(tmp_path):
    # The checks above must be able to fail: a transport module importing the engine is caught.
    fake = tmp_path / "x.py"
    fake.write_text("from ..engine.scheduler import Engine\nimport mlx.core as mx\n")
    found = _imports("provider.local.x", fake, _modules())
    assert "provider.engine.scheduler" in found and "mlx.core" in found


def test_the_checker_sees_an_import_made_only_for_type_checking(tmp_path):
    fake = tmp_path / "x.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .scheduler import Engine\n")
    assert "provider.engine.scheduler" in _imports("provider.engine.x", fake, _modules())


def test_modules_stay_small():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert not {m: n for m, n in sizes.items() if n > 360}, sorted(sizes.items(), key=lambda x: -x[1])[:5]


def test_health_heartbeat_and_registration_come_from_one_status(fixtures_dir, tmp_path):
    from provider.local.server import start_local_api

    node = make_node({"g": fixtures_dir / "gemma4-tiny", "q": fixtures_dir / "qwen3-tiny"})

    async def main():
        await collect(node, Job("warm", "g", greedy(4), prompt="x"))
        runner, url = await start_local_api(node, "127.0.0.1", 0, token=None)
        async with httpx.AsyncClient(base_url=url) as client:
            health = (await client.get("/health")).json()
        await runner.cleanup()
        st = node.status()
        hb = heartbeat(st, draining=False)
        reg = registration(st, Identity.load_or_create(tmp_path), nonce=b"n" * 16, epoch=1, protocol_version=1,
                           software_version="t")
        assert health["resident_models"] == list(hb.resident_models) == st.resident == ["g"]
        assert [m.id for m in reg.models] == health["models"] == ["g", "q"]
        assert [m.resident for m in reg.models] == [True, False]
        assert health["counters"]["jobs_completed"] == hb.counters.jobs_completed == 1
        assert health["memory"]["usable_bytes"] == hb.memory.budget_bytes == reg.memory.budget_bytes
        assert health["memory"]["free_bytes"] == hb.memory.free_for_load_bytes == reg.memory.free_for_load_bytes
        assert health["memory"]["system_bytes"] == hb.memory.total_bytes == reg.memory.total_bytes
        assert reg.models[0].size_bytes == st.models[0].facts.size_bytes > 0
        assert health["active_jobs"] == hb.active_jobs == 0 and health["status"] == "ok"
        await node.stop()

    run(main())



