#!/usr/bin/env bash
# bench_infra.sh: the Olmo 3 RL infrastructure ablation (report sec 4.5, Table 23) as one command.
#
# Runs grpo.py three times on the same data, seed and step budget, then prints one table:
#   1. static_drained       --batching static     --no_inflight_updates   (OLMo 2: llm.generate per batch)
#   2. continuous_drained   --batching continuous --no_inflight_updates   (engine kept full, drained for weights)
#   3. continuous_inflight  --batching continuous --inflight_updates      (Olmo 3: weights loaded mid-generation)
# and, when CONFIGS names it, colocated_inflight: the third one as `python grpo.py` (one process, the actor
# in a thread, on CPU half of the cores each), to compare with the torchrun run in one command:
#   CONFIGS="continuous_inflight colocated_inflight" bash bench_infra.sh
# and tools_inflight: the third one with tool use, each request's drawn length cut into TOOL_TURNS + 1 turns
# with a tool call of TOOL_LATENCY_S seconds between two (results appended, the sequence continued, as in a
# real tool episode); the report gives its generated tokens/s and occupancy beside the no-tool run's:
#   CONFIGS="continuous_inflight tools_inflight" bash bench_infra.sh
# and lora_inflight: the third one training a LoRA adapter (--lora_rank LORA_RANK): only the adapter goes to the
# engines; the report gives its bytes and seconds per update, step time and generated tokens/s beside the full run's:
#   CONFIGS="continuous_inflight lora_inflight" bash bench_infra.sh
# Columns: generated tokens/s, learner tokens/s, trained (kept) tokens/s, steps, mean step time, learner steps/min, actor MFU
# and MBU (weights counted once per engine step, never once per sequence), actor engine occupancy, time the
# actors waited for weights, time the learner waited for data, the static batch's wasted-compute
# fraction ((max - mean length) / max), weight sync time (split into gather, transfer and the engines'
# load) and its share of a learner step, stale
# groups dropped, and each configuration's speedup over the first. Writes results.json,
# results.md, tokens_per_s.png and each run's log (run_*.log) and output directory into RESULTS_DIR.
#
#   bash bench_infra.sh                       # CPU default: toy model, 6-13 min on an idle 2-core machine
#   bash bench_infra.sh --report RESULTS_DIR  # only (re)build the table and plot from finished runs
#
# Budget. Every configuration runs the same number of learner steps (STEPS), with the same seed,
# data order and length draws per request. A step budget keeps the learning work identical, so
# throughput (tokens/s) and speed (steps/min) compare like for like; the paper instead ran each
# configuration for 2 hours of wall clock (grpo.py has no wall-clock stop, so set STEPS large
# enough to cover your time). Steps/min is measured between the end of the first step and the end
# of the last (steady state: the first step also waits for the pipeline to fill); the mean step time
# is over all steps, as grpo.py's summary.json reports it.
#
# Workload. With a random toy model every math reward is 0, so active sampling would filter every
# group and the benchmark would measure the filter. The default data is therefore toy.py's RLVR
# prompts scored by the `max_length` verifier against 0 words (reward 1 - words/8192: model-
# independent and different for every sample, so groups keep a non-zero std and are trained on).
# Response lengths come from grpo.py's BENCHMARK-ONLY sampler: each request draws
# max_tokens = min(MAX_RESPONSE_LENGTH, Exponential(mean RESPONSE_LENGTH_MEAN)) and ignores eos, so
# lengths are long-tailed with mean / max ~ 0.46 at the default RESPONSE_LENGTH_MEAN = 0.55 x max
# (mean of a capped exponential: m (1 - exp(-max / m)); the paper: 14628 / 32000 = 0.46).
# With a trained model and real data set RESPONSE_LENGTH_SAMPLER=none: lengths are then the model's.
#
# Regime. The paper's benchmark is generation-bound ("inference is our bottleneck"): that is where
# continuous batching and inflight updates pay. On CPU, grpo.py pins each torchrun rank to its own
# cores (--cpu_affinity, on by default); without it vLLM's engine-core process busy-polls its worker,
# the two take both cores of a 2-core machine, and the learner's steps ran 5-17x slower than alone,
# which made the benchmark learner-bound. Pinned, the fp32 toy learner trains ~2,000 tokens/s on one
# core and the engine generates ~360 tokens/s with 4 running sequences (~850 with 16) on the other.
# Check `learner data wait s` in the table: near zero means the run was learner-bound, and then
# neither continuous batching nor inflight updates can raise learner steps/min.
#
# Off-policy bound and slots. The paper's benchmark script (open-instruct
# scripts/benchmarking/olmo3_infra.sh, the report's footnote 44) ran --async_steps 4, so ASYNC_STEPS
# defaults to 4 here, for all three configurations (grpo.py's own default is 1). Each engine gets
# MAX_NUM_SEQS = 2 x one step's completions per actor (8 on the CPU default): room to run the next
# step while the current one's tail finishes, which is what continuous batching is for. More slots
# make each sequence slower. The bound applies at admission (a prompt starts only on weights recent
# enough for the step that trains on it); a long sample admitted within it is trained even when its
# later tokens come from newer versions, so no group is dropped and every configuration trains on the
# same length distribution (grpo.py's old rule dropped such groups: 7 per 30 steps with 8 slots, 29
# with 16, and the kept responses got 18% shorter under inflight updates).
#
# What to expect. Static batching generates one step's share at a time (4 of the 8 slots on the
# CPU default) and waits for its longest response before it takes the next batch. Continuous
# batching keeps the slots filled from the prompts of the next ASYNC_STEPS steps. With drained
# updates an engine must stop admitting and drain before it loads, so it asks for new weights only
# when every prompt it holds needs newer ones (learner 0 then streams at its next step boundary;
# also every ASYNC_STEPS versions and before an evaluation): it drains about once per few learner
# steps and loads the latest version, instead of draining at every step. Inflight updates remove the
# drain altogether. Under inflight updates a long sequence spans several learner versions; the
# table's `token lag` column shows how many on average. (When every update drained, continuous
# batching gained only 1.07-1.33x over static batching in four CPU runs.)
#
# Peaks. MFU and MBU divide by the device's peaks. On GPUs these are the datasheet's; on CPU they are
# measured once here, before the runs (an fp32 matmul and a memory copy on the cores an actor rank is
# pinned to), and passed to every configuration, so the three divide by the same numbers.
#
# Environment variables (defaults: the CPU toy run; the paper's values in brackets):
#   MODEL                 HF model dir or hub name (default: toy.py model, built once in CACHE_DIR)
#                         [allenai/Olmo-3-7B-Think-DPO or your own checkpoint]
#   DATA                  RLVR .jsonl / hub dataset for --dataset_mixer_list (default: toy prompts
#                         with the max_length verifier, see above) [your RLVR mix]
#   NPROC                 processes per node (default 2: 1 learner + 1 actor; 1: colocated
#                         `python grpo.py`, the actor in a thread) [8]
#   NNODES                nodes (default 1) [2]
#   NUM_LEARNERS          learner ranks; the remaining ranks are actors (default 1) [8: node 0 learns,
#                         node 1 generates]
#   TORCHRUN_ARGS         rendezvous flags (default `--standalone` on one node: a free port, so
#                         parallel runs on one machine do not collide)
#                         [`--node-rank $NODE_RANK --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id bench`]
#   NODE_RANK             this node's rank (default 0); only node 0 holds the learner's outputs and
#                         builds the report
#   PROMPTS_PER_STEP      unique prompts per learner step (default 2) [64]
#   SAMPLES_PER_PROMPT    completions per prompt (default 2) [2]
#   MAX_PROMPT_LENGTH     (default 128) [2048]
#   MAX_RESPONSE_LENGTH   (default 512) [32000]
#   RESPONSE_LENGTH_SAMPLER  exponential (default) or none (the model's own lengths)
#   RESPONSE_LENGTH_MEAN  mean of the exponential (default 0.55 x MAX_RESPONSE_LENGTH, mean/max ~0.46)
#   ASYNC_STEPS           off-policy bound K, grpo.py --async_steps (default 4, see above) [4]
#   MAX_NUM_SEQS          vLLM slots per engine (default 2 x PROMPTS_PER_STEP x SAMPLES_PER_PROMPT
#                         / actors, see above) [32: 2 x 128 completions / 8 engines]
#   STEPS                 learner steps per configuration, the budget (default 30) [enough for 2 h]
#   SEED                  (default 1)
#   ENFORCE_EAGER         1: vLLM without compilation, starts faster (default 1 on CPU, 0 on GPU)
#   CONFIGS               which configurations to run (default the three above, in that order;
#                         colocated_inflight too when named; speedups are relative to the first one listed)
#   EXTRA_ARGS            more grpo.py flags, the same for every configuration
#   TOOL_LATENCY_S        tools_inflight: seconds per tool call (default 1)
#   TOOL_TURNS            tools_inflight: tool calls per request (default 2)
#   LORA_RANK             lora_inflight: the adapter's rank (default 16)
#   RESULTS_DIR           (default results/bench_infra_<UTC timestamp>)
#   CACHE_DIR             where the toy model and data are built (default results/.bench_infra_cache)
#   PYTHON                (default .venv/bin/python if present, else python3)
#   VLLM_CPU_KVCACHE_SPACE  GiB of KV cache on CPU (default 2)
#
# The paper's layout (Table 23: two 8-GPU nodes, one learning, one generating), run on each node:
#   MODEL=allenai/Olmo-3-7B-Think-DPO DATA=your_rlvr.jsonl RESPONSE_LENGTH_SAMPLER=none \
#   NNODES=2 NPROC=8 NUM_LEARNERS=8 NODE_RANK=<0|1> PROMPTS_PER_STEP=64 SAMPLES_PER_PROMPT=2 \
#   MAX_PROMPT_LENGTH=2048 MAX_RESPONSE_LENGTH=32000 STEPS=200 \
#   TORCHRUN_ARGS="--node-rank <0|1> --rdzv-backend c10d --rdzv-endpoint NODE0_HOST:29500 --rdzv-id bench" \
#   RESULTS_DIR=results/table23 bash bench_infra.sh
# (the same RESULTS_DIR path on both nodes; node 0 prints the table). On GPUs MFU / MBU use the
# datasheet peaks (grpo.py GPU_PEAKS); on CPU the peaks are a measured fp32 matmul and memory copy
# (PEAK_FLOPS and PEAK_MEMORY_BANDWIDTH, in FLOP/s and B/s, skip the measurement), and the table says so.
set -euo pipefail
cd "$(dirname "$0")"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# ------------------------------------------------------------------------------------------------
# The report: one table, results.json, results.md, tokens_per_s.png (also usable on its own)
# ------------------------------------------------------------------------------------------------
report() {
    "$PYTHON" - "$1" <<'PYEOF'
import json, math, os, sys

out_dir = sys.argv[1]
ORDER = ["static_drained", "continuous_drained", "continuous_inflight", "colocated_inflight", "tools_inflight",
         "lora_inflight"]
TARGETS = {"continuous_vs_static_gen": 1.5, "inflight_vs_drained_steps_per_min": 1.3, "occupancy_inflight": 0.90,
           "weight_sync_share_of_step": 0.10, "stale_groups_dropped": 0, "kept_length_spread": 0.05}


def read_run(name):
    d = os.path.join(out_dir, name)
    with open(os.path.join(d, "summary.json")) as f:
        s = json.load(f)
    recs = []
    with open(os.path.join(d, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                recs.append(json.loads(line))
    steps = [r for r in recs if r.get("kind") == "train"]
    if not steps:
        raise SystemExit(f"{name}: metrics.jsonl has no training steps")
    # learner steps/min in steady state: from the end of step 1 to the end of the last step
    if len(steps) > 1 and steps[-1]["time"] > steps[0]["time"]:
        spm = 60.0 * (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"])
    else:
        spm = 60.0 / max(s["mean_step_time_s"], 1e-9)
    lens_mean = [r["rollout/response_length"] for r in steps if "rollout/response_length" in r]
    lens_max = [r["rollout/response_length_max"] for r in steps if "rollout/response_length_max" in r]
    # static waste: the engine's own per-batch measure for static batching; for continuous runs the
    # waste a static batch of the same step's responses would have had ("would-be"), from the lengths
    if s.get("static_wasted_fraction") is not None:
        waste, waste_src = s["static_wasted_fraction"], "measured per static batch"
    else:
        per_step = [(mx - mn) / mx for mn, mx in zip(lens_mean, lens_max) if mx]
        waste, waste_src = (sum(per_step) / len(per_step) if per_step else float("nan")), "would-be, from each step's lengths"
    # trained (kept, non-stale) response tokens per second of training wall time: generated tokens/s
    # counts every token the engine produced, including groups later dropped as stale
    span = steps[-1]["time"] - steps[0]["time"] + steps[0].get("time/step", 0.0)
    trained_tps = sum(r.get("train/trained_tokens", 0) for r in steps) / max(span, 1e-9)
    peak = next((r.get("perf/peak_source") for r in reversed(steps) if r.get("perf/peak_source")), s.get("peak_source"))
    row = {
        "config": name,
        "generated_tokens_per_s": s["generated_tokens_per_s"],
        "learner_tokens_per_s": s["learner_tokens_per_s"],
        "trained_tokens_per_s": trained_tps,
        "steps": s["steps"],
        "mean_step_time_s": s["mean_step_time_s"],
        "learner_steps_per_min": spm,
        "actor_mfu": s["actor_mfu"],
        "actor_mbu": s["actor_mbu"],
        "actor_occupancy": s["actor_occupancy"],
        "actor_weight_wait_s": s["actor_weight_wait_s"],
        "learner_data_wait_s": s["learner_data_wait_s"],
        "static_wasted_fraction": waste,
        "static_wasted_fraction_source": waste_src,
        "mean_weight_sync_s": s["mean_weight_sync_s"],
        "weight_sync_share_of_step": s["mean_weight_sync_s"] / max(s["mean_step_time_s"], 1e-9),
        # the update's parts: learner 0 gathering and packing, its stream to the engines (waits for them
        # included), and the engines' own loading (mean per update and engine)
        **{f"mean_weight_{k}_s": s.get(f"mean_weight_{k}_s", float("nan")) for k in ("gather", "transfer", "load")},
        # what one update moves to each engine: every weight, or the LoRA adapter alone
        "update_mb": (sum(r["sync/update_bytes"] for r in steps if "sync/update_bytes" in r)
                      / max(1, sum("sync/update_bytes" in r for r in steps)) / 1e6
                      if any("sync/update_bytes" in r for r in steps) else float("nan")),
        "groups_dropped_stale": sum(r.get("rollout/groups_dropped_stale", 0) for r in steps),
        "token_lag_mean": sum(r.get("rollout/lag_mean", 0.0) for r in steps) / len(steps),
        "prompts_consumed": sum(r.get("rollout/prompts_consumed", 0) for r in steps),
        "response_length_mean": sum(lens_mean) / len(lens_mean) if lens_mean else float("nan"),
        "response_length_max": max(lens_max) if lens_max else 0,
        "wall_s": s["wall_s"],
        "occupancy_while_tools": (sum(r["perf/actor_occupancy_while_tools"] for r in steps if "perf/actor_occupancy_while_tools" in r)
                                  / max(1, sum("perf/actor_occupancy_while_tools" in r for r in steps))),
        "peak_source": peak,
        "series": [{"t": r["time"] - steps[0]["time"] + steps[0].get("time/step", 0.0), "step": r["step"],
                    "generated_tokens_per_s": r.get("perf/actor_tokens_per_s"),
                    "learner_tokens_per_s": r.get("perf/learner_tokens_per_s")} for r in steps],
    }
    return row


names = [n for n in os.environ.get("CONFIGS", " ".join(ORDER)).split() if os.path.isdir(os.path.join(out_dir, n))]
if not names:  # --report on a directory: whatever configurations it holds, in the standard order first
    names = [n for n in ORDER if os.path.isdir(os.path.join(out_dir, n))]
    names += sorted(n for n in os.listdir(out_dir) if n not in names and os.path.isfile(os.path.join(out_dir, n, "summary.json")))
if not names:
    raise SystemExit(f"no finished runs (NAME/summary.json) in {out_dir}")
rows = [read_run(n) for n in names]
base = rows[0]
for r in rows:
    r["gen_speedup"] = r["generated_tokens_per_s"] / max(base["generated_tokens_per_s"], 1e-9)
    r["steps_per_min_speedup"] = r["learner_steps_per_min"] / max(base["learner_steps_per_min"], 1e-9)

by = {r["config"]: r for r in rows}
targets = {}
if "static_drained" in by and "continuous_drained" in by:
    v = by["continuous_drained"]["generated_tokens_per_s"] / max(by["static_drained"]["generated_tokens_per_s"], 1e-9)
    targets["continuous_vs_static_gen"] = {"measured": v, "target": ">= 1.5x", "holds": v >= 1.5}
if "continuous_drained" in by and "continuous_inflight" in by:
    v = by["continuous_inflight"]["learner_steps_per_min"] / max(by["continuous_drained"]["learner_steps_per_min"], 1e-9)
    targets["inflight_vs_drained_steps_per_min"] = {"measured": v, "target": ">= 1.3x", "holds": v >= 1.3}
cont = [r for r in rows if r["config"].startswith("continuous")]
# Olmo 3 sec 4.5: inflight updates keep the engine busy and the update cheap. With drained updates the
# engine must finish what it runs before it can load, so a drained run's occupancy and sync share are
# context, not targets.
# (tools_inflight is context: its engines wait on tools by design, and its lengths hold the tools' results)
inflight = [r for r in rows if r["config"].endswith("inflight") and r["config"] != "tools_inflight"]
if inflight:
    v = min(r["actor_occupancy"] for r in inflight)
    targets["occupancy_inflight"] = {"measured": v, "target": ">= 0.90 (min over inflight runs)", "holds": v >= 0.9}
    v = max(r["weight_sync_share_of_step"] for r in inflight)
    targets["weight_sync_share_of_step"] = {"measured": v, "target": "< 0.10 (max over inflight runs)", "holds": v < 0.1}
v = sum(r["groups_dropped_stale"] for r in rows)
targets["stale_groups_dropped"] = {"measured": v, "target": "0 (sum over runs)", "holds": v == 0}
lengths = [r["response_length_mean"] for r in rows if r["config"] != "tools_inflight"]
if len(lengths) > 1:  # the off-policy rule must not select against long answers in any configuration
    v = max(lengths) / max(min(lengths), 1e-9) - 1
    targets["kept_length_spread"] = {"measured": v, "target": "< 0.05 (max / min mean kept length - 1)", "holds": v < 0.05}
# Not targets, context for them: the whole Olmo 3 actor (continuous batching with inflight updates)
# against static batching, each continuous run's occupancy (with drained updates the engine admits
# nothing while it drains for new weights), and inflight vs drained in trained tokens/s, which,
# unlike generated tokens/s, counts only what was not dropped as stale.
context = {}
if "static_drained" in by and "continuous_inflight" in by:
    context["continuous_inflight_vs_static_gen"] = by["continuous_inflight"]["generated_tokens_per_s"] / max(by["static_drained"]["generated_tokens_per_s"], 1e-9)
if "continuous_drained" in by and "continuous_inflight" in by:
    context["inflight_vs_drained_trained_tokens_per_s"] = by["continuous_inflight"]["trained_tokens_per_s"] / max(by["continuous_drained"]["trained_tokens_per_s"], 1e-9)
for r in cont:
    context[f"occupancy_{r['config']}"] = r["actor_occupancy"]
for r in rows:
    if r["config"].endswith("drained"):  # the learner's update includes waiting for the engine to drain
        context[f"weight_sync_share_{r['config']}"] = r["weight_sync_share_of_step"]
if "continuous_inflight" in by and "tools_inflight" in by:  # what tool calls of a set latency cost the engines
    context["tools_vs_no_tools_gen"] = by["tools_inflight"]["generated_tokens_per_s"] / max(by["continuous_inflight"]["generated_tokens_per_s"], 1e-9)
    context["occupancy_while_tools"] = by["tools_inflight"]["occupancy_while_tools"]
if "continuous_inflight" in by and "colocated_inflight" in by:  # one process against the torchrun layout
    context["colocated_vs_torchrun_steps_per_min"] = by["colocated_inflight"]["learner_steps_per_min"] / max(by["continuous_inflight"]["learner_steps_per_min"], 1e-9)
if "continuous_inflight" in by and "lora_inflight" in by:  # LoRA against full updates (LoRA kernels cost decode time)
    full, lora = by["continuous_inflight"], by["lora_inflight"]
    for key, col in (("bytes_per_update", "update_mb"), ("weight_sync_s", "mean_weight_sync_s"),
                     ("mean_step_s", "mean_step_time_s"), ("gen_tokens_per_s", "generated_tokens_per_s")):
        context[f"lora_vs_full_{key}"] = lora[col] / max(full[col], 1e-9)

load = "not recorded"
if os.path.exists(os.path.join(out_dir, "loadavg.txt")):
    with open(os.path.join(out_dir, "loadavg.txt")) as f:
        load = "; ".join(line.strip() for line in f if line.strip())
COLS = [("config", "config", "{}"), ("gen tok/s", "generated_tokens_per_s", "{:.0f}"), ("gen speedup", "gen_speedup", "{:.2f}x"),
        ("learner tok/s", "learner_tokens_per_s", "{:.0f}"), ("trained tok/s", "trained_tokens_per_s", "{:.0f}"), ("steps", "steps", "{}"), ("mean step s", "mean_step_time_s", "{:.1f}"),
        ("steps/min", "learner_steps_per_min", "{:.2f}"), ("steps/min speedup", "steps_per_min_speedup", "{:.2f}x"),
        ("actor MFU", "actor_mfu", "{:.2%}"), ("actor MBU", "actor_mbu", "{:.2%}"), ("occupancy", "actor_occupancy", "{:.1%}"),
        ("actor weight wait s", "actor_weight_wait_s", "{:.1f}"), ("learner data wait s", "learner_data_wait_s", "{:.1f}"),
        ("static waste", "static_wasted_fraction", "{:.1%}"), ("weight sync s", "mean_weight_sync_s", "{:.2f}"),
        ("gather s", "mean_weight_gather_s", "{:.3f}"), ("transfer s", "mean_weight_transfer_s", "{:.3f}"),
        ("load s", "mean_weight_load_s", "{:.3f}"),
        ("sync/step", "weight_sync_share_of_step", "{:.1%}"), ("token lag", "token_lag_mean", "{:.2f}"),
        ("stale groups dropped", "groups_dropped_stale", "{}")]

if any(not math.isnan(r["update_mb"]) for r in rows):  # runs of this version record what each update moved
    COLS.insert([k for _, k, _ in COLS].index("mean_weight_load_s") + 1, ("MB/update", "update_mb", "{:.2f}"))


def fmt(f, v):
    return "nan" if isinstance(v, float) and math.isnan(v) else f.format(v)


cells = [[fmt(f, r[k]) for _, k, f in COLS] for r in rows]
heads = [h for h, _, _ in COLS]
width = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
print()
print("  ".join(h.rjust(w) for h, w in zip(heads, width)))
for c in cells:
    print("  ".join(x.rjust(w) for x, w in zip(c, width)))
md = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)] + ["| " + " | ".join(c) + " |" for c in cells]
notes = [
    f"- Peaks for MFU / MBU: {base['peak_source']}.",
    "- Static waste: " + "; ".join(f"{r['config']}: {r['static_wasted_fraction_source']}" for r in rows) + ".",
    "- Response lengths (kept groups): " + "; ".join(f"{r['config']}: mean {r['response_length_mean']:.0f}, max {r['response_length_max']}"
                                                     f" (mean/max {r['response_length_mean'] / max(r['response_length_max'], 1):.2f})" for r in rows) + ".",
    "- gen tok/s: every token the actor engines generated over their wall time (idle included), also tokens of groups"
    " later dropped as stale; learner tok/s: packed tokens per second of optimizer work; trained tok/s: response tokens"
    " actually trained on per second of training wall time.",
    "- Steps/min: steady state, from the end of step 1 to the end of the last step. Speedups are over " + base["config"] + ".",
    "- Machine load (1/5/15-min load average; timings are only comparable on an otherwise idle machine): " + load + ".",
    "- Targets: " + "; ".join(f"{k} {t['measured']:.2f} ({t['target']}): {'holds' if t['holds'] else 'MISSED'}" for k, t in targets.items()) + ".",
]
if context:
    notes.append("- Context (not targets): " + "; ".join(f"{k} {v:.2f}" for k, v in context.items()) + ".")
print()
print("\n".join(notes))
with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write("# bench_infra.sh results\n\n" + "\n".join(md) + "\n\n" + "\n".join(notes) + "\n")
with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump({"rows": rows, "targets": targets, "context": context, "baseline": base["config"], "loadavg": load}, f, indent=1)

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        t = [p["t"] for p in r["series"]]
        axes[0].plot(t, [p["generated_tokens_per_s"] for p in r["series"]], marker="o", label=r["config"])
        axes[1].plot(t, [p["step"] for p in r["series"]], marker="o", label=r["config"])
    axes[0].set(xlabel="seconds since training started", ylabel="generated tokens/s (per step window)",
                title="actor throughput over time")
    axes[1].set(xlabel="seconds since training started", ylabel="learner steps completed", title="learner progress")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "tokens_per_s.png"), dpi=110)
    print(f"\nwrote {out_dir}/results.json, results.md, tokens_per_s.png")
