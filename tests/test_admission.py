"""Memory decisions are pure functions over plain numbers."""

from provider.memory.admission import (ADMIT, FOREVER, NEVER, WAIT, Resident, idle_to_unload, keep_seconds, plan_job,
                                      plan_load)
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
    residents = [Resident("a", 1, False, 0.0, 10), Resident("b", 1, True, 0.0, 10), Resident("c", 1, False, 95.0, 10)]
    assert idle_to_unload(residents, now=100.0) == ["a"]
    forever = [Resident("a", 1, False, 0.0, None), Resident("p", 1, False, 0.0, 0, pinned=True)]
    assert idle_to_unload(forever, now=100.0) == []


def test_how_long_a_model_stays_idle_pin_then_request_then_model_then_node():
    assert keep_seconds(pinned=True, asked=0, model_ttl=5, node_ttl=9) is None
    assert keep_seconds(pinned=False, asked=0, model_ttl=5, node_ttl=9) == 0
    assert keep_seconds(pinned=False, asked=FOREVER, model_ttl=5, node_ttl=9) is None
    assert keep_seconds(pinned=False, asked=None, model_ttl=5, node_ttl=9) == 5
    assert keep_seconds(pinned=False, asked=None, model_ttl=0, node_ttl=9) is None  # the model's 0: never
    assert keep_seconds(pinned=False, asked=None, model_ttl=None, node_ttl=9) == 9
    assert keep_seconds(pinned=False, asked=None, model_ttl=None, node_ttl=0) is None


def test_a_pinned_model_is_never_evicted_to_make_room():
    residents = [Resident("pinned", 40, False, 0.0, pinned=True), Resident("idle", 40, False, 5.0)]
    assert plan_load(50, 100, residents, max_resident=4).evict == ("idle",)
    assert not plan_load(70, 100, residents, max_resident=4).admit  # only the pin could make room
    assert not plan_load(1, 100, residents[:1], max_resident=1).admit  # the cap counts the pin
    job = plan_job(60, 100, [Resident("m", 10, True, 0.0)] + residents, "m", jobs_kv=0, prefix_bytes=0)
    assert job.decision == WAIT and not job.evict


def test_a_job_is_admitted_from_free_memory_then_from_prefix_caches_then_by_evicting_idle_models():
    residents = [Resident("m", 50, True, 1.0), Resident("idle", 20, False, 0.5)]
    assert plan_job(10, 100, residents, "m", jobs_kv=10, prefix_bytes=5).decision == ADMIT  # 15 free
    from_prefix = plan_job(20, 100, residents, "m", jobs_kv=10, prefix_bytes=10)  # 10 free + 10 of prefixes
    assert from_prefix.decision == ADMIT and from_prefix.prefix_keep == 0 and not from_prefix.evict
    partly = plan_job(14, 100, residents, "m", jobs_kv=10, prefix_bytes=10)
    assert partly.prefix_keep == 6  # only what it needs is dropped
    evicting = plan_job(35, 100, residents, "m", jobs_kv=10, prefix_bytes=5)
    assert evicting.decision == ADMIT and evicting.evict == ("idle",) and evicting.prefix_keep == 0


def test_a_job_waits_for_running_jobs_and_is_refused_only_when_it_could_never_fit():
    residents = [Resident("m", 50, True, 1.0), Resident("other", 30, True, 0.5)]  # busy: not evictable
    wait = plan_job(30, 100, residents, "m", jobs_kv=15, prefix_bytes=0)
    assert wait.decision == WAIT and wait.free == 5
    assert plan_job(50, 100, residents, "m", jobs_kv=0, prefix_bytes=0).decision == WAIT  # once "other" goes
    never = plan_job(51, 100, residents, "m", jobs_kv=0, prefix_bytes=0)
    assert never.decision == NEVER and "MiB" in never.message("m")


def test_a_job_waiting_for_memory_is_passed_over_a_bounded_number_of_times():
    import concurrent.futures

    from provider.engine.waiting import MAX_PASSED_OVER, Pending, Verdict, WaitingJobs
    from provider.jobs import Job, SamplingParams

    def pending(name):
        ready = concurrent.futures.Future()
        ready.set_result(None)
        return Pending(Job(name, "m", SamplingParams(max_tokens=1), prompt="x"), print, 0.0, ready)

    line = WaitingJobs()
    big = pending("big")
    line.append(big)
    started = []

    def try_start(p):
        if p is big:
            return Verdict.WAIT
        started.append(p.job.id)
        return Verdict.STARTED

    for i in range(MAX_PASSED_OVER + 3):
        line.append(pending(f"small{i}"))
        line.start_in_order(try_start)
    assert started == [f"small{i}" for i in range(MAX_PASSED_OVER)]  # then the big one blocks the line
    assert big.passed_over == MAX_PASSED_OVER and line.waiting_for_memory == 1 and len(line) == 4
