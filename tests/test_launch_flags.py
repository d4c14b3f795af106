"""Every flag of open-instruct's Olmo 3 launch scripts, parsed by the stage that does that step.

The flag lists are copied from allenai/open-instruct scripts/train/olmo3/ (the mason.py / accelerate /
torchrun launcher flags before the training script are left out; shell variables are filled in with
the values the scripts set). The SFT scripts there run OLMo-core's trainer, so their flags are
OLMo-core's; the open-instruct finetune.py / dpo_tune_cache.py names of the same options follow in
their own lists. Each flag is either taken with the same meaning (the test names the field it sets and
the value), taken because it asks for what the script does anyway (`SAME`: nothing changes), or refused
with a message naming what to use instead (`REFUSED`, with a piece of that message).
"""

import dataclasses

import pytest

import chat_template
import dpo
import grpo
import sft

SAME, REFUSED = "same", "refused"
MODULES = {"sft": sft, "dpo": dpo, "grpo": grpo}


def parse(stage, argv):
    module = MODULES[stage]
    return chat_template.parse_stage_args(module.Args, module.UNSUPPORTED_FLAGS, argv)


# (flag, values, expectation); expectation: (field, value) | SAME | (REFUSED, text the message must contain)
THINK_SFT = ("/weka/oe-adapt-default/saumyam/checkpoints/olmo2-7B-sft/rl-sft/"
             "olmo2.5-6T-LC-sigma-reasoning-mix-decontam-v2-special-tokens-v3-think-FIX")  # 7b_think_dpo.sh MODEL_NAME
INSTRUCT_DPO = ("/weka/oe-adapt-default/scottg/olmo/merging/ckpts/olmo3-instruct-dpo-1116-vibes/"
                "olmo3-7b-DPO-1115-newb-tpc-d5-lbc100-bal-1e-6-1__42__1763293644")  # 7b_instruct_rl.sh
