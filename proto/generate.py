"""Regenerate proto/pdserve_pb2*.py from proto/pdserve.proto (`make proto`).

The modules are generated as `pdserve/proto/...` so that they import each other as
`pdserve.proto.*`, then copied next to the .proto file. protoc runs in a child process: its
compiler and NIXL's libraries (protobuf and abseil of other versions) crash a process that loads
both, as a test run that used the nixl backend would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
OUTPUTS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    """Run protoc into a scratch directory; return {file name: text}."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-Ipdserve/proto={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            str(PROTO_DIR / "pdserve.proto"),
        ]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed on proto/pdserve.proto: {done.stderr.strip()}")
        gen = Path(tmp) / "pdserve" / "proto"
        texts = {name: (gen / name).read_text() for name in OUTPUTS}
    for name, text in texts.items():
        (out_dir / name).write_text(text)
    return texts


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        for name in OUTPUTS:
            shutil.copyfile(Path(tmp) / name, PROTO_DIR / name)
    print("regenerated", ", ".join(OUTPUTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
