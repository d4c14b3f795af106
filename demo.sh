#!/usr/bin/env bash
# The whole Olmo 3 post-training recipe in miniature, on a laptop CPU: SFT -> DPO -> RL.
#
#   make demo                      # installs .venv on first use, then runs this script
#   DEMO_DIR=out bash demo.sh      # same, with the venv's python on PATH or PYTHON=.venv/bin/python
#   DEMO_SEED=1 make demo          # another seed for the three training stages (docs/demo.md: what varies)
#
# Each stage starts from the previous stage's output (Olmo 3 sec 4: the final RL run starts from the DPO
# checkpoint); what the results table shows and what varies between runs: docs/demo.md.
# DEMO_SHORT=1 shrinks every stage to a smoke run (the test suite uses it); the numbers are then meaningless.
# A full run took 16 to 18 minutes on two idle CPU cores (AVX-512; 25 to 33 on an older machine).
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python}
OUT=${DEMO_DIR:-demo_output}
SHORT=${DEMO_SHORT:-0}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-disabled} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# vLLM logs each weight update at INFO (scheduler pause/resume, reload time): WARNING unless asked
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
# vLLM 0.32's CPU build touches torch.distributed.reduce_op (deprecated in torch) at import, in every process
# it starts: four lines of FutureWarning that nobody running the demo can act on
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning:vllm.triton_utils.dispatcher}
SEED=${DEMO_SEED:-0}  # the training stages' seed (data order, RL sampling); toy.py's model and data stay fixed
# Threads. The single-process stages (SFT, DPO, evaluation) use SOLO_THREADS intra-op threads
# (default: the core count, at most 4; on two idle cores 2 threads made an SFT step 1.75x faster).
# The RL stage runs two processes (learner, actor) with one thread each: on two cores, two threads
# per process were measured ten times slower than one.
SOLO_THREADS=${SOLO_THREADS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
solo() { OMP_NUM_THREADS=$SOLO_THREADS "$@"; }

if [ "$SHORT" = 1 ]; then
    SFT_ARGS=(--max_steps 4) DPO_ARGS=(--max_steps 3)
    RL_ARGS=(--num_training_steps 2 --eval_every 0 --num_unique_prompts_per_step 4 --num_samples_per_prompt 4)
    DATA_ARGS=(--num_sft 256 --num_preference 128 --num_rlvr 256 --num_eval 32)
else
    # SFT four epochs, DPO three, RL 40 steps at a constant lr (Olmo 3's schedule): docs/demo.md says why
    SFT_ARGS=(--num_train_epochs 4 --logging_steps 200) DPO_ARGS=(--num_train_epochs 3 --logging_steps 125)
    RL_ARGS=(--num_training_steps 40 --eval_every 20 --logging_steps 10)
    DATA_ARGS=()
fi

stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }
started=$(date +%s)

stage "1/5 toy model, tokenizer and tasks"
# toy.py: a tiny random Olmo3ForCausalLM and arithmetic tasks, SFT traces from a teacher with two slips
$PY toy.py model "$OUT/base"
$PY toy.py data "$OUT/data" "${DATA_ARGS[@]}"

stage "2/5 SFT (sft.py)"
# learns the task, and both of the teacher's slips
solo $PY sft.py --model_name_or_path "$OUT/base" --dataset_mixer_list "$OUT/data/sft.jsonl" 1.0 \
    --output_dir "$OUT/sft" --overwrite_output_dir --learning_rate 1e-3 --per_device_train_batch_size 32 \
    --gradient_accumulation_steps 1 --warmup_ratio 0.05 --max_seq_length 256 --save_steps 0 --seed "$SEED" \
    "${SFT_ARGS[@]}"

stage "3/5 DPO (dpo.py)"
# delta-learning pairs (a correct chosen answer, a rejected one that forgets every carry): fixes the carry
solo $PY dpo.py --model_name_or_path "$OUT/sft" --dataset_mixer_list "$OUT/data/preference.jsonl" 1.0 \
    --output_dir "$OUT/dpo" --overwrite_output_dir --learning_rate 1e-5 --per_device_train_batch_size 16 \
    --gradient_accumulation_steps 1 --max_seq_length 256 --save_steps 0 --seed "$SEED" \
    "${DPO_ARGS[@]}"

stage "4/5 RL (grpo.py: 1 learner rank + 1 vLLM actor rank)"
# OlmoRL with rewards from verifiers.py: fixes the box slip, which only the reward sees
echo "(vLLM's start-up WARNINGs are expected on a CPU: eager mode and no Triton or tcmalloc cost speed only)"
$PY -m torch.distributed.run --nproc-per-node 2 grpo.py --num_learners 1 \
    --model_name_or_path "$OUT/dpo" --output_dir "$OUT/rl" --overwrite_output_dir \
    --dataset_mixer_list "$OUT/data/rlvr.jsonl" 1.0 --eval_dataset_mixer_list "$OUT/data/eval.jsonl" 1.0 \
    --learning_rate 1e-4 --lr_scheduler_type constant --num_unique_prompts_per_step 16 --num_samples_per_prompt 8 \
    --max_response_length 64 --max_prompt_length 128 --max_num_seqs 64 --enforce_eager --seed "$SEED" \
    "${RL_ARGS[@]}"

stage "5/5 evaluation on the held-out split"
# greedy accuracy and sampled pass@1 of every checkpoint, a table like the report's Table 26, the curves
RL_FINAL=$(ls -d "$OUT"/rl/checkpoints/step_* | sort -V | tail -n 1)   # grpo.py's last checkpoint
solo $PY toy.py report --stage base="$OUT/base" --stage SFT="$OUT/sft" --stage DPO="$OUT/dpo" --stage RL="$RL_FINAL" \
    --eval_path "$OUT/data/eval.jsonl" --out_dir "$OUT"
echo "demo finished in $(( $(date +%s) - started )) s"
