"""Memory decisions are pure functions over plain numbers."""

from provider.memory.admission import Resident, idle_to_unload, plan_load
from provider.memory.budget import SystemFacts, decide_budget

GB = 1 << 30


def test_budget_prefers_metal_working_set_then_system_fraction():
    metal = SystemFacts(64 * GB, 40 * GB, recommended_working_set=48 * GB, backend="metal")
    b = decide_budget(metal, fraction=0.5, reserve_bytes=2 * GB)
    assert (b.total, b.usable, b.source) == (48 * GB, 46 * GB, "mlx max_recommended_working_set_size")
    cpu = SystemFacts(24 * GB, 20 * GB, recommended_working_set=None, backend="cpu")
    b = decide_budget(cpu, fraction=0.75, reserve_bytes=1 * GB)
    assert b.total == 18 * GB and b.usable == 17 * GB and "psutil" in b.source
    assert decide_budget(cpu, fraction=0.75, reserve_bytes=GB, override_bytes=5 * GB).usable == 5 * GB


def test_fits_without_eviction():
    plan = plan_load(10, 100, [Resident("a", 50, False, 1.0)], max_resident=4)
    assert plan.admit and plan.evict == () and plan.free == 50


def test_evicts_least_recently_used_idle_first():
    residents = [Resident("old", 40, False, 1.0), Resident("new", 40, False, 5.0), Resident("mid", 10, False, 3.0)]
    plan = plan_load(40, 100, residents, max_resident=4)
    assert plan.admit and plan.evict == ("old",)


def test_busy_models_are_never_evicted():
    residents = [Resident("busy", 60, True, 0.0), Resident("idle", 30, False, 9.0)]
    plan = plan_load(40, 100, residents, max_resident=4)  # 10 free + 30 from the idle one
    assert plan.admit and plan.evict == ("idle",)
    refused = plan_load(80, 100, residents, max_resident=4)
    assert not refused.admit and refused.evict == () and refused.reason == "insufficient_memory"
    msg = refused.message("big")
    assert "needs" in msg and "free" in msg and "budget" in msg


def test_max_resident_models_forces_lru_eviction():
    residents = [Resident("a", 1, False, 1.0), Resident("b", 1, False, 2.0)]
    plan = plan_load(1, 100, residents, max_resident=2)
    assert plan.admit and plan.evict == ("a",)
    all_busy = [Resident("a", 1, True, 1.0), Resident("b", 1, True, 2.0)]
    assert plan_load(1, 100, all_busy, max_resident=2).reason == "too_many_models"


def test_idle_timeout():
    residents = [Resident("a", 1, False, 0.0), Resident("b", 1, True, 0.0), Resident("c", 1, False, 95.0)]
    assert idle_to_unload(residents, now=100.0, idle_timeout=10) == ["a"]
    assert idle_to_unload(residents, now=100.0, idle_timeout=0) == []
