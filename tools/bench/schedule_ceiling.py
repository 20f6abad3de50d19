"""How far any prompt-reading schedule can get ahead of `mlx_lm.server` on this machine (issue 28).

Measures the model's own forwards here (mlx-lm's, as both servers run them): a decode forward over B rows
costs F + r*B, a forward reading prompts costs G + S*tokens. Then it replays guidellm's `concurrent` profile
(each of c streams sends its next request when its last one ends; P prompt tokens, O output tokens) in a
simulator over those costs, for:
- server: mlx-lm 0.32's BatchGenerator as mlx_lm.server drives it, each step one decode forward and one
  forward reading up to 8 waiting prompts whole;
- node: provider.engine.prefill_plan at the node's budget, and at larger budgets;
- fused: the node's plan if decode rows rode the prompt forward (no decode fixed cost in a step that
  reads): what one mixed forward, as vLLM runs it, would save. mlx-lm has no such forward.
It prints tokens/s and TTFT p50 as ratios to the server. A ratio the simulator cannot reach for any schedule
is a ceiling of scheduling on this machine, not a measurement of the node (bench_guidellm measures that).

    python tools/bench/schedule_ceiling.py [--model DIR | llama-100m] [--prompt-tokens 128 512] [--concurrency 4 8 16]
                                           [--budgets 128 256 512 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from mlx_lm import load

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.engine.prefill_plan import CPU_STEP_TOKENS, plan_prefill  # noqa: E402
from provider.models.default import ensure_default_model  # noqa: E402
from tools.bench.bench_guidellm import BUILT, built_model  # noqa: E402
from tools.bench.forwards import decode_ms, read_ms  # noqa: E402

SERVER_PROMPT_BATCH = 8  # mlx_lm.server's --prompt-concurrency default


@dataclass(frozen=True)
class Costs:  # milliseconds
    decode_fixed: float
    decode_row: float
    read_fixed: float
    read_token: float


def measure(model, prompt_tokens: int, rounds: int = 3) -> Costs:
    def read(batch: int) -> float:
        return read_ms(model, batch, prompt_tokens)

    def decode(batch: int, steps: int = 12) -> float:
        return decode_ms(model, batch, prompt_tokens, steps)

    read(1), decode(1, 2)  # warm
    r1, r4 = (min(read(b) for _ in range(rounds)) for b in (1, 4))
    d1, d16 = (min(decode(b) for _ in range(rounds)) for b in (1, 16))
    read_token = (r4 - r1) / (3 * prompt_tokens)
    decode_row = (d16 - d1) / 15
    return Costs(d1 - decode_row, decode_row, max(0.0, r1 - read_token * prompt_tokens), read_token)


def simulate(policy: str, costs: Costs, streams: int, prompt: int, output: int, budget: int,
             requests: int = 400) -> tuple[float, float]:
    """Closed loop of `streams` clients: (output tokens/s, TTFT p50 in ms)."""
    now, done = 0.0, 0
    queued = [[prompt, 0.0] for _ in range(streams)]  # [tokens left to read, arrival]
    reading: list[list] = []
    decoding: list[list] = []  # [tokens left to give, arrival, first token given]
    ttfts = []
    while done < requests:
        if policy == "server":
            join, chunk = min(SERVER_PROMPT_BATCH, len(queued)), prompt
        else:
            plan = plan_prefill([r[0] for r in reading], [q[0] for q in queued], len(decoding), budget)
            join, chunk = plan.join, plan.chunk
        reading += queued[:join]
        del queued[:join]
        read = [min(chunk, r[0]) for r in reading]
        cost = costs.read_fixed + costs.read_token * max(read) * len(read) if reading else 0.0  # padded
        if decoding:
            fixed = 0.0 if policy == "fused" and reading else costs.decode_fixed
            cost += fixed + costs.decode_row * len(decoding)
        now += cost
        for row in list(decoding):
            if not row[2]:
                ttfts.append(now - row[1])
                row[2] = True
            row[0] -= 1
            if row[0] == 0:
                decoding.remove(row)
                done += 1
                queued.append([prompt, now])
        for r, n in zip(list(reading), read):
            r[0] -= n
            if r[0] == 0:
                reading.remove(r)
                decoding.append([output, r[1], False])
    return requests * output / now * 1e3, statistics.median(ttfts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--budgets", type=int, nargs="+", default=[CPU_STEP_TOKENS, 256, 512, 1024])
    ap.add_argument("--rounds", type=int, default=3, help="each cost is the fastest of this many forwards")
    a = ap.parse_args()
    path = (built_model(a.model.name) if a.model and a.model.name in BUILT else a.model or ensure_default_model()
            ).resolve()
    model, _ = load(str(path))
    print(f"model {path.name}; {a.output_tokens} output tokens; ratios to the server: tok/s, TTFT p50")
    for prompt in a.prompt_tokens:
        costs = measure(model, prompt, a.rounds)
        print(f"\nprompt {prompt}: decode forward {costs.decode_fixed:.1f} + {costs.decode_row:.2f} a row ms; "
              f"reading forward {costs.read_fixed:.1f} + {costs.read_token:.2f} a token ms")
        print(f"{'c':>3} {'server tok/s':>12}  " + "  ".join(f"{f'node b={b}':>13}" for b in a.budgets)
              + f"  {'fused b=' + str(a.budgets[0]):>13}")
        for c in a.concurrency:
            server = simulate("server", costs, c, prompt, a.output_tokens, 0)
            cells = [simulate("node", costs, c, prompt, a.output_tokens, b) for b in a.budgets]
            cells.append(simulate("fused", costs, c, prompt, a.output_tokens, a.budgets[0]))
            print(f"{c:>3} {server[0]:>12.1f}  " + "  ".join(
                f"{f'{tps / server[0]:.3f},{ttft / server[1]:.2f}':>13}" for tps, ttft in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
