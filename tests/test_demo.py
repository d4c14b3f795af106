"""demo.sh (what `make demo` runs): the whole recipe, shortened, end to end on the real scripts."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_short_demo_runs_every_stage_and_prints_the_table(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, DEMO_SHORT="1", DEMO_DIR=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    # nothing a newcomer cannot act on: vLLM's import of a deprecated torch name, the rotary embedding's
    # "Failed to load weights" (it has none to load)
    for expected_noise in ("FutureWarning", "Failed to load weights"):
        assert expected_noise not in console, expected_noise
    assert "demo finished in" in proc.stdout
    for stage in ("1/5 toy", "2/5 SFT", "3/5 DPO", "4/5 RL", "5/5 evaluation"):
        assert stage in proc.stdout, stage
    assert "Accuracy, greedy (all, %)" in proc.stdout and "pass@1, sampled" in proc.stdout
    printed_table = proc.stdout.split("Toy arithmetic")[1].split("\n\n")[0]
    assert "Boxes its last step (%)" in printed_table and "nan" not in printed_table  # the base model's row reads "-"
    def strict(constant):  # NaN / Infinity are not JSON: other tools cannot read them
        raise ValueError(f"results.json holds {constant}")
    results = json.loads((out / "results.json").read_text(), parse_constant=strict)
    assert list(results) == ["base", "SFT", "DPO", "RL"]
    for result in results.values():
        assert result["num_examples"] == 32 and 0.0 <= result["accuracy"] <= 1.0
    table = (out / "results.md").read_text().splitlines()
    assert table[0] == "| Toy arithmetic (held-out) | base | SFT | DPO | RL |"
    assert (out / "curves.png").stat().st_size > 1000
    for stage in ("sft", "dpo", "rl"):
        assert (out / stage / "metrics.jsonl").stat().st_size > 0, stage
