"""The API reference (tools/api_reference.py, `make docs`): every public name has a docstring and appears in the
built reference. mkdocs fails on warnings (--strict) but not on a name without a docstring: that is checked here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import api_reference  # noqa: E402


def _public():
    return [(package, name, api_reference.object_path(package, name))
            for package in api_reference.PACKAGES for name in api_reference.public_names(package)]


def test_the_reference_covers_the_public_packages():
    covered = set(api_reference.PACKAGES)
    for package in ("forgelab", "forgelab.config", "forgelab.experiments", "forgelab.rewards", "forgelab.algos",
                    "forgelab.envs", "forgelab.lab"):
        assert package in covered, package
    names = {(p, n) for p, n, _ in _public()}
    assert ("forgelab", "Run") in names and ("forgelab.rewards", "trl_reward") in names and len(names) > 100


def test_every_public_name_has_a_docstring():
    import griffe

    pkg = griffe.load("forgelab", search_paths=[str(ROOT)], resolve_aliases=False)
    missing = []
    for package, name, path in _public():
        obj = pkg[path[len("forgelab."):]] if path != "forgelab" else pkg
        doc = obj.docstring
        if doc is None or not doc.value.strip():
            missing.append(f"{package}.{name} ({path})")
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


@pytest.mark.timeout(300)
def test_the_reference_builds_strict_and_lists_every_public_name(tmp_path):
    import re

    api_reference.build(tmp_path / "site")  # raises on any mkdocs warning (--strict)
    absent = []
    for package, name, path in _public():
        html = (tmp_path / "site" / package / "index.html").read_text()
        ids = set(re.findall(r'id="([^"]+)"', html))
        if path not in ids and f"{package}.{name}" not in ids:
            absent.append(f"{package}.{name} ({path})")
    assert not absent, "public names missing from the built reference:\n" + "\n".join(absent)
    rewards = (tmp_path / "site" / "forgelab.rewards" / "index.html").read_text()
    assert "does not apply" in rewards  # docstrings are rendered, not only headings
