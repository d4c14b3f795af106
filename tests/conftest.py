"""Session fixtures: the toy model, tokenizer and data are built once, offline, from a seed."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Offline and small: no hub look-ups, no wandb network, a small vLLM KV cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import toy  # noqa: E402


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory):
    """A randomly initialised tiny Olmo3ForCausalLM with the Olmo 3 tokenizer and template."""
    return toy.write_model(str(tmp_path_factory.mktemp("toy_model")), seed=0)


@pytest.fixture(scope="session")
def toy_data_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("toy_data"))
    toy.write_data(out, seed=0)
    return out


@pytest.fixture(scope="session")
def toy_sft_model_dir(toy_model_dir, toy_data_dir, tmp_path_factory):
    """The toy model after a short `sft.py` run: it solves some toy problems, not all (room for RL)."""
    out = str(tmp_path_factory.mktemp("toy_sft"))
    cmd = [sys.executable, os.path.join(REPO, "sft.py"), *SFT_FIXTURE_ARGS,
           "--model_name_or_path", toy_model_dir,
           "--dataset_mixer_list", os.path.join(toy_data_dir, "sft.jsonl"), "1.0",
           "--output_dir", out]
    # One intra-op thread: on two shared cores, two threads per process make a tiny model's steps
    # ten times slower as soon as anything else runs (measured: 12 s vs 1.2 s per step).
    subprocess.run(cmd, check=True, cwd=REPO, timeout=1200, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out


# Short enough for the test suite, long enough that the model learns the format and part of the task.
SFT_FIXTURE_ARGS = ["--num_train_epochs", "1", "--learning_rate", "3e-3", "--per_device_train_batch_size", "32",
                    "--gradient_accumulation_steps", "1", "--warmup_ratio", "0.05", "--max_seq_length", "256",
                    "--save_steps", "0", "--seed", "0", "--report_to", "none"]
