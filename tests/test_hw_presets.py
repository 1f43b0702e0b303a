"""Hardware profiles for the sim clock: presets ship inside the package, a user's own live in
profiles/hw/ under the directory moetool runs in (or anywhere, given as a path)."""

import json

import pytest

from moetool.engine.clock import HW_DIR, USER_HW_DIR, load_hw, packaged_hw_names, preset_for_device
from moetool.errors import MoetoolError


def test_presets_are_files_of_the_package_not_a_link():
    assert HW_DIR.is_dir() and not HW_DIR.is_symlink()
    assert {"rtx3090", "rtx4060ti", "a6000", "h100pcie", "h100sxm", "h200", "h100sxm-qwen15moe"} <= set(packaged_hw_names())
    assert load_hw("rtx3090")[0].name


@pytest.mark.parametrize("device,preset", [
    ("NVIDIA H100 80GB HBM3", "h100sxm"), ("NVIDIA H100 PCIe", "h100pcie"), ("NVIDIA GeForce RTX 3090", "rtx3090"),
    ("NVIDIA GeForce RTX 4060 Ti", "rtx4060ti"), ("NVIDIA RTX A6000", "a6000"), ("NVIDIA H200", "h200"),
    ("NVIDIA GeForce RTX 3090 Ti", "rtx3090"), ("Tesla T4", None)])
def test_a_cuda_device_is_matched_to_the_preset_made_for_it_by_its_name(device, preset):
    """What `profile --what timing` keeps the throughputs of on that device (no --hw-base): the H100's
    SXM part (its CUDA name says HBM3) is not its PCIe part, whose memory is 40% slower; a device no
    preset is made for matches none (profile then says it keeps rtx3090's)."""
    assert preset_for_device(device) == preset


def test_only_the_device_presets_name_devices_and_a_measured_profile_does_not_inherit_them():
    """A profile measured on an H100 SXM for one model keeps h100sxm's throughputs but not its
    device names: the calibrated file is one model's, not the preset a device should match."""
    from moetool.profile.timing import ExpertTiming, TimingProfile, hw_profile

    named = {n for n in packaged_hw_names() if json.loads((HW_DIR / f"{n}.json").read_text()).get("devices")}
    assert named == {"rtx3090", "rtx4060ti", "a6000", "h100pcie", "h100sxm", "h200"}
    t = TimingProfile(device="cuda:0", dtype="bfloat16", steps=4, layers=(), c_cpu_s=1e-3, h2d_gbps=52.0,
                      t_dense_s=1e-4, experts=(ExpertTiming(bits=4, nbytes=1 << 20, load_s=2e-5, dequant_s=0.0,
                                                            compute_s=8e-6, path="triton"),))
    measured = hw_profile(t, "h100sxm", "mine", model={"model_type": "qwen2_moe"})
    assert "devices" not in measured and measured["gpu_mem_gbps"] == load_hw("h100sxm")[0].gpu_mem_gbps
    assert measured["t_expert_s"] == {"4": 8e-6} and measured["h2d_gbps"] == 52.0


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


def test_a_path_wins_and_a_preset_name_shared_with_ones_own_profile_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / USER_HW_DIR).mkdir(parents=True)
    (tmp_path / USER_HW_DIR / "rtx3090.json").write_bytes((HW_DIR / "rtx3090.json").read_bytes())
    assert load_hw("rtx3090")[0] == load_hw(str(HW_DIR / "rtx3090.json"))[0]  # a copy of the preset is the preset
    (tmp_path / USER_HW_DIR / "rtx3090.json").write_text(json.dumps(_mine(h2d_gbps=1.0)))
    # a profile of one's own named after the preset's machine had lost to the preset unsaid
    with pytest.raises(MoetoolError, match=r"--hw rtx3090 names both the shipped preset and your "
                                           r"profiles/hw/rtx3090.json, which differ; give the file's path"):
        load_hw("rtx3090")
    assert load_hw("profiles/hw/rtx3090.json")[0].h2d_gbps == 1.0
    (tmp_path / USER_HW_DIR / "rtx3090.json").unlink()
    (tmp_path / "rtx3090").write_text(json.dumps(_mine(h2d_gbps=2.0)))  # a file of the working directory so named
    assert load_hw("rtx3090")[0].h2d_gbps != 2.0  # it replaced the default preset unsaid
    assert load_hw("./rtx3090")[0].h2d_gbps == 2.0  # a path, given as one


def test_a_field_a_hardware_profile_does_not_have_is_refused_with_the_one_meant(tmp_path):
    """`t_expert` for t_expert_s was dropped: the run was charged the estimates and recorded the file as its machine."""
    (tmp_path / "typo.json").write_text(json.dumps({**_mine(), "t_expert": {"16": 1e-3}}))
    with pytest.raises(MoetoolError, match=r"typo.json names 't_expert', which is no field of a hardware profile "
                                           r"\(did you mean t_expert_s\?\)"):
        load_hw(str(tmp_path / "typo.json"))
    for name in packaged_hw_names():  # every shipped preset reads
        load_hw(name)


