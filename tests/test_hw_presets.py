"""Hardware profiles for the sim clock: presets ship inside the package, a user's own live in
profiles/hw/ under the directory moetool runs in (or anywhere, given as a path)."""

import json

import pytest

from moetool.engine.clock import HW_DIR, USER_HW_DIR, load_hw, packaged_hw_names
from moetool.errors import MoetoolError


def test_presets_are_files_of_the_package_not_a_link():
    assert HW_DIR.is_dir() and not HW_DIR.is_symlink()
    assert {"rtx3090", "rtx4060ti", "a6000", "h100pcie", "h100sxm", "h100sxm-qwen15moe"} <= set(packaged_hw_names())
    assert load_hw("rtx3090")[0].name


def _mine(**edit) -> dict:
    return {**json.loads((HW_DIR / "rtx3090.json").read_text()), "name": "mybox", **edit}


def test_a_users_own_profile_is_found_by_name_in_profiles_hw(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MoetoolError, match="profiles/hw/mybox.json"):
        load_hw("mybox")
    (tmp_path / USER_HW_DIR).mkdir(parents=True)
    (tmp_path / USER_HW_DIR / "mybox.json").write_text(json.dumps(_mine(h2d_gbps=7.5)))
    assert load_hw("mybox")[0].h2d_gbps == 7.5
    assert load_hw(str(tmp_path / USER_HW_DIR / "mybox.json"))[0].h2d_gbps == 7.5  # a path from anywhere


def test_a_path_wins_and_a_preset_name_is_the_shipped_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / USER_HW_DIR).mkdir(parents=True)
    (tmp_path / USER_HW_DIR / "rtx3090.json").write_text(json.dumps(_mine(h2d_gbps=1.0)))
    assert load_hw("rtx3090")[0].h2d_gbps != 1.0  # runs that name a preset mean the shipped one
    assert load_hw("profiles/hw/rtx3090.json")[0].h2d_gbps == 1.0
