"""What logprobs cost, side by side in one run on the local node (the bundled model, speculation off):

- decode: tokens/s of 8 concurrent completions asking `logprobs: 5` over the same 8 without, in alternating
  rounds (goal >= 0.95). The rate is the batch's: completion tokens of all 8 over the wall time of the round.
- scoring: prompt tokens scored per second with `echo` (max_tokens 0, logprobs 1: what lm-eval's
  loglikelihood sends, one request at a time) over a bare mlx-lm forward of the same token ids in this process
  while the node is idle (goal >= 0.8). Both over the same prompts, alternating.

    python tools/bench/bench_logprobs.py [--tokens 64] [--rounds 3] [--prompt-tokens 512] [--prompts 6]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.fixtures import factory  # noqa: E402
from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402

C = 8


def completion(srv: LocalServer, body: dict) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {srv.token}"},
                   timeout=600)
    r.raise_for_status()
    return r.json()


def decode_round(srv: LocalServer, tokens: int, logprobs: bool) -> float:
    """Completion tokens per second of C concurrent requests (EOS biased away, so each runs to `tokens`)."""
    def one(i: int) -> int:
        body = {"prompt": f"The provider node {i} serves", "max_tokens": tokens, "temperature": 0.7, "seed": i,
                "speculation": "off", "logit_bias": {str(t): -100 for t in srv.eos}}
        if logprobs:
            body["logprobs"] = 5
        return completion(srv, body)["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(C) as pool:
        done = sum(pool.map(one, range(C)))
    return done / (time.perf_counter() - start)


def scoring_round(srv: LocalServer, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    for ids in prompts:
        body = completion(srv, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def bare_round(model, prompts: list[list[int]]) -> float:
    """mlx-lm's forward over each prompt, the log-softmax taken (what a scorer needs), in float32."""
    import mlx.core as mx

    start = time.perf_counter()
    for ids in prompts:
        logits = model(mx.array(ids)[None]).astype(mx.float32)
        mx.eval(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=6)
    a = ap.parse_args()
    from mlx_lm import load

    path = ensure_default_model()
    model, tok = load(str(path))
    rng = random.Random(0)
    words = factory.CORPUS.split()
    prompts = []
    for _ in range(a.prompts):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(a.prompt_tokens)))
        prompts.append(ids[:a.prompt_tokens])
    with tempfile.TemporaryDirectory() as tmp:
        (home := Path(tmp) / "home").mkdir()
        srv = LocalServer(path, home, env={"PROVIDER_SPECULATION": "off", "PROVIDER_MAX_CONCURRENT_JOBS": str(C)})
        srv.eos = list(tok.eos_token_ids)
        try:
            decode_round(srv, 8, True)  # warm both paths
            scoring_round(srv, prompts[:1])
            with_lp, without, scored, bare = [], [], [], []
            for r in range(a.rounds):
                for wants in ((True, False) if r % 2 == 0 else (False, True)):
                    (with_lp if wants else without).append(decode_round(srv, a.tokens, wants))
                scored.append(scoring_round(srv, prompts))
                bare.append(bare_round(model, prompts))
        finally:
            srv.stop()
    d_with, d_without = statistics.median(with_lp), statistics.median(without)
    s_node, s_bare = statistics.median(scored), statistics.median(bare)
    print(f"model {path.name}; {a.rounds} rounds, medians")
    print(f"  decode at c={C}: logprobs 5 {d_with:.1f} tok/s, without {d_without:.1f} tok/s, "
          f"ratio {d_with / d_without:.3f} (goal >= 0.95)")
    print(f"  scoring {a.prompts} x {a.prompt_tokens}-token prompts: echo {s_node:.0f} tok/s, bare mlx-lm forward "
          f"{s_bare:.0f} tok/s, ratio {s_node / s_bare:.3f} (goal >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
