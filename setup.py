"""qmc-sampler: correlated, exact parallel sampling for LLMs.

Everything installs under one import namespace, ``qmc_sampler``: the top-level
folders ``vllm_engine/``, ``vllm_plugin/``, ``server/``, ``eval/`` and ``hf/`` become
``qmc_sampler.vllm_engine``, ``qmc_sampler.vllm_plugin``, ``qmc_sampler.server``, ``qmc_sampler.eval``
and ``qmc_sampler.hf`` through ``package_dir``.

The fused CPU kernel (``csrc/cpu_sampling.cpp``) is built as the torch extension
``qmc_sampler._C`` when torch is importable at build time (``pip install
--no-build-isolation``, as the Makefile does). No torch, no compiler or a failed
build only prints a warning: the package then uses its pure-torch path.
"""

import os
import platform
import warnings

from setuptools import find_packages, setup

#: The file beside the built kernel naming the torch it was built against (qmc_sampler.kernels reads it).
TORCH_RECORD = "_C.built_with_torch"

SUBPACKAGES = {
    "vllm_engine": "vllm_engine", "vllm_plugin": "vllm_plugin", "server": "server", "eval": "eval", "hf": "hf"
}


def _extensions() -> tuple[list, dict]:
    if os.environ.get("QMC_SAMPLER_NO_EXT"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        warnings.warn(
            "qmc-sampler: torch is not importable at build time, so the fused CPU kernel is not built "
            "(pure-torch path); install with --no-build-isolation to build it",
            stacklevel=1,
        )
        return [], {}
    # No FP traps or errno are relied on; without these GCC keeps the exp loop scalar.
    # -fopenmp: ATen's parallel_for is an OpenMP loop only where the including code is built with
    # OpenMP (otherwise rows run one after another); it links libgomp.so.1, which torch has loaded.
    import torch

    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"]
    # The loader (qmc_sampler.kernels) uses the kernel only under the torch it was built against.
    flags.append(f'-DQMC_BUILT_WITH_TORCH="{torch.__version__}"')
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-mavx2", "-mfma"]  # the loader checks the CPU has AVX2 before importing it

    class SafeBuildExtension(BuildExtension):
        """Build the kernel if possible; otherwise warn once and install without it."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # a missing or failing compiler must not break the install
                warnings.warn(f"qmc-sampler: building {ext.name} failed ({e}); using the pure-torch path", stacklevel=1)
                return
            # The record the loader reads before it loads the .so (qmc_sampler.kernels): loading a library
            # built against another torch's C++ ABI can already fail or crash, before any check inside it.
            record = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), TORCH_RECORD)
            with open(record, "w") as f:
                f.write(torch.__version__ + "\n")

        def copy_extensions_to_source(self):
            # An editable or in-place build copies each .so into the source tree; its record goes with it.
            super().copy_extensions_to_source()
            for built, placed in self.get_output_mapping().items():
                record = os.path.join(os.path.dirname(built), TORCH_RECORD)
                if os.path.isfile(record):
                    self.copy_file(record, os.path.join(os.path.dirname(placed), TORCH_RECORD))

    ext = CppExtension(
        "qmc_sampler._C", ["csrc/cpu_sampling.cpp"], extra_compile_args=flags, extra_link_args=["-fopenmp"]
    )
    return [ext], {"build_ext": SafeBuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    # The core's own subpackages (qmc_sampler.members, …) are found; the doors are mapped above.
    packages=[
        "qmc_sampler",
        *(f"qmc_sampler.{name}" for name in find_packages("qmc_sampler")),
        *(f"qmc_sampler.{name}" for name in SUBPACKAGES),
        # A door's own rooms (qmc_sampler.eval.stats, …), found in its folder.
        *(f"qmc_sampler.{name}.{sub}" for name, folder in SUBPACKAGES.items() for sub in find_packages(folder)),
    ],
    package_dir={"qmc_sampler": "qmc_sampler", **{f"qmc_sampler.{k}": v for k, v in SUBPACKAGES.items()}},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
