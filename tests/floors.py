"""The dependency floors that pyproject.toml declares, as exact pins, to test the code on them.

    python -m tests.floors --except torch       # prints e.g. transformers==5.0.0 lightning==2.4.0 ...

README ("Check the declared floors") installs these pins beside the current environment and runs
the fast tests on them, so a floor the code does not actually work with is caught.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    raise SystemExit("python -m tests.floors needs Python >= 3.11 (tomllib); run the floors check on 3.11+") from None

ROOT = Path(__file__).resolve().parents[1]


def floors(extra: str | None = None) -> dict[str, str]:
    """Package -> declared minimum version, from [project] dependencies (and one optional extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    out = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?>=([0-9][0-9.]*)", dep.replace(" ", ""))
        if m is None:
            raise ValueError(f"pyproject dependency {dep!r} has no '>=' floor")
        out[m.group(1)] = m.group(3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--except", dest="skip", nargs="*", default=[], help="packages to leave at their installed version")
    args = ap.parse_args()
    print(" ".join(f"{name}=={version}" for name, version in floors().items() if name not in args.skip))


if __name__ == "__main__":
    main()
