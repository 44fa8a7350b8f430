"""Make `import dac` work next to the CPU torch wheel.

descript-audio-codec imports audiotools, which imports torchaudio. PyPI only has CUDA builds of torchaudio,
whose C++ extension cannot load next to torch's CPU wheel (OSError: libc10_cuda.so). torchaudio skips its
extension when `torchaudio/lib/*.so` is absent, and Encore uses no torchaudio op, so the files are moved
into `torchaudio/lib/disabled/`. Idempotent; does nothing when the extension loads fine (a CUDA torch).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path


def extension_loads() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torchaudio"], capture_output=True, text=True, check=False)
    return probe.returncode == 0


def main() -> int:
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or spec.origin is None:
        print("torchaudio not installed: nothing to do")
        return 0
    if extension_loads():
        return 0
    lib = Path(spec.origin).parent / "lib"
    disabled = lib / "disabled"
    disabled.mkdir(exist_ok=True)
    for shared_object in lib.glob("*.so"):
        shared_object.rename(disabled / shared_object.name)
    if not extension_loads():
        print("torchaudio still fails to import after disabling its extension", file=sys.stderr)
        return 1
    print(f"disabled torchaudio's C++ extension (moved to {disabled})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
