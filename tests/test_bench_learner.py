"""bench_learner.py runs its FSDP2 learner step end to end (on CPU here, gloo: the GPU numbers need a GPU), with vLLM
hidden from it."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The GPU machines this benchmark is for may have no vLLM: it imports grpo.py, which must load without it.
_NO_VLLM = """
import sys
class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vLLM on this machine")
sys.meta_path.insert(0, NoVllm())
"""


def test_cpu_smoke_run_prints_plan_and_step(tmp_path):
    cmd = [sys.executable, "bench_learner.py", "--device", "cpu", "--num_layers", "2", "--hidden_size", "128",
           "--intermediate_size", "256", "--num_heads", "2", "--tokens", "512", "--vocab_size", "1000",
           "--logprob_chunk_size", "100"]
    (tmp_path / "sitecustomize.py").write_text(_NO_VLLM)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MASTER_PORT": "29531", "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "returned a view tensor" not in out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["shape"]["tokens"] == 512 and result["shape"]["attention"] == "sdpa"
    assert result["plan_gib"]["total"] > 0 and result["step_s"] > 0
    assert result["measured_peak_gib"] is None and result["mfu"] is None  # no GPU: no peak, no MFU
    assert "no vLLM on this machine" not in out.stderr