except ImportError:
    print(f"\nwrote {out_dir}/results.json, results.md (matplotlib is not installed: no plot)")
PYEOF
}

if [[ "${1:-}" == "--report" ]]; then
    [[ -n "${2:-}" ]] || { echo "usage: bash bench_infra.sh --report RESULTS_DIR" >&2; exit 2; }
    report "$2"
    exit 0
fi
[[ $# -eq 0 ]] || { echo "usage: bash bench_infra.sh   (settings are environment variables, see the header)" >&2; exit 2; }

# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------
HAS_GPU=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
NPROC=${NPROC:-2}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NUM_LEARNERS=${NUM_LEARNERS:-1}
TORCHRUN_ARGS=${TORCHRUN_ARGS:---standalone}
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-2}
SAMPLES_PER_PROMPT=${SAMPLES_PER_PROMPT:-2}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-128}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-512}
RESPONSE_LENGTH_SAMPLER=${RESPONSE_LENGTH_SAMPLER:-exponential}
RESPONSE_LENGTH_MEAN=${RESPONSE_LENGTH_MEAN:-$(( MAX_RESPONSE_LENGTH * 55 / 100 ))}
WORLD=$(( NPROC * NNODES ))
NUM_ACTORS=$(( WORLD > 1 ? WORLD - NUM_LEARNERS : 1 ))
(( NUM_ACTORS >= 1 )) || { echo "NUM_LEARNERS=$NUM_LEARNERS leaves no actor rank in $WORLD processes" >&2; exit 2; }
ASYNC_STEPS=${ASYNC_STEPS:-4}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-$(( 2 * ((PROMPTS_PER_STEP * SAMPLES_PER_PROMPT + NUM_ACTORS - 1) / NUM_ACTORS) ))}
STEPS=${STEPS:-30}
SEED=${SEED:-1}
ENFORCE_EAGER=${ENFORCE_EAGER:-$(( 1 - HAS_GPU ))}
CONFIGS=${CONFIGS:-static_drained continuous_drained continuous_inflight}
EXTRA_ARGS=${EXTRA_ARGS:-}
TOOL_LATENCY_S=${TOOL_LATENCY_S:-1}
TOOL_TURNS=${TOOL_TURNS:-2}
LORA_RANK=${LORA_RANK:-16}
RESULTS_DIR=${RESULTS_DIR:-results/bench_infra_$(date -u +%Y%m%d_%H%M%S)}
CACHE_DIR=${CACHE_DIR:-results/.bench_infra_cache}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
mkdir -p "$RESULTS_DIR"
export CONFIGS