INSTRUCT_MIX = "allenai/olmo-3-pref-mix-deltas-complement2-DECON-tpc-kwd-ch-dedup5-lbc100-grafmix-unbal"
SCRIPTS = {
    # scripts/train/olmo3/7b_think_sft.sh (OLMo-core; LR=5e-5)
    ("sft", "7b_think_sft.sh"): [
        ("--trainer.callbacks.wandb.enabled=True", [], (REFUSED, "--report_to wandb")),
        ("--trainer.max_duration.value=2", [], (REFUSED, "--num_train_epochs")),
        ("--train_module.optim.lr=5e-5", [], (REFUSED, "--learning_rate")),
        ("--seq_len=32768", [], (REFUSED, "--max_seq_length with --packing")),
        ("--launch.num_gpus=8", [], (REFUSED, "torchrun --nproc-per-node")),
        ("--num_nodes=8", [], (REFUSED, "torchrun --nnodes")),
        ("--global_batch_size=1048576", [], (REFUSED, "per_device_train_batch_size x gradient_accumulation_steps")),
        ("--model_name=olmo2.5-7b-yarn-fullonly", [], (REFUSED, "--model_name_or_path")),
        ("--budget=ai2/oe-adapt", [], (REFUSED, "not needed here")),
        ("--workspace=ai2/olmo-instruct", [], (REFUSED, "not needed here")),
        ("--dataset_path=/weka/oe-training-default/ai2-llm/jacobm/data/sft/rl-sft-32k/reasoning-mix-decontam-v2-"
         "special-tokens-v3-think-FIX", [], (REFUSED, "--dataset_mixer_list")),
        ("--launch.priority=urgent", [], (REFUSED, "not needed here")),
    ],
    # scripts/train/olmo3/7b_instruct_sft.sh (OLMo-core; LR=8e-5): the same flags, other values
    ("sft", "7b_instruct_sft.sh"): [
        ("--trainer.callbacks.wandb.enabled=True", [], (REFUSED, "--report_to wandb")),
        ("--trainer.max_duration.value=2", [], (REFUSED, "--num_train_epochs")),
        ("--train_module.optim.lr=8e-5", [], (REFUSED, "--learning_rate")),
        ("--seq_len=32768", [], (REFUSED, "--max_seq_length")),
        ("--launch.num_gpus=8", [], (REFUSED, "--nproc-per-node")),
        ("--num_nodes=4", [], (REFUSED, "--nnodes")),
        ("--global_batch_size=1048576", [], (REFUSED, "rows")),
        ("--model_name=olmo3-7b", [], (REFUSED, "--model_name_or_path")),
        ("--budget=ai2/oe-adapt", [], (REFUSED, "not needed here")),
        ("--workspace=ai2/olmo-instruct", [], (REFUSED, "not needed here")),
        ("--dataset_path=gs://ai2-llm/jacobm/data/sft/rl-sft-32k/olmo3-32b-instruct-sft-1114", [],
         (REFUSED, "--dataset_mixer_list")),
        ("--launch.priority=urgent", [], (REFUSED, "not needed here")),
    ],
    # open-instruct finetune.py names of the SFT options (not in the Olmo 3 scripts, which use OLMo-core)
    ("sft", "finetune.py names"): [
        ("--model_name_or_path", ["allenai/Olmo-3-1025-7B"], ("model_name_or_path", "allenai/Olmo-3-1025-7B")),
        ("--dataset_mixer_list", ["allenai/Dolci-Think-SFT-7B", "1.0"],
         ("dataset_mixer_list", ["allenai/Dolci-Think-SFT-7B", "1.0"])),
        ("--dataset_mixer_list_splits", ["train"], ("dataset_mixer_list_splits", ["train"])),
        ("--max_seq_length", ["32768"], ("max_seq_length", 32768)),
        ("--learning_rate", ["5e-5"], ("learning_rate", 5e-5)),
        ("--lr_scheduler_type", ["linear"], ("lr_scheduler_type", "linear")),
        ("--warmup_ratio", ["0.03"], ("warmup_ratio", 0.03)),
        ("--num_train_epochs", ["2"], ("num_train_epochs", 2)),
        ("--max_train_steps", ["1000"], ("max_steps", 1000)),
        ("--clip_grad_norm", ["1.0"], ("max_grad_norm", 1.0)),
        ("--checkpointing_steps", ["500"], ("save_steps", 500)),
        ("--chat_template_name", ["olmo3-instruct-dev"], ("chat_template", "olmo3-instruct-dev")),
        ("--gradient_checkpointing", [], ("gradient_checkpointing", True)),
        ("--report_to", ["wandb"], ("report_to", "wandb")),
        ("--wandb_project_name", ["olmo3-sft"], ("wandb_project", "olmo3-sft")),
        ("--exp_name", ["olmo3_7b_think_sft"], ("run_name", "olmo3_7b_think_sft")),
        ("--with_tracking", [], (REFUSED, "--report_to wandb")),
        # as the code picks it: flash attention 2 when installed and one row a forward, else sdpa
        ("--use_flash_attn", [], (REFUSED, "flash_attn package is installed and a forward holds one row")),
        ("--lr", ["5e-5"], (REFUSED, "--learning_rate")),
    ],
    # scripts/train/olmo3/7b_think_dpo.sh (open_instruct/dpo_tune_cache.py)
    ("dpo", "7b_think_dpo.sh"): [
        ("--exp_name", ["sm0922-rsn-dpo-delta-yolo_scottmix1_150k-8e-8"],
         ("run_name", "sm0922-rsn-dpo-delta-yolo_scottmix1_150k-8e-8")),
        ("--model_name_or_path", [THINK_SFT], ("model_name_or_path", THINK_SFT)),
        ("--tokenizer_name", [THINK_SFT], (REFUSED, "--model_name_or_path")),
        ("--use_slow_tokenizer", ["False"], SAME),
        ("--dataset_mixer_list", ["scottgeng00/olmo-3-preference-mix-deltas_reasoning-yolo_scottmix-DECON", "1.0"],
         ("dataset_mixer_list", ["scottgeng00/olmo-3-preference-mix-deltas_reasoning-yolo_scottmix-DECON", "1.0"])),
        ("--max_seq_length", ["16384"], ("max_seq_length", 16384)),
        ("--per_device_train_batch_size", ["1"], ("per_device_train_batch_size", 1)),
        ("--gradient_accumulation_steps", ["4"], ("gradient_accumulation_steps", 4)),
        ("--learning_rate", ["8e-8"], ("learning_rate", 8e-8)),
        ("--lr_scheduler_type", ["linear"], ("lr_scheduler_type", "linear")),
        ("--warmup_ratio", ["0.1"], ("warmup_ratio", 0.1)),
        ("--weight_decay", ["0.0"], ("weight_decay", 0.0)),
        ("--num_train_epochs", ["1"], ("num_train_epochs", 1)),
        ("--logging_steps", ["1"], ("logging_steps", 1)),
        ("--dpo_loss_type", ["dpo_norm"], ("loss_type", "dpo_norm")),
        ("--dpo_beta", ["5"], ("beta", 5.0)),
        ("--use_flash_attn", [], (REFUSED, "sdpa")),
        ("--gradient_checkpointing", [], ("gradient_checkpointing", True)),
        ("--report_to", ["wandb"], ("report_to", "wandb")),
        ("--chat_template_name", ["olmo_thinker"], ("chat_template", "olmo_thinker")),
        ("--with_tracking", [], (REFUSED, "--report_to wandb")),
        ("--eval_workspace", ["usable-olmo"], (REFUSED, "not needed here")),
        ("--eval_priority", ["high"], (REFUSED, "not needed here")),
        ("--oe_eval_max_length", ["32768"], (REFUSED, "not needed here")),
        ("--oe_eval_gpu_multiplier", ["2"], (REFUSED, "not needed here")),
        ("--max_train_samples", ["150000"], (REFUSED, "a row count as the amount in --dataset_mixer_list")),
        ("--oe_eval_tasks", ["zebralogic::hamish_zs_reasoning_deepseek,ifeval::hamish_zs_reasoning_deepseek"],
         (REFUSED, "not needed here")),
    ],
    # scripts/train/olmo3/7b_instruct_dpo.sh (LR=1e-6), flags the think script does not have or sets otherwise
    ("dpo", "7b_instruct_dpo.sh"): [
        ("--dataset_mixer_list", [INSTRUCT_MIX, "125000", "allenai/related-query_qwen_pairs_filtered_lbc100", "1250"],
         ("dataset_mixer_list", [INSTRUCT_MIX, "125000", "allenai/related-query_qwen_pairs_filtered_lbc100", "1250"])),
        ("--zero_hpz_partition_size", ["1"], (REFUSED, "FSDP2")),
        ("--learning_rate", ["1e-6"], ("learning_rate", 1e-6)),
        ("--chat_template_name", ["olmo123"], SAME),  # not an open-instruct template: the tokenizer's own
        ("--dpo_loss_type", ["dpo_norm"], ("loss_type", "dpo_norm")),
        ("--dpo_beta", ["5"], ("beta", 5.0)),
    ],
    # open-instruct dpo_tune_cache.py names from the issue, not in the Olmo 3 scripts
    ("dpo", "dpo_tune_cache.py names"): [
        ("--max_train_steps", ["100"], ("max_steps", 100)),
        ("--clip_grad_norm", ["1.0"], ("max_grad_norm", 1.0)),
        ("--checkpointing_steps", ["200"], ("save_steps", 200)),
        ("--dataset_mixer_list_splits", ["train"], ("dataset_mixer_list_splits", ["train"])),
        ("--dataset_mixer_eval_list", ["a.jsonl", "100"], ("eval_dataset_mixer_list", ["a.jsonl", "100"])),
        ("--wandb_project_name", ["olmo3-dpo"], ("wandb_project", "olmo3-dpo")),
        ("--deepspeed_stage", ["3"], (REFUSED, "FSDP2")),
        ("--mixer_list", ["a.jsonl", "1.0"], ("dataset_mixer_list", ["a.jsonl", "1.0"])),  # an older name
        ("--lr", ["1e-6"], (REFUSED, "--learning_rate")),
    ],
    # scripts/train/olmo3/7b_think_rl.sh (open_instruct/grpo_fast.py)
    ("grpo", "7b_think_rl.sh"): [
        ("--exp_name", ["pipelinerl_7b_olmo3_thinker"], ("run_name", "pipelinerl_7b_olmo3_thinker")),
        ("--beta", ["0.0"], ("beta", 0.0)),
        ("--num_samples_per_prompt_rollout", ["8"], ("num_samples_per_prompt", 8)),
        ("--num_unique_prompts_rollout", ["64"], ("num_unique_prompts_per_step", 64)),
        ("--num_mini_batches", ["1"], ("num_mini_batches", 1)),
        ("--num_epochs", ["1"], ("num_epochs", 1)),
        ("--learning_rate", ["1e-6"], ("learning_rate", 1e-6)),
        ("--per_device_train_batch_size", ["1"], SAME),
        ("--output_dir", ["/output"], ("output_dir", "/output")),
        ("--kl_estimator", ["kl3"], SAME),
        ("--dataset_mixer_list", ["allenai/Dolci-Think-RL-7B", "1.0"],
         ("dataset_mixer_list", ["allenai/Dolci-Think-RL-7B", "1.0"])),
        ("--dataset_mixer_list_splits", ["train"], ("dataset_mixer_list_splits", ["train"])),
        ("--dataset_mixer_eval_list", ["allenai/Dolci-Think-RL-7B", "8"],
         ("eval_dataset_mixer_list", ["allenai/Dolci-Think-RL-7B", "8"])),
        ("--dataset_mixer_eval_list_splits", ["train"], ("eval_dataset_mixer_list_splits", ["train"])),
        ("--max_token_length", ["10240"], (REFUSED, "--max_prompt_length")),
        ("--max_prompt_token_length", ["2048"], ("max_prompt_length", 2048)),
        ("--response_length", ["32768"], ("max_response_length", 32768)),
        ("--pack_length", ["35840"], ("pack_length", 35840)),
        ("--model_name_or_path", ["allenai/Olmo-3-7B-Think-DPO"],
         ("model_name_or_path", "allenai/Olmo-3-7B-Think-DPO")),
        ("--chat_template_name", ["olmo_thinker"], ("chat_template", "olmo_thinker")),
        ("--non_stop_penalty", ["False"], SAME),
        ("--mask_truncated_completions", ["False"], SAME),
        ("--temperature", ["1.0"], ("temperature", 1.0)),
        ("--ground_truths_key", ["ground_truth"], SAME),
        ("--sft_messages_key", ["messages"], SAME),
        ("--total_episodes", ["10000000"], (REFUSED, "--num_training_steps")),
        ("--deepspeed_stage", ["3"], (REFUSED, "FSDP2")),
        ("--num_learners_per_node", ["8", "8"], (REFUSED, "--num_learners")),
        ("--vllm_num_engines", ["16"], (REFUSED, "the number of actor ranks")),
        ("--vllm_tensor_parallel_size", ["1"], SAME),
        ("--lr_scheduler_type", ["constant"], ("lr_scheduler_type", "constant")),
        ("--apply_verifiable_reward", ["true"], SAME),
        ("--seed", ["1"], ("seed", 1)),
        ("--local_eval_every", ["50"], ("eval_every", 50)),
        ("--save_freq", ["25"], ("save_steps", 25)),
        ("--beaker_eval_freq", ["50"], (REFUSED, "not needed here")),
        ("--eval_priority", ["urgent"], (REFUSED, "not needed here")),
        ("--try_launch_beaker_eval_jobs_on_weka", ["True"], (REFUSED, "not needed here")),
        ("--gradient_checkpointing", [], ("gradient_checkpointing", True)),
        ("--with_tracking", [], (REFUSED, "--report_to wandb")),
        ("--llm_judge_model", ["hosted_vllm/Qwen/Qwen3-32B"], (REFUSED, "JUDGE_BASE_URL")),
        ("--llm_judge_timeout", ["600"], (REFUSED, "--verifier_timeout")),
        ("--llm_judge_max_tokens", ["2048"], (REFUSED, "not needed here")),
        ("--llm_judge_max_context_length", ["32768"], (REFUSED, "not needed here")),
        ("--clip_higher", ["0.272"], ("clip_high", 0.272)),
        ("--allow_world_padding", ["False"], SAME),
        ("--use_fp8_kv_cache", ["False"], SAME),
        ("--code_api_url", ["https://p9f1719l7f.execute-api.us-west-2.amazonaws.com/prod/test_program"],
         (REFUSED, "local sandbox")),
        ("--code_pass_rate_reward_threshold", ["0.99"], (REFUSED, "fraction of tests passed")),
        ("--oe_eval_max_length", ["32768"], (REFUSED, "not needed here")),
        ("--checkpoint_state_freq", ["100"], (REFUSED, "--save_steps")),
        ("--backend_timeout", ["1200"], (REFUSED, "--timeout_s")),
        ("--inflight_updates", ["true"], ("inflight_updates", True)),
        ("--async_steps", ["8"], ("async_steps", 8)),
        ("--advantage_normalization_type", ["centered"], ("advantage_normalization", "centered")),
        ("--truncated_importance_sampling_ratio_cap", ["2.0"], ("tis_cap", 2.0)),
        ("--oe_eval_beaker_image", ["oe-eval-beaker/oe_eval_olmo2_retrofit_auto"], (REFUSED, "not needed here")),
        ("--oe_eval_tasks", ["mmlu:cot::hamish_zs_reasoning_deepseek,ifeval::hamish_zs_reasoning_deepseek"],
         (REFUSED, "not needed here")),
    ],
    # scripts/train/olmo3/7b_instruct_rl.sh; its --dataset_mixer_list names an unset shell variable, so the
    # mix the script defines (nonreasoner_integration_mix_decon, first two sources) stands in for it
    ("grpo", "7b_instruct_rl.sh"): [
        ("--exp_name", ["grpo_math_only_p64_4_8k_olmo3-instruct-dpo-hpz1"],
         ("run_name", "grpo_math_only_p64_4_8k_olmo3-instruct-dpo-hpz1")),
        ("--beta", ["0.0"], ("beta", 0.0)),
        ("--num_samples_per_prompt_rollout", ["8"], ("num_samples_per_prompt", 8)),
        ("--num_unique_prompts_rollout", ["64"], ("num_unique_prompts_per_step", 64)),
        ("--num_mini_batches", ["4"], ("num_mini_batches", 4)),
        ("--num_epochs", ["1"], ("num_epochs", 1)),
        ("--learning_rate", ["1e-6"], ("learning_rate", 1e-6)),
        ("--per_device_train_batch_size", ["1"], SAME),
        ("--kl_estimator", ["2"], SAME),
        ("--dataset_mixer_list", ["hamishivi/rlvr_acecoder_filtered_filtered", "20000",
                                  "hamishivi/omega-combined-no-boxed_filtered", "20000"],
         ("dataset_mixer_list", ["hamishivi/rlvr_acecoder_filtered_filtered", "20000",
                                 "hamishivi/omega-combined-no-boxed_filtered", "20000"])),
        ("--dataset_mixer_list_splits", ["train"], ("dataset_mixer_list_splits", ["train"])),
        ("--dataset_mixer_eval_list", ["hamishivi/omega-combined", "4", "allenai/IF_multi_constraints_upto5", "4"],
         ("eval_dataset_mixer_list", ["hamishivi/omega-combined", "4", "allenai/IF_multi_constraints_upto5", "4"])),
        ("--dataset_mixer_eval_list_splits", ["train"], ("eval_dataset_mixer_list_splits", ["train"])),
        ("--max_prompt_token_length", ["2048"], ("max_prompt_length", 2048)),
        ("--response_length", ["8192"], ("max_response_length", 8192)),
        ("--pack_length", ["11264"], ("pack_length", 11264)),
        ("--model_name_or_path", [INSTRUCT_DPO], ("model_name_or_path", INSTRUCT_DPO)),
        ("--chat_template_name", ["olmo123"], SAME),
        ("--stop_strings", ["</answer>"], (REFUSED, "eos or --max_response_length")),
        ("--non_stop_penalty", ["False"], SAME),
        ("--temperature", ["1.0"], ("temperature", 1.0)),
        ("--total_episodes", ["1024000"], (REFUSED, "--num_training_steps")),
        ("--deepspeed_stage", ["3"], (REFUSED, "FSDP2")),
        ("--num_learners_per_node", ["8"], (REFUSED, "--num_learners")),
        ("--lr_scheduler_type", ["constant"], ("lr_scheduler_type", "constant")),
        ("--apply_verifiable_reward", ["true"], SAME),
        ("--seed", ["1"], ("seed", 1)),
        ("--local_eval_every", ["50"], ("eval_every", 50)),
        ("--save_freq", ["50"], ("save_steps", 50)),
        ("--checkpoint_state_freq", ["50"], (REFUSED, "--save_steps")),
        ("--beaker_eval_freq", ["50"], (REFUSED, "not needed here")),
        ("--gradient_checkpointing", [], ("gradient_checkpointing", True)),
        ("--with_tracking", [], (REFUSED, "--report_to wandb")),
        ("--vllm_enable_prefix_caching", [], SAME),
        ("--clip_higher", ["0.272"], ("clip_high", 0.272)),
        ("--mask_truncated_completions", ["False"], SAME),
        ("--llm_judge_model", ["hosted_vllm/Qwen/Qwen3-32B"], (REFUSED, "JUDGE_MODEL")),
        ("--llm_judge_timeout", ["600"], (REFUSED, "--verifier_timeout")),
        ("--llm_judge_max_tokens", ["2048"], (REFUSED, "not needed here")),
        ("--llm_judge_max_context_length", ["32768"], (REFUSED, "not needed here")),
        ("--oe_eval_max_length", ["32768"], (REFUSED, "not needed here")),
        ("--try_launch_beaker_eval_jobs_on_weka", ["True"], (REFUSED, "not needed here")),
        ("--oe_eval_tasks", ["gpqa:0shot_cot::qwen3-instruct,ifeval::hamish_zs_reasoning_deepseek"],
         (REFUSED, "not needed here")),
        ("--eval_priority", ["urgent"], (REFUSED, "not needed here")),
        ("--code_pass_rate_reward_threshold", ["0.99"], (REFUSED, "fraction of tests passed")),
        ("--inflight_updates", ["true"], ("inflight_updates", True)),
        ("--async_steps", ["8"], ("async_steps", 8)),
        ("--active_sampling", [], SAME),
        ("--advantage_normalization_type", ["centered"], ("advantage_normalization", "centered")),
        ("--no_resampling_pass_rate", ["0.875"], (REFUSED, "not supported")),
    ],
    # other open-instruct grpo_fast.py names from the issue
    ("grpo", "grpo_fast.py names"): [
        ("--clip_lower", ["0.2"], ("clip_low", 0.2)),
        ("--wandb_project_name", ["olmo3-rl"], ("wandb_project", "olmo3-rl")),
        ("--vllm_enforce_eager", [], ("enforce_eager", True)),
        ("--vllm_tensor_parallel_size", ["2"], ("vllm_tensor_parallel_size", 2)),
        ("--lr", ["1e-6"], (REFUSED, "--learning_rate")),
    ],
}
CASES = [(stage, script, flag, values, expect) for (stage, script), flags in SCRIPTS.items()
         for flag, values, expect in flags]


