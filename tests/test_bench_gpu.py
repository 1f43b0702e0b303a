"""scripts/bench_gpu.py's dry run on a CPU (`--device cpu --geometry tiny`): every part of the GPU
benchmark runs and writes its rows, so the script a lent GPU runs is known to work before the lease.
No timing is asserted, only what the rows must hold."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_gpu.py"


def test_the_gpu_benchmark_runs_every_part_on_a_cpu(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cpu", "--geometry", "tiny",
                    "--layers", "1", "--prompt", "16", "--tokens", "4", "--p1-tokens", "2", "--rounds", "1",
                    "--budgets", "25", "--time-limit", "600"], check=True, capture_output=True, text=True)
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert results["quantize"]["experts"] == 60 and results["p1"]["same_tokens"]
    rows = {(r["policy"], r["budget"]): r for r in results["rows"]}
    assert set(rows) == {(p, "25%") for p in ("static int4", "lod", "lru", "eap", "fate", "dymoe 4/2", "dymoe 4/0",
                                              "smoe", "dynaexq 4/2")} | {("resident", "100%")}
    assert "keeps all 60 experts at 4 bits" in rows["static int4", "25%"]["error"]  # 4-bit experts need 28%
    for key, r in rows.items():
        if "error" in r:
            continue
        assert r["tpot_wall_s"] > 0 and 0 <= r["hit_rate"] <= 1 and r["peak_device_bytes"] <= r["budget_bytes"], key
        assert key[1] == "100%" or r["tpot_sim_s"] > 0  # the first budget's rows again on the sim clock
    assert rows["resident", "100%"]["hit_rate"] == 1.0 and rows["resident", "100%"]["bytes_per_token"] == 0
    assert rows["lod", "25%"]["hit_rate"] == 0.0 and rows["lod", "25%"]["bytes_per_token"] > 0
    assert (tmp_path / "hw-profile.json").is_file() and not results["skipped"]
