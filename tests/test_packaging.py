"""The wheel a user installs holds every module of the package: a subpackage missing from
setup.py still imports in the editable checkout the suite runs on, and fails on a user's machine."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: setup.py's package_dir: where each part of the one ``qmc_sampler`` namespace lives in the tree.
FOLDERS = {"qmc_sampler": "qmc_sampler", "qmc_sampler.vllm_plugin": "vllm_plugin", "qmc_sampler.server": "server",
           "qmc_sampler.eval": "eval", "qmc_sampler.hf": "hf"}  # fmt: skip


def test_the_wheel_holds_every_module_of_the_package(tmp_path):
    # Built from a copy: setuptools packs what an earlier build left in the tree's build/ too.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "*.so", "runs", "gpu-check"))  # fmt: skip
    env = os.environ | {"QMC_SAMPLER_NO_EXT": "1"}  # the modules, not the kernels' build
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("qmc_sampler-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {
        f"{package.replace('.', '/')}/{path.relative_to(ROOT / folder).as_posix()}"
        for package, folder in FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert "qmc_sampler/members/registry.py" in modules and not modules - names, sorted(modules - names)
    assert not {n for n in names if n.split("/")[0] not in ("qmc_sampler",) and ".dist-info/" not in n}
