"""Decode tokens/s through the gRPC path vs the local HTTP API vs bare mlx-lm, in one run.

One node process serves both front ends from one engine (`provider start --coordinator URL --local`);
the reference coordinator and the HTTP client run here, as does bare mlx_lm.stream_generate.
Rounds alternate the three so machine noise hits all alike; medians are compared.

    python tools/bench/bench_grpc.py [--model PATH] [--tokens 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from coordinator_client.pb import provider_pb2 as pb  # noqa: E402
from coordinator_client.reference_coordinator import ReferenceCoordinator  # noqa: E402
from provider.models.default import ensure_default_model  # noqa: E402
from tools.harness.daemon import LocalServer  # noqa: E402
from tools.bench.bench_local import PROMPT, bare_mlx_lm, through_node  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def through_grpc(coord: ReferenceCoordinator, model_id: str, n: int, job_id: str):
    session = await coord.wait_for_node(timeout=120)
    coord.dispatch(session, pb.JobRequest(job_id=job_id, model=model_id, prompt=PROMPT, max_tokens=n,
                                          sampling=pb.SamplingParams(temperature=0)))
    done = (await coord.outcome(job_id, timeout=600)).job_done
    chunks, times = coord.chunks[job_id], coord.chunk_arrivals[job_id]
    first_tokens = len(chunks[0].token_ids)
    rate = (done.usage.completion_tokens - first_tokens) / (times[-1] - times[0])
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return rate, done.usage.completion_tokens, gaps, len(chunks)


async def main_async(args) -> None:
    from mlx_lm import load

    path = args.model or ensure_default_model()
    model, tok = load(str(path))
    prompt_ids = tok.encode(PROMPT)
    coord = ReferenceCoordinator(heartbeat_interval_ms=1000)
    await coord.start()
    home = Path(tempfile.mkdtemp(prefix="bench-grpc-"))
    server = await asyncio.to_thread(LocalServer, path, home, "--no-auth", "--coordinator", coord.url)
    try:
        await through_grpc(coord, path.name, 16, "warm")  # warm every path
        await asyncio.to_thread(through_node, server.url, {}, path.name, 16)
        bare_mlx_lm(model, tok, prompt_ids, 16)
        grpc_rates, local_rates, bare_rates, gaps_all, chunk_counts = [], [], [], [], []
        for i in range(args.rounds):
            # Rotate which path runs first, so warm-up and ordering effects do not favour one of them.
            results = {}
            for name in ["grpc", "local", "bare"][i % 3:] + ["grpc", "local", "bare"][: i % 3]:
                if name == "grpc":
                    results[name] = await through_grpc(coord, path.name, args.tokens, f"bench-{i}")
                elif name == "local":
                    results[name] = await asyncio.to_thread(through_node, server.url, {}, path.name, args.tokens)
                else:
                    results[name] = bare_mlx_lm(model, tok, prompt_ids, args.tokens)
            g_rate, g_n, gaps, n_chunks = results["grpc"]
            l_rate, l_n, _ = results["local"]
            b_rate, b_n = results["bare"]
            grpc_rates.append(g_rate)
            local_rates.append(l_rate)
            bare_rates.append(b_rate)
            gaps_all += gaps
            chunk_counts.append(n_chunks)
            print(f"round {i + 1}: grpc {g_rate:7.1f} tok/s ({g_n} tokens, {n_chunks} chunks)   "
                  f"local {l_rate:7.1f} tok/s ({l_n})   bare mlx_lm {b_rate:7.1f} tok/s ({b_n})")
    finally:
        server.stop()
        await coord.kill()
    g, l, b = (statistics.median(x) for x in (grpc_rates, local_rates, bare_rates))
    print(f"model: {path}")
    print(f"median decode tokens/s: grpc {g:.1f}, local HTTP {l:.1f}, bare mlx_lm {b:.1f}")
    print(f"chunk inter-arrival at the coordinator: p50 {percentile(gaps_all, 0.5):.2f} ms, "
          f"p99 {percentile(gaps_all, 0.99):.2f} ms")
    print(f"ratio grpc/local: {g / l:.3f}  (target >= 0.95)    grpc/bare: {g / b:.3f}    local/bare: {l / b:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    asyncio.run(main_async(ap.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
