"""pyproject.toml's metadata in the form current setuptools builds without a deprecation warning:
the license as an SPDX expression string, its text named by ``license-files``, no License
classifiers, and a setuptools that understands both."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# setuptools 77.0 is the first to take `project.license` as an SPDX string and `license-files`;
# older ones reject the string form, newer ones warn about the table form.
SETUPTOOLS_FOR_SPDX = (77, 0)


def test_the_license_is_an_spdx_expression_string():
    license_ = PYPROJECT["project"]["license"]
    assert isinstance(license_, str), f"project.license must be an SPDX string, not {license_!r}"
    assert re.fullmatch(r"[A-Za-z0-9.+-]+( (AND|OR|WITH) [A-Za-z0-9.+-]+)*", license_), license_


def test_no_license_classifiers():
    classifiers = PYPROJECT["project"].get("classifiers", [])
    assert [c for c in classifiers if c.startswith("License ::")] == []


def test_license_files_exist():
    patterns = PYPROJECT["project"]["license-files"]
    assert patterns, "license-files names the license text"
    for pattern in patterns:
        assert sorted(ROOT.glob(pattern)), f"license-files pattern {pattern!r} matches no file"


def test_the_build_asks_for_a_setuptools_that_reads_spdx_licenses():
    requires = PYPROJECT["build-system"]["requires"]
    pins = [re.fullmatch(r"setuptools\s*>=\s*(\d+)(?:\.(\d+))?.*", r) for r in requires]
    found = [(int(m.group(1)), int(m.group(2) or 0)) for m in pins if m]
    assert found and found[0] >= SETUPTOOLS_FOR_SPDX, requires
