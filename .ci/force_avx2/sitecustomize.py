"""Make an AVX-512 machine run the test suite the way an AVX2-only x86 CPU would.

Used by ``QMC_FORCE_AVX2=1 .ci/run`` (which puts this folder on PYTHONPATH, so every
process the suite starts — pytest, vLLM servers, engine cores — loads it). It changes
what the software stack *chooses*, not what the hardware can do:

- PyTorch's ATen kernels: ``ATEN_CPU_CAPABILITY=avx2``; oneDNN: ``ONEDNN_MAX_CPU_ISA=AVX2``
  (both set by ``.ci/run``);
- vLLM: ``torch.cpu._is_avx512_supported`` / ``_is_avx512_bf16_supported`` /
  ``_is_amx_tile_supported`` answer False, so vLLM loads ``vllm._C_AVX2``, picks its
  AVX2 attention path and fp32 where it would use bf16 instructions;
- qmc-sampler: the flags read from ``/proc/cpuinfo`` lose every ``avx512*`` and ``amx*`` flag, so the CPU
  defaults (dtype) are those of an AVX2-only machine.

The patches are applied when those modules are first imported (nothing is imported here).
"""

import importlib.abc
import sys


def _patch_torch_cpu(module) -> None:
    names = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")
    for name in names:
        if hasattr(module, name):
            setattr(module, name, lambda: False)


def _patch_cpu_defaults(module) -> None:
    original = module.cpu_flags

    def cpu_flags(cpuinfo=None):
        flags = original(cpuinfo)
        if cpuinfo is not None:  # text a caller passed (the tests' own cpuinfo samples): as it is
            return flags
        return {f for f in flags if not f.startswith(("avx512", "amx"))}

    module.cpu_flags = cpu_flags


_PATCHES = {"torch.cpu": _patch_torch_cpu, "qmc_sampler.cpu_defaults": _patch_cpu_defaults}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of each module in _PATCHES."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched_exec(module, _exec=exec_module, _patch=_PATCHES[name]):
                    _exec(module)
                    _patch(module)

                spec.loader.exec_module = patched_exec
                return spec
        return None


sys.meta_path.insert(0, _PatchAfterImport())