def _id(case):
    return f"{case[1]}:{case[2].split('=')[0]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_each_flag_is_taken_with_its_meaning_or_refused_with_a_replacement(case):
    stage, _, flag, values, expect = case
    default = parse(stage, [])
    if isinstance(expect, tuple) and expect[0] == REFUSED:
        with pytest.raises(SystemExit) as e:
            parse(stage, [flag, *values])
        message = str(e.value.code)
        assert flag.split("=")[0] in message.split(":")[0] and expect[1] in message, message
        return
    args = parse(stage, [flag, *values])
    if expect == SAME:
        assert args == default  # taken, and it asks for what the script does anyway
        return
    field, value = expect
    assert getattr(args, field) == value
    changed = {f.name for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(default, f.name)}
    assert changed <= {field}, changed  # nothing else moved


@pytest.mark.parametrize("stage,script", list(SCRIPTS))
def test_whole_script_minus_its_refused_flags_parses(stage, script):
    """The taken flags parse together (one command line), and the first refused one stops it."""
    flags = SCRIPTS[(stage, script)]
    taken = [tok for flag, values, expect in flags if not (isinstance(expect, tuple) and expect[0] == REFUSED)
             for tok in (flag, *values)]
    args = parse(stage, taken)
    for flag, values, expect in flags:
        if isinstance(expect, tuple) and expect[0] != REFUSED:
            assert getattr(args, expect[0]) == expect[1], flag
    refused = [(flag, values) for flag, values, expect in flags if isinstance(expect, tuple) and expect[0] == REFUSED]
    if refused:
        with pytest.raises(SystemExit, match=refused[0][0].split("=")[0]):
            parse(stage, taken + [refused[0][0], *refused[0][1]])


