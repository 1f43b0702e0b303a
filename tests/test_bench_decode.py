"""scripts/bench_decode.py's comparison of the simulated clock with a wall-clock run (`--against`,
what a lent GPU runs for "sim within 10% of wall"), on a tiny checkpoint on a CPU. No timing is
asserted: which rows get compared and with what, and the refusals."""

import importlib.util
import json
from pathlib import Path

import torch

from moetool.engine.store import HostStore
from moetool.model import load_model
from tiny import save_tiny

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_sim_run_is_set_against_the_wall_clock_rows_of_the_same_settings(tmp_path, capsys):
    bench = _bench()
    model = save_tiny("qwen2_moe", tmp_path / "m")
    common = ["--model", str(model), "--policies", "lru", "--budgets", "25%,100%", "--paths", "host",
              "--tokens", "2", "--no-plain"]
    assert bench.main([*common, "--json", str(tmp_path / "wall.json")]) == 0
    wall = {(r["policy"], r["budget"]): r for r in json.loads((tmp_path / "wall.json").read_text())}
    lm = load_model(model)  # a token reads its layers' top-k bf16 experts (the roofline's device bytes)
    store = HostStore.from_experts(lm.experts, torch.float32)
    g = lm.geometry.layers[0]
    assert wall["lru", "25%"]["expert_read_bytes"] == len(lm.geometry.layers) * g.top_k * store.slot_bytes(16)
    assert bench.main([*common, "--budgets", "25%", "--clock", "sim", "--against", str(tmp_path / "wall.json"),
                       "--json", str(tmp_path / "sim.json")]) == 0
    (row,) = json.loads((tmp_path / "sim.json").read_text())
    assert row["wall_tpot_p50_ms"] == wall["lru", "25%"]["tpot_p50_ms"]  # its own settings' row, not 100%'s
    assert row["sim_over_wall"] == row["tpot_p50_ms"] / row["wall_tpot_p50_ms"]
    assert "sim/wall" in capsys.readouterr().out
    # Both runs' policies read rtx3090's costs (the default --hw); a sim run whose policies read another
    # machine's (Fate sizes its prefetch from them) moved other bytes: not set against that wall row.
    assert row["policy_hw"] == wall["lru", "25%"]["policy_hw"] == "rtx3090"
    assert bench.main([*common, "--budgets", "25%", "--clock", "sim", "--hw", "a6000", "--against",
                       str(tmp_path / "wall.json"), "--json", str(tmp_path / "sim2.json")]) == 0
    (row,) = json.loads((tmp_path / "sim2.json").read_text())
    assert row["policy_hw"] == "a6000" and "sim_over_wall" not in row
    assert "give both runs the same --hw" in row["not_compared"]
    assert "not set against the wall clock" in capsys.readouterr().err


def test_against_needs_the_sim_clock_and_a_wall_runs_rows_and_policies_are_known(tmp_path, capsys):
    bench = _bench()
    assert bench.main(["--policies", "lru,fate-papr"]) == 2
    assert "fate-papr not among" in capsys.readouterr().err
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    assert bench.main(["--against", str(tmp_path / "other.json")]) == 2
    assert "give --clock sim" in capsys.readouterr().err
    for bad in (tmp_path / "other.json", tmp_path / "absent.json"):
        assert bench.main(["--clock", "sim", "--against", str(bad)]) == 2
        assert "not the --json rows" in capsys.readouterr().err
