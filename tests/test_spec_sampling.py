"""Speculation for sampled requests and auto's choice of k: lossless in distribution, reproducible when seeded,
and on only where the costs measured on this machine say it pays."""

import itertools

import pytest
from mlx_lm import load

from provider import speculation as sp
from provider.engine.acceptance import SampledChoice
from provider.engine.proposers import DraftModelDrafter
from provider.engine.spec_rounds import speculative_tokens
from provider.jobs import Job, SamplingParams
from provider.telemetry import SpecTelemetry
from provider.types import SpecReason
from tests.helpers import collect, make_node, run, until
from tools.harness.distribution import AcceptEveryDraft, compare, plain_samples, speculative_samples

SAMPLES = 800  # a side, on the fixture pair


def test_sampled_speculation_is_distributed_as_plain_sampling(fixtures_dir):
    """The first 6 tokens at T = 0.7 with top_p and top_k, k = 3, over 800 samples a side: a chi-square test does not tell
    speculative sampling from the node's plain sampler, and it does tell a biased one. The fixture pair is
    random, so its distributions are flat over 512 tokens; top_k = 64 gives the test power at this size.
    The bundled demo pair, at top_k off, 2,000 a side (four minutes of a core, so a campaign rather than a test):
    `python tools/bench/spec_distribution.py --k 1`."""
    model, tok = load(str(fixtures_dir / "llama-tiny"))
    draft, _ = load(str(fixtures_dir / "llama-tiny-draft"))
    prompt = tok.encode("The cache")
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.95, top_k=64, seed=3)
    plain = plain_samples(model, prompt, params, SAMPLES, 6)
    spec, stats = speculative_samples(model, lambda: DraftModelDrafter(draft), prompt, params, SAMPLES, 6, k=3)
    assert 0.05 < stats.accepted / stats.judged < 0.95  # both branches (accept, resample the residual) exercised
    rows = compare(plain, spec, 6)
    assert all(r["p"] >= 1e-3 for r in rows), rows
    biased, _ = speculative_samples(model, lambda: DraftModelDrafter(draft), prompt, params, 200, 6, k=2,
                                    choice=AcceptEveryDraft, seed0=10**6)
    assert min(r["p"] for r in compare(plain, biased, 6)) < 1e-3  # the test has the power to see a bias


def test_seeded_sampled_speculation_reproduces_and_unseeded_varies(fixtures_dir):
    node = make_node({"l": fixtures_dir / "llama-tiny"}, speculation="on",
                     manager_kw={"drafters": {"l": fixtures_dir / "llama-tiny-draft"}})

    async def main():
        seeded = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=11)
        runs = [await collect(node, Job(f"s{i}", "l", seeded, prompt="The cache")) for i in range(2)]
        assert runs[0][0] == runs[1][0]
        spec = runs[0][2].telemetry.speculation.as_dict()
        assert spec["mode"] == "draft" and spec["sampling_scheme"] == "speculative_sampling"
        unseeded = SamplingParams(max_tokens=24, temperature=0.9)
        outs = {tuple((await collect(node, Job(f"u{i}", "l", unseeded, prompt="The cache")))[0]) for i in range(4)}
        assert len(outs) > 1
        await node.stop()

    run(main())


def test_speculative_sampling_emits_the_seeded_job_s_tokens_at_every_k(fixtures_dir):
    """Same seed, same k: the same tokens; and the stream is not stuck on the drafter's proposals."""
    model, tok = load(str(fixtures_dir / "llama-tiny"))
    draft, _ = load(str(fixtures_dir / "llama-tiny-draft"))
    prompt = tok.encode("hello")
    params = SamplingParams(max_tokens=20, temperature=1.0)
    for k in (1, 4):
        a, b = ([*itertools.islice(speculative_tokens(model, prompt, DraftModelDrafter(draft), k=k,
                                                        stats=SpecTelemetry("draft", k=k),
                                                        choice=SampledChoice(params, seed)), 20)] for seed in (5, 5))
        assert a == b and len(a) == 20


