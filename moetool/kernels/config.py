"""The fused experts kernels' launch configs: the loop modes, the default tiles, a config checked,
and the configs tuned per device (`scripts/bench_kernels.py --tune` writes them, `tuned_config`
reads them).

A config is (rows a gate_up program computes, its K tile, rows a down program computes, its K
tile, columns a combine program sums, warps, loop mode). `moetool.kernels.experts` takes the
caller's, else the device's tuned one for the launch's shape and precisions, else the default.

    tuned_config(torch.device("cuda"), 2048, 1408, (4, 2))   # or None: nothing tuned for it
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch

# The kernels' loop modes (`default_config`'s last field). 0: each program reads a K tile, waits
# for it, and adds its products into an [rows, K tile] fp32 tile reduced after the loop (measured
# on an H200, docs/benchmarks.md: every precision took the same ~6 us an expert). 1: the next tile's codes are
# loaded before this tile's math, so two tiles' reads are in flight a program, and each tile is
# reduced as it is done. 2: three tiles' codes in flight while one tile's math runs (codes wait as
# stored, a byte a byte, so the reads in flight grow without the fp32 tile growing). Registers and
# machine code per mode: `bench_kernels.py --compile-only 90`. Modes 1 and 2 are the candidates for
# low-bit experts at their bytes' speed; neither has run on a GPU yet (`bench_kernels.py --tune`
# picks among all of them on the device). 3: packed codes read as 32-bit words and turned into
# floats in place: 3.1-4.3 loop instructions a weight at INT4/INT2 where the others take 7.4-10
# (sm_90, `triton_words._gemv_words`, docs/benchmarks.md); 16-bit projections, interleaved
# gate_up rows and layouts off 4-byte boundaries take mode 1's loop within the same launch. Not
# timed on a GPU yet, so not the default.
MODES = (0, 1, 2, 3)


def default_config(device: torch.device) -> tuple[int, int, int, int, int, int, int]:
    """(rows a gate_up program computes, its K tile, rows a down program computes, its K tile,
    columns a combine program sums, warps, accumulation mode `MODES`). On CUDA: GEMV tiles of 16 rows
    and 256 columns, so one (token, slot) pair of a 1408-wide expert is ~88 gate_up and ~128 down
    programs (a few per SM with top-4 at batch 1). Under the interpreter each program costs Python
    time: few, large ones."""
    if device.type == "cuda":
        return 16, 256, 16, 256, 1024, 4, 0
    return 128, 256, 128, 256, 1024, 4, 0


# Mode 3's own starting tiles on CUDA: its loop tile is [K tile / 64 chunks, rows, 4 words], and
# 32 rows under 2 warps give each thread two rows of one chunk (one x load serves 4 INT4 weights);
# the default tiles' 16 rows under 4 warps leave threads with no rows of their own. Not the default
# until a GPU has timed it (`bench_kernels.py` times each mode at its tiles; `--tune` starts here too).
WORDS_TILES = (32, 256, 32, 256, 1024, 2)


def mode_tiles(mode: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
    """The six tiles a mode starts from on `device` (`default_config`'s, or mode 3's on CUDA)."""
    return WORDS_TILES if mode == 3 and device.type == "cuda" else default_config(device)[:6]


def checked_config(config: Sequence[int], where: str = "a kernel config") -> tuple[int, ...]:
    """A config as seven ints (a six-field one gets mode 0), or ValueError naming what is wrong."""
    ok = len(config) in (6, 7) and all(isinstance(v, int) and not isinstance(v, bool) for v in config)
    ok = ok and all(v > 0 for v in config[:6]) and (len(config) == 6 or config[6] in MODES)
    if not (ok and all(v & (v - 1) == 0 for v in config[:6])):
        raise ValueError(f"{where} is R1,BK1,R2,BK2,B3,WARPS[,MODE in {MODES}] with powers of two for "
                         f"the tiles and warps, not {list(config)}")
    return (*config, 0) if len(config) == 6 else tuple(config)


# ---- tuned configs, per device --------------------------------------------------------------------
# What `scripts/bench_kernels.py --tune` measured fastest on one device (every candidate checked
# against the dequantize reference first), as vLLM ships fused_moe configs per device name: one JSON
# file per device in `configs/` (package data), or the file MOETOOL_KERNEL_CONFIGS names (a device
# this package has no file for). Keys: the experts' shape "HIDDENxWIDTH", then the precisions of one
# launch, highest first ("4,2"); a launch whose precisions have no entry takes its lowest
# precision's (the latency-bound case the tuning is for), else `default_config`.
CONFIGS_ENV = "MOETOOL_KERNEL_CONFIGS"
CONFIG_DIR = Path(__file__).parent / "configs"


def device_slug(name: str) -> str:
    """A device name as a file name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def precisions_key(bits: Sequence[int]) -> str:
    return ",".join(str(b) for b in sorted(set(bits), reverse=True))


@lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@lru_cache(maxsize=16)
def load_tuned(path: str) -> tuple[str, dict[str, dict[str, tuple[int, ...]]]]:
    """(device name, {shape: {precisions: config}}) of a tuned-configs file, or ValueError naming
    the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the kernel configs {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("device"), str) or \
            not isinstance(data.get("configs"), dict):
        raise ValueError(f"the kernel configs {path} are not an object with 'device' and 'configs'")
    table = {}
    for shape, entries in data["configs"].items():
        if not re.fullmatch(r"\d+x\d+", shape) or not isinstance(entries, dict):
            raise ValueError(f"the kernel configs {path}: '{shape}' is not HIDDENxWIDTH with an object of configs")
        table[shape] = {}
        for key, config in entries.items():
            if not re.fullmatch(r"\d+(,\d+)*", key) or not isinstance(config, list):
                raise ValueError(f"the kernel configs {path}: {shape} '{key}' is not precisions with a list")
            table[shape][precisions_key(int(b) for b in key.split(","))] = checked_config(
                config, f"the kernel configs {path}: {shape} {key}")
    return data["device"], table


def tuned_config(device: torch.device, hidden: int, width: int, bits: Sequence[int]) -> tuple[int, ...] | None:
    """The config tuned on this CUDA device for experts of hidden x width at these precisions, or None."""
    if device.type != "cuda":
        return None
    return tuned_for(_cuda_name(device.index if device.index is not None else torch.cuda.current_device()),
                     hidden, width, bits)


def check_tuned(device: torch.device) -> None:
    """ValueError now, naming the file, if the tuned configs this CUDA device would read cannot be
    used (unreadable, malformed, another device's, or MOETOOL_KERNEL_CONFIGS naming no file)."""
    tuned_config(device, 0, 0, (16,))


def tuned_for(name: str, hidden: int, width: int, bits: Sequence[int]) -> tuple[int, ...] | None:
    """`tuned_config` for the device called `name`: from the file MOETOOL_KERNEL_CONFIGS names (it
    must be this device's), else from the package's file for the device, else None."""
    return _tuned(name, hidden, width, precisions_key(bits), os.environ.get(CONFIGS_ENV), str(CONFIG_DIR))


@lru_cache(maxsize=256)
def _tuned(name: str, hidden: int, width: int, key: str, chosen: str | None, config_dir: str) -> tuple[int, ...] | None:
    """Resolved once per kind of launch (a kernel call on the host path pays a dict lookup, not a stat)."""
    path = Path(chosen) if chosen else Path(config_dir) / f"{device_slug(name)}.json"
    if not path.is_file():
        if chosen:
            raise ValueError(f"{CONFIGS_ENV} names {chosen}, which is not a file")
        return None
    tuned_on, table = load_tuned(str(path))
    if tuned_on != name:
        raise ValueError(f"the kernel configs {path} were tuned on {tuned_on}, not this {name}: "
                         f"unset {CONFIGS_ENV} or tune this device (scripts/bench_kernels.py --tune)")
    entries = table.get(f"{hidden}x{width}", {})
    return entries.get(key) or entries.get(key.split(",")[-1])