# The toy model and the benchmark data (built once; toy.py is deterministic)
if [[ -z "${MODEL:-}" ]]; then
    MODEL=$CACHE_DIR/toy_model
    [[ -f $MODEL/config.json ]] || "$PYTHON" toy.py model "$MODEL" >/dev/null
fi
if [[ -z "${DATA:-}" ]]; then
    DATA=$CACHE_DIR/bench_rlvr.jsonl
    if [[ ! -f $DATA ]]; then
        [[ -f $CACHE_DIR/toy_data/rlvr.jsonl ]] || "$PYTHON" toy.py data "$CACHE_DIR/toy_data" >/dev/null
        "$PYTHON" - "$CACHE_DIR/toy_data/rlvr.jsonl" "$DATA" <<'PYEOF'
import json, sys
# toy prompts, scored by the max_length verifier against 0 words: a reward that differs per sample
# whatever the model writes, so active sampling keeps the groups (see the header)
with open(sys.argv[1]) as f, open(sys.argv[2] + ".tmp", "w") as g:
    for line in f:
        row = json.loads(line)
        row["verifier"], row["ground_truth"] = "max_length", "0"
        g.write(json.dumps(row) + "\n")
import os; os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PYEOF
    fi
fi

if (( WORLD > 1 )); then
    LAUNCH=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" $TORCHRUN_ARGS grpo.py --num_learners "$NUM_LEARNERS")
    MODE="torchrun: $NNODES node(s) x $NPROC processes, $NUM_LEARNERS learner rank(s) + $NUM_ACTORS actor rank(s), one vLLM engine each"
