#!/usr/bin/env bash
# Tool use in miniature, on a laptop CPU: SFT on function-calling traces, then RL with and without the tool.
#
#   make demo-tools                       # installs .venv on first use, then runs this script
#   DEMO_DIR=out bash demo_tools.sh       # same, with the venv's python on PATH or PYTHON=.venv/bin/python
#   DEMO_SEED=1 make demo-tools           # another seed for the training stages (docs/demo.md: what varies)
#
# The task (toy.py tool_data): sums and differences of two 4-digit numbers, which a tiny model cannot work out
# in its head but can with the `calculator` tool (toy.TOOLS). SFT traces, in Olmo 3's function-calling format,
# call the tool on half the problems it is offered on and box an estimate otherwise. From the SFT checkpoint,
# one RL run offers the tool (grpo.py --tools_module toy.py: multi-turn episodes) and one gets the same
# problems without it; the table gives each checkpoint's greedy accuracy on held-out problems with and without
# the tool, and its tool calls. About 8 minutes on two CPU cores (docs/demo.md).
# DEMO_SHORT=1 shrinks every stage to a smoke run; the numbers are then meaningless.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python}
OUT=${DEMO_DIR:-demo_tools_output}
SHORT=${DEMO_SHORT:-0}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}  # as in demo.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning:vllm.triton_utils.dispatcher}
SEED=${DEMO_SEED:-0}  # the training stages' seed; the toy model and data stay fixed
# Threads as in demo.sh: the single-process stages use SOLO_THREADS, each RL process one.
SOLO_THREADS=${SOLO_THREADS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
solo() { OMP_NUM_THREADS=$SOLO_THREADS "$@"; }

if [ "$SHORT" = 1 ]; then
    SFT_ARGS=(--max_steps 4)
    RL_ARGS=(--num_training_steps 2 --eval_every 0 --num_unique_prompts_per_step 4 --num_samples_per_prompt 4)
    DATA_ARGS=(--num_sft 64 --num_rlvr 64 --num_eval 16)
else
    # SFT: 300 steps of 16 conversations, by when the model copies the problem into the call and the result
    # into the box (docs/demo.md). RL: 12 steps of 8 prompts x 8 samples. 50 held-out problems.
    SFT_ARGS=(--max_steps 300)
    RL_ARGS=(--num_training_steps 12 --eval_every 0 --logging_steps 2)
    DATA_ARGS=(--num_eval 50)
fi

stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }
started=$(date +%s)

stage "1/5 toy model, tokenizer and tool task"
$PY toy.py model "$OUT/base"
$PY toy.py tool_data "$OUT/data" "${DATA_ARGS[@]}"

stage "2/5 SFT on function-calling traces (sft.py)"
# learns the call format, to copy the problem into the call and the result into the box, and the teacher's
# habit: an estimate instead of a call half the time
solo $PY sft.py --model_name_or_path "$OUT/base" --dataset_mixer_list "$OUT/data/sft_tools.jsonl" 1.0 \
    --output_dir "$OUT/sft" --overwrite_output_dir --learning_rate 2e-3 --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 1 --warmup_ratio 0.05 --lr_scheduler_type constant --max_seq_length 384 \
    --save_steps 0 --seed "$SEED" --logging_steps 50 "${SFT_ARGS[@]}"

rl() {  # rl NAME DATA [grpo.py flags...]: one RL run from the SFT checkpoint
    local name=$1 data=$2
    shift 2
    $PY -m torch.distributed.run --nproc-per-node 2 grpo.py --num_learners 1 \
        --model_name_or_path "$OUT/sft" --output_dir "$OUT/$name" --overwrite_output_dir \
        --dataset_mixer_list "$data" 1.0 \
        --learning_rate 1e-4 --lr_scheduler_type constant --num_unique_prompts_per_step 8 --num_samples_per_prompt 8 \
        --max_response_length 96 --max_prompt_length 256 --max_num_seqs 64 --enforce_eager --seed "$SEED" \
        --max_prompts_per_step_factor 2 "${RL_ARGS[@]}" "$@"
}

stage "3/5 RL with the tool (grpo.py --tools_module toy.py)"
# multi-turn episodes: a call's result comes back as an environment turn; only a right final answer is rewarded.
# Active sampling draws at most 2 x 8 prompts a step (--max_prompts_per_step_factor): once the model calls on
# every problem, most groups are all right and, uncapped, it drew up to 12 x 8 a step.
rl rl_tools "$OUT/data/rlvr_tools.jsonl" --tools_module toy.py --max_tool_turns 5

stage "4/5 RL without the tool (the same problems)"
# Without the tool almost no sample is right, so almost no group has an advantage to learn from
rl rl_notools "$OUT/data/rlvr_notools.jsonl"

stage "5/5 greedy tool episodes on the held-out problems"
last() { ls -d "$OUT/$1"/checkpoints/step_* | sort -V | tail -n 1; }  # grpo.py's last checkpoint
solo $PY toy.py tool_report --stage SFT="$OUT/sft" --stage "RL, tool"="$(last rl_tools)" \
    --stage "RL, no tool"="$(last rl_notools)" \
    --eval "with tool"="$OUT/data/eval_tools.jsonl" --eval "without"="$OUT/data/eval_notools.jsonl" --out_dir "$OUT"
echo "demo finished in $(( $(date +%s) - started )) s"
