"""Could the node read prompts on a second core while it decodes? (issue 28)

MLX's CPU backend runs each stream on one thread, so one process decoding on one stream uses one core. This
measures the bundled model's decode step (B rows) alone, then while another thread reads 128-token prompts
on a stream of its own, in chunks of each --chunks size, and prints both rates beside their rates alone: the
share of a core each side keeps, and their sum (1.0: no gain from the second core; 2.0: all of it).

    python tools/bench/bench_two_streams.py [--model DIR] [--rows 4] [--chunks 128 32]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider.models.default import ensure_default_model  # noqa: E402
from tools.bench.forwards import decode_ms, read_ms  # noqa: E402

PROMPT = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 32])
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    path = (a.model or ensure_default_model()).resolve()
    model, _ = load(str(path))
    mx.eval(model(mx.array([[1, 2, 3]]), cache=make_prompt_cache(model)))  # lazily made model state, evaluated here

    def decode() -> float:
        return decode_ms(model, a.rows, PROMPT, a.steps)

    def read(chunk: int) -> None:
        read_ms(model, 1, PROMPT, chunk)

    reads, stop, go = [0], threading.Event(), threading.Event()
    chunk_size = [a.chunks[0]]

    def reader() -> None:  # alive for the whole run: a thread leaving with its MLX stream can abort at exit
        with mx.stream(mx.new_stream(mx.cpu)):
            while True:
                go.wait()
                while not stop.is_set():
                    read(chunk_size[0])
                    reads[0] += 1
                go.clear()

    threading.Thread(target=reader, daemon=True).start()
    decode()
    alone_decode = min(decode() for _ in range(2))
    print(f"model {path.name}; decode {a.rows} rows alone: "
          f"{alone_decode:.1f} ms a step")
    for chunk in a.chunks:
        chunk_size[0] = chunk
        start = time.perf_counter()
        for _ in range(3):
            read(chunk)
        alone_read = (time.perf_counter() - start) / 3
        stop.clear()
        reads[0] = 0
        go.set()
        time.sleep(0.3)
        start, first = time.perf_counter(), reads[0]
        beside = decode()
        elapsed, done = time.perf_counter() - start, reads[0] - first
        stop.set()
        while go.is_set():
            time.sleep(0.01)
        decode_share = alone_decode / beside
        read_share = done * alone_read / elapsed
        print(f"reading {PROMPT}-token prompts in {chunk}-token chunks: alone {alone_read * 1e3:.0f} ms a prompt; "
              f"together decode {beside:.1f} ms a step ({decode_share:.2f} of its rate), "
              f"reading {read_share:.2f} of its rate; sum {decode_share + read_share:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