else
    LAUNCH=("$PYTHON" grpo.py)
    MODE="colocated: python grpo.py, the actor runs in a thread beside the learner"
fi
COMMON=(--model_name_or_path "$MODEL" --dataset_mixer_list "$DATA" 1.0 --seed "$SEED"
        --num_training_steps "$STEPS" --num_unique_prompts_per_step "$PROMPTS_PER_STEP"
        --num_samples_per_prompt "$SAMPLES_PER_PROMPT" --max_prompt_length "$MAX_PROMPT_LENGTH"
        --max_response_length "$MAX_RESPONSE_LENGTH" --max_num_seqs "$MAX_NUM_SEQS" --async_steps "$ASYNC_STEPS" --eval_every 0)
if [[ $RESPONSE_LENGTH_SAMPLER == exponential ]]; then
    COMMON+=(--response_length_sampler exponential --response_length_mean "$RESPONSE_LENGTH_MEAN")
    LENGTHS="benchmark-only sampler: max_tokens = min($MAX_RESPONSE_LENGTH, Exponential(mean $RESPONSE_LENGTH_MEAN)) per request, eos ignored; expected mean/max $("$PYTHON" -c "import math; m, L = $RESPONSE_LENGTH_MEAN, $MAX_RESPONSE_LENGTH; print(f'{m * (1 - math.exp(-L / m)) / L:.2f}')")"
