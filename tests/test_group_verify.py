"""Work a node group makes, checked by another node (issue 39): a group of two on loopback (the documented
commands, MLX's ring, mlx-lm's `sharded_load` split by projections and by layers) commits to its hidden states,
and a single node holding the same checkpoint verifies each outcome with a verify job, the path a coordinator's
spot check takes. Honest outcomes, greedy and sampled (seeded, or seeded by rank 0), all pass; a group one of
whose ranks serves other weights under the model's name fails where its output starts."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import pytest

from provider.group.proofs import refuse_false_commitments, why_not_committing
from provider.jobs import Claim, Job, SamplingParams
from provider.outputs import Done, Proof
from tools.fixtures import cheats as cheat_fixtures
from tests.helpers import collect, make_node, run
from tools.harness.daemon import LocalServer
from tools.harness.group import Follower, start_group, write_hostfile, write_secret

COMMITTING = {"PROVIDER_COMMITMENTS": "on"}
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41, 42], [1, 100, 7, 30, 12, 9, 33], list(range(1, 60))]
# As the local API turns each request into SamplingParams (the verifier must be told the job's own sampling).
SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=11), dict(temperature=1.0),
             dict(temperature=0.7, top_k=20, seed=3)]
SPLITS = [("llama-tiny", "auto", "tensor"), ("qwen2-tiny", "pipeline", "pipeline")]
MAX_TOKENS = 40
# The alteration a cheating rank makes: 3% noise. At 1%, llama-tiny's outcomes are not all caught even from one
# node altered whole (measured: one of four passed, at overlap 0.92; another failed at token 10 only), the
# scheme's margin on so small a model, not the group's; at 3% every one fails at token 0, alone or in a group.
NOISE = 0.03


def ask(srv, prompt: list[int], sampling: dict) -> tuple[list[int], dict]:
    """One completion from the group's rank 0: its token ids and its proof."""
    r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=300,
                   json={"prompt": prompt, "max_tokens": MAX_TOKENS} | sampling)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice.get("proof"), f"the group's outcome carries no proof: {choice}"
    return choice["proof"]["output_ids"], choice["proof"]


def outcomes(srv) -> list[tuple[list[int], dict, list[int], dict]]:
    """Every prompt with every sampling, eight at a time (one batch across the group's ranks)."""
    cases = [(p, s) for p in PROMPTS for s in SAMPLINGS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: ask(srv, *c), cases))
    return [(p, s, ids, proof) for (p, s), (ids, proof) in zip(cases, got)]


def verdicts(model: Path, made) -> list:
    """A single node with `model` verifies each outcome in a verify job, as a coordinator's spot check asks."""
    node = make_node({"m": model}, commitments="on", speculation="off")

    async def main():
        out = []
        for i, (prompt, sampling, ids, proof) in enumerate(made):
            made_by = Proof(base64.b64decode(proof["commitment"]), proof["sampler"], proof["seed"], proof["end_token"])
            claim = Claim(tuple(ids), made_by)
            job = Job(id=f"v{i}", model="m", prompt_ids=tuple(prompt),
                      sampling=SamplingParams(max_tokens=MAX_TOKENS, **sampling), verify=claim)
            _, _, end, _ = await collect(node, job)
            assert isinstance(end, Done) and end.verdict is not None, end
            out.append(end.verdict)
        return out

    try:
        return run(main())
    finally:
        run(node.stop())


def stop(leader, followers) -> None:
    assert leader.stop() == 0, leader.logs()[-3000:]
    for f in followers:  # rank 0's stop ends them with it
        assert f.proc.wait(30) == 0, f.logs()[-3000:]
        f.stop()


def split_of(*logs: str) -> set[str]:
    return {json.loads(line)["split"] for text in logs for line in text.splitlines()
            if line.startswith("{") and '"group_share_loaded"' in line}


@pytest.mark.heavy
@pytest.mark.parametrize("family,split,expected", SPLITS)
def test_a_groups_honest_outcomes_are_verified_by_a_single_node(fixtures_dir, tmp_path, family, split, expected):
    model = fixtures_dir / family
    leader, followers = start_group(model, tmp_path, 2, "--group-split", split, env=COMMITTING)
    try:
        made = outcomes(leader)
        assert split_of(leader.logs(), *(f.logs() for f in followers)) == {expected}
    finally:
        stop(leader, followers)
    for (_, sampling, _, proof) in made:
        # Rank 0 fixes an unseeded job's seed (every rank draws the same), so every sampled outcome is replayable.
        assert proof["sampler"] == ("greedy" if sampling["temperature"] == 0 else "replayable"), proof
        assert proof["seed"] == sampling.get("seed", proof["seed"])
    checked = verdicts(model, made)
    failed = [(i, v) for i, v in enumerate(checked) if not v.passed]
    assert not failed, failed
    assert sum(len(ids) for _, _, ids, _ in made) > len(made) * 8  # not a pass over empty outputs
    print(f"{family} {expected}: {len(checked)} outcomes passed; largest relative error "
          f"{max(v.max_rel_err for v in checked)}, lowest overlap {min(v.min_overlap for v in checked)}")


