"""The requirements of a vLLM wheel's Python layer, for a machine without a GPU.

``python .ci/vllm_python_layer.py WHEEL`` prints, one per line, the wheel's own requirements (its
METADATA's ``Requires-Dist``, markers evaluated for this Python) less the packages that only serve
its CUDA kernels or media inputs (:data:`GPU_ONLY`). ``make compat-check`` installs the wheel with
``--no-deps`` and then these, so that vLLM's loader, front-end validator and Model Runner V2's
sampler import and run on CPU tensors (docs/serving.md, "vLLM versions"). The torch pin is kept:
the wheel's Python layer runs on the torch it was built against.
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement

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
        out.append(str(req))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python .ci/vllm_python_layer.py VLLM_WHEEL", file=sys.stderr)
        sys.exit(2)
    print("\n".join(requirements(sys.argv[1])))