else
    LENGTHS="the model's own response lengths (up to $MAX_RESPONSE_LENGTH tokens)"
fi
(( ENFORCE_EAGER )) && COMMON+=(--enforce_eager)

# Peaks for MFU / MBU, once for all configurations (see the header). On CPU: measured on the cores an
# actor rank gets (grpo.py's split of this node's cores; all of them when colocated), with that many threads.
if [[ -z "${PEAK_FLOPS:-}" || -z "${PEAK_MEMORY_BANDWIDTH:-}" ]]; then
    read -r MEASURED_FLOPS MEASURED_BW < <("$PYTHON" - "$NPROC" "$NUM_LEARNERS" <<'PYEOF'
import os, sys
import torch
import grpo
nproc, learners = int(sys.argv[1]), int(sys.argv[2])
cores = sorted(os.sched_getaffinity(0))
if nproc > 1:  # the first actor rank's share, as grpo.py --cpu_affinity pins it
    cores = grpo.split_cores(cores, min(learners, nproc - 1), nproc) or cores
os.sched_setaffinity(0, cores)
torch.set_num_threads(len(cores))
flops, bandwidth, _ = grpo.measure_peaks("cuda" if torch.cuda.is_available() else "cpu")
print(f"{flops:.6g} {bandwidth:.6g}")
PYEOF
)
    PEAK_FLOPS=${PEAK_FLOPS:-$MEASURED_FLOPS}
    PEAK_MEMORY_BANDWIDTH=${PEAK_MEMORY_BANDWIDTH:-$MEASURED_BW}