def test_flag_counts_per_script():
    """accepted (same meaning, or asking for what the script does) / refused with a replacement."""
    counts = {script: (sum(1 for *_, e in flags if not (isinstance(e, tuple) and e[0] == REFUSED)),
                       sum(1 for *_, e in flags if isinstance(e, tuple) and e[0] == REFUSED))
              for (_, script), flags in SCRIPTS.items()}
    assert counts == {"7b_think_sft.sh": (0, 12), "7b_instruct_sft.sh": (0, 12), "finetune.py names": (16, 3),
                      "7b_think_dpo.sh": (18, 9), "7b_instruct_dpo.sh": (5, 1), "dpo_tune_cache.py names": (7, 2),
                      "7b_think_rl.sh": (38, 20), "7b_instruct_rl.sh": (33, 17), "grpo_fast.py names": (4, 1)}


def test_no_prefix_matching_and_unknown_flags_fail():
    for stage in MODULES:
        with pytest.raises(SystemExit, match="--learning_rate"):
            parse(stage, ["--lr", "1e-5"])
        with pytest.raises(SystemExit, match="unrecognized arguments: --learning_r"):
            parse(stage, ["--learning_r", "1e-5"])  # a prefix is not expanded
    assert parse("grpo", ["--response_length", "100"]).max_response_length == 100  # an alias, not a prefix