def test_choose_k_is_the_best_expected_rate_or_off():
    costs = sp.SpecCosts(plain_token_s=0.010, round_s=(0.012, 0.016, 0.020, 0.024))  # on a line
    assert sp.expected_tokens(0.0, 3) == 1 and sp.expected_tokens(1.0, 3) == 4
    assert sp.expected_tokens(0.5, 2) == pytest.approx(1.75)
    high = sp.choose_k(costs, 0.9)
    best = max(high.speedups.values())
    assert high.speedup > 1.05 and high.speedup == best
    assert high.speedups[1] == pytest.approx((1 + 0.9) / 0.012 * 0.010)
    low = sp.choose_k(costs, 0.1)
    assert low.k == 0 and low.speedup == 1.0 and max(low.speedups.values()) < 1.05
    # Cheaper drafting moves the best k up.
    cheap = sp.SpecCosts(plain_token_s=0.010, round_s=(0.0105, 0.011, 0.0115, 0.012))
    assert sp.choose_k(cheap, 0.9).k == 4
    # A noisy measurement (k = 4 timed faster than k = 3) is smoothed by the fitted line, not believed.
    noisy = sp.SpecCosts(plain_token_s=0.010, round_s=(0.012, 0.016, 0.024, 0.020))
    assert [noisy.round(k) for k in (1, 2, 3, 4)] == sorted(noisy.round(k) for k in (1, 2, 3, 4))
    assert noisy.round(4) > noisy.round(3)
    # A round timed faster than a plain step (a busy machine) is not believed: a useless drafter stays off.
    busy = sp.SpecCosts(plain_token_s=0.010, round_s=(0.008, 0.009, 0.010, 0.011))
    assert busy.round(1) == 0.010 and sp.choose_k(busy, 0.0).k == 0