fi
COMMON+=(--peak_flops "$PEAK_FLOPS" --peak_memory_bandwidth "$PEAK_MEMORY_BANDWIDTH")

cat <<EOF | tee "$RESULTS_DIR/settings.txt"
bench_infra.sh: Olmo 3 Table 23 ablation, $(date -u +%FT%TZ) on $(hostname) ($(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg))
  mode:      $MODE
  model:     $MODEL
  data:      $DATA
  per step:  $PROMPTS_PER_STEP prompts x $SAMPLES_PER_PROMPT samples, max prompt $MAX_PROMPT_LENGTH, max response $MAX_RESPONSE_LENGTH, $MAX_NUM_SEQS vLLM slots per engine, async_steps $ASYNC_STEPS
  lengths:   $LENGTHS
  budget:    $STEPS learner steps per configuration, seed $SEED, enforce_eager=$ENFORCE_EAGER
  peaks:     $PEAK_FLOPS FLOP/s, $PEAK_MEMORY_BANDWIDTH B/s per engine (every configuration divides by these)
  configs:   $CONFIGS
  results:   $RESULTS_DIR
  command:   ${LAUNCH[*]} ${COMMON[*]} $EXTRA_ARGS --output_dir $RESULTS_DIR/CONFIG --batching ... --inflight_updates true|false