def altered_share(src: Path, out: Path, layers_only: bool) -> Path:
    """`src` with NOISE (cheat_fixtures.noisy's), under the same directory name, config bytes and weights index:
    what the ranks compare when they form a group, so the group forms. `layers_only`: noise on the decoder layers
    alone, the weights a split divides between the ranks; the ones every rank holds whole (embeddings, final
    norm, LM head) stay the real ones, so both ranks still sample the same tokens from the altered states."""
    import mlx.core as mx

    cheat_fixtures.noisy(src, out, NOISE)
    if layers_only:
        real, noisy = mx.load(str(src / "model.safetensors")), mx.load(str(out / "model.safetensors"))
        mixed = {k: noisy[k] if ".layers." in k else v for k, v in real.items()}
        assert mixed.keys() == real.keys() and any(not mx.array_equal(mixed[k], real[k]) for k in real)
        mx.save_safetensors(str(out / "model.safetensors"), mixed, metadata={"format": "mlx"})
    shutil.copy(src / "config.json", out / "config.json")
    if (src / "model.safetensors.index.json").exists():
        shutil.copy(src / "model.safetensors.index.json", out / "model.safetensors.index.json")
    return out


def altered_group(model: Path, tmp_path: Path, split: str, layers_only: bool):
    """A group of two: rank 0 on the real checkpoint, rank 1 on an altered copy."""
    cheat = altered_share(model, tmp_path / "cheat" / model.name, layers_only)
    hostfile = write_hostfile(tmp_path / "hostfile.json", 2)
    env = {"PROVIDER_GROUP_SECRET_FILE": str(write_secret(tmp_path / "group-secret"))} | COMMITTING
    followers = [Follower(cheat, tmp_path / "rank1", hostfile, 1, "--group-split", split, env=env)]
    (tmp_path / "rank0").mkdir()
    try:
        leader = LocalServer(model, tmp_path / "rank0", "--group", str(hostfile), "--rank", "0", "--group-split",
                             split, env=env)
    except BaseException:
        followers[0].stop()
        raise
    return leader, followers


@pytest.mark.heavy
@pytest.mark.parametrize("family,split,expected", SPLITS)
def test_a_group_whose_rank_serves_other_layers_fails_verification(fixtures_dir, tmp_path, family, split, expected):
    model = fixtures_dir / family
    leader, followers = altered_group(model, tmp_path, split, layers_only=True)
    try:
        made = [(p, s, *ask(leader, p, s)) for p in PROMPTS[:2] for s in SAMPLINGS[:2]]
        assert split_of(leader.logs(), *(f.logs() for f in followers)) == {expected}
    finally:
        stop(leader, followers)
    checked = verdicts(model, made)
    print(f"{family} {expected}, rank 1 altered: overlaps {[v.min_overlap for v in checked]}")
    for verdict in checked:
        assert not verdict.passed and verdict.first_failure == 0, verdict


@pytest.mark.heavy
def test_a_rank_with_other_weights_everywhere_stops_the_group_before_any_outcome(fixtures_dir, tmp_path):
    """Altered weights that every rank holds whole (the LM head among them) make the ranks sample different tokens:
    the group stops at its first step (lockstep.check_step) and claims nothing."""
    leader, followers = altered_group(fixtures_dir / "llama-tiny", tmp_path, "auto", layers_only=False)
    try:
        r = httpx.post(f"{leader.url}/v1/completions", headers=leader.headers, timeout=300,
                       json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 503 and "proof" not in r.text, r.text
    finally:
        assert leader.stop() != 0
        assert followers[0].stop() != 0
    assert "group_diverged" in leader.logs()


class Seat:
    """A rank's place in a group as mlx-lm's `pipeline` reads it (its rank and the group's size)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_rank_0_commits_only_where_its_norm_sees_the_final_hidden_state(fixtures_dir):
    """mlx-lm gives rank 0 the last layers of a pipeline, so its norm reads the model's final state; a share
    without them (another rank's, or a convention that changed) makes no commitment rather than a false one."""
    from provider.models.loader import load_pair
    from provider.speculation import DrafterPlan
    from provider.types import SpecReason

    def loaded(rank: int | None):
        lm, _ = load_pair("m", fixtures_dir / "qwen2-tiny", None, DrafterPlan(None, SpecReason.GROUP_MODE))
        if rank is not None:
            lm.model.model.pipeline(Seat(rank, 2))  # the real split of the real layers, as sharded_load makes it
        return lm

    whole, first, last = loaded(None), loaded(0), loaded(1)
    assert why_not_committing(whole) is None and why_not_committing(first) is None
    assert "another rank" in why_not_committing(last)
    for lm, kept in ((first, True), (last, False)):
        refuse_false_commitments(lm)
        assert (lm.hidden_tap is not None) == kept