def test_the_load_profile_times_its_kinds_of_step_in_turns(monkeypatch):
    """One step of each kind per rotation, each rotation starting one further along, the first untimed (new
    kernel shapes). A kind's time is its median ratio to the first kind within a rotation times the first
    kind's median, so a slow rotation or one stall moves nothing. A stand-in clock."""
    from types import SimpleNamespace

    from provider.engine import profile

    now, calls, reps = [0.0], [], 6
    slow = {4: 3.0}  # a rotation in which the whole machine runs 3x slower

    def kind(i, seconds):
        def step():
            calls.append(i)
            rotation = (len(calls) - 1) // 3
            now[0] += 100.0 if len(calls) == 3 * 2 + 2 else seconds * slow.get(rotation, 1.0)  # one stall
        return step

    monkeypatch.setattr(profile, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    times = profile._take_turns([kind(0, 1.0), kind(1, 2.0), kind(2, 3.0)], reps)
    rotations = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(rotations) == reps + 1 and rotations[:4] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert times == [1.0, 2.0, 3.0]


def test_auto_weighs_the_batch_a_job_would_speculate_in():
    """Two machines measured at 1 and 4 rows: where a step's time grows with its rows (arithmetic-bound, like
    this CPU), speculation that pays for one row does not for eight, and plain batching wins; where it
    hardly grows (bandwidth-bound, a GPU), it pays in the batch too."""
    one = dict(plain_token_s=0.010, round_s=(0.012, 0.016, 0.020, 0.024))
    compute_bound = sp.SpecCosts(**one, rows=4, plain_rows_s=0.040, round_rows_s=(0.080, 0.112, 0.144, 0.176))
    bandwidth_bound = sp.SpecCosts(**one, rows=4, plain_rows_s=0.011, round_rows_s=(0.013, 0.017, 0.021, 0.025))
    assert compute_bound.plain(8) == pytest.approx(0.010 + 7 * 0.010) and bandwidth_bound.round(1, 1) == pytest.approx(0.012)
    assert sp.choose_k(compute_bound, 0.9).k > 0 and sp.choose_k(bandwidth_bound, 0.9).k > 0
    assert sp.choose_k(compute_bound, 0.9, rows=8).k == 0
    assert sp.choose_k(bandwidth_bound, 0.9, rows=8).k > 0
    profile = sp.SpecProfile(compute_bound, {sp.GREEDY: 0.9})
    assert profile.decide(sp.GREEDY).k > 0 and profile.decide(sp.GREEDY, rows=8).k == 0
    seen = []
    plan = sp.plan(policy="auto", drafter_mode="mtp", drafter_reason="ok", sampling=SamplingParams(4), k=3,
                   sharing=5, decide=lambda rows: seen.append(rows) or profile.decide(sp.GREEDY, rows))
    assert seen == [6] and plan.reason == SpecReason.NOT_PROFITABLE  # five jobs on the model: it would be the sixth row


def test_auto_off_probes_every_sixteenth_job_and_follows_acceptance():
    costs = sp.SpecCosts(plain_token_s=0.010, round_s=(0.012, 0.016))
    profile = sp.SpecProfile(costs, {sp.GREEDY: 0.1, sp.SPECULATIVE_SAMPLING: 0.1})
    decisions = [profile.decide(sp.GREEDY).k for _ in range(32)]
    assert [i for i, k in enumerate(decisions) if k] == [15, 31]  # probes keep the estimate alive
    fresh = sp.SpecProfile(costs, {sp.GREEDY: 0.1, sp.SPECULATIVE_SAMPLING: 0.1})
    mixed = [fresh.decide(scheme).k for scheme in [sp.GREEDY] * 10 + [sp.SPECULATIVE_SAMPLING] * 10]
    assert not any(mixed)  # each scheme counts its own jobs toward a probe
    for _ in range(30):  # the traffic accepts nearly everything now
        profile.observe(sp.GREEDY, accepted=19, judged=20)
    assert profile.acceptance[sp.GREEDY].rate > 0.9 and profile.decide(sp.GREEDY).k > 0
    assert profile.acceptance[sp.SPECULATIVE_SAMPLING].rate == pytest.approx(0.1)  # per scheme
    assert sp.plan(policy="auto", drafter_mode="draft", drafter_reason="ok", sampling=SamplingParams(4),
                   k=3, decide=lambda rows: sp.KChoice(0, 1.0, 0.1, {1: 0.8})).reason == SpecReason.NOT_PROFITABLE
    on = sp.plan(policy="on", drafter_mode="draft", drafter_reason="ok", sampling=SamplingParams(4), k=3,
                 decide=lambda rows: sp.KChoice(0, 1.0, 0.1, {1: 0.8}))
    assert on.on and on.k == 3  # `on` forces the configured k
    # Under auto a seeded sampled job decodes plain: auto's choice follows measurements, a seed's tokens must not.
    seeded = SamplingParams(4, temperature=0.8, seed=7)
    assert sp.plan(policy="auto", drafter_mode="draft", drafter_reason="ok", sampling=seeded, k=3,
                   decide=lambda rows: sp.KChoice(2, 1.5, 0.9, {2: 1.5})).reason == "ineligible_request:seed"
    assert sp.plan(policy="on", drafter_mode="draft", drafter_reason="ok", sampling=seeded, k=3).on


def test_auto_says_not_profitable_with_the_numbers_it_decided_from(fixtures_dir):
    """Given costs on which no k pays at the pair's acceptance: both sampling schemes decode plain, and the
    telemetry carries the numbers `choose_k` decided from; the node's status carries the costs."""
    costs = sp.SpecCosts(plain_token_s=0.010, round_s=(0.012, 0.016, 0.020, 0.024), rows=4, plain_rows_s=0.040,
                         round_rows_s=(0.080, 0.112, 0.144, 0.176))
    node = make_node({"g": fixtures_dir / "gemma4-tiny"},
                     manager_kw={"drafters": {"g": fixtures_dir / "gemma4-tiny-assistant"}})
    node.models.profiler = lambda lm: sp.SpecProfile(costs, {sp.GREEDY: 0.1, sp.SPECULATIVE_SAMPLING: 0.2})

    async def main():
        await _profiled(node, "g")
        for params, acceptance in ((SamplingParams(max_tokens=8, temperature=0.0), 0.1),
                                   (SamplingParams(max_tokens=8, temperature=0.7), 0.2)):
            done = (await collect(node, Job("j", "g", params, prompt="The cache")))[2]
            spec = done.telemetry.speculation.as_dict()
            assert spec["mode"] == "off" and spec["reason"] == "not_profitable"
            origin = spec["decision"].pop("profile")
            assert spec["decision"] == {"k": 0, "acceptance": acceptance, "expected_speedup": {
                str(k): round(v, 3) for k, v in sp.speedups(costs, acceptance).items()}}
            assert origin["source"] == "measured"  # at this load, in the background (models.profile_store)
        (model,) = [m for m in node.status().models if m.id == "g"]
        profile = model.speculation
        assert profile["plain_token_ms"] == 10.0 and profile["round_ms"] == [12.0, 16.0, 20.0, 24.0]
        assert profile["rows"] == 4 and profile["plain_rows_ms"] == 40.0 and len(profile["round_rows_ms"]) == 4
        assert profile["greedy"]["k"] == 0 and profile["speculative_sampling"]["k"] == 0
        await node.stop()

    run(main())


async def _profiled(node, model_id: str) -> None:
    """Load the model and wait for its speculation costs: a first load serves at once and measures them in the
    background (auto decoding plain meanwhile)."""
    await node.preload(model_id)
    await until(lambda: next(m for m in node.status().models if m.id == model_id).speculation,
                f"{model_id}'s speculation profile")


def _costs(profile) -> sp.SpecCosts:
    """The costs a heartbeat's SpeculationProfile reports (milliseconds, rounded to the microsecond)."""
    return sp.SpecCosts(profile.plain_token_ms / 1000, tuple(t / 1000 for t in profile.round_ms), profile.rows,
                        profile.plain_rows_ms / 1000, tuple(t / 1000 for t in profile.round_rows_ms))


def _as_choose_k_decides(k: int, acceptance: float, speedups: list[float], costs: sp.SpecCosts) -> None:
    """A reported decision is what `choose_k` makes from the reported numbers: its expected speedups are
    speedups(costs, acceptance), and k is the best of them, or 0 when none clears the profit margin. The
    numbers are rounded on their way (costs to 1 us, speedups to 0.001), so a near tie may go either way."""
    tol = 0.005
    assert len(speedups) == costs.k_max and 0 <= acceptance <= 1
    assert speedups == pytest.approx(list(sp.speedups(costs, acceptance).values()), abs=tol), (speedups, costs)
    best = max(speedups)
    if k == 0:
        assert best < sp.PROFIT_MARGIN + tol, (k, speedups)
    else:
        assert speedups[k - 1] >= max(best, sp.PROFIT_MARGIN) - tol, (k, speedups)


def test_auto_measures_at_load_and_its_decision_and_costs_reach_the_coordinator(fixtures_dir, tmp_path):
    """The one check of auto on costs really measured at load (on whatever this machine is doing): it reports
    them and decides from them, and says so through the wire; how large they are is not asserted (the
    decision on given costs: test_auto_says_not_profitable_with_the_numbers_it_decided_from and the pure
    tests above)."""
    from coordinator_client.pb import provider_pb2 as pb
    from tools.harness.nodes import harness, job

    async def main():
        drafters = {"g": fixtures_dir / "gemma4-tiny-assistant"}
        async with harness({"g": fixtures_dir / "gemma4-tiny"}, tmp_path, manager_kw={"drafters": drafters}) as (
                coord, node, _s):
            s = await coord.wait_for_node()
            await _profiled(node, "g")
            decisions = {}
            for name, temperature in (("greedy", 0.0), ("sampled", 0.7)):
                coord.dispatch(s, job(name, "g", max_tokens=6, temperature=temperature))
                decisions[name] = (await coord.outcome(name)).job_done.telemetry.speculation
            coord.dispatch(s, job("forced", "g", max_tokens=6, temperature=0.7, speculation=pb.SPECULATION_POLICY_ON))
            forced = (await coord.outcome("forced")).job_done.telemetry.speculation
            assert forced.mode == "mtp" and forced.k == 3 and forced.sampling_scheme == "speculative_sampling"
            await until(lambda: s.heartbeats and s.heartbeats[-1].speculation, "no heartbeat with the pair's costs")
            (profile,) = s.heartbeats[-1].speculation
            (model,) = [m for m in node.status().models if m.id == "g"]
            return decisions, profile, model.speculation

    decisions, profile, status = run(main())
    print(f"measured at load (ms): plain {profile.plain_token_ms}, rounds {list(profile.round_ms)}, "
          f"{profile.rows} rows: plain {profile.plain_rows_ms}, rounds {list(profile.round_rows_ms)}")
    for name, spec in decisions.items():
        print(f"{name}: {spec.mode} ({spec.reason}), k {spec.decision.k} at acceptance {spec.decision.acceptance:.3f}, "
              f"expected speedups {[round(x, 3) for x in spec.decision.expected_speedup]}")
    assert profile.model == "g" and profile.plain_token_ms > 0 and len(profile.round_ms) == 4
    assert profile.rows == 4 and profile.plain_rows_ms > 0 and len(profile.round_rows_ms) == 4
    assert [profile.plain_token_ms, list(profile.round_ms)] == [status["plain_token_ms"], status["round_ms"]]
    costs = _costs(profile)
    for d in (profile.greedy, profile.sampled):
        _as_choose_k_decides(d.k, d.acceptance, list(d.expected_speedup), costs)
    d = decisions["greedy"].decision
    _as_choose_k_decides(d.k, d.acceptance, list(d.expected_speedup), costs)
    assert (decisions["greedy"].mode, decisions["greedy"].reason) == (
        ("off", "not_profitable") if d.k == 0 else ("mtp", "ok"))
    assert d.k == 0 or decisions["greedy"].k == d.k
    # The network seeds every sampled job (network_terms), and auto keeps a seeded job on the plain path
    sampled = decisions["sampled"]
    assert (sampled.mode, sampled.reason) == ("off", "ineligible_request:seed")


def test_one_round_emits_exactly_the_target_distribution():
    """One round on a 4-token vocabulary where the drafter is badly wrong: the first emitted token (the draft
    if accepted, else the residual's sample) must follow p, not q. 4,000 rounds, goodness of fit."""
    import collections
    import math

    import mlx.core as mx

    from tools.harness.distribution import _upper_gamma_regularized

    p = [0.5, 0.3, 0.15, 0.05]
    q = [0.1, 0.2, 0.3, 0.4]
    choice = SampledChoice(SamplingParams(4, temperature=1.0), seed=0)
    target_logits = mx.log(mx.array([p, p]))  # positions 0 and 1 (the bonus after one accepted draft)
    counts = collections.Counter()
    for _ in range(4000):
        draft, q_row = choice.draft(mx.log(mx.array([q])))
        n, bonus, _ = choice.verify(target_logits, draft, [q_row])
        counts[draft.item() if n.item() == 1 else bonus.item()] += 1
    stat = sum((counts[i] - 4000 * p[i]) ** 2 / (4000 * p[i]) for i in range(4))
    assert _upper_gamma_regularized(1.5, stat / 2) > 1e-3, counts  # 3 degrees of freedom
    assert math.isclose(counts[0] / 4000, 0.5, abs_tol=0.04)  # q alone would give 0.1