EOF

# ------------------------------------------------------------------------------------------------
# The three runs
# ------------------------------------------------------------------------------------------------
for name in $CONFIGS; do
    case $name in
        static_drained)      FLAGS=(--batching static --inflight_updates false) ;;
        continuous_drained)  FLAGS=(--batching continuous --inflight_updates false) ;;
        continuous_inflight) FLAGS=(--batching continuous --inflight_updates true) ;;
        colocated_inflight)  FLAGS=(--batching continuous --inflight_updates true) ;;
        tools_inflight)      FLAGS=(--batching continuous --inflight_updates true
                                    --bench_tool_latency_s "$TOOL_LATENCY_S" --bench_tool_turns "$TOOL_TURNS") ;;
        lora_inflight)       FLAGS=(--batching continuous --inflight_updates true --lora_rank "$LORA_RANK") ;;
        *) echo "unknown configuration '$name' in CONFIGS" >&2; exit 2 ;;
    esac
    out=$RESULTS_DIR/$name
    log=$RESULTS_DIR/run_$name.log
    rm -rf "$out"
    echo "[bench_infra] $(date -u +%T) $name: ${FLAGS[*]} (log: $log)"
    t0=$SECONDS
    echo "$name start $(cut -d' ' -f1-3 /proc/loadavg)" >>"$RESULTS_DIR/loadavg.txt"
    # shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
    RUN=("${LAUNCH[@]}")
    [[ $name == colocated_inflight ]] && RUN=("$PYTHON" grpo.py)
    if ! "${RUN[@]}" "${COMMON[@]}" $EXTRA_ARGS --output_dir "$out" "${FLAGS[@]}" >"$log" 2>&1; then
        echo "[bench_infra] $name FAILED after $(( SECONDS - t0 ))s. Errors in $log:" >&2
        grep -E "FATAL|Error|error:" "$log" | grep -v "elastic\|ChildFailedError" | head -n 10 >&2 || true
        echo "[bench_infra] the last 40 lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    echo "$name end $(cut -d' ' -f1-3 /proc/loadavg)" >>"$RESULTS_DIR/loadavg.txt"
    rm -rf "$out/checkpoints"  # the final checkpoint grpo.py always writes: not part of the benchmark
    if (( NODE_RANK == 0 )) && [[ ! -f $out/summary.json ]]; then
        echo "[bench_infra] $name exited 0 but wrote no $out/summary.json; the last 40 lines of $log:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    echo "[bench_infra] $(date -u +%T) $name done in $(( SECONDS - t0 ))s: $(grep -o '"steps": [0-9]*' "$out/summary.json" 2>/dev/null || echo 'actor node')"
done

if (( NODE_RANK == 0 )); then
    report "$RESULTS_DIR"
fi
