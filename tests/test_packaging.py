"""The wheel a user installs holds every module of the package: a subpackage missing from
setup.py still imports in the editable checkout the suite runs on, and fails on a user's machine."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import qmc_sampler

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_module_of_the_package(tmp_path, package_folders):
    # Built from a copy of what git has (tracked, or new and not ignored): setuptools packs what an
    # earlier build left in the tree's build/ too.
    source = tmp_path / "source"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # (a file deleted but not yet committed is listed too)
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = os.environ | {"QMC_SAMPLER_NO_EXT": "1"}  # the modules, not the kernels' build
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Our own name on the registries (its qmc-sampler is another project), at the package's version.
    (wheel,) = tmp_path.glob("qmc_llm_sampler-*.whl")
    assert wheel.name.startswith(f"qmc_llm_sampler-{qmc_sampler.__version__}-"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {
        f"{package.replace('.', '/')}/{path.relative_to(ROOT / folder).as_posix()}"
        for package, folder in package_folders.items()
        for path in (ROOT / folder).rglob("*.py")
    }
    assert "qmc_sampler/members/registry.py" in modules and not modules - names, sorted(modules - names)
    assert not {n for n in names if n.split("/")[0] not in ("qmc_sampler",) and ".dist-info/" not in n}
