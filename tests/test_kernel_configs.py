"""The fused experts kernels' configs tuned per device (`moetool.kernels.config.tuned_config`): which
entry a launch takes, and a file that cannot be used refused in one sentence naming it. No GPU: the
device's name is given (`tuned_for`), or stands in for torch.cuda's."""

import json

import pytest
import torch

from moetool.kernels import config as kconfig
from moetool.kernels import experts as kexperts
from moetool.quant.format import make_layout

H200 = "NVIDIA H200"
TUNED = {"2048x1408": {"4": [8, 256, 16, 128, 1024, 2, 1], "4,2": [16, 128, 16, 128, 1024, 4, 1],
                       "2": [8, 512, 8, 256, 1024, 4, 0], "16": [16, 256, 16, 256, 1024, 4, 0]}}


@pytest.fixture
def package_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(kconfig.CONFIGS_ENV, raising=False)
    monkeypatch.setattr(kconfig, "CONFIG_DIR", tmp_path)
    (tmp_path / "nvidia-h200.json").write_text(json.dumps({"device": H200, "configs": TUNED}))
    _clear()
    yield tmp_path
    _clear()


def _clear():
    kconfig.load_tuned.cache_clear()
    kconfig._tuned.cache_clear()


def test_a_launch_takes_its_precisions_entry_else_its_lowest_precisions(package_dir):
    assert kconfig.device_slug(H200) == "nvidia-h200"
    assert kconfig.tuned_for(H200, 2048, 1408, (4,)) == tuple(TUNED["2048x1408"]["4"])
    assert kconfig.tuned_for(H200, 2048, 1408, (2, 4, 4)) == tuple(TUNED["2048x1408"]["4,2"])  # order, repeats
    assert kconfig.tuned_for(H200, 2048, 1408, (8, 2)) == tuple(TUNED["2048x1408"]["2"])  # no "8,2": INT2's
    assert kconfig.tuned_for(H200, 2048, 1408, (8,)) is None  # nothing tuned: the caller's default
    assert kconfig.tuned_for(H200, 2048, 768, (4,)) is None  # another shape
    assert kconfig.tuned_for("NVIDIA H100 80GB HBM3", 2048, 1408, (4,)) is None  # no file for that device
    mode0 = {"device": H200, "configs": {"64x32": {"4": [16, 256, 16, 256, 1024, 4]}}}  # six fields: mode 0
    (package_dir / "nvidia-h200.json").write_text(json.dumps(mode0))
    _clear()
    assert kconfig.tuned_for(H200, 64, 32, (4,)) == (16, 256, 16, 256, 1024, 4, 0)


def test_a_launch_on_cuda_resolves_its_config_from_its_layouts(package_dir, monkeypatch):
    """`_config` with no explicit config (what the engine passes): the shape and precisions come from
    the launch's layouts; explicit configs win; off CUDA nothing is looked up."""
    monkeypatch.setattr(kconfig, "_cuda_name", lambda index: H200)
    layouts = []
    for bits in (4, 2):
        layouts += kexperts.layout_ints(make_layout(bits, (2 * 1408, 2048), (2048, 1408), has_bias=False, group_size=64))
    cuda = torch.device("cuda", 0)
    assert kexperts._config([], cuda, layouts, 2048) == tuple(TUNED["2048x1408"]["4,2"])
    assert kexperts._config([], cuda, layouts[:kexperts.LAYOUT_INTS], 2048) == tuple(TUNED["2048x1408"]["4"])
    assert kexperts._config([32, 64, 32, 64, 256, 8], cuda, layouts, 2048) == (32, 64, 32, 64, 256, 8, 0)
    assert kexperts._config([], torch.device("cpu"), layouts, 2048) == kconfig.default_config(torch.device("cpu"))


def test_a_file_named_by_the_environment_must_be_this_devices(tmp_path, package_dir, monkeypatch):
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"device": "NVIDIA RTX 4090", "configs": {"2048x1408": {"4": [8, 128, 8, 128, 512, 4, 1]}}}))
    monkeypatch.setenv(kconfig.CONFIGS_ENV, str(mine))
    assert kconfig.tuned_for("NVIDIA RTX 4090", 2048, 1408, (4,)) == (8, 128, 8, 128, 512, 4, 1)
    with pytest.raises(ValueError, match="tuned on NVIDIA RTX 4090, not this NVIDIA H200"):
        kconfig.tuned_for(H200, 2048, 1408, (4,))
    monkeypatch.setenv(kconfig.CONFIGS_ENV, str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="absent.json, which is not a file"):
        kconfig.tuned_for(H200, 2048, 1408, (4,))
    monkeypatch.setattr(kconfig, "_cuda_name", lambda index: H200)  # what an engine on CUDA asks at build
    with pytest.raises(ValueError, match="absent.json, which is not a file"):
        kconfig.check_tuned(torch.device("cuda", 0))
    kconfig.check_tuned(torch.device("cpu"))  # nothing is read off CUDA


@pytest.mark.parametrize("text,match", [
    ("{not json", "cannot read"),
    (json.dumps({"configs": {}}), "'device' and 'configs'"),
    (json.dumps({"device": H200, "configs": {"2048": {"4": [16, 256, 16, 256, 1024, 4]}}}), "HIDDENxWIDTH"),
    (json.dumps({"device": H200, "configs": {"2048x1408": {"int4": [16, 256, 16, 256, 1024, 4]}}}), "precisions"),
    (json.dumps({"device": H200, "configs": {"2048x1408": {"4": [16, 250, 16, 256, 1024, 4]}}}), "powers of two"),
    (json.dumps({"device": H200, "configs": {"2048x1408": {"4": [16, 256, 16, 256, 1024, 4, 5]}}}), "MODE"),
])
def test_a_configs_file_that_cannot_be_used_is_refused_naming_it(package_dir, text, match):
    (package_dir / "nvidia-h200.json").write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        kconfig.tuned_for(H200, 2048, 1408, (4,))
    assert "nvidia-h200.json" in str(info.value)

