"""bench_infra.sh: the report step on synthetic run directories (fast, hand-computed values), the
script's argument handling, and (slow) one very short real run of one configuration."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench_infra.sh")


def _write_run(root, name, summary, steps, **step_metrics):
    """A finished grpo.py output directory: summary.json and metrics.jsonl (train steps only)."""
    d = os.path.join(root, name)
    os.makedirs(d)
    base = {"args": {}, "wall_s": 100.0, "mean_data_wait_s": 1.0, "peak_source": "see metrics.jsonl perf/peak_source",
            "eval_pass@1": [], "static_wasted_fraction": None}
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({**base, **summary}, f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "kind": "eval", "time": 1.0, "eval/pass@1": 0.0}) + "\n")  # ignored
        for i, (t, mean_len, max_len) in enumerate(steps):
            f.write(json.dumps({"step": i + 1, "kind": "train", "time": t, "time/step": 4.0,
                                "rollout/response_length": mean_len, "rollout/response_length_max": max_len,
                                "rollout/groups_dropped_stale": 1, "rollout/prompts_consumed": 16,
                                "train/trained_tokens": 100,
                                "perf/actor_tokens_per_s": 100.0 + i, "perf/learner_tokens_per_s": 50.0,
                                "perf/peak_source": "measured on cpu: fp32 matmul 1024^3 and a 64 MiB copy "
                                                    "(read+write)", **step_metrics}) + "\n")


def _summary(gen, occ, step_s, sync_s, steps=3, waste=None):
    return {"steps": steps, "generated_tokens_per_s": gen, "learner_tokens_per_s": 400.0, "mean_step_time_s": step_s,
            "mean_weight_sync_s": sync_s, "actor_mfu": 0.012, "actor_mbu": 0.034, "actor_occupancy": occ,
            "actor_weight_wait_s": 2.5, "learner_data_wait_s": 7.5, "static_wasted_fraction": waste,
            "mean_weight_gather_s": 0.25 * sync_s, "mean_weight_transfer_s": 0.5 * sync_s, "mean_weight_load_s": 0.125}


def _report(results_dir):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("CONFIGS", None)
    return subprocess.run(["bash", SCRIPT, "--report", str(results_dir)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_report_hand_computed(tmp_path):
    # static: step ends at 10, 20, 30 s -> steady state 2 steps / 20 s = 6 steps/min
    _write_run(tmp_path, "static_drained", _summary(100.0, 0.50, 10.0, 0.5, waste=0.54),
               [(10.0, 100, 200), (20.0, 100, 200), (30.0, 100, 200)])
    # continuous drained: 2 steps / 16 s = 7.5 steps/min;
    # would-be waste from lengths: (200-100)/200, (300-150)/300 -> 0.5
    _write_run(tmp_path, "continuous_drained", _summary(180.0, 0.95, 8.0, 0.4),
               [(5.0, 100, 200), (13.0, 150, 300), (21.0, 100, 200)])
    # continuous inflight: 2 steps / 12 s = 10 steps/min; weight sync 1.2 s of a 6 s step = 20% (misses the target)
    _write_run(tmp_path, "continuous_inflight", _summary(200.0, 0.97, 6.0, 1.2),
               [(4.0, 100, 200), (10.0, 100, 200), (16.0, 100, 200)])
    p = _report(tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert [r["config"] for r in res["rows"]] == ["static_drained", "continuous_drained", "continuous_inflight"]
    assert rows["static_drained"]["learner_steps_per_min"] == pytest.approx(6.0)
    assert rows["continuous_drained"]["learner_steps_per_min"] == pytest.approx(7.5)
    assert rows["continuous_inflight"]["learner_steps_per_min"] == pytest.approx(10.0)
    assert rows["continuous_drained"]["gen_speedup"] == pytest.approx(1.8)
    assert rows["continuous_inflight"]["gen_speedup"] == pytest.approx(2.0)
    assert rows["continuous_inflight"]["steps_per_min_speedup"] == pytest.approx(10.0 / 6.0)
    assert rows["static_drained"]["static_wasted_fraction"] == pytest.approx(0.54)  # the engine's own measure
    assert rows["continuous_drained"]["static_wasted_fraction"] == pytest.approx(0.5)  # would-be, from lengths
    assert rows["continuous_inflight"]["weight_sync_share_of_step"] == pytest.approx(0.2)
    assert rows["continuous_inflight"]["mean_weight_transfer_s"] == pytest.approx(0.6)  # the update's parts are shown
    assert rows["continuous_inflight"]["mean_weight_load_s"] == pytest.approx(0.125)
    # 3 x 100 tokens, 24 s
    assert rows["static_drained"]["trained_tokens_per_s"] == pytest.approx(300 / (30.0 - 10.0 + 4.0))
    assert rows["static_drained"]["groups_dropped_stale"] == 3 and rows["static_drained"]["prompts_consumed"] == 48
    t = res["targets"]
    assert t["continuous_vs_static_gen"]["measured"] == pytest.approx(1.8) and t["continuous_vs_static_gen"]["holds"]
    assert (t["inflight_vs_drained_steps_per_min"]["measured"] == pytest.approx(10.0 / 7.5)
            and t["inflight_vs_drained_steps_per_min"]["holds"])
    assert t["occupancy_inflight"]["measured"] == pytest.approx(0.97) and t["occupancy_inflight"]["holds"]
    assert (t["weight_sync_share_of_step"]["measured"] == pytest.approx(0.2)
            and not t["weight_sync_share_of_step"]["holds"])
    assert t["stale_groups_dropped"]["measured"] == 9 and not t["stale_groups_dropped"]["holds"]  # 1 a step, 3 x 3
    # mean kept lengths 100, 350 / 3 and 100: the longest configuration's is 1/6 above the shortest's
    assert t["kept_length_spread"]["measured"] == pytest.approx(350 / 300 - 1) and not t["kept_length_spread"]["holds"]
    # trained tok/s: 300 tokens in (21 - 5 + 4) s drained, in (16 - 4 + 4) s inflight
    assert res["context"] == pytest.approx({"continuous_inflight_vs_static_gen": 2.0,
                                            "occupancy_continuous_drained": 0.95,
                                            "occupancy_continuous_inflight": 0.97,
                                            # a drained update's share includes the wait for the drain: context
                                            "weight_sync_share_static_drained": 0.5 / 10.0,
                                            "weight_sync_share_continuous_drained": 0.4 / 8.0,
                                            "inflight_vs_drained_trained_tokens_per_s": (300 / 16) / (300 / 20)})
    # every column in the issue is in the printed table and in results.md
    md = (tmp_path / "results.md").read_text()
    for col in ["gen tok/s", "learner tok/s", "trained tok/s", "steps", "mean step s", "actor MFU", "actor MBU",
                "occupancy", "actor weight wait s", "learner data wait s", "static waste", "gen speedup",
                "steps/min speedup"]:
        assert col in p.stdout and col in md, col
    assert "measured on cpu" in p.stdout  # the output says where the peaks came from
    assert "MISSED" in md and "nan" not in md
    png = tmp_path / "tokens_per_s.png"  # matplotlib is a requirement: the plot is always written
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_report_compares_colocated_with_torchrun(tmp_path):
    # torchrun: 2 steps in 12 s = 10 steps/min; colocated: 2 steps in 10 s = 12 steps/min
    _write_run(tmp_path, "colocated_inflight", _summary(150.0, 0.9, 5.0, 0.1),
               [(3.0, 100, 200), (8.0, 100, 200), (13.0, 100, 200)])
    _write_run(tmp_path, "continuous_inflight", _summary(200.0, 0.97, 6.0, 0.1),
               [(4.0, 100, 200), (10.0, 100, 200), (16.0, 100, 200)])
    p = _report(tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["config"] for r in res["rows"]] == ["continuous_inflight", "colocated_inflight"]
    assert res["context"]["colocated_vs_torchrun_steps_per_min"] == pytest.approx(12.0 / 10.0)


def test_report_puts_the_tool_run_beside_the_no_tool_run(tmp_path):
    """tools_inflight is context, not a target: its engines wait on tools by design."""
    _write_run(tmp_path, "continuous_inflight", _summary(200.0, 0.97, 6.0, 0.1),
               [(4.0, 100, 200), (10.0, 100, 200), (16.0, 100, 200)])
    _write_run(tmp_path, "tools_inflight", _summary(150.0, 0.40, 6.0, 0.1),
               [(4.0, 300, 600), (10.0, 300, 600), (16.0, 300, 600)], **{"perf/actor_occupancy_while_tools": 0.25})
    p = _report(tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["context"]["tools_vs_no_tools_gen"] == pytest.approx(0.75)
    assert res["context"]["occupancy_while_tools"] == pytest.approx(0.25)
    assert res["targets"]["occupancy_inflight"]["measured"] == pytest.approx(0.97)  # the tool run's 40% not in it
    assert "kept_length_spread" not in res["targets"]  # nor its lengths, which hold the tools' results


def test_report_without_runs_fails_clearly(tmp_path):
    p = _report(tmp_path)
    assert p.returncode != 0 and "no finished runs" in p.stderr


def test_unknown_argument_is_refused():
    p = subprocess.run(["bash", SCRIPT, "--steps", "3"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "environment variables" in p.stderr


@pytest.mark.slow
def test_one_short_real_run(toy_model_dir, tmp_path):
    """One configuration, 2 steps of 4 prompts x 2 samples, 64 tokens: the script's run + report path
    on real grpo.py output (the full three-way benchmark is the script itself, never a timed test). The
    configuration is continuous_inflight with tool calls (tools_inflight): every request runs as a tool
    episode of three turns with two 0.2 s calls between them."""
    env = dict(os.environ, PYTHON=sys.executable, MODEL=toy_model_dir, CONFIGS="tools_inflight", STEPS="2",
               TOOL_LATENCY_S="0.2", TOOL_TURNS="2",
               PROMPTS_PER_STEP="4", SAMPLES_PER_PROMPT="2", MAX_RESPONSE_LENGTH="64", MAX_PROMPT_LENGTH="64",
               RESULTS_DIR=str(tmp_path / "res"), CACHE_DIR=str(tmp_path / "cache"), VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "res" / "results.json").read_text())
    (row,) = res["rows"]
    assert row["steps"] == 2 and row["generated_tokens_per_s"] > 0 and 0 < row["actor_occupancy"] <= 1.0
    assert 0 < row["actor_mbu"] <= 1.0 and 0 < row["actor_mfu"] <= 1.0
    settings = (tmp_path / "res" / "settings.txt").read_text()
    assert "FLOP/s" in settings and "every configuration divides by these" in settings  # measured once, passed on
    assert row["peak_source"].startswith("given")
    assert (tmp_path / "res" / "run_tools_inflight.log").exists()
    with open(tmp_path / "res" / "tools_inflight" / "metrics.jsonl") as f:
        steps = [m for m in map(json.loads, f) if m.get("kind") == "train"]
    # every kept sample made its two calls; the engines decoded while the tools ran
    assert all(m["tools/calls_per_episode"] == 2 and m["tools/turns_per_episode"] == 3 for m in steps)
    assert all(m["time/tools"] > 0 and m["tokens/appended"] > 0 for m in steps)
    assert 0 < row["occupancy_while_tools"] <= 1.0


def test_report_puts_the_lora_run_beside_the_full_run(tmp_path):
    """lora_inflight beside continuous_inflight: bytes per update (the column and the ratio), sync seconds, step
    time and generated tokens/s, as context."""
    _write_run(tmp_path, "continuous_inflight", _summary(200.0, 0.97, 6.0, 0.5),
               [(4.0, 100, 200), (10.0, 100, 200), (16.0, 100, 200)], **{"sync/update_bytes": 500e6})
    _write_run(tmp_path, "lora_inflight", _summary(150.0, 0.95, 5.0, 0.1),
               [(4.0, 100, 200), (9.0, 100, 200), (14.0, 100, 200)], **{"sync/update_bytes": 20e6})
    p = _report(tmp_path)
    assert p.returncode == 0, p.stderr + p.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    context = res["context"]
    assert context["lora_vs_full_bytes_per_update"] == pytest.approx(0.04)
    assert context["lora_vs_full_weight_sync_s"] == pytest.approx(0.2)
    assert context["lora_vs_full_mean_step_s"] == pytest.approx(5.0 / 6.0)
    assert context["lora_vs_full_gen_tokens_per_s"] == pytest.approx(0.75)
    assert "MB/update" in p.stdout and "500.00" in p.stdout and "20.00" in p.stdout
