"""Regenerate coordinator_client/pb/ from proto/ with grpcio-tools.

    python tools/scripts/gen_proto.py            # write the generated modules
    python tools/scripts/gen_proto.py --check    # exit 1 if the checked-in modules drifted from the proto
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto" / "provider" / "v1"
OUT = ROOT / "coordinator_client" / "pb"
FILES = ("provider_pb2.py", "provider_pb2.pyi", "provider_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            str(PROTO_DIR / "provider.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # protoc writes `import provider_pb2`, a top-level import; make it package-relative.
    grpc_file = out / "provider_pb2_grpc.py"
    grpc_file.write_text(re.sub(r"^import provider_pb2", "from . import provider_pb2", grpc_file.read_text(),
                                flags=re.M))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if not args.check:
        generate(OUT)
        print(f"wrote {', '.join(FILES)} to {OUT}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drifted = [f for f in FILES if not filecmp.cmp(Path(tmp) / f, OUT / f, shallow=False)]
    if drifted:
        print(f"generated code drifted from proto/: {', '.join(drifted)}; run python tools/scripts/gen_proto.py")
        return 1
    print("generated code matches proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