def test_times_measured_on_another_model_are_not_charged_to_this_one(tiny_ckpt, tmp_path):
    """Qwen1.5-MoE's measured layer and expert times were charged to any model run on h100sxm-qwen15moe (111x a
    tiny model's TPOT), unsaid; a profile measured on this model's geometry is charged as measured."""
    from moetool.engine import cost_model, measured_on
    from moetool.engine.store import HostStore
    from moetool.model import load_model

    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, next(lm.model.parameters()).dtype)
    cost, raw = cost_model(lm, store, "h100sxm-qwen15moe")
    assert cost.hw.t_expert_s is None and cost.hw.t_dense_s is None and "measured on another model" in \
        raw["measured_elsewhere"]
    mine = json.loads((HW_DIR / "h100sxm-qwen15moe.json").read_text())
    assert load_hw("h100sxm-qwen15moe")[0].t_expert_s  # the preset itself keeps them, for its own model
    path = tmp_path / "mine.hw.json"
    path.write_text(json.dumps({**mine, "model": measured_on(lm)}))
    cost, raw = cost_model(lm, store, str(path))
    assert cost.hw.t_expert_s == load_hw("h100sxm-qwen15moe")[0].t_expert_s and "measured_elsewhere" not in raw
    # written by `profile --what timing` (it sets `base`) before profiles recorded their model: not known whose
    old = {k: v for k, v in mine.items() if k != "model"}
    path.write_text(json.dumps(old))
    cost, raw = cost_model(lm, store, str(path))
    assert cost.hw.t_expert_s is None and "record no model they were measured on" in raw["measured_elsewhere"]
    path.write_text(json.dumps({k: v for k, v in old.items() if k != "base"}))  # times a researcher wrote by hand
    cost, raw = cost_model(lm, store, str(path))
    assert cost.hw.t_expert_s == load_hw("h100sxm-qwen15moe")[0].t_expert_s and "measured_elsewhere" not in raw


def test_a_measured_time_a_thousand_times_off_the_throughputs_is_said(tiny_ckpt, tmp_path):
    """A hand-written profile in microseconds (the unit `profile` prints): 43.6 s a token, unsaid."""
    from moetool.engine import cost_model
    from moetool.engine.store import HostStore
    from moetool.model import load_model

    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, next(lm.model.parameters()).dtype)
    path = tmp_path / "us.hw.json"
    path.write_text(json.dumps(_mine(t_expert_s={"16": 10.9})))
    _, raw = cost_model(lm, store, str(path))
    assert raw["measured_implausible"].startswith("hardware profile mybox's t_expert_s[16] = 10.9 s is ") and \
        raw["measured_implausible"].endswith("its times are in seconds, not micro- or milliseconds?")
    path.write_text(json.dumps(_mine(t_expert_s={"16": 1.09e-5})))
    assert "measured_implausible" not in cost_model(lm, store, str(path))[1]


def test_the_sim_clock_charges_attention_over_the_kv_cache_as_it_grows(tiny_ckpt):
    """A decode step's time was flat in the context: 8 and 2,000 cached positions were charged alike (on
    Qwen1.5-MoE at 4k positions the K/V reads are a third of the dense part on an RTX 3090). Each softmax
    layer now reads its cache (a sliding one, its window), linear-attention and Mamba layers none."""
    import torch

    from moetool.engine.budget import attention_layers
    from moetool.engine.clock import CostModel
    from moetool.run import RunConfig, run
    from tiny import tiny_config

    hw, _ = load_hw("rtx3090")
    kv, window = 2 * 4 * 128 * 2.0, 64  # 4 KV heads of 128, bf16
    cost = CostModel(hw=hw, expert_bytes={16: 1}, expert_flops_per_token=1.0, reference_bytes=1, dense_bytes_per_layer=0.0,
                     dense_flops_per_token_per_layer=0.0, attention=((kv, 4.0 * 1024, None), (kv, 4.0 * 1024, window)),
                     moe_layers=2)
    step = lambda past: cost.t_attention(1, past)  # noqa: E731
    assert step(4095) == pytest.approx(kv * (4096 + window) / (hw.gpu_mem_gbps * 1e9) / 2)
    assert step(4095) > step(1023) > step(0) > 0 and cost.t_dense(1, past=4095) - cost.t_dense(1) == pytest.approx(
        step(4095) - step(0))
    assert cost.t_attention(8, 0, sequences=2) == pytest.approx(  # two sequences of 4: each reads its own 4
        2 * kv * 4 * 2 / (hw.gpu_mem_gbps * 1e9) / 2)
    one = attention_layers(tiny_config("qwen2_moe"), torch.bfloat16)  # two full-attention layers, summed
    assert len(one) == 1 and one[0][2] is None
    for hybrid in ("qwen3_next", "jamba"):  # a linear-attention or Mamba layer reads no cache: half of one's
        assert [(kv * 2, flops * 2, w) for kv, flops, w in attention_layers(tiny_config(hybrid), torch.bfloat16)] == \
            list(one)
    assert {w for _, _, w in attention_layers(tiny_config("gpt_oss"), torch.bfloat16)} == {16, None}  # sliding apart

    path = str(tiny_ckpt("qwen2_moe"))
    short, long_ = (run(RunConfig(model=path, policy="resident", budget="100%", clock="sim", prompts=(p,),
                                  max_new_tokens=4)).tpot_s["mean"] for p in ("ab", "ab " * 30))
    assert long_ > short  # the same weights read a step, and a longer cache
