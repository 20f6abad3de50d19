"""Kill and restart the reference coordinator mid-stream N times and print what the node did.

    python tools/scripts/fault_report.py [--cycles 10]

Prints reconnects, jobs with exactly one outcome, duplicates, coordinator_lost,
gaps in completed streams, the largest reconnect delay, and the node's RSS per cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from provider import logs  # noqa: E402
from tools.fixtures import factory  # noqa: E402
from tools.harness.nodes import kill_restart_scenario  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=10)
    args = ap.parse_args()
    logs.configure("error", "json")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        factory.FIXTURES["gemma4-tiny"](root)
        report = asyncio.run(kill_restart_scenario(root / "gemma4-tiny", root / "state", cycles=args.cycles))
    print("\n".join(report.lines()))
    ok = (report.jobs_with_one_outcome == report.jobs and report.completed_streams_with_gaps_or_duplicates == 0
          and report.sessions == args.cycles + 1)
    print("verdict:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