@pytest.mark.parametrize("stage", list(MODULES))
def test_help_shows_open_instruct_aliases(stage, capsys):
    with pytest.raises(SystemExit):
        parse(stage, ["--help"])
    text = capsys.readouterr().out
    for name in ("--chat_template_name", "--wandb_project_name", "--exp_name", "--clip_grad_norm", "--mixer_list"):
        assert name in text, name


def test_one_name_per_idea_across_stages():
    """The same idea has the same flag in every stage: open-instruct's / Hugging Face's name."""
    for name in ("save_steps", "lr_scheduler_type", "learning_rate", "max_grad_norm", "report_to", "wandb_project",
                 "wandb_entity", "run_name", "dataset_mixer_list", "dataset_mixer_list_splits", "chat_template",
                 "gradient_checkpointing", "seed", "output_dir", "model_name_or_path"):
        for stage, module in MODULES.items():
            assert name in {f.name for f in dataclasses.fields(module.Args)}, (stage, name)
    for old in ("save_every", "lr_schedule"):
        assert old not in {f.name for f in dataclasses.fields(grpo.Args)}


@pytest.mark.parametrize("stage", list(MODULES))
def test_mixer_list_is_dataset_mixer_list_in_every_stage(stage):
    """`--mixer_list`, open-instruct's older name (a version of its 7b_think_dpo.sh uses it), is an alias."""
    assert parse(stage, ["--mixer_list", "a.jsonl", "0.5", "b.jsonl", "10"]).dataset_mixer_list == [
        "a.jsonl", "0.5", "b.jsonl", "10"]


