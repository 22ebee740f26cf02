"""A flashinfer wheel cut down to what nsa_cp.RMSNorm JIT-builds, small enough to travel to the GPU machine.

    python scripts/slim_flashinfer_wheel.py WHEEL [OUT_DIR]     # OUT_DIR: .whl/flashinfer-slim (git-ignored)

The GPU machines take a working tree of at most 64 MiB per call; flashinfer 0.7.2's wheel alone is 62 MiB
and 0.7.4's 97 MiB, almost all of it CUDA sources of other kernels (``flashinfer/data/csrc``) that the
JIT compiles on demand. flashinfer.norm builds ``norm.cu`` and ``flashinfer_norm_binding.cu`` from
there, including headers of ``csrc`` and ``flashinfer/data/include``. This keeps every Python module
(``import flashinfer`` imports most of them; of ``flashinfer/experimental`` only those, not its kernel
files) and every data folder but ``csrc``, and of ``csrc`` the two norm sources and its top-level
headers; everything else of ``csrc`` is dropped. The wheel keeps its name
and version, with a RECORD of what it holds, so ``pip install --no-deps`` takes it as the release.
A kernel other than the norm's will not JIT-build from it: it is for testing nsa_cp's norm only.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

CSRC = "flashinfer/data/csrc/"
NORM_SOURCES = {"norm.cu", "flashinfer_norm_binding.cu"}
# 0.7's experimental kernels and their build files (13 MiB of 0.7.4's wheel); only its modules are imported
EXPERIMENTAL = "flashinfer/experimental/"


def keep(name: str) -> bool:
    """Whether a file of the wheel (by its path inside the zip) stays in the slim wheel."""
    if name.startswith(EXPERIMENTAL):
        return name.endswith(".py")  # its modules are imported (flashinfer.gemm reads one); its kernels not
    if not name.startswith(CSRC):
        return True
    rest = name[len(CSRC):]
    return "/" not in rest and (rest in NORM_SOURCES or rest.endswith((".h", ".cuh")))


def slim(wheel: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for info in src.infolist():
            if info.filename == record or not keep(info.filename):
                continue
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
        lines.append(f"{record},,")
        dst.writestr(record, "\n".join(lines) + "\n")
    return out


def main(argv) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    out = slim(wheel, Path(argv[1]) if len(argv) > 1 else Path(".whl/flashinfer-slim"))
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (from {wheel.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
