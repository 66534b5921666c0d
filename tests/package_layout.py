"""setup.py's layout of the one ``qmc_sampler`` namespace, read off its ``SUBPACKAGES`` without
running setup.py: each part of the package → the repository folder it is built from.

The one reader of that layout for the tests that copy, pack or read the package by it
(``tests/conftest.py``'s ``package_folders``) and for ``make gpu-check``, which links the checkout
as the package: ``python tests/package_layout.py`` prints each subpackage as ``name=folder``, one a line.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_folders(root: Path = ROOT) -> dict[str, str]:
    """Each part of the namespace → its folder: ``qmc_sampler`` → ``qmc_sampler``, ``qmc_sampler.hf``
    → ``hf``, … (setup.py's ``SUBPACKAGES``, a literal dict)."""
    tree = ast.parse((root / "setup.py").read_text())
    found = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["SUBPACKAGES"]]  # fmt: skip
    if len(found) != 1 or not isinstance(found[0], dict):
        raise ValueError(f"{root / 'setup.py'} has no one SUBPACKAGES = {{name: folder}} at its top level")
    (subpackages,) = found
    return {"qmc_sampler": "qmc_sampler", **{f"qmc_sampler.{name}": folder for name, folder in subpackages.items()}}


if __name__ == "__main__":
    for package, folder in package_folders().items():
        if package != "qmc_sampler":
            print(f"{package.removeprefix('qmc_sampler.')}={folder}")