@pytest.mark.parametrize("stage,flag,replacement", [
    ("grpo", "--max_steps", "--num_training_steps"), ("grpo", "--max_train_steps", "--num_training_steps"),
    ("grpo", "--eval_steps", "--eval_every"), ("dpo", "--num_training_steps", "--max_steps"),
    ("dpo", "--eval_every", "--eval_steps"), ("sft", "--num_training_steps", "--max_steps"),
    ("sft", "--eval_every", "no held-out evaluation")])
def test_other_stages_step_and_eval_flags_name_this_stages_own(stage, flag, replacement):
    """sft.py / dpo.py count --max_steps (-1: no limit) and --eval_steps (0: eval at the ends only); grpo.py's
    --num_training_steps and --eval_every (0: never) differ at those values, so they are refused, not aliased."""
    with pytest.raises(SystemExit) as e:
        parse(stage, [flag, "10"])
    message = str(e.value.code)
    assert message.startswith(f"{flag} 10:") and replacement in message, message


def test_dataset_mixer_list_splits_pick_each_sources_split(tmp_path):
    import datasets

    for name, splits in (("a", {"train": ["a-train"], "test": ["a-test"]}),
                         ("b", {"train": ["b-train"], "validation": ["b-dev"]})):
        datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
            str(tmp_path / name))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    mixed = chat_template.load_mixture([a, "1.0", b, "1.0"], split=["test", "validation"])
    assert sorted(mixed["text"]) == ["a-test", "b-dev"]
    assert sorted(chat_template.load_mixture([a, "1.0", b, "1.0"], split=["train"])["text"]) == ["a-train", "b-train"]
    with pytest.raises(ValueError, match="one per source"):
        chat_template.load_mixture([a, "1.0", b, "1.0"], split=["train", "test", "validation"])


def test_readme_olmo3_think_commands_parse():
    """The README's Olmo 3 7B Think SFT -> DPO -> RL commands parse, with the scripts' values."""
    import os
    import shlex

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        text = f.read()
    block = text.split("### The Olmo 3 7B Think recipe")[1].split("```bash")[1].split("```")[0]
    commands = {}
    for line in block.replace("\\\n", " ").splitlines():
        if "$TORCHRUN" in line and not line.lstrip().startswith("#"):
            script, *argv = shlex.split(line.split("$TORCHRUN", 1)[1])
            commands[script.removesuffix(".py")] = parse(script.removesuffix(".py"), argv)
    sft_args, dpo_args, rl = commands["sft"], commands["dpo"], commands["grpo"]
    assert (sft_args.num_train_epochs, sft_args.learning_rate, sft_args.max_seq_length, sft_args.packing) == (
        2, 5e-5, 32768, True)
    assert (dpo_args.loss_type, dpo_args.beta, dpo_args.learning_rate, dpo_args.gradient_accumulation_steps) == (
        "dpo_norm", 5.0, 8e-8, 4)
    assert (rl.num_learners, rl.num_samples_per_prompt, rl.num_unique_prompts_per_step, rl.max_response_length,
            rl.pack_length, rl.async_steps, rl.clip_high, rl.save_steps, rl.eval_every) == (
        16, 8, 64, 32768, 35840, 8, 0.272, 25, 50)
    assert rl.num_training_steps == 10000000 // (64 * 8)


@pytest.mark.slow
def test_wandb_follows_its_own_mode_with_project_entity_and_run_name(toy_model_dir, toy_data_dir, tmp_path):
    """No WANDB_MODE and no wandb login: the run is logged offline (wandb's own behaviour when not logged in),
    under the given project, entity and run name; WANDB_MODE=disabled writes nothing."""
    import glob
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), OMP_NUM_THREADS="1")
    runs = {}
    for mode in (None, "disabled"):
        out = str(tmp_path / f"run_{mode}")
        cmd = [sys.executable, "sft.py", "--model_name_or_path", toy_model_dir, "--dataset_mixer_list",
               os.path.join(toy_data_dir, "sft.jsonl"), "32", "--max_steps", "1", "--per_device_train_batch_size", "4",
               "--gradient_accumulation_steps", "1", "--save_steps", "0", "--report_to", "wandb",
               "--wandb_project_name", "olmo3-test", "--wandb_entity", "someone", "--exp_name", "flags-test",
               "--output_dir", out]
        result = subprocess.run(cmd, cwd=repo, env={**env, **({"WANDB_MODE": mode} if mode else {})},
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[mode] = glob.glob(os.path.join(out, "wandb", "offline-run-*"))
    assert len(runs[None]) == 1 and runs["disabled"] == []
    with open(glob.glob(os.path.join(runs[None][0], "run-*.wandb"))[0], "rb") as f:
        record = f.read()
    assert b"olmo3-test" in record and b"someone" in record and b"flags-test" in record


# -------------------------------------------------------------------------------------------------
# Every launch command in README fits its own memory plan at Olmo 3 7B's shape on 80 GB GPUs
# -------------------------------------------------------------------------------------------------
GPU_BYTES = 80 * 10 ** 9  # an 80 GB GPU (H100 / A100 80GB), counted low: torch reports 79-80 GiB
# Olmo 3 7B's published shape (allenai/Olmo-3-1025-7B config.json), built offline
OLMO3_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, vocab_size=100278, tie_word_embeddings=False)


def readme_launch_commands() -> list[tuple[str, int, list[str], str]]:
    """(stage, torchrun's processes per node x nodes, the script's argv, the command) of every `torchrun` or
    `python` launch of sft.py / dpo.py / grpo.py in README's bash blocks, continuation lines joined and
    `$VAR` of a `VAR="..."` line of the same block filled in. A trailing `...` (README's "and the flags
    above") is dropped: the command is planned with the flags it shows and the defaults."""
    import os
    import re
    import shlex

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    commands = []
    for block in blocks:
        variables = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if assignment := re.fullmatch(r'([A-Z_]+)="(.*)"', line):
                variables[assignment[1]] = assignment[2]
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            launch = re.search(r"(?:\btorchrun\b(.*?)|\bpython3?)\s+(sft|dpo|grpo)\.py(?:\s|$)(.*)", line)
            if line.startswith("#") or not launch:
                continue
            torchrun, stage, argv = launch.groups()
            processes = 1
            if torchrun is not None:  # processes per node x nodes; an expression ($(...)) is not a count
                per_node = re.search(r"--nproc[-_]per[-_]node[ =](\S+)", torchrun)
                nodes = re.search(r"--nnodes[ =](\d+)", torchrun)
                processes = (int(per_node[1]) if per_node and per_node[1].isdigit() else 0) * (
                    int(nodes[1]) if nodes else 1)
            argv = shlex.split(argv)
            commands.append((stage, processes, argv[:-1] if argv[-1:] == ["..."] else argv, line))
    return commands


def plan_at_7b(stage: str, processes: int, argv: list[str], config_dir: str) -> dict:
    """The stage's memory plan for this command on GPUs (bf16 by default there), per rank, as the script
    computes it before loading; without flash_attn (not in the requirements), so the (T, T) mask is counted."""
    args = parse(stage, argv + ["--model_name_or_path", config_dir])
    if stage in ("sft", "dpo"):  # build_model: FSDP2 over every rank, chosen on GPU when one rank cannot fit
        assert processes > 0, f"{stage}.py needs a literal --nproc-per-node to be planned"
        bf16 = True if args.bf16 is None else args.bf16
        rows = args.per_device_train_batch_size * (2 if stage == "dpo" else 1)  # dpo: chosen and rejected
        module = MODULES[stage]
        if not args.use_fsdp and module.plan_memory(args, 1, rows, bf16, False)["total"] > GPU_BYTES:
            args.use_fsdp = processes > 1
        return module.plan_memory(args, processes if args.use_fsdp else 1, rows, bf16, False)
    # grpo.py's load_policy: one packed row of forward_tokens per pass, weights sharded over the learners
    from transformers import AutoConfig

    pack_length = args.pack_length or args.max_prompt_length + args.max_response_length
    forward_tokens = args.forward_tokens or max(pack_length, 16384)
    plan = grpo.memory_plan(AutoConfig.from_pretrained(config_dir), forward_tokens, 1, args.num_learners,
                            True if args.bf16 is None else args.bf16, args.gradient_checkpointing,
                            args.logprob_chunk_size)
    if args.beta > 0:  # the frozen fp32 reference, unsharded on every learner
        plan["total"] += plan["weights"] * args.num_learners
    return plan


def test_every_readme_launch_command_fits_its_memory_plan_at_7b_on_80gb(tmp_path):
    """README's commands (one node, the Olmo 3 recipe on 4 nodes, the engine layouts) name Olmo 3 7B or its
    descendants: each must pass its stage's memory check on 80 GB GPUs, or it stops before loading. Without
    --gradient_checkpointing the DPO and RL commands of "Launch each stage" plan 214 and 227 GiB of activations."""
    from transformers import Olmo3Config

    Olmo3Config(**OLMO3_7B).save_pretrained(tmp_path)
    commands = readme_launch_commands()
    assert sorted({stage for stage, *_ in commands}) == ["dpo", "grpo", "sft"]
    assert len(commands) >= 8, [c for *_, c in commands]
    failures = []
    for stage, processes, argv, line in commands:
        plan = plan_at_7b(stage, processes, argv, str(tmp_path))
        if plan["total"] > GPU_BYTES:
            failures.append(f"{plan['total'] / 2 ** 30:.0f} GiB (activations {plan['activations'] / 2 ** 30:.0f})"
                            f": {line}")
    assert not failures, "\n".join(failures)


def test_readme_launch_plan_check_can_fail(tmp_path):
    """The check above sees a command that does not fit: the RL recipe without --gradient_checkpointing."""
    from transformers import Olmo3Config

    Olmo3Config(**OLMO3_7B).save_pretrained(tmp_path)
    (stage, processes, argv, _), = [c for c in readme_launch_commands()
                                    if c[0] == "grpo" and "--num_learners 16" in " ".join(c[2])]  # the recipe
    argv = [a for a in argv if a != "--gradient_checkpointing"]
    assert plan_at_7b(stage, processes, argv, str(tmp_path))["activations"] > GPU_BYTES
