"""grpo.py: unit tests of the pure pieces (loss, advantages, active sampling, off-policy bound, packing,
utilization math) against hand-computed values, the weight-transfer protocol on our gloo backend, then
end-to-end runs on the toy model (marked slow): an inflight weight update seen token by token, a colocated
run within the off-policy bound, torchrun learner + actor (weights streamed into the engine, no file), two
actors, one engine of two tensor-parallel workers, two nodes, a killed actor, a stopped engine, resume, two
FSDP2 learners that resume."""

import ast
import contextlib
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections import Counter

import pytest
import torch

import grpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLMO3_7B = grpo.ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                           vocab=100278)


# -------------------------------------------------------------------------------------------------
# Utilization math, Olmo 3 7B's shape
# -------------------------------------------------------------------------------------------------
def test_matmul_params_olmo3_7b():
    # per layer: q, k, v, o = 4 x 4096 x 4096 = 67,108,864; gated MLP 3 x 4096 x 11008 = 135,266,304
    assert OLMO3_7B.matmul_params() == 32 * (67_108_864 + 135_266_304) == 6_476_005_376
    assert OLMO3_7B.kv_bytes_per_token(2) == 2 * 32 * 32 * 128 * 2 == 524_288


@pytest.mark.parametrize("context, flops", [
    # 2 x 6,476,005,376 + 4 x 32 x 32 x 128 x c + 2 x 4096 x 100278 = 13,773,488,128 + 524,288 c
    (1, 13_773_488_128 + 524_288),
    (1000, 14_297_776_128),
    (32768, 30_953_357_312),
])
def test_decode_flops(context, flops):
    f, kv = grpo.decode_cost(OLMO3_7B, context, 2)
    assert f == flops
    assert kv == context * 524_288  # reads context-1 cached tokens' K and V, writes its own


def test_prefill_flops_is_causal():
    # 2 x 6,476,005,376 x 2048 + 524,288 x (2048 x 2049 / 2) + 2 x 4096 x 100278 (one sampled position)
    f, kv = grpo.prefill_cost(OLMO3_7B, 2048, 2)
    assert f == 26_525_718_020_096 + 1_100_048_498_688 + 821_477_376 == 27_626_587_996_160
    assert kv == 2048 * 524_288
    # the attention part is about half of a full p^2 (causal)
    attn = f - 2 * 6_476_005_376 * 2048 - 821_477_376
    assert attn / (524_288 * 2048 ** 2) == pytest.approx(0.5, rel=1e-3)


@pytest.mark.parametrize("batch, context", [(1, 1000), (16, 4096), (64, 1000), (256, 32768)])
def test_mbu_counts_weights_once_per_step(batch, context):
    weights = (6_476_005_376 + 410_738_688) * 2  # 13,773,488,128 bytes in bf16
    flops, nbytes = grpo.engine_step_cost(OLMO3_7B, [], [context] * batch, 2)
    assert nbytes == weights + batch * context * 524_288
    assert flops == batch * (13_773_488_128 + 524_288 * context)
    # the weights once per step, never once per sequence (what pushes MBU past 100% elsewhere)
    assert nbytes - batch * context * 524_288 == weights


def test_prefill_from_the_prefix_cache_is_not_charged():
    # a 2048-token prompt of which vLLM found 2000 in the prefix cache (the group's other samples):
    # 48 queries run, 2 x 6,476,005,376 matmul FLOPs each, attending to (2048*2049 - 2000*2001) / 2 =
    # 97,176 (query, key) pairs at 524,288 FLOPs, plus the LM head once (2 x 4096 x 100,278); 48 KV written
    flops, nbytes = grpo.engine_step_cost(OLMO3_7B, [(2048, 2000)], [], 2)
    assert flops == 2 * 6_476_005_376 * 48 + 524_288 * 97_176 + 821_477_376 == 673_466_204_160
    assert nbytes == 13_773_488_128 + 48 * 524_288
    assert grpo.engine_step_cost(OLMO3_7B, [(2048, 0)], [], 2) == grpo.engine_step_cost(OLMO3_7B, [2048], [], 2)


def test_mfu_mbu_hand_computed():
    # 64 sequences at context 1000, one decode step in 50 ms on an H100 (989e12 FLOP/s, 3.35e12 B/s)
    flops, nbytes = grpo.engine_step_cost(OLMO3_7B, [], [1000] * 64, 2)
    assert (flops, nbytes) == (915_057_672_192, 47_327_920_128)
    # through the metrics a run logs: one actor's stats for that step
    stats = {"actor": 0, "gen_tokens": 64, "elapsed": 0.05, "flops": flops, "bytes": nbytes, "peak_flops": 989e12,
             "peak_bw": 3.35e12, "peak_source": "given", "max_num_seqs": 64}
    m = grpo.rollout_metrics([], Counter(), [], [], [], [stats], grpo.Args())
    assert m["perf/actor_mfu"] == pytest.approx(915_057_672_192 / 0.05 / 989e12) == pytest.approx(0.0185047, rel=1e-5)
    assert m["perf/actor_mbu"] == pytest.approx(0.2825547, rel=1e-5)
    # a prefill of 2048 tokens plus 8 decodes in the same step: the weights still count once
    f2, b2 = grpo.engine_step_cost(OLMO3_7B, [2048], [1000] * 8, 2)
    assert f2 == 27_626_587_996_160 + 8 * 14_297_776_128
    assert b2 == 13_773_488_128 + 2048 * 524_288 + 8 * 1000 * 524_288
    # three engine steps merged into one report: weights three times
    assert grpo.engine_step_cost(OLMO3_7B, [], [10], 2, num_engine_steps=3)[1] == 3 * 13_773_488_128 + 10 * 524_288


SMOLLM2_135M = grpo.ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)


def test_smollm2_mfu_hand_check_and_the_engine_peaks():
    """The actor's MFU on SmolLM2-135M (134,515,008 parameters, the output head tied to the input embedding) by
    hand. A decode token costs 2 FLOPs per parameter: the embedding's gather is free, but the tied head's matmul
    is not, so the parameters count once; the norms (35,136 parameters) are not matmuls; attention adds
    4 x layers x heads x head_dim per key."""
    flops, _ = grpo.engine_step_cost(SMOLLM2_135M, [], [1], 4)
    assert flops == 2 * (134_515_008 - 35_136) + 4 * 30 * 9 * 64 == 268_959_744 + 69_120
    # The peak MFU divides by is the engine's: its workers measure it on the cores (or GPUs) they compute on, and a
    # tensor-parallel engine's workers add up. One worker bound to one core, measured at 97e9 FLOP/s:
    one = grpo.engine_peaks([(97e9, 20e9, "measured on cpu with 1 threads")])
    assert one[:2] == (97e9, 20e9) and "engine's worker" in one[2]
    assert grpo.engine_peaks([(989e12, 3.35e12, "datasheet")] * 2)[:2] == (2 * 989e12, 2 * 3.35e12)
    with pytest.raises(ValueError):
        grpo.engine_peaks([])
    peak_flops, peak_bw, source = grpo.resolve_peaks(0.0, 0.0, measure=lambda: one)
    assert (peak_flops, peak_bw, source) == one  # measured by the engine, not by the calling process
    assert grpo.resolve_peaks(5e9, 0.0, measure=lambda: one)[:2] == (5e9, 20e9)  # a given peak stays
    assert grpo.resolve_peaks(5e9, 6e9, measure=lambda: 1 / 0)[:2] == (5e9, 6e9)  # both given: nothing measured
    # the first RL step of issue #51's run under torchrun: 172 generated tokens/s on that core, decode alone (its
    # prefills add more) is MFU 0.48, where a 2-thread peak measured in the actor's process (both cores) logged 0.37
    stats = {"actor": 0, "gen_tokens": 172, "elapsed": 1.0, "flops": 172 * flops, "bytes": 0, "peak_flops": one[0],
             "peak_bw": one[1], "peak_source": one[2], "max_num_seqs": 32}
    m = grpo.rollout_metrics([], Counter(), [], [], [], [stats], grpo.Args())
    assert m["perf/actor_mfu"] == pytest.approx(172 * 269_028_864 / 97e9) == pytest.approx(0.477, abs=1e-3)


def test_static_waste_matches_paper():
    # Olmo 3 sec 4.4: mean 14628 at a max of 32000 -> 54% wasted
    assert grpo.static_waste([32000, 6000, 5884]) == pytest.approx((32000 - 14628) / 32000) == pytest.approx(0.542875)
    assert grpo.static_waste([10, 10]) == 0.0


def test_measured_peaks_on_cpu():
    flops, bw, source = grpo.measure_peaks("cpu")
    assert flops > 1e8 and bw > 1e8 and "measured" in source


# -------------------------------------------------------------------------------------------------
# Advantages, active sampling, off-policy bound
# -------------------------------------------------------------------------------------------------
def test_engine_gpus_learners_first_then_tensor_parallel_engines(monkeypatch):
    """Which GPUs an actor rank's engine gets: a node's learners take its first GPUs, one each, and each
    actor rank the next `tp`; CUDA_VISIBLE_DEVICES is honoured; a node short of GPUs stops with what to run."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # one node, torchrun --nproc-per-node 6 --num_learners 4 --vllm_tensor_parallel_size 2, 8 GPUs
    assert grpo.engine_gpus(4, 6, 4, 2, 8) == (4, "4,5") and grpo.engine_gpus(5, 6, 4, 2, 8) == (6, "6,7")
    # two nodes: 8 learners on one node, 4 engines of 2 GPUs on the other (no learner there)
    assert [grpo.engine_gpus(r, 4, 0, 2, 8) for r in (0, 3)] == [(0, "0,1"), (6, "6,7")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    assert grpo.engine_gpus(4, 6, 4, 2, 8) == (4, "3,2")
    with pytest.raises(SystemExit, match="--nproc-per-node = learners \\+ engines"):
        grpo.engine_gpus(4, 8, 4, 2, 8)  # 4 learners + 4 engines of 2 GPUs on 8 GPUs


def _nodes(*sizes):
    """(node, local rank) of each process in torchrun's rank order, nodes numbered in join order."""
    return [(n, i) for n, size in enumerate(sizes) for i in range(size)]


def test_roles_follow_each_nodes_process_count_whatever_order_nodes_join():
    """README's two-node launch: a node of 8 for 8 learners and a node of 4 engines. torchrun's c10d rendezvous
    numbers the nodes by host name, ignoring --node-rank: whichever joins first, the 8 learners are the node of 8
    (torchrun's own ranks would make the actor node's 4 processes learners 0-3). One node, or equal nodes, keep
    torchrun's ranks; learners that fill no whole node take the first local ranks of the largest other one."""
    learner_node_first, actor_node_first = _nodes(8, 4), _nodes(4, 8)
    roles = grpo.assign_roles(learner_node_first, 8)
    assert roles == list(range(12))
    roles = grpo.assign_roles(actor_node_first, 8)
    assert sorted(roles[4:]) == list(range(8)) and sorted(roles[:4]) == list(range(8, 12))
    assert roles[4] == 0  # learner 0: the learner node's first process
    assert grpo.assign_roles(_nodes(6), 4) == list(range(6))  # one node: torchrun's ranks
    assert grpo.assign_roles(_nodes(8, 8, 8, 8), 16) == list(range(32))
    # 12 learners on 8 + 8: one whole node, then the first 4 local ranks of the other
    roles = grpo.assign_roles(_nodes(8, 8), 12)
    assert roles == list(range(8)) + [8, 9, 10, 11, 12, 13, 14, 15]
    roles = grpo.assign_roles(_nodes(2, 1), 1)  # a node of 2 engines joined first, the learner's node of 1 second
    assert roles[2] == 0 and sorted(roles[:2]) == [1, 2]


def test_gloo_weight_transfer_round_trip_checks_before_loading():
    """learner 0 -> one worker through vLLM's weight-transfer protocol on our gloo backend, both ends in this
    process: the real Link (colocated) is the trainer engine's client, and a thread stands in for the actor,
    making the calls it gets on a worker engine from vLLM's factory (its model a stand-in recording what
    load_weights gets). vLLM's send_weights makes the four calls in order; the worker loads exactly the sender's
    tensors, in the training dtype; an update sent before the engine took the one before still completes (the
    worker holds it: learner 0 does not wait for the engine's next step); an update with a non-finite value fails
    before anything of it loads."""
    from types import SimpleNamespace

    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    loads, calls, errors, go = [], [], [], threading.Event()
    model = SimpleNamespace(load_weights=lambda weights: loads.append({k: v.clone() for k, v in weights}))
    worker = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=grpo.GLOO_BACKEND),
        SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None), torch.device("cpu"), model)
    actor = SimpleNamespace(updates=queue.Queue(), weights=SimpleNamespace(wants=None, join=lambda info: (
        calls.append("init"), worker.init_transfer_engine(worker.parse_init_info(info)))))

    def make_calls():  # EngineWeights.load's calls, on the worker engine, once the test lets it
        while (update := actor.updates.get()) is not None:
            go.wait()
            calls.append(update["version"])
            try:
                worker.update_weights(update["update_info"])
            except Exception as e:
                errors.append(e)

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 50)).to(torch.bfloat16)
    source = grpo.WireWeights(net, torch.bfloat16)
    info = grpo.GlooTrainerInitInfo("127.0.0.1", 0, 2, timeout_s=30.0, rank=0)
    client = grpo.WeightClient(grpo.Link(_args(timeout_s=30.0), [], None, actor, queue.Queue()))
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    assert calls == ["init"] and trainer.buffer.numel() == (12 + 3 + 150 + 50) * 2
    threading.Thread(target=make_calls, daemon=True).start()
    sent = []
    for version in (1, 2):  # the engine takes neither yet: both sends return
        client.send_weights({"version": version, "stream": True}, trainer, 30.0)
        sent.append({k: v.clone() for k, v in net.state_dict().items()})
        with torch.no_grad():
            net[1].bias.add_(1.0)
    go.set()
    deadline = time.time() + 30
    while len(loads) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert calls == ["init", 1, 2] and not errors
    assert [list(b) for b in loads] == [list(net.state_dict())] * 2
    assert all(torch.equal(b[k], v) and b[k].dtype == torch.bfloat16 for b, s in zip(loads, sent) for k, v in s.items())
    with torch.no_grad():
        net[1].bias[3] = float("nan")
    client.send_weights({"version": 3, "stream": True}, trainer, 30.0)
    deadline = time.time() + 30
    while not errors and time.time() < deadline:
        time.sleep(0.01)
    actor.updates.put(None)
    assert len(errors) == 1 and "non-finite values in 1.bias" in str(errors[0]) and len(loads) == 2


def test_omp_bind_gives_each_tensor_parallel_worker_its_cores():
    assert grpo.omp_bind([2, 3], 2) == "2|3" and grpo.omp_bind([0, 1, 2], 1) == "0,1,2"
    assert grpo.omp_bind([0, 1, 2], 2) == "0,1|2" and grpo.omp_bind([1], 2) == "1|1"  # too few: each gets all


def test_split_cores_gives_each_local_rank_its_own_share():
    assert grpo.split_cores([0, 1], 0, 2) == [0] and grpo.split_cores([0, 1], 1, 2) == [1]
    shares = [grpo.split_cores(list(range(5)), r, 2) for r in range(2)]
    assert shares == [[0, 1, 2], [3, 4]]  # the first rank takes the odd core
    assert [grpo.split_cores([2, 3, 6, 7], r, 2) for r in range(2)] == [[2, 3], [6, 7]]  # an allowed set with gaps
    assert grpo.split_cores([0, 1], 0, 3) is None  # fewer cores than ranks: nothing is pinned
    assert grpo.split_cores(list(range(8)), 0, 1) is None  # one process: nothing to split
    shares = [grpo.split_cores(list(range(16)), r, 3) for r in range(3)]
    assert sorted(c for s in shares for c in s) == list(range(16)) and [len(s) for s in shares] == [6, 5, 5]


def test_an_actor_without_a_share_of_cores_binds_each_tensor_parallel_worker(monkeypatch):
    """vLLM's "auto" binding gives each tensor-parallel worker a NUMA node of its own and refuses to start with fewer
    nodes than workers. An actor alone on its node (a multi-node launch) takes all the node's cores, each worker a
    share; one on a node with fewer cores than ranks binds its workers the same way, pinned nowhere. A learner alone
    on its node and a one-worker engine stay as they were (unpinned; vLLM's own binding)."""
    pinned = []
    # recorded now, so that teardown removes what pin_cpu_cores sets (a delenv of an absent name records nothing, and
    # a later one would record the value set here: a binding to cores 4-7 left behind broke every later vLLM start)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7, 4, 6, 5})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(sorted(cores)))

    def pin(local_world, local_rank, is_actor, tensor_parallel):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        cores = grpo.pin_cpu_cores(local_rank, is_actor, tensor_parallel)
        return cores, os.environ.get("VLLM_CPU_OMP_THREADS_BIND")

    assert pin(1, 0, True, 2) == ([4, 5, 6, 7], "4,5|6,7")  # alone on its node
    assert pin(1, 0, True, 8) == ([4, 5, 6, 7], "|".join(["4,5,6,7"] * 8))  # more workers than cores: each all
    assert pin(5, 4, True, 2) == (None, "4,5|6,7")  # fewer cores than ranks: bound, not pinned
    assert pin(2, 1, True, 2) == ([6, 7], "6|7")  # its own share, as before
    assert pin(1, 0, True, 1) == (None, None) and pin(1, 0, False, 2) == (None, None) and not pinned
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the user's own binding stays
    assert grpo.pin_cpu_cores(0, True, 2) is None and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


OMP_BIND_AT_IMPORT = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def test_the_binding_test_leaves_no_binding_behind():
    """Runs after the test above (file order): vLLM's engines started later in this process must not inherit its
    binding to cores this machine may not have."""
    assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == OMP_BIND_AT_IMPORT


LEND_SCRIPT = """
import json, os, sys, threading, time, types
own, lent = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, [own])  # as a learner pins itself (pin_cpu_cores): before any other thread starts
import torch
import grpo
torch.set_num_threads(1)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread made while on the own core only
link = types.SimpleNamespace(idle_cores={})  # what Link keeps from the actors' idle / busy messages


def state():
    x = torch.randn(256, 256)
    (x @ x).sum().item()  # the compute pool runs (and makes its threads) on what it has now
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}), \\
        torch.get_num_threads()


cores, out = grpo.IdleCores(link), {}
out["own"] = state()
cores.adjust()
out["nothing idle"] = state()
link.idle_cores[1] = [lent]
cores.adjust()
out["actor idle"] = state()
time.sleep(0.2)
link.idle_cores.pop(1)
cores.adjust()
out["actor busy"] = state()
link.idle_cores[1] = [lent, own]  # an actor sharing a core with the learner lends only the other
cores.adjust()
time.sleep(0.2)
out["lent_s"] = cores.restore()
out["restored"] = state()
out["never"] = grpo.IdleCores(None).restore()
print(json.dumps(out))
"""


def test_one_learner_computes_on_an_idle_actors_cores_and_gives_them_back():
    """IdleCores, as learner 0 runs it before each forward pass: while an actor's engine is idle (its message in the
    link), every thread of the learner's process may run on that actor's cores too and the compute pool has a thread
    more per lent core; once the engine runs again, the learner is back on its own core with its own thread count
    (the pool's extra thread too, not only the thread that asked). restore() gives the cores back at the end of a
    step and says how long they were lent. In a process of its own: it pins every thread of that process."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    own, lent = cores[0], cores[1]
    proc = subprocess.run([sys.executable, "-c", LEND_SCRIPT, str(own), str(lent)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    alone, both = [[[own]], 1], [[sorted([own, lent])], 2]
    assert out["own"] == alone and out["nothing idle"] == alone
    assert out["actor idle"] == both
    assert out["actor busy"] == alone
    assert out["restored"] == alone
    assert 0.4 <= out["lent_s"] < 60, out["lent_s"]  # the two lendings of 0.2 s and more, summed
    assert out["never"] == 0.0


def test_advantages():
    assert grpo.compute_advantages([[1, 0, 0, 1]], "centered") == [[0.5, -0.5, -0.5, 0.5]]
    std = grpo.compute_advantages([[1, 0, 0, 1], [1, 1]], "standard")
    assert std[0] == pytest.approx([1, -1, -1, 1], abs=1e-5)  # population std 0.5
    assert std[1] == [0.0, 0.0]  # zero-std group: 0, not nan


def test_filter_reason():
    assert grpo.filter_reason([1, 1, 1]) == "all_solved"
    assert grpo.filter_reason([0, 0]) == "all_failed"
    assert grpo.filter_reason([0.5, 0.5]) == "zero_std"
    assert grpo.filter_reason([1]) == "too_few_samples"
    assert grpo.filter_reason([1, 0]) is None


def test_active_sampling_exact_batch_when_most_groups_filtered():
    import random

    rng = random.Random(0)
    made = []

    def pull():  # groups arrive in bunches of 1-5; 90% have zero reward std
        out = []
        for _ in range(rng.randint(1, 5)):
            kind = rng.random()
            rewards = [1.0] * 8 if kind < 0.45 else [0.0] * 8 if kind < 0.9 else [1.0, 0.0] * 4
            out.append({"id": len(made), "rewards": rewards})
            made.append(out[-1])
        return out

    kept, leftover, counts = grpo.active_sampling(pull, 16, max_prompts=10_000)
    assert len(kept) == 16
    assert all(grpo.filter_reason(g["rewards"]) is None for g in kept)
    assert counts["prompts"] == len(made) - len(leftover)
    assert counts["prompts"] == 16 + counts["all_solved"] + counts["all_failed"]
    assert counts["all_solved"] + counts["all_failed"] > 4 * 16  # most were filtered
    assert {g["id"] for g in kept} | {g["id"] for g in leftover} <= {g["id"] for g in made}
    # leftovers are the tail of the last pull, untouched, for the next step
    assert [g["id"] for g in leftover] == [g["id"] for g in made[len(made) - len(leftover):]]
    # a run where nothing carries gradient stops at the cap and says so
    kept, _, counts = grpo.active_sampling(lambda: [{"rewards": [0.0, 0.0]}], 4, max_prompts=50)
    assert kept == [] and counts["capped"] == 1 and counts["prompts"] == 50


def test_offpolicy_lags_recorded_and_groups_kept_unless_max_token_lag():
    def group(*versions):
        return {"samples": [{"versions": list(v)} for v in versions]}

    groups = [group([5, 5], [5]), group([4, 5], [5, 5]), group([3, 4, 5], [5]), group([2], [2, 2])]
    # Default: the bound applies at admission; every group that arrives is trained (long samples span versions).
    kept, counts, lags, first = grpo.offpolicy_filter(groups, learner_version=5)
    assert kept == groups and not counts
    assert sorted(lags) == sorted([0, 0, 0] + [1, 0, 0, 0] + [2, 1, 0, 0] + [3, 3, 3])
    assert sorted(first) == sorted([0, 0, 1, 0, 2, 0, 3, 3])  # each sample's first token
    # --max_token_lag N: the old drop, a whole group with any token more than N versions old.
    kept, counts, _, _ = grpo.offpolicy_filter(groups, learner_version=5, max_token_lag=1)
    assert kept == groups[:2] and counts == {"groups_dropped_stale": 2, "samples_dropped_stale": 4}
    kept, counts, _, _ = grpo.offpolicy_filter(groups, learner_version=5, max_token_lag=3)
    assert kept == groups and not counts


class _RecordingLink:
    """Stands in for the transport to the actors (not under test): keeps what the dispatcher sends."""

    def __init__(self):
        self.messages, self.lock = [], threading.Lock()

    def send_prompts(self, actor, prompts):
        with self.lock:
            self.messages += prompts


def _drive_dispatcher_gate(P, K, steps, useful_every=1, gate=True):
    """The real Dispatcher thread between a learner and a fast actor played by the test, in lockstep: the actor
    starts every prompt the dispatcher sent as soon as admissible() lets it (or at once, `gate` False) under its
    current version, which is the learner's step (inflight updates: no engine lag); the learner begins each step
    (Dispatcher.begin_step), then consumes in order until P useful groups (one in `useful_every` is useful),
    telling the dispatcher after each (Dispatcher.consumed) and waiting for its refill. Returns the per-group
    lags; fails on a starved learner."""
    args = grpo.Args(num_unique_prompts_per_step=P, async_steps=K, num_samples_per_prompt=1)
    data = [{"prompt_input_ids": [i], "ground_truth": "0", "verifier": "math"} for i in range(10)]
    link = _RecordingLink()
    dispatcher = grpo.Dispatcher(args, data, link, 1, start=0, version=0)
    waiting, started, seen, release = [], {}, 0, -1

    def settle():  # the dispatcher is idle (window full, release sent) and everything it sent has arrived
        nonlocal seen, release
        deadline = time.time() + 10
        while True:
            with dispatcher.cond, link.lock:
                idle = (dispatcher.in_flight >= grpo.prefetch_window(P, K, dispatcher.rate)
                        and dispatcher.release <= dispatcher.release_sent
                        and sum("index" in m for m in link.messages) == dispatcher.position
                        and max([m["release"] for m in link.messages if "release" in m], default=-1)
                        == dispatcher.release_sent)
                new, seen = link.messages[seen:], len(link.messages)
            for m in new:
                release = max(release, m["release"]) if "release" in m else release
                waiting.extend([m] if "index" in m else [])
            if idle:
                return
            assert time.time() < deadline and dispatcher.error is None, dispatcher.error
            time.sleep(0.002)

    def generate(version):
        for p in waiting:
            if p["index"] not in started and grpo.admissible(p if gate else {"index": p["index"]}, version, release):
                started[p["index"]] = version

    lags, consumed = [], 0
    dispatcher.start()
    try:
        for version in range(steps):
            dispatcher.begin_step(version)
            settle()
            generate(version)
            useful = 0
            while useful < P:
                assert consumed in started, f"learner starved at step {version} waiting for prompt {consumed}"
                lags.append(version - started[consumed])
                useful += consumed % useful_every == 0
                consumed += 1
                dispatcher.consumed(1, need=P - useful)
                settle()
                generate(version)
    finally:
        dispatcher.stop.set()
        dispatcher.join(timeout=5)
    return lags


def test_admission_gate_keeps_generation_within_bound():
    # without the gate, step t+2's prompts (refilled while step t pulls) are generated by policy t: lag 2
    assert max(_drive_dispatcher_gate(P=4, K=1, steps=8, gate=False)) == 2
    for K in (1, 2):
        lags = _drive_dispatcher_gate(P=4, K=K, steps=8)
        assert max(lags) == K and min(lags) >= 0  # the prefetch still runs K versions ahead, never more
    # active sampling that filters 3 of 4 groups needs far more than P x (K + 1) prompts in one step:
    # the release index lets those through in step 0, so the learner never starves; from then on
    # the prefetch scales with the useful fraction, and the next step's prompts are ready in advance
    lags = _drive_dispatcher_gate(P=4, K=1, steps=8, useful_every=4)
    assert len(lags) == 8 * 4 * 4 - 3 and max(lags) <= 1
    assert sum(lag == 1 for lag in lags[13:]) > 0.6 * len(lags[13:])


def test_dispatcher_gate_labels_and_release():
    """The prompt thread: min_version labels follow admission_version with the learner's step, and a
    learner that still misses groups releases the prompts it needs even when all are in flight."""
    class FakeLink:
        def __init__(self):
            self.msgs = []

        def send_prompts(self, actor, prompts):
            self.msgs.append((actor, prompts))

    args = grpo.Args(num_unique_prompts_per_step=2, async_steps=1, num_samples_per_prompt=2)
    data = [{"prompt_input_ids": [i], "ground_truth": str(i), "verifier": "math"} for i in range(50)]
    link = FakeLink()
    d = grpo.Dispatcher(args, data, link, 1, start=10, version=3)

    def wait_for(cond):
        deadline = time.time() + 10
        while not cond():
            assert time.time() < deadline
            time.sleep(0.01)

    def sent():
        return [p for _, ps in link.msgs for p in ps]

    d.start()
    try:
        wait_for(lambda: len(sent()) == 4)
        assert [(p["index"], p["min_version"]) for p in sent()] == [(i, 3) for i in range(10, 14)]
        d.consumed(1, need=1)  # step 3 still misses one group: prompt 10 consumed, 11 released; refill 14
        wait_for(lambda: len(sent()) == 6)
        # 11 is still needed for step 3, 12 and 13 are step 4's, 14 is for step 5: it waits for version 4
        assert ([(p.get("index"), p.get("min_version"), p.get("release")) for p in sent()[4:]]
                == [(14, 4, None), (None, None, 12)])
        d.consumed(1, need=0)  # step 3 done with 12 consumed: 15 is for step 5
        wait_for(lambda: len([p for p in sent() if "index" in p]) == 6)
        d.begin_step(4)
        d.consumed(1, need=1)  # step 4 consumed 13 and misses 1 (13): 14, 15 are step 5's, 16 is step 6's
        wait_for(lambda: len([p for p in sent() if "index" in p]) == 7)
        assert [(p["index"], p["min_version"]) for p in sent() if "index" in p][-2:] == [(15, 4), (16, 5)]
    finally:
        d.stop.set()
        d.join(timeout=5)

def test_only_the_benchmarks_prompts_carry_their_own_lengths():
    """--response_length_sampler exponential (bench_infra.sh): each training sample gets its own max_tokens, drawn
    from Exponential(mean) and cut to max_response_length, with eos ignored; evaluation prompts and every prompt of a
    run without the flag carry nothing, so the actor samples them to max_response_length, stopping at eos."""
    row = {"prompt_input_ids": [1, 2], "ground_truth": "3", "verifier": "math"}
    plain = grpo.Dispatcher(grpo.Args(), [row], _RecordingLink(), 1, start=0)
    assert not {"max_tokens", "ignore_eos"} & set(plain.prompt(0, "train", row, 4))
    args = grpo.Args(response_length_sampler="exponential", response_length_mean=100, max_response_length=300)
    bench = grpo.Dispatcher(args, [row], _RecordingLink(), 1, start=0)
    lengths = [t for i in range(500) for t in bench.prompt(i, "train", row, 4)["max_tokens"]]
    assert len(lengths) == 2000 and bench.prompt(0, "train", row, 4)["ignore_eos"] is True
    assert 1 <= min(lengths) and max(lengths) == 300  # P(Exp(100) > 300) = e^-3: about 100 of 2000 are cut
    assert 85 < sum(lengths) / len(lengths) < 100  # the cut mean: 100 (1 - e^-3) = 95
    assert not {"max_tokens", "ignore_eos"} & set(bench.prompt(0, "eval", row, 4))


def _rollouts(**kw):
    """A Rollouts on learner 0 as grpo.learner builds it, without engines: the real Link in its colocated form
    (the test puts the actor's messages on its queue), a real Dispatcher (not started: the test reads what it
    was told), and rewards the samples carry (`r`) in place of the verifiers."""
    import queue
    import types

    args = grpo.Args(**{"num_unique_prompts_per_step": 2, "num_samples_per_prompt": 2, "async_steps": 1,
                        "max_prompts_per_step_factor": 8, "timeout_s": 5.0, "eval_num_samples": 2, **kw})
    link = grpo.Link(args, [], None, types.SimpleNamespace(inbox=queue.Queue()), queue.Queue())
    data = [{"prompt_input_ids": [i], "ground_truth": str(i), "verifier": "math"} for i in range(50)]
    dispatcher = grpo.Dispatcher(args, data, link, 1, start=0, version=0)

    def score(groups, counts):
        for g in groups:
            g["rewards"] = [s["r"] for s in g["samples"]]
            counts["samples_verified"] += len(g["samples"])
    return grpo.Rollouts(args, link, dispatcher, score), link, dispatcher


def _group(i, rewards, kind="train", versions=(0,)):
    return {"group": {"id": i, "kind": kind, "prompt_ids": [i], "verifier": "math", "ground_truth": "1",
                      "samples": [{"r": r, "response_ids": [1, 2], "versions": list(versions)} for r in rewards]},
            "stats": {"actor": 0, "n": i}}


def test_rollouts_keep_the_surplus_the_stash_and_the_stats_between_steps():
    """What the learner keeps between steps, in Rollouts: the groups pulled beyond a step's batch are the
    next step's first (scored once), an eval group that arrives during training waits for evaluate(), the
    actors' stats are handed out once each, and the dispatcher is told only what each step consumed."""
    rollouts, link, dispatcher = _rollouts()
    # one delivery: a filtered group, two useful ones, an eval group, then two more (the surplus)
    for m in (_group(0, [1, 1]), _group(1, [0, 1]), _group(2, [1, 0]), _group(9, [1, 0], kind="eval"),
              _group(3, [0, 1]), _group(4, [0, 0])):
        link.results.put(m)
    batch, counts, scored = rollouts.next_batch(version=0)
    assert [g["id"] for g in batch] == [1, 2]
    assert [g["id"] for g in rollouts.surplus] == [3, 4] and [g["id"] for g in rollouts.stash] == [9]
    assert counts["all_solved"] == 1 and counts["prompts"] == 3 and counts["samples_verified"] == 10
    assert scored == [1, 1, 0, 1, 1, 0]  # every consumed group's rewards, not the surplus'
    assert dispatcher.done == 3 and dispatcher.need == 0  # the surplus is still in flight for the gate
    assert [st["n"] for st in rollouts.take_stats()] == [0, 1, 2, 9, 3, 4] and rollouts.take_stats() == []
    assert [g["id"] for g in rollouts.pull(5.0, kind="eval")] == [9] and rollouts.stash == []  # from the stash


def test_rollouts_a_step_takes_the_surplus_first_then_pulls():
    """The second step trains on last step's surplus before anything new, and scores it only once."""
    rollouts, link, dispatcher = _rollouts()
    for m in (_group(1, [0, 1]), _group(2, [1, 0]), _group(3, [0, 1]), _group(4, [0, 0])):
        link.results.put(m)
    rollouts.next_batch(version=0)
    assert [g["id"] for g in rollouts.surplus] == [3, 4]
    verified = []
    rollouts.score = (lambda score: lambda gs, c: (verified.extend(g["id"] for g in gs), score(gs, c)))(rollouts.score)
    link.results.put(_group(5, [1, 0]))
    batch, counts, scored = rollouts.next_batch(version=1)
    assert [g["id"] for g in batch] == [3, 5] and counts["all_failed"] == 1
    assert verified == [5]  # the surplus was scored when it was pulled
    assert scored == [0, 1, 0, 0, 1, 0] and dispatcher.done == 5 and rollouts.surplus == []


def test_look_ahead_releases_what_the_next_step_will_miss_once_the_engines_are_idle():
    """Rollouts.look_ahead, between the learner's passes: the groups that arrive while it trains are scored and kept
    for the next step; once every engine says it has nothing to run and they hold fewer groups with gradient than a
    step takes, the dispatcher releases that many of the prompts its gate holds, the first ones, once each time the
    engines go idle. The next step trains on them, and counts what scoring them counted."""
    rollouts, link, dispatcher = _rollouts()
    link.actor_ranks = [1]  # an actor rank (torchrun), its messages put on the queue by the test
    dispatcher.start()
    inbox = link.local.inbox

    def sent(n):  # the next n prompts, and release indices, the dispatcher sends
        out, deadline = [], time.time() + 10
        while len(out) < n:
            assert time.time() < deadline, out
            with contextlib.suppress(queue.Empty):
                out += inbox.get(timeout=0.1)
        return [(p["index"], p["min_version"]) if "index" in p else ("release", p["release"]) for p in out]

    def idle(said):
        link.on_idle(1, {"idle": said, "cores": None, "host": "elsewhere"})

    try:
        assert sent(4) == [(0, 0), (1, 0), (2, 0), (3, 0)]  # steps 0 and 1 (async_steps 1): no gate
        for m in (_group(0, [0, 1]), _group(1, [1, 0])):
            link.results.put(m)
        assert [g["id"] for g in rollouts.next_batch(version=0)[0]] == [0, 1]
        assert sent(2) == [(4, 1), (5, 1)]  # step 2's: gated until version 1
        # the learner trains step 0; step 1's groups arrive, one all solved
        for m in (_group(2, [1, 1]), _group(3, [0, 1])):
            link.results.put(m)
        rollouts.look_ahead(0, 0)
        assert [g["id"] for g in rollouts.surplus] == [2, 3] and dispatcher.release == -1  # the engine still runs
        idle(True)
        rollouts.look_ahead(1, 0)  # engines a version behind (drained updates): their samples may feed no later step
        assert dispatcher.release == -1
        rollouts.look_ahead(0, 0)  # one group with gradient of the two a step needs: release the first gated prompt
        assert sent(1) == [("release", 5)]
        rollouts.look_ahead(0, 0)
        assert dispatcher.release == 5  # once per idle
        link.results.put(_group(4, [0, 0]))  # the released one runs, and is filtered
        idle(False)
        idle(True)
        rollouts.look_ahead(0, 0)
        assert sent(1) == [("release", 6)]
        link.results.put(_group(5, [1, 0]))
        dispatcher.begin_step(1)
        assert min(dispatcher.labels) == 2  # the labels of consumed prompts are dropped: they stay bounded
        batch, counts, scored = rollouts.next_batch(version=1)
        assert [g["id"] for g in batch] == [3, 5] and rollouts.surplus == []
        assert counts["prompts"] == 4 and counts["all_solved"] == 1 and counts["all_failed"] == 1
        assert counts["samples_verified"] == 8  # scored ahead (2, 3, 4) and now (5): all this step's
    finally:
        dispatcher.stop.set()
        dispatcher.join(timeout=5)


def test_rollouts_stop_on_actor_errors_timeouts_and_failing_infrastructure():
    """A silent actor is a timeout that names who it waited on, an actor's error an exception, and three steps
    in a row that mostly dropped their samples stop the run."""
    rollouts, link, _ = _rollouts(timeout_s=0.5)
    with pytest.raises(TimeoutError, match="no finished group from any actor in 0s .*colocated"):
        rollouts.pull(0.5)
    link.results.put({"error": "engine died"})
    with pytest.raises(RuntimeError, match="actor failed: engine died"):
        rollouts.pull(0.5)
    failing = Counter({"infra_failures": 5, "samples_verified": 8, "verifier_error/worker_lost": 5})
    rollouts.check_infra(failing)
    rollouts.check_infra(Counter({"samples_verified": 8}))  # a good step resets the streak
    rollouts.check_infra(failing)
    rollouts.check_infra(failing)
    with pytest.raises(RuntimeError, match="3 steps in a row .*worker_lost 5"):
        rollouts.check_infra(failing)


def test_rollouts_evaluate_scores_what_came_back_and_counts_the_dropped():
    """Evaluation sends each held-out prompt once, waits for all, and averages pass@1 over the prompts that
    kept a sample (the one that lost all of its samples is not scored as a zero)."""
    rollouts, link, _ = _rollouts()
    eval_ds = [{"prompt_input_ids": [i], "ground_truth": "1", "verifier": "math"} for i in range(3)]
    for i, rewards in enumerate(([1, 0], [0, 0], [])):  # the last prompt lost every sample to the infrastructure
        link.results.put(_group(i, rewards, kind="eval"))
    ev = rollouts.evaluate(eval_ds, num_actors=1)
    sent = link.local.inbox.get_nowait()
    assert [p["index"] for p in sent] == [0, 1, 2] and all(p["kind"] == "eval" and p["n"] == 2 for p in sent)
    assert ev["eval/prompts"] == 2 and ev["eval/pass@1"] == 0.25 and ev["eval/pass@2"] == 0.5


def test_admissible():
    train = {"index": 10, "min_version": 3}
    assert not grpo.admissible(train, None, -1)  # no weights yet
    assert not grpo.admissible(train, 2, -1) and grpo.admissible(train, 3, -1) and grpo.admissible(train, 4, -1)
    assert grpo.admissible(train, 2, 11) and not grpo.admissible(train, 2, 10)  # released: needed now
    assert grpo.admissible({"index": 0}, 0, -1)  # eval prompts (no min_version) are never gated
    # 2 consumed, 3 groups still missing this step, 4 per step, async_steps 1: positions < 9 are due in time
    assert grpo.admission_version(8, 5, 2, 3, 4, 1) == 5 and grpo.admission_version(9, 5, 2, 3, 4, 1) == 6
    # half the prompts yield a group with gradient: twice as far ahead is still due in time
    assert grpo.admission_version(12, 5, 2, 3, 4, 1, 0.5) == 5 and grpo.admission_version(13, 5, 2, 3, 4, 1, 0.5) == 6
    assert grpo.prefetch_window(4, 1) == 8 and grpo.prefetch_window(4, 1, 0.5) == 16

# -------------------------------------------------------------------------------------------------
# Loss
# -------------------------------------------------------------------------------------------------
def _loss_inputs():
    ratio = torch.tensor([[1.5, 0.5, 1.0]])
    old = torch.zeros(1, 3)
    new = torch.log(ratio).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    return new, old, adv, torch.ones(1, 3)


def test_grpo_loss_clip_higher_hand_computed():
    new, old, adv, mask = _loss_inputs()
    loss, stats = grpo.grpo_loss(new, old, old, adv, mask, 0.2, 0.272, tis_cap=2.0)
    # token 1: ratio 1.5, A=1: max(-1.5, -1.272) = -1.272 (clipped at 1 + 0.272)
    # token 2: ratio 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped at 1 - 0.2)
    # token 3: ratio 1, A=2: -2.  Mean over 3 tokens: (-1.272 + 0.8 - 2) / 3
    assert loss.item() == pytest.approx(-2.472 / 3, abs=1e-6)
    assert stats["clipfrac_sum"] == 2 and stats["tokens"] == 3
    loss.backward()
    # clipped tokens get no gradient; token 3: d(-A r)/d log r = -A r = -2, over 3 tokens
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.0, -2 / 3], abs=1e-6)


def test_grpo_loss_global_token_normalization_and_mask():
    new, old, adv, mask = _loss_inputs()
    loss, _ = grpo.grpo_loss(new, old, old, adv, mask, 0.2, 0.272, 2.0, num_tokens_global=6)
    assert loss.item() == pytest.approx(-2.472 / 6, abs=1e-6)  # divided by the global count, not 3
    loss, _ = grpo.grpo_loss(new, old, old, adv, torch.tensor([[1.0, 1.0, 0.0]]), 0.2, 0.272, 2.0, num_tokens_global=6)
    assert loss.item() == pytest.approx((-1.272 + 0.8) / 6, abs=1e-6)


def test_grpo_loss_truncated_importance_sampling():
    new, old, adv, mask = _loss_inputs()
    # exp(old - sampling) = 3 (capped at 2), 0.5, 1
    sampling = torch.tensor([[-math.log(3.0), math.log(2.0), 0.0]])
    loss, stats = grpo.grpo_loss(new, old, sampling, adv, mask, 0.2, 0.272, tis_cap=2.0)
    assert loss.item() == pytest.approx((-1.272 * 2 + 0.8 * 0.5 - 2.0) / 3, abs=1e-6)
    assert stats["tis_capped_sum"] == 1
    loss_off, _ = grpo.grpo_loss(new, old, sampling, adv, mask, 0.2, 0.272, tis_cap=0.0)
    assert loss_off.item() == pytest.approx(-2.472 / 3, abs=1e-6)


def test_grpo_loss_k3_kl():
    new, old, adv, mask = _loss_inputs()
    ref = new.detach().clone()
    ref[0, 0] += math.log(2.0)  # d = ref - new = log 2: k3 = 2 - log 2 - 1
    loss, stats = grpo.grpo_loss(new, old, old, adv, mask, 0.2, 0.272, 2.0, ref_logprobs=ref, beta=0.1)
    k3 = 2 - math.log(2) - 1
    assert stats["ref_kl_sum"] == pytest.approx(k3, abs=1e-6)
    assert loss.item() == pytest.approx((-2.472 + 0.1 * k3) / 3, abs=1e-6)


def test_grpo_loss_kl_stays_finite_far_from_the_reference():
    # a token the reference finds 100 nats likelier than the policy: exp(100) overflows fp32 unclamped
    new, old, adv, mask = _loss_inputs()
    ref = new.detach().clone()
    ref[0, 0] += 100.0
    loss, stats = grpo.grpo_loss(new, old, old, adv, mask, 0.2, 0.272, 2.0, ref_logprobs=ref, beta=0.1)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(stats["ref_kl_sum"])
    assert torch.isfinite(new.grad).all()


# -------------------------------------------------------------------------------------------------
# Packing
# -------------------------------------------------------------------------------------------------
def _row(p, r, adv=1.0):
    return {"prompt_ids": list(range(10, 10 + p)), "response_ids": list(range(100, 100 + r)), "advantage": adv,
            "sampling_logprobs": [-0.5] * r}


def test_pack_and_split():
    rows = [_row(5, 5), _row(3, 3), _row(4, 8), _row(2, 1), _row(6, 6)]
    bins = grpo.pack_rows(rows, 16)
    assert sorted(len(r["prompt_ids"]) + len(r["response_ids"]) for b in bins for r in b) == [3, 6, 10, 12, 12]
    assert all(sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in b) <= 16 for b in bins)
    assert len(bins) == 3  # 43 tokens in bins of 16
    shares = grpo.split_bins(bins, 2)
    assert len(shares[0]) == len(shares[1])  # padded with empty bins: same number of forwards
    assert sorted(id(b) for s in shares for b in s if b) == sorted(id(b) for b in bins)


def _tiny_olmo3(vocab=128, layers=2):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    torch.manual_seed(0)
    return Olmo3ForCausalLM(Olmo3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64))


def test_collate_masks_and_logprobs_match_unpacked():
    model = _tiny_olmo3().eval()
    grpo.install_chunked_head(model, chunk_size=5)
    a, b = _row(4, 3, adv=1.0), _row(2, 5, adv=-1.0)
    batch = grpo.collate_bin([a, b])
    # position t predicts t + 1: row a (7 tokens) trains positions 3, 4, 5; row b (7 tokens) 8..12
    assert batch["mask"].tolist() == [0, 0, 0, 1, 1, 1, 0] + [0, 1, 1, 1, 1, 1, 0]
    assert batch["position_ids"].tolist() == list(range(7)) + list(range(7))
    assert batch["advantages"][batch["mask"] > 0].tolist() == [1.0] * 3 + [-1.0] * 5
    assert batch["sampling_logprobs"][batch["mask"] > 0].tolist() == [-0.5] * 8
    assert batch["targets"][3:6].tolist() == a["response_ids"]
    with torch.no_grad():
        packed, _ = grpo.token_logprobs(model, batch)
        for start, row in ((0, a), (7, b)):
            alone, _ = grpo.token_logprobs(model, grpo.collate_bin([row]))
            assert torch.allclose(packed[start:start + 6], alone[:6], atol=1e-5)  # rows do not see each other
        # Control: the same tokens as one sequence (positions do not restart), so row b sees row a.
        joined = dict(batch, position_ids=torch.arange(14))
        seen, _ = grpo.token_logprobs(model, joined)
    alone_b = grpo.token_logprobs(model, grpo.collate_bin([b]))[0][:6]
    assert (seen[7:13] - alone_b).abs().max() > 1e-3


def test_forward_batches_group_bins_within_the_token_budget():
    bins = [[_row(5, 5)], [_row(3, 3)], [_row(4, 8)], [_row(2, 1)], [_row(6, 6)]]  # 10, 6, 12, 3, 12 tokens
    batches = grpo.forward_batches(bins, token_budget=24)
    # longest first; a pass holds rows x its longest row <= 24 padded tokens
    assert [[grpo.bin_tokens(b) for b in batch] for batch in batches] == [[12, 12], [10, 6], [3]]
    assert grpo.forward_batches(bins, token_budget=5)[0] == [bins[2]]  # a bin over the budget: a pass of its own
    forwards = grpo.learner_forwards(bins, num_learners=2, token_budget=24)
    assert len(forwards[0]) == len(forwards[1])  # the same number of passes on every learner (FSDP2)
    assert sorted(id(b) for f in forwards for batch in f for b in batch if b) == sorted(id(b) for b in bins)


def test_a_batch_of_padded_bins_gives_each_bins_own_logprobs():
    model = _tiny_olmo3().eval()
    grpo.install_chunked_head(model, chunk_size=4)
    long_bin, short_bin = [_row(4, 3, adv=1.0), _row(2, 5, adv=-1.0)], [_row(3, 2, adv=0.5)]
    batch = grpo.collate_forward([long_bin, short_bin])
    assert batch["input_ids"].shape == (2, 14) and batch["real_tokens"] == 19
    assert batch["mask"][1, 5:].sum() == 0 and batch["position_ids"][1].tolist() == list(range(5)) + list(range(9))
    with torch.no_grad():
        both, _ = grpo.token_logprobs(model, batch)
        for i, b in enumerate((long_bin, short_bin)):
            alone, _ = grpo.token_logprobs(model, grpo.collate_bin(b))
            n = len(alone)
            assert torch.allclose(both[i, :n - 1], alone[:n - 1], atol=1e-5)
    assert torch.equal(batch["mask"][0], grpo.collate_bin(long_bin)["mask"])


@pytest.mark.parametrize("chunk_size, temperature", [(1, 1.0), (3, 1.0), (64, 1.0), (4, 0.7)])
def test_chunked_logprobs_equal_full_logits_values_and_gradients(chunk_size, temperature):
    """fp32: the chunked head (recomputed in backward) gives the full-logits log-softmax, and the same
    gradients for every parameter, within 1e-5."""
    model = _tiny_olmo3(vocab=96)
    ids = torch.randint(0, 96, (2, 11))
    targets = torch.randint(0, 96, (2, 11))
    targets[0, -3:] = -100  # not trained: any id is gathered, then masked
    weights = torch.randn(2, 11)
    mask = targets != -100

    logits = model(input_ids=ids, use_cache=False).logits.float() / temperature
    full = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    full_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    ((full * weights)[mask]).sum().backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    grpo.install_chunked_head(model, chunk_size)
    assert "lm_head.weight" in dict(model.named_parameters())  # checkpoints and weight sync keep their names
    chunked, entropy = grpo.target_logprobs(model, ids, None, targets, temperature, with_entropy=True)
    ((chunked * weights)[mask]).sum().backward()
    assert torch.allclose(chunked[mask], full[mask].detach(), atol=1e-5)
    assert torch.allclose(entropy, full_entropy.detach(), atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, full_grads[name], atol=1e-5), name
    assert model(input_ids=ids).logits.shape == (2, 11, 96)  # outside target_logprobs: the plain head


def test_bf16_learner_step_on_cpu():
    """The bf16 path (autocast, fp32 master weights) runs a loss + backward + AdamW step on CPU: its logprobs
    and entropies differ from fp32 (bf16 was used) but only by bf16 rounding."""
    model = _tiny_olmo3()
    grpo.install_chunked_head(model, 4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = grpo.collate_bin([_row(4, 3, adv=1.0), _row(2, 5, adv=-1.0)])
    with torch.no_grad():
        fp32_lp, fp32_entropy = grpo.token_logprobs(model, batch, with_entropy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new_lp, entropy = grpo.token_logprobs(model, batch, with_entropy=True)
    assert new_lp.dtype == torch.float32  # the chunked head's log-softmax runs in fp32 under autocast
    assert 0 < (new_lp - fp32_lp).abs().max() < 0.1
    assert 0 < (entropy - fp32_entropy).abs().max() < 0.1
    loss, stats = grpo.grpo_loss(new_lp[None], new_lp.detach()[None], batch["sampling_logprobs"][None],
                                 batch["advantages"][None], batch["mask"][None], 0.2, 0.272, 2.0)
    loss.backward()
    before = model.lm_head.weight.detach().clone()
    assert all(p.dtype == torch.float32 and p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert not torch.equal(before, model.lm_head.weight)
    assert stats["tokens"] == 8


def test_colocated_engine_share_is_what_the_learner_leaves():
    """One GPU (`python grpo.py`): vLLM reads gpu_memory_utilization as a share of the whole GPU that must be free
    when it starts, and the learner loaded first keeps its planned memory. The engine's share is what the plan leaves
    less 2 GiB of headroom, never above --vllm_gpu_memory_utilization; when that cannot hold the engine's bf16 weights
    and one full-length sequence's KV cache, the run stops before loading, saying what to change."""
    gib = 2**30
    share = grpo.colocated_engine_share(20 * gib, 80 * gib, 0.9, 10 * gib, "knobs")
    assert share == pytest.approx((80 - 20 - 2) / 80)
    assert grpo.colocated_engine_share(5 * gib, 80 * gib, 0.9, 10 * gib, "knobs") == 0.9  # the flag caps it
    with pytest.raises(SystemExit, match="cannot hold the learner .*torchrun --nproc-per-node 2.*knobs"):
        grpo.colocated_engine_share(70 * gib, 80 * gib, 0.9, 10 * gib, "knobs")  # 8 GiB left, 10 needed
    # Olmo 3 7B's engine at 2,048 + 32,768 tokens: bf16 weights and K and V of 32 layers x 32 heads x 128 per token
    need = grpo.engine_memory_need(OLMO3_7B, 7.3e9, 2048 + 32768)
    assert need == int(2 * 7.3e9 + 2 * 32 * 32 * 128 * 2 * 34816)


def test_memory_plan_hand_computed():
    """Olmo 3 7B's shape, one 35,840-token row, 16 FSDP2 learners, bf16, checkpointing, flash attention: the
    parameters counted by hand; the activation estimate is checked against a measurement below."""
    from transformers import Olmo3Config

    config = Olmo3Config(vocab_size=100278, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)
    plan = grpo.memory_plan(config, 35840, 1, 16, bf16=True, checkpointing=True, chunk_size=1024, flash_attention=True)
    # Parameters by hand: per layer q, k, v, o 4 x 4096^2 + MLP 3 x 4096 x 11008, q/k norms 2 x 4096 and
    # two layer norms 2 x 4096; embedding and head 2 x 100278 x 4096; the final norm 4096: 7,298,011,136.
    params = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 4 * 4096) + 2 * 100278 * 4096 + 4096
    assert params == 7_298_011_136
    assert plan["weights"] == 4 * params / 16
    assert plan["gradients"] == 4 * params / 16 and plan["optimizer"] == 8 * params / 16
    assert plan["attention_mask"] == 0
    assert plan["total"] == pytest.approx(sum(v for k, v in plan.items() if k != "total"))
    assert 25 * 2 ** 30 < plan["total"] < 35 * 2 ** 30  # about 29 GiB: fits an 80 GB GPU
    no_ckpt = grpo.memory_plan(config, 35840, 1, 16, bf16=True, checkpointing=False, chunk_size=1024,
                               flash_attention=True)
    assert no_ckpt["activations"] > 200 * 10 ** 9  # 32 layers' full sets: about 245 GB
    with pytest.raises(SystemExit, match="gradient_checkpointing"):
        grpo.check_memory_plan(no_ckpt, 80 * 10 ** 9, "--gradient_checkpointing")
    assert grpo.check_memory_plan(plan, 80 * 10 ** 9, "--gradient_checkpointing").startswith("memory plan:")


def _saved_for_backward_bytes(model, tokens: int) -> int:
    """Bytes autograd keeps for backward in one forward pass of `tokens` tokens through the chunked head (each
    storage once, the parameters left out): what the plan's `activations` estimates."""
    saved, params = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs, _ = grpo.target_logprobs(model, ids, torch.arange(tokens)[None], ids)
    logprobs.sum().backward()
    return sum(n for ptr, n in saved.items() if ptr not in params)


def test_memory_plan_matches_what_a_real_step_holds():
    """The plan against a measured fp32 step of a 4-layer Olmo 3: the bytes saved for backward (autograd's own
    saved-tensor hooks), the gradients and AdamW's state. Without checkpointing the estimate of 16 x hidden +
    4 x intermediate values per token and layer came within 2% of the measurement; with it, the layer inputs
    kept plus one layer's set recomputed in backward within 10%."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    tokens, layers = 256, 4
    config = Olmo3Config(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=tokens,
                         tie_word_embeddings=False)
    measured = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Olmo3ForCausalLM(config)
        grpo.install_chunked_head(model, 32)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        measured[checkpointing] = _saved_for_backward_bytes(model, tokens)
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.step()
        plan = grpo.memory_plan(config, tokens, 1, 1, bf16=False, checkpointing=checkpointing, chunk_size=32)
        assert plan["gradients"] == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
        assert plan["optimizer"] == sum(v.numel() * v.element_size() for state in optimizer.state.values()
                                        for v in state.values() if v.dim() > 0)  # exp_avg, exp_avg_sq (not step)
        if not checkpointing:
            assert plan["activations"] == pytest.approx(measured[False], rel=0.05)
        else:
            one_layer_recomputed = measured[False] / layers
            assert plan["activations"] == pytest.approx(measured[True] + one_layer_recomputed, rel=0.15)
            assert measured[True] < measured[False] / 4  # checkpointing kept far less


# -------------------------------------------------------------------------------------------------
# Data safety: output_dir, checkpoints, RL rows
# -------------------------------------------------------------------------------------------------
def _stage_definitions(script: str) -> dict:
    """Top-level functions, classes and assignments of a stage script, by name, in file order: their exact
    source, decorators included."""
    text = open(os.path.join(REPO, script)).read()
    lines = text.splitlines(keepends=True)
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = "".join(lines[first - 1:node.end_lineno])
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = ast.get_source_segment(text, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ast.get_source_segment(text, node)
    return out


def test_checkpoint_helpers_are_the_same_in_every_stage():
    """One-file-per-stage: sft.py, dpo.py and grpo.py each carry these, and they must not drift apart
    (checkpoint save / resume / prune, peak FLOPs, memory plan, the chunked LM head); every main() decides
    where to resume through the shared function. (What sft.py and dpo.py alone share:
    test_sft_and_dpo_main_share_their_plumbing_blocks.)"""
    stages = [_stage_definitions(script) for script in ("sft.py", "dpo.py", "grpo.py")]
    for name in ("latest_checkpoint", "resume_checkpoint", "fsync_dir", "check_output_dir", "publish_checkpoint",
                 "prune_checkpoints", "GPU_PEAKS", "measure_peaks", "memory_plan", "device_memory_bytes",
                 "check_memory_plan", "ChunkedLogprobs", "ChunkedLogprobHead", "install_chunked_head",
                 "target_logprobs"):
        assert stages[0][name] == stages[1][name] == stages[2][name], name
    for stage in stages:
        calls = {n.func.id for n in ast.walk(ast.parse(stage["main"])) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name)}
        assert "resume_checkpoint" in calls and "latest_checkpoint" not in calls, calls


# What only one of sft.py / dpo.py defines (its algorithm and, for dpo.py, the reference cache), and what both
# define differently (the stage's arguments, data, training step and main); everything else both define is
# plumbing and must be byte-identical.
_SFT_ONLY = {"pack_rows", "collate", "token_nll", "sft_loss"}
_DPO_ONLY = {"DEFAULT_BETA", "AVERAGE_LOGPS", "dpo_loss", "collate_pairs", "sequence_logps", "model_fingerprint",
             "pairs_fingerprint", "reference_cache_key", "shard_batches", "tokenize_pairs", "pair_logps", "preference_loss",
             "reference_tables", "compute_reference_logps", "save_reference_logps", "load_resumed_weights",
             "evaluate"}
_SFT_DPO_OWN = {"Args", "UNSUPPORTED_FLAGS", "RESUME_IGNORED_ARGS", "load_data", "train_step", "main"}


def _section_titles(path: str) -> list[str]:
    """The first title line of every section: comment lines between two rulers at most three lines apart."""
    lines, titles, i = open(path).read().splitlines(), [], 0
    is_ruler = lambda line: line.startswith("# ") and set(line[2:]) == {"-"} and len(line) > 40  # noqa: E731
    while i < len(lines):
        if is_ruler(lines[i]):
            close = next((j for j in range(i + 1, min(i + 4, len(lines))) if is_ruler(lines[j])), None)
            if close is not None and close > i + 1:
                titles.append(lines[i + 1][2:])
                i = close
        i += 1
    return titles


def test_header_reading_order_is_the_files_sections():
    """grpo.py's docstring lists its sections in reading order, one per line; each line starts the title of the
    section in that place, and every section is listed: moving or adding a section without the header fails."""
    listed = grpo.__doc__.split("Reading order:")[1].split("\n\n")[0].splitlines()[2:]
    listed = [line.strip() for line in listed if line.startswith("    ")]
    titles = _section_titles(os.path.join(REPO, "grpo.py"))
    assert len(listed) == len(titles) >= 10, (listed, titles)
    for entry, title in zip(listed, titles):
        assert title.startswith(entry), (entry, title)


def test_sft_and_dpo_main_share_their_plumbing_blocks():
    """`diff sft.py dpo.py` shows the algorithm and the reference cache only: every top-level function, class
    and constant both files define is byte-identical and in the same order, except the stage's own (arguments,
    data, training step, main); the plumbing main() calls is all top level (main <= 150 lines, no nested
    function), and the lines of main() that do the same thing (the loop's schedule and checkpoint, MFU, the
    final save) are byte-identical too."""
    sft_defs, dpo_defs = (_stage_definitions(script) for script in ("sft.py", "dpo.py"))
    assert set(sft_defs) - set(dpo_defs) == _SFT_ONLY and set(dpo_defs) - set(sft_defs) == _DPO_ONLY
    both = [name for name in sft_defs if name in dpo_defs]
    assert both == [name for name in dpo_defs if name in sft_defs], "the shared definitions come in another order"
    differ = {name for name in both if sft_defs[name] != dpo_defs[name]}
    assert differ == _SFT_DPO_OWN, differ ^ _SFT_DPO_OWN
    assert {"World", "setup_world", "plan_batches", "build_model", "save_checkpoint", "RunLog", "lr_at",
            "save_final_model"} <= set(both) - differ  # the plumbing is there, not only the names
    mains = []
    for defs in (sft_defs, dpo_defs):
        main = ast.parse(defs["main"]).body[0]
        assert main.end_lineno - main.lineno + 1 <= 150
        assert not [n for n in ast.walk(main) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n is not main]
        mains.append(defs["main"].splitlines())

    def block(lines: list[str], first: str, last: str) -> list[str]:
        start = next(i for i, line in enumerate(lines) if line.startswith(first))
        end = next(i for i in range(start, len(lines)) if lines[i].startswith(last))
        return lines[start:end + 1]

    blocks = [  # (first line starts with, last line starts with), both as written in main()
        ("    resume_from = resume_checkpoint(", "    resume_from = resume_checkpoint("),
        ("    trainable, optimizer = make_optimizer(", "    peak_total = world.all_reduce_sum("),  # resume, peaks
        ("    run_log = RunLog(", "    run_log = RunLog("),
        ("    # ---- loop", "        t0 = time.perf_counter()"),  # lr schedule, periodic checkpoint
        ("        grad_norm = clip_and_step(", "        grad_norm = clip_and_step("),
        ("        dt = time.perf_counter() - t0", "        last_step = "),  # MFU <= 1
        ("    progress.close()", "    finish(world, run_log)"),  # final save
    ]
    for first, last in blocks:
        sft_block, dpo_block = (block(lines, first, last) for lines in mains)
        assert sft_block == dpo_block, (first, [a for a in sft_block if a not in dpo_block],
                                        [b for b in dpo_block if b not in sft_block])


def test_save_checkpoint_fsyncs_points_latest_and_keeps_last_n(toy_model_dir, tmp_path, monkeypatch):
    """grpo.py's checkpoints are written like sft.py's: a temp dir, fsynced, renamed, `latest` moved;
    then only the newest --keep_last_n_checkpoints stay, plus the one the run resumed from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    synced = []
    real_fsync_dir = grpo.fsync_dir
    monkeypatch.setattr(grpo, "fsync_dir", lambda path: (synced.append(os.path.basename(path)), real_fsync_dir(path)))
    out = str(tmp_path)
    args = _args(output_dir=out, keep_last_n_checkpoints=2)
    root = os.path.join(out, "checkpoints")
    for step in (1, 2, 3, 4):
        grpo.save_checkpoint(args, model, tokenizer, optimizer, scheduler, step, 10 * step, True, 1, {},
                             protect=os.path.join(root, "step_1"))
        assert open(os.path.join(root, "latest")).read() == f"step_{step}"
    assert synced == [".tmp-step_1", ".tmp-step_2", ".tmp-step_3", ".tmp-step_4"]  # each before its rename
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3", "step_4"]  # step_1: resumed from
    assert grpo.latest_checkpoint(out) == os.path.join(root, "step_4")
    state = torch.load(os.path.join(root, "step_4", "training_state.pt"), weights_only=False)
    assert state["step"] == 4 and state["sampler_position"] == 40


def test_optimizer_state_loads_whatever_number_of_learners_saved_it():
    """One learner saves the optimizer's own state dict (parameters by index), several the full state by name
    (torch's get_optimizer_state_dict): a run resumed with another number of learners gets each parameter's own AdamW
    state either way (the several-learner load, set_optimizer_state_dict, takes names only; it runs here on one
    process, as FSDP2's does on each learner). A frozen parameter in the middle shifts the indices: LoRA's case."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    def policy():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        model[1].weight.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, optimizer = policy()
    for _ in range(2):
        model(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    assert by_name["param_groups"][0]["params"][0] == "0.weight"  # the form several learners save
    for saved, num_learners in ((optimizer.state_dict(), 2), (by_name, 1)):
        resumed, resumed_optimizer = policy()
        grpo.load_optimizer(resumed, resumed_optimizer, saved, num_learners)
        pairs = zip([p for p in model.parameters() if p.requires_grad],
                    [p for p in resumed.parameters() if p.requires_grad])
        for p, q in pairs:
            want, got = optimizer.state[p], resumed_optimizer.state[q]
            assert int(got["step"]) == 2, num_learners
            assert torch.equal(got["exp_avg"], want["exp_avg"]) and torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])


def test_reused_output_dir_stops_at_once(tmp_path):
    """A previous run's checkpoints in output_dir stop grpo.py before anything starts (the model name is
    bogus: nothing is loaded) unless --resume or --overwrite_output_dir."""
    (tmp_path / "checkpoints").mkdir()
    out = subprocess.run([sys.executable, "grpo.py", "--model_name_or_path", "no_such_model", "--output_dir",
                          str(tmp_path), "--dataset_mixer_list", "no_such.jsonl", "1.0"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "holds a previous run (checkpoints)" in out.stderr, out.stderr[-3000:]


def test_resume_without_a_checkpoint_starts_fresh(tmp_path, capsys):
    """--resume where output_dir holds no complete checkpoint yet (a preemptible job's first start, or one
    stopped before its first save: metrics and a half-written temp dir) starts from scratch, so such a job
    can always pass --resume; with a checkpoint it continues from it. main() decides through this function."""
    out = str(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / ".tmp-step_2").mkdir(parents=True)
    grpo.check_output_dir(out, True, False, True)  # no stop, nothing deleted
    assert grpo.resume_checkpoint(out, True, True) is None
    assert "--resume: no checkpoint" in capsys.readouterr().out and (tmp_path / "metrics.jsonl").exists()
    assert grpo.resume_checkpoint(out, True, False) is None and capsys.readouterr().out == ""  # one rank says it
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir()
    (step / "training_state.pt").write_bytes(b"")
    assert grpo.resume_checkpoint(out, True, True) == str(step)
    assert grpo.resume_checkpoint(out, False, True) is None  # without --resume, never


def _rlvr_row(content="What is 1+1?", **kw):
    row = {"messages": [{"role": "user", "content": content}], "ground_truth": "2", "verifier": "math"}
    return json.dumps({**row, **kw})


def test_bad_rlvr_rows_are_reported_by_file_and_line(tmp_path):
    """Rows that can never earn a reward stop the run before training, each named by file and line:
    an unknown verifier (every sample would score 0 and steps would train on nothing), labels that do not
    fit the verifiers, no ground truth, malformed messages. Good rows, and an upsampled source, pass."""
    import chat_template

    good = tmp_path / "good.jsonl"
    good.write_text(_rlvr_row() + "\n" + _rlvr_row(verifier="string-matcher") + "\n")
    grpo.check_rlvr_rows(chat_template.load_mixture([str(good), "3.0"]), "--dataset_mixer_list")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        _rlvr_row(), _rlvr_row(verifier="mathh"), _rlvr_row(verifier=["math", "ifeval"]),
        json.dumps({"messages": [{"role": "user", "content": "q"}], "verifier": "math"}),
        _rlvr_row(content=None), _rlvr_row()]) + "\n")
    with pytest.raises(ValueError) as e:
        grpo.check_rlvr_rows(chat_template.load_mixture([str(good), "1.0", str(bad), "2.0"]), "--dataset_mixer_list")
    msg = str(e.value)
    assert "4 row(s)" in msg and str(good) not in msg, msg
    assert f"{bad}:2: unknown verifier 'mathh'" in msg
    assert f"{bad}:3: labels do not match the verifiers" in msg
    assert f"{bad}:4: no ground_truth" in msg
    assert f"{bad}:5: messages: missing_content" in msg


def test_code_rows_without_a_sandbox_stop_the_run_unless_allowed(tmp_path, monkeypatch):
    """With no isolation here and no --allow_unsandboxed_code, code rows would be refused at every step and
    dropped as infrastructure failures (silently while under --max_infra_failure_rate): the run stops first,
    naming them by file and line and saying how to fix it."""
    import chat_template
    import sandbox

    data = tmp_path / "mix.jsonl"
    data.write_text("\n".join([
        _rlvr_row(), _rlvr_row(verifier="code", ground_truth=["assert f(1) == 2"]), _rlvr_row(),
        _rlvr_row(verifier="code_stdio", ground_truth=json.dumps([{"input": "1", "output": "2"}])),
        _rlvr_row(verifier=["math", "code"], ground_truth=["2", ["assert f(1) == 2"]])]) + "\n")
    mixture = chat_template.load_mixture([str(data), "2.0"])
    monkeypatch.setattr(sandbox, "_SANDBOX", {"mode": "none", "cgroup": {}})
    with pytest.raises(ValueError) as e:
        grpo.check_rlvr_rows(mixture, "--dataset_mixer_list")
    msg = str(e.value)
    assert msg.startswith("--dataset_mixer_list: 3 row(s) use the code / code_stdio verifiers"), msg
    assert sorted(line.strip() for line in msg.splitlines()[1:]) == [f"{data}:{i}" for i in (2, 4, 5)], msg
    assert "bubblewrap" in msg and "user namespaces" in msg and "--allow_unsandboxed_code" in msg
    grpo.check_rlvr_rows(mixture, "--dataset_mixer_list", allow_unsandboxed_code=True)
    math_only = tmp_path / "math.jsonl"
    math_only.write_text(_rlvr_row() + "\n")
    grpo.check_rlvr_rows(chat_template.load_mixture([str(math_only), "1.0"]), "--dataset_mixer_list")
    monkeypatch.setattr(sandbox, "_SANDBOX", {"mode": "userns", "cgroup": {}})  # a sandbox: code rows run
    grpo.check_rlvr_rows(mixture, "--dataset_mixer_list")


@pytest.mark.slow
def test_unknown_verifier_stops_the_run_before_training(toy_model_dir, tmp_path):
    """The real script: a file whose verifier name is a typo ends the run before any engine starts or
    any step runs, with the file and line (without the check the run trained on nothing)."""
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(_rlvr_row(f"What is {i}+1?") + "\n" for i in range(8)) + _rlvr_row(verifier="maths") + "\n")
    out = str(tmp_path / "run")
    t = time.time()
    proc = subprocess.run([sys.executable, "grpo.py", "--model_name_or_path", toy_model_dir, "--output_dir", out,
                           "--dataset_mixer_list", str(data), "1.0", "--enforce_eager", "--num_training_steps", "2",
                           "--num_unique_prompts_per_step", "2", "--num_samples_per_prompt", "2", "--eval_every", "0",
                           "--max_prompt_length", "128", "--max_response_length", "16", "--timeout_s", "120"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"{data}:9: unknown verifier 'maths'" in text, text[-3000:]
    assert time.time() - t < 120 and not os.path.exists(os.path.join(out, "checkpoints"))


# -------------------------------------------------------------------------------------------------
# End to end (vLLM on CPU, the toy model)
# -------------------------------------------------------------------------------------------------
def _args(**kw):
    args = grpo.Args(enforce_eager=True, max_num_seqs=8, max_prompt_length=64, max_response_length=64, timeout_s=120)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _connect_stream(actor, model):
    """Be learner 0 of a weight transfer to `actor`'s engine, as grpo.learner is with a colocated actor: vLLM's
    trainer engine on our gloo backend (fp32 on the wire), its calls queued for the actor's engine loop."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    client = grpo.WeightClient(grpo.Link(actor.args, [], None, actor))
    info = grpo.GlooTrainerInitInfo("127.0.0.1", 0, 2, timeout_s=120.0, rank=0)
    source = grpo.WireWeights(model, torch.float32)
    transfer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    return client, transfer


def _weight_update(model, version, probe_ids):
    """What learner 0 sends: a header (the version, and the learner's logprobs of a fixed probe sequence),
    and the model whose weights go."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([probe_ids])).logits[0].float(), -1)
    header = {"version": version, "stream": True, "probe_ids": probe_ids,
              "probe_logprobs": [lp[t, probe_ids[t + 1]].item() for t in range(len(probe_ids) - 1)]}
    return header, model


def _push(stream, update):
    """vLLM's four calls to the actor and the weights to its workers (WeightClient.send_weights): returns once the
    workers received the update."""
    (client, transfer), (header, model) = stream, update
    transfer.source = grpo.WireWeights(model, torch.float32)
    client.send_weights(header, transfer, 120.0)


def _version_only(version, **probe):
    return {"version": version, **probe}  # no update_info: update_weight_version only


@pytest.fixture(scope="module")
def streamed_actor(toy_model_dir):
    """One in-process Actor on the toy model for the two tests below (one engine start, not two), its engine loop in
    a thread, on version 0 of the model, with learner 0's end of a weight stream into it (`sender`). Room for both
    tests' requests: prompts of 320 tokens (the prefix cache's), responses of 160 (inflight updates')."""
    from transformers import AutoModelForCausalLM

    args = _args(max_prompt_length=400, max_response_length=160, num_samples_per_prompt=2, temperature=1.0)
    out, errors = [], []
    actor = grpo.Actor(args, toy_model_dir, 0, out.append, "cpu")
    base = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    sender = _connect_stream(actor, base)

    def run():
        try:
            actor.run()
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        actor.updates.put(_version_only(0))
        deadline = time.time() + 120
        while actor.version != 0:  # the loop takes it once the engine's peaks are measured
            assert time.time() < deadline and not errors, errors
            time.sleep(0.01)
        yield types.SimpleNamespace(actor=actor, out=out, errors=errors, thread=thread, sender=sender, base=base)
    finally:
        actor.shutdown()


def _probe_checks(out, actor) -> int:
    """The probes the actor has run so far: those its emitted stats counted, and those not emitted yet."""
    return sum(m["stats"].get("probe_checks", 0) for m in out if "stats" in m) + actor.stats["probe_checks"]


@pytest.mark.slow
def test_prefix_cache_is_reused_only_within_a_policy_version(streamed_actor):
    """The same prompt twice under one version hits vLLM's prefix cache (and the hit is not charged as
    prefill); after a weight update the same prompt is computed again: KV from an older policy is never
    reused by a request that starts on the new one. (Runs before the inflight test below, on the same engine:
    that one ends the engine's loop.)"""
    s = streamed_actor
    actor, out, errors = s.actor, s.out, s.errors
    prompt = [5 + i % 300 for i in range(320)]  # spans several KV blocks, so whole blocks can be cached
    probe_ids = prompt[:8]
    assert actor.version == 0 and not errors, errors

    def prefill_of_next_group(index):
        n = len(out)
        actor.inbox.put([{"kind": "train", "index": index, "prompt_ids": prompt, "ground_truth": "1",
                          "verifier": "math", "n": 1, "max_tokens": [4]}])
        deadline = time.time() + 120
        while not any("group" in m for m in out[n:]):
            assert time.time() < deadline and not errors, errors
            time.sleep(0.01)
        return sum(m["stats"].get("prefill_tokens", 0) for m in out[n:])

    assert prefill_of_next_group(0) == 320
    assert prefill_of_next_group(1) < 320  # control: same version, the prompt's blocks come from the cache
    _push(s.sender, _weight_update(s.base, 1, probe_ids))
    deadline = time.time() + 120
    while actor.version != 1 or actor.weights.probe is not None:
        assert time.time() < deadline and not errors, errors
        time.sleep(0.01)
    assert prefill_of_next_group(2) == 320  # a new policy: the whole prompt is computed again


@pytest.mark.slow
def test_an_idle_engine_says_so_and_says_when_it_runs_again(streamed_actor):
    """The actor's half of lending idle cores (IdleCores): an engine with nothing to run tells learner 0 so once it
    has been idle 0.2 s, and says it runs again with its first step, before its samples come back; one message per
    change, never one per loop. (Before the inflight test, which ends this engine's loop.)"""
    s = streamed_actor
    actor, out, errors = s.actor, s.out, s.errors
    said = []
    actor.on_idle = said.append
    try:
        deadline = time.time() + 60
        while said != [True]:  # nothing runs: idle
            assert time.time() < deadline and not errors and len(said) < 2, (said, errors)
            time.sleep(0.01)
        n = len(out)
        actor.inbox.put([{"kind": "train", "index": 90, "prompt_ids": [5, 6, 7, 8], "ground_truth": "1",
                          "verifier": "math", "n": 2, "max_tokens": [24, 24], "ignore_eos": True}])
        while not any("group" in m for m in out[n:]):
            assert time.time() < deadline and not errors, errors
            time.sleep(0.005)
        assert said[:2] == [True, False], said  # busy was said while the group ran
        time.sleep(0.5)
        assert said == [True, False, True], said  # idle again, once
    finally:
        actor.on_idle = None


@pytest.mark.slow
def test_inflight_update_running_requests_finish_under_new_weights(streamed_actor, toy_model_dir):
    """Requests running when new weights stream in are neither aborted nor restarted: their early tokens
    keep the old model's logprobs, their later tokens have the new model's, token for token, and vLLM
    labels every token with the version that produced it. Then, switched to drained updates, an update
    sent while a request runs waits until the request has finished (the stream goes only once the engine
    is drained), and its probe passes. Last, a wrong probe fails loudly. The engine holds the toy model's
    weights at the version `v` it is on (the prefix cache test, when it ran first, streamed them as version 1)."""
    from transformers import AutoModelForCausalLM

    s = streamed_actor
    actor, out, errors, thread, sender, old = s.actor, s.out, s.errors, s.thread, s.sender, s.base
    v = actor.version
    new = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # only the LM head changes: the KV cache kept across the update stays exact
        new.lm_head.weight.mul_(4.0)
    prompt = [5, 6, 7, 8, 9, 10]
    probe_ids = prompt + [20, 21, 22, 23]
    long_requests = {"max_tokens": [160, 160], "ignore_eos": True}  # as the benchmark's prompts carry them

    def wait_until_both_samples_run(limit):
        while not (len(actor.pending) == 2 and all(len(s["tokens"]) >= 8 for s in actor.pending.values())):
            assert time.time() < limit and not errors, errors
            time.sleep(0.002)

    try:
        assert not errors and not actor.pending, errors
        n_first, probes = len(out), _probe_checks(out, actor)
        actor.inbox.put([{"kind": "train", "index": 100, "prompt_ids": prompt, "ground_truth": "1", "verifier": "math",
                          "n": 2, **long_requests}])
        deadline = time.time() + 120
        wait_until_both_samples_run(deadline)
        before = {rid: list(s["tokens"]) for rid, s in actor.pending.items()}
        first = _weight_update(new, v + 1, probe_ids)
        _push(sender, first)
        while not any("group" in m for m in out[n_first:]):
            assert time.time() < deadline and not errors, errors
            time.sleep(0.01)
        (group,) = [m["group"] for m in out[n_first:] if "group" in m]
        for j, s in enumerate(group["samples"]):
            tokens, versions = s["response_ids"], s["versions"]
            assert len(tokens) == 160
            k = versions.index(v + 1)  # the first token produced by the new weights
            assert versions == [v] * k + [v + 1] * (160 - k) and k >= 8
            assert tokens[:len(before[f"train-100-{j}"])] == before[f"train-100-{j}"]  # not restarted
            with torch.no_grad():
                ids = torch.tensor([prompt + tokens])
                lp_old = torch.log_softmax(old(ids).logits[0].float(), -1)
                lp_new = torch.log_softmax(new(ids).logits[0].float(), -1)
            p = len(prompt)
            ref_old = torch.tensor([lp_old[p - 1 + t, tok].item() for t, tok in enumerate(tokens)])
            ref_new = torch.tensor([lp_new[p - 1 + t, tok].item() for t, tok in enumerate(tokens)])
            got = torch.tensor(s["sampling_logprobs"])
            assert (got[:k] - ref_old[:k]).abs().max() < 2e-3  # before: the old model
            assert (got[k:] - ref_new[k:]).abs().max() < 2e-3  # after: the new model
            assert (ref_new[k:] - ref_old[k:]).abs().mean() > 0.1  # and the two models differ
        # the probe after the update passed
        time.sleep(0.5)
        assert not errors and _probe_checks(out, actor) >= probes + 1
        # drained updates: version v + 2 is sent while a request runs; the engine loads it only once the request
        # has finished under version v + 1 (and v + 2's probe would fail on v + 1's weights)
        actor.args.inflight_updates = False
        model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)
        n_out = len(out)
        actor.inbox.put([{"kind": "train", "index": 101, "prompt_ids": prompt, "ground_truth": "1", "verifier": "math",
                          "n": 2, **long_requests}])
        wait_until_both_samples_run(deadline + 120)
        push = threading.Thread(target=_push, args=(sender, _weight_update(model, v + 2, probe_ids)), daemon=True)
        push.start()
        assert actor.version == v + 1 and actor.pending  # the stream waits for the engine, which drains first
        while actor.version != v + 2 or actor.weights.probe is not None:  # loaded, and its probe has run
            assert time.time() < deadline + 240 and not errors, errors
            time.sleep(0.01)
        push.join(10)
        assert not push.is_alive()
        time.sleep(0.2)
        assert not errors, errors
        (drained,) = [m["group"] for m in out[n_out:] if "group" in m]
        assert all(s["versions"] == [v + 1] * 160 for s in drained["samples"])  # no update mid-sequence
        # a probe that disagrees must stop the actor
        header, _ = first
        actor.updates.put(_version_only(v + 5, probe_ids=probe_ids,
                                        probe_logprobs=[x + 0.5 for x in header["probe_logprobs"]]))
        thread.join(timeout=60)
        assert errors and "stale or corrupted" in str(errors[0])
    finally:
        actor.shutdown()


def _grpo_cmd(model, data, out, *extra):
    return [os.path.join(data, "rlvr.jsonl"), "1.0"], [
        "--model_name_or_path", model, "--output_dir", out,
        "--dataset_mixer_list", os.path.join(data, "rlvr.jsonl"), "1.0",
        "--eval_dataset_mixer_list", os.path.join(data, "eval.jsonl"), "64", "--enforce_eager", "--report_to", "none",
        "--max_prompt_length", "128", "--max_response_length", "48", "--max_num_seqs", "32", "--timeout_s", "120",
        *extra]


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_colocated_trains_within_offpolicy_bound(toy_sft_model_dir, toy_data_dir, tmp_path):
    """`python grpo.py` (actor thread beside the learner), from the SFT start: every step trains on
    exactly num_unique_prompts_per_step non-zero-std groups, no generated group is thrown away as
    stale (the bound applies at admission) and the token lags are recorded, the probe
    agrees after every update, evaluation runs before and after, and the summary carries the peaks
    it was given. It does NOT assert that eval reward rises: a run this short on a 2-core CPU is
    within eval noise (see the demo's curves)."""
    out = str(tmp_path / "run")
    steps = 6
    _, cmd = _grpo_cmd(toy_sft_model_dir, toy_data_dir, out, "--num_training_steps", str(steps),
                       "--eval_every", str(steps),
                       "--num_unique_prompts_per_step", "4", "--num_samples_per_prompt", "8", "--learning_rate", "3e-5",
                       "--eval_num_samples", "2", "--pack_length", "1024", "--peak_flops", "1e12",
                       "--peak_memory_bandwidth", "1e11")
    subprocess.run([sys.executable, "grpo.py", *cmd], cwd=REPO, check=True, timeout=600)
    rows = _metrics(out)
    train = [r for r in rows if "rollout/groups" in r]
    assert len(train) == steps
    assert all(r["rollout/groups"] == 4 for r in train)
    assert sum(r["rollout/reward"] for r in train) > 0  # the SFT start solves some problems
    # The all-scored solve rate is over every prompt the step consumed, kept or filtered: 8 samples
    # each, and each step's wins are the kept groups' plus 8 per all-solved group (a sample dropped
    # for a verifier infrastructure error, counted in verifier_errors, is the only slack).
    for r in train:
        slack = r["rollout/verifier_errors"]
        assert (8 * r["rollout/prompts_consumed"] - slack <= r["rollout/samples_scored"]
                <= 8 * r["rollout/prompts_consumed"]), r
        wins = r["rollout/reward_all_scored"] * r["rollout/samples_scored"]
        assert abs(wins - 8 * r["rollout/filtered_all_solved"]
                   - r["rollout/reward"] * r["rollout/samples"]) <= slack + 1e-6, r
    # The off-policy bound applies at admission: no group is dropped at consumption (no --max_token_lag),
    # and every token's lag is recorded; a sample's first token is its oldest.
    assert all(r["rollout/groups_dropped_stale"] == 0 for r in train)
    assert all(r["rollout/lag_first_token_max"] == r["rollout/lag_max"] for r in train)
    assert all(0 <= r["rollout/lag_first_token_mean"] <= r["rollout/lag_first_token_max"] for r in train)
    assert all(r["sync/probe_max_abs_diff"] < 1e-2 for r in train if r["sync/probe_checks"])
    assert all(r["perf/peak_flops"] == 1e12 and r["perf/peak_memory_bandwidth"] == 1e11 for r in train)
    assert "time/save" in train[-1] and train[-1]["time/step"] > 0
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    assert [st for st, _ in evals] == [0, steps] and all(0.0 <= v <= 1.0 for _, v in evals)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["generated_tokens_per_s"] > 0 and summary["learner_tokens_per_s"] > 0
    assert all(0 < summary[key] <= 1 for key in ("actor_mfu", "actor_mbu", "actor_occupancy"))
    assert summary["mean_step_time_s"] > 0 and summary["actor_weight_wait_s"] >= 0 and summary["mean_save_time_s"] >= 0
    assert summary["peak_flops"] == 1e12 and summary["peak_memory_bandwidth"] == 1e11


def _rewarded_by_length(toy_data_dir, tmp_path):
    """400 toy RL prompts scored by length (max_length against 0 words): every group has a gradient."""
    rows = [json.loads(line) for line in open(os.path.join(toy_data_dir, "rlvr.jsonl"))][:400]
    data = tmp_path / "by_length.jsonl"
    data.write_text("".join(json.dumps({**r, "verifier": "max_length", "ground_truth": "0"}) + "\n" for r in rows))
    return data


@pytest.mark.slow
def test_drained_updates_stream_when_an_engine_needs_them(toy_model_dir, toy_data_dir, tmp_path):
    """Drained updates under --async_steps 3 (torchrun: the engine's request travels over gloo): learner 0
    streams new weights only when the engine asks (it has drained and every prompt it holds needs newer ones),
    when its weights reach the bound, and before the closing evaluation; not at every step. Every step still
    trains all its groups and the lag stays within the bound. Drained updates make the engine deliver its groups in bursts
    (everything finishes before it loads), so a pull brings more groups than the step takes: the surplus must
    stay counted in flight, or the dispatcher refills and labels prompts for groups no step took and the lag
    grows step after step (with the surplus counted as consumed, this run's lag reached 10 versions; 16 with
    --async_steps 4 in a 30-step bench run). A reward by length gives every group a gradient, so each step
    takes exactly its prompts and the bound is exact."""
    data = _rewarded_by_length(toy_data_dir, tmp_path)
    out = str(tmp_path / "run")
    steps, bound = 12, 3
    _, cmd = _grpo_cmd(toy_model_dir, toy_data_dir, out, "--num_training_steps", str(steps), "--eval_every",
                       str(steps), "--dataset_mixer_list", str(data), "1.0", "--inflight_updates", "false",
                       "--async_steps", str(bound), "--num_unique_prompts_per_step", "2", "--num_learners", "1",
                       "--num_samples_per_prompt", "4", "--learning_rate", "1e-5", "--pack_length", "1024")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "grpo.py", *cmd],
                   cwd=REPO, check=True, timeout=600)
    train = [r for r in _metrics(out) if "rollout/groups" in r]
    assert len(train) == steps and all(r["rollout/groups"] == 2 for r in train)
    streamed = [r["sync/streamed"] for r in train]
    assert 0 < sum(streamed) < steps and streamed[-1] == 1, streamed  # the last: before the final evaluation
    since = 0  # versions since the engines' weights were sent
    for s in streamed:
        since = 0 if s else since + 1
        assert since < bound, streamed
    assert max(r["rollout/lag_max"] for r in train) <= bound, [r["rollout/lag_max"] for r in train]
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["weight_updates"] == sum(streamed)


def _descendants(pid: int) -> list[int]:
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _torchrun_until_checkpoint(toy_model_dir, toy_data_dir, tmp_path, timeout_s: int = 60):
    """Start `torchrun --nproc-per-node 2 grpo.py` (1 learner + 1 actor, a checkpoint every step, --timeout_s
    timeout_s) in its own session, logging to tmp_path/log.txt, and return once step 2 is saved: (out, proc, log)."""
    out = str(tmp_path / "run")
    _, cmd = _grpo_cmd(toy_model_dir, toy_data_dir, out, "--num_training_steps", "1000", "--eval_every", "0",
                       "--num_unique_prompts_per_step", "2", "--num_samples_per_prompt", "4", "--save_steps", "1",
                       "--max_prompts_per_step_factor", "2", "--timeout_s", str(timeout_s))
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "grpo.py", *cmd],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while not os.path.isdir(os.path.join(out, "checkpoints", "step_2")):
        if proc.poll() is not None or time.time() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
            raise AssertionError(open(tmp_path / "log.txt").read()[-3000:])
        time.sleep(0.5)
    return out, proc, log


def _two_nodes(out, tmp_path, model_dir, toy_data_dir, *extra, sizes=(1, 1)) -> tuple[list[int], list[str]]:
    """README's two-node launch with both "nodes" on this machine: two torchrun agents (--nnodes 2, `sizes`
    processes each, c10d rendezvous on 127.0.0.1) make one run. The first joins first, hosts the rendezvous and is
    torchrun's node 0 (c10d numbers nodes by address: 127.0.0.1 before localhost). Returns their exit codes and
    logs."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _, cmd = _grpo_cmd(model_dir, toy_data_dir, out, "--eval_every", "0", "--num_unique_prompts_per_step", "2",
                       "--num_samples_per_prompt", "4", *extra)
    procs, logs = [], []
    for node, (size, address) in enumerate(zip(sizes, ("127.0.0.1", "localhost"))):
        logs.append(open(tmp_path / f"node{node}.log", "w"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(size),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "grpo-two-nodes",
             "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", address, "grpo.py", *cmd],
            cwd=REPO, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(2.0)
    try:
        rcs = [p.wait(timeout=700) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in logs:
            f.close()
    return rcs, [open(tmp_path / f"node{node}.log").read() for node in (0, 1)]


@pytest.fixture(scope="module")
def killed_actor_run(toy_model_dir, toy_data_dir, tmp_path_factory):
    """One run for the two tests below. torchrun, 1 learner + 1 actor, a checkpoint each step; once step 2 is
    saved the actor is killed -9, and what follows is recorded: the exit, the engine processes, the log, the
    last checkpoint's training state. Then README's two-node launch resumes the run from that checkpoint for
    three more steps."""
    tmp_path = tmp_path_factory.mktemp("killed_actor")
    out, proc, log = _torchrun_until_checkpoint(toy_model_dir, toy_data_dir, tmp_path)
    try:
        text = open(tmp_path / "log.txt").read()
        actor_pid = int(text.split("[actor rank 1] pid ")[1].split(":")[0])
        engine_pids = _descendants(actor_pid)  # vLLM's engine core and worker
        affinity = {p: os.sched_getaffinity(p) for p in [actor_pid, *engine_pids]}
        os.kill(actor_pid, signal.SIGKILL)
        t = time.time()
        rc = proc.wait(timeout=90)
        exit_s = time.time() - t
        while any(os.path.exists(f"/proc/{p}") for p in engine_pids) and time.time() - t < 30:
            time.sleep(0.5)
        engine_left = [p for p in engine_pids if os.path.exists(f"/proc/{p}")]
    finally:
        if proc.poll() is None:  # torchrun forwards SIGTERM; its workers also die with it (PDEATHSIG)
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    last = grpo.latest_checkpoint(out)
    state = torch.load(os.path.join(last, "training_state.pt"), weights_only=False)
    killed_rows = len(_metrics(out))
    resumed_rcs, resumed_logs = _two_nodes(out, tmp_path, toy_model_dir, toy_data_dir, "--resume",
                                           "--num_training_steps", str(state["step"] + 3), "--save_steps", "1",
                                           "--max_prompts_per_step_factor", "2", "--num_learners", "1")
    return {"out": out, "log": open(tmp_path / "log.txt").read(), "engine_pids": engine_pids, "affinity": affinity,
            "actor_pid": actor_pid, "rc": rc, "exit_s": exit_s, "engine_left": engine_left, "last": last,
            "state": state, "killed_rows": killed_rows, "resumed_rcs": resumed_rcs, "resumed_logs": resumed_logs}


@pytest.mark.slow
def test_torchrun_actor_killed_learner_exits_checkpoint_loads(killed_actor_run):
    """torchrun, 1 learner + 1 actor: train a few steps with a checkpoint each step, kill -9 the actor,
    and the learner exits with a clear error well within --timeout_s; the last checkpoint loads and
    --resume continues from it (launched as two nodes, see killed_actor_run): three more steps, numbered on
    from the checkpoint's, the sampler moving on."""
    run = killed_actor_run
    text, engine_pids = run["log"], run["engine_pids"]
    assert engine_pids
    if len(os.sched_getaffinity(0)) >= 2:  # each rank on its own core(s); vLLM's processes stay on the actor's
        # two ranks print into one log: a line may run into the other rank's, so read the list itself
        learner_cores, actor_cores = (
            set(ast.literal_eval(re.search(rf"\[rank {r}\] pinned to CPU cores (\[[\d, ]*\])", text).group(1)))
            for r in (0, 1))
        assert learner_cores and actor_cores and not learner_cores & actor_cores
        assert all(cores == actor_cores for cores in run["affinity"].values()), run["affinity"]
    assert run["rc"] != 0 and run["exit_s"] < 60, (run["rc"], run["exit_s"])
    assert not run["engine_left"], run["engine_left"]  # the engine does not outlive its actor (30 s)
    # either the learner saw the dead actor first (its FATAL names it), or torchrun's agent did and
    # stopped the learner (SIGTERM: "interrupted"), with the killed actor rank as the root cause
    assert ("FATAL" in text and "actor" in text) or (
        "interrupted (signal 15)" in text and "Root Cause" in text
        and "rank      : 1" in text.split("Root Cause")[1]), text[-3000:]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run["last"])
    state, out = run["state"], run["out"]
    assert state["step"] >= 2 and state["sampler_position"] > 0
    logs = run["resumed_logs"]
    assert run["resumed_rcs"] == [0, 0] and any(f"start step {state['step']}" in t for t in logs), [
        t[-2000:] for t in logs]
    # the killed run may have logged a step after its last checkpoint: the resumed run logs it again
    new_steps = [r["step"] for r in _metrics(out)[run["killed_rows"]:] if "rollout/groups" in r]
    assert new_steps == [state["step"] + 1, state["step"] + 2, state["step"] + 3], new_steps
    resumed = torch.load(os.path.join(grpo.latest_checkpoint(out), "training_state.pt"), weights_only=False)
    assert resumed["step"] == state["step"] + 3 and resumed["sampler_position"] > state["sampler_position"]


@pytest.mark.slow
def test_torchrun_ctrl_c_every_process_exits_checkpoint_intact(toy_model_dir, toy_data_dir, tmp_path):
    """Ctrl-C in the terminal (SIGINT to torchrun's whole process group: the agent, the learner, the
    actor and vLLM's engine processes) mid-run: every process is gone within a bounded time, the
    learner says it was interrupted, and the last checkpoint loads and carries its training state."""
    out, proc, log = _torchrun_until_checkpoint(toy_model_dir, toy_data_dir, tmp_path)
    try:
        everyone = _descendants(proc.pid)  # torchrun's workers and the engine processes under the actor
        assert len(everyone) >= 3
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        t = time.time()
        rc = proc.wait(timeout=90)
        assert rc != 0 and time.time() - t < 60
        while any(os.path.exists(f"/proc/{p}") for p in everyone):
            assert time.time() - t < 60, [p for p in everyone if os.path.exists(f"/proc/{p}")]
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = open(tmp_path / "log.txt").read()
    assert "interrupted" in text, text[-3000:]
    from transformers import AutoModelForCausalLM

    last = grpo.latest_checkpoint(out)
    AutoModelForCausalLM.from_pretrained(last)
    state = torch.load(os.path.join(last, "training_state.pt"), weights_only=False)
    assert state["step"] >= 2 and state["sampler_position"] > 0


def test_weight_dir_is_refused_with_what_replaced_it():
    """--weight_dir staged every update as a file for the engines; weights now stream into the engines'
    workers, so an old launch line that passes it stops at once and says why."""
    import chat_template

    with pytest.raises(SystemExit, match="--weight_dir.*stream from learner 0 straight into the engines"):
        chat_template.parse_stage_args(grpo.Args, grpo.UNSUPPORTED_FLAGS, ["--weight_dir", "/dev/shm"])


class _FilesCreated:
    """Names of the files created in some directories while it runs (inotify: even a file that lives for a
    millisecond is seen, where polling a listing would miss it)."""

    def __init__(self, *dirs):
        import ctypes

        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        created, moved_in = 0x100, 0x80
        self.dirs = {self.libc.inotify_add_watch(self.fd, d.encode(), created | moved_in): d for d in dirs}
        assert self.fd >= 0 and all(wd >= 0 for wd in self.dirs), "inotify is not available"
        self.names = []

    def read(self) -> list[str]:
        import struct

        with contextlib.suppress(BlockingIOError):
            data = os.read(self.fd, 1 << 20)
            off = 0
            while off < len(data):
                wd, _, _, n = struct.unpack_from("iIII", data, off)
                name = data[off + 16:off + 16 + n].rstrip(b"\0").decode()
                self.names.append(os.path.join(self.dirs.get(wd, "?"), name))
                off += 16 + n
        return self.names


def _torchrun(nproc, toy_model_dir, toy_data_dir, out, *extra, env=None, timeout=400, every=None) -> tuple[int, str]:
    """Run `torchrun --nproc-per-node nproc grpo.py` on the toy model; `every(pid)` is called each 0.2 s while it
    runs. Returns (exit code, log)."""
    _, cmd = _grpo_cmd(toy_model_dir, toy_data_dir, out, "--eval_every", "0", "--num_unique_prompts_per_step", "2",
                       "--num_samples_per_prompt", "4", "--max_prompts_per_step_factor", "2", "--timeout_s", "60",
                       *extra)
    with open(out + ".log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                                 "grpo.py", *cmd], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        deadline = time.time() + timeout
        while proc.poll() is None and time.time() < deadline:
            if every is not None:
                every(proc.pid)
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(), open(out + ".log").read()


@pytest.fixture(scope="module")
def tensor_parallel_stream_run(toy_model_dir, toy_data_dir, tmp_path_factory):
    """One run for the weight-stream tests below: torchrun, 1 learner + 1 actor whose engine has two workers
    (--vllm_tensor_parallel_size 2), four steps rewarded by length (every step has a gradient, so every update
    changes the weights), with TMPDIR and /dev/shm watched for files. Returns its output dir, exit code, log,
    the files created there while it ran and the pids of its processes."""
    root = tmp_path_factory.mktemp("tensor_parallel_stream")
    tmp = root / "tmp"
    tmp.mkdir()
    data = _rewarded_by_length(toy_data_dir, root)
    watch, pids, out = _FilesCreated("/dev/shm", str(tmp)), set(), str(root / "run")
    rc, log = _torchrun(2, toy_model_dir, toy_data_dir, out, "--num_training_steps", "4",
                        "--vllm_tensor_parallel_size", "2", "--dataset_mixer_list", str(data), "1.0",
                        "--learning_rate", "1e-4", env=dict(os.environ, TMPDIR=str(tmp)), timeout=700,
                        every=lambda pid: pids.update(_descendants(pid)))
    return {"out": out, "rc": rc, "log": log, "tmp": str(tmp), "created": watch.read(), "pids": pids}


@pytest.mark.slow
def test_torchrun_weights_stream_without_any_file(tensor_parallel_stream_run):
    """Four weight updates from learner 0 into both workers of the engine: no weight file appears in /dev/shm or
    the temp dir (the old path staged each update in /dev/shm as grpo_<actor pid>_v<N>.pt), every probe after an
    update matches, and the update's time is logged split into gather, transfer and load. /dev/shm is shared with
    whatever else runs on the machine: there, only names that carry a pid of this run count."""
    run = tensor_parallel_stream_run
    assert run["rc"] == 0, run["log"][-3000:]
    created, pids = run["created"], run["pids"]
    print(f"{len(created)} files created in /dev/shm and TMPDIR during the run by {len(pids)} processes of it and "
          f"others: {sorted(set(created))[:20]}")
    ours = [n for n in created if n.startswith(run["tmp"]) or any(str(p) in os.path.basename(n) for p in pids)]
    weights = [n for n in ours if "grpo" in os.path.basename(n) or n.endswith((".pt", ".safetensors", ".bin"))]
    assert len(pids) >= 4 and not weights, (pids, weights)
    rows = [r for r in _metrics(run["out"]) if "rollout/groups" in r]
    assert len(rows) == 4 and sum(r["sync/probe_checks"] for r in rows) >= 3
    assert all(r["sync/probe_max_abs_diff"] < 2e-3 for r in rows if r["sync/probe_checks"])
    assert all(r["time/weight_gather"] > 0 and r["time/weight_transfer"] > 0 for r in rows)
    assert any("time/weight_load" in r for r in rows)
    summary = json.load(open(os.path.join(run["out"], "summary.json")))
    assert summary["mean_weight_load_s"] > 0 and summary["mean_weight_transfer_s"] > 0


# Run by torchrun in place of grpo.py (same arguments): grpo.main() with three things recorded or changed from outside.
# Learner 0's end of the weight stream's rendezvous (its gloo group) waits for the engines' workers STORE_LIMIT_S at
# most, as vLLM's NCCL store does for a fixed 300 s; actor rank 2's engine takes SLOW_ENGINE_S longer to start;
# learner 0 records when each weight broadcast starts, and each actor the spans during which its engine has requests
# (or tool episodes) in flight.
_OBSERVED_LAUNCH = """
import datetime, json, os, sys, time
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import vllm
import grpo

STORE_LIMIT_S, SLOW_ENGINE_S, LOG = {store_limit_s}, {slow_engine_s}, {log!r}
TORCHRUN_RANK = int(os.environ.get("RANK", 0))


def record(**event):
    with open(LOG, "a") as f:
        f.write(json.dumps(dict(event, t=time.time())) + "\\n")


real_group = dist.ProcessGroupGloo


def limited_group(store, rank, size, timeout):  # learner 0's end of the weight stream waits STORE_LIMIT_S at most
    return real_group(store, rank, size, min(timeout, datetime.timedelta(seconds=STORE_LIMIT_S)) if rank == 0
                      else timeout)


dist.ProcessGroupGloo = limited_group


class SlowLLM(vllm.LLM):
    def __init__(self, *args, **kw):
        if TORCHRUN_RANK == 2:
            time.sleep(SLOW_ENGINE_S)
        super().__init__(*args, **kw)


vllm.LLM = SlowLLM
real_broadcast = grpo.GlooTrainerWeightTransferEngine._broadcast


def broadcast(self, source, meta):
    if self.is_sender:
        record(kind="send")
    return real_broadcast(self, source, meta)


grpo.GlooTrainerWeightTransferEngine._broadcast = broadcast


def track(method):
    def tracked(self, *args, **kw):
        out = method(self, *args, **kw)
        busy = bool(self.pending or self.in_tools)
        if busy != getattr(self, "_recorded_busy", False):
            self._recorded_busy = busy
            record(kind="busy" if busy else "idle", actor=self.actor_id)
        return out
    return tracked


grpo.Actor._admit = track(grpo.Actor._admit)
grpo.Actor._step_engine = track(grpo.Actor._step_engine)
if __name__ == "__main__":
    grpo.main()
"""


def _observed_launch(tmp_path, store_limit_s: float, slow_engine_s: float) -> tuple[str, str]:
    """The path of a launch script (_OBSERVED_LAUNCH) and of the events it records."""
    log, script = str(tmp_path / "events.jsonl"), tmp_path / "observed_grpo.py"
    script.write_text(_OBSERVED_LAUNCH.format(repo=REPO, store_limit_s=store_limit_s, slow_engine_s=slow_engine_s,
                                              log=log))
    return str(script), log


def _busy_spans(events: list[dict]) -> dict[int, list[tuple[float, float]]]:
    """Each actor's spans (start, end) with requests in flight; one still open at the end runs to infinity."""
    spans, since = {}, {}
    for e in events:
        if e["kind"] == "busy":
            since[e["actor"]] = e["t"]
        elif e["kind"] == "idle" and e["actor"] in since:
            spans.setdefault(e["actor"], []).append((since.pop(e["actor"]), e["t"]))
    for actor, t in since.items():
        spans.setdefault(actor, []).append((t, math.inf))
    return spans


@pytest.mark.slow
def test_torchrun_two_actors_one_slow_to_start_drained_updates_wait_for_both(toy_model_dir, toy_data_dir, tmp_path):
    """torchrun, 1 learner + 2 actors, drained updates (--inflight_updates false) and tool episodes that keep each
    engine busy across step ends (a 2 s tool call inside every request). Learner 0's end of the weight stream's
    rendezvous gives up after 10 s (as vLLM's NCCL store does after a fixed 300 s) and actor rank 2's engine starts
    10 s late: learner 0 opens the rendezvous only once both engines are up, so the run starts (opened before, as it
    was, the rendezvous gave up while the engines loaded). Learner 0 sends each update only once both engines have
    drained: no broadcast starts while either engine has a request in flight (before, the gloo path sent at once;
    on NCCL the broadcast waited for the slowest engine to drain). Every update reaches both engines and their
    probes match."""
    out = str(tmp_path / "run")
    script, events_log = _observed_launch(tmp_path, store_limit_s=10, slow_engine_s=10)
    _, cmd = _grpo_cmd(toy_model_dir, toy_data_dir, out, "--eval_every", "0", "--num_unique_prompts_per_step", "2",
                       "--num_samples_per_prompt", "4", "--max_prompts_per_step_factor", "2", "--timeout_s", "60",
                       "--num_training_steps", "4", "--inflight_updates", "false",
                       "--response_length_sampler", "exponential", "--response_length_mean", "24",
                       "--bench_tool_latency_s", "2", "--bench_tool_turns", "1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", script, *cmd],
                          cwd=REPO, capture_output=True, text=True, timeout=500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "1 learner(s), 2 actor(s)" in log
    assert "Failed to load weights" not in log  # vLLM's reload warning for the rotary cache: expected, filtered
    rows = [r for r in _metrics(out) if "rollout/groups" in r]
    assert len(rows) == 4 and json.load(open(os.path.join(out, "summary.json")))["engines_loaded"] == 2
    assert sum(r["sync/probe_checks"] for r in rows) >= 4
    assert all(r["sync/probe_max_abs_diff"] < 2e-3 for r in rows if r["sync/probe_checks"])
    events = [json.loads(line) for line in open(events_log)]
    sends, spans = [e["t"] for e in events if e["kind"] == "send"], _busy_spans(events)
    assert len(sends) == sum(r["sync/streamed"] for r in rows) >= 3 and set(spans) == {0, 1}, (sends, spans)
    during = [(t, a) for t in sends for a, ss in spans.items() for start, end in ss if start < t < end]
    assert not during, f"broadcasts started while an engine had requests in flight: {during}"


@pytest.mark.slow
def test_torchrun_tensor_parallel_engine_loads_every_update(tensor_parallel_stream_run):
    """The engine's two workers (vLLM CPU's multiprocess workers, each bound by grpo.py to its share of the
    actor's cores) both join the weight stream and load their own shard of every update. The probe after each
    update matches (a worker left on old weights would add its stale half to the all-reduce; a failed probe is
    fatal) and every token carries a version within the off-policy bound."""
    run, steps = tensor_parallel_stream_run, 4
    assert run["rc"] == 0, run["log"][-3000:]
    pinned = re.search(r"\[rank 1\] pinned to CPU cores (\[[\d, ]*\])", run["log"])
    if pinned:  # vLLM's own report of the binding it was given: each worker its share
        assert (f"VLLM_CPU_OMP_THREADS_BIND={grpo.omp_bind(ast.literal_eval(pinned.group(1)), 2)!r}"
                in run["log"]), run["log"][-3000:]
    rows = [r for r in _metrics(run["out"]) if "rollout/groups" in r]
    assert len(rows) == steps and all(r["rollout/groups"] == 2 for r in rows)
    assert sum(r["sync/probe_checks"] for r in rows) >= steps - 1
    assert all(r["sync/probe_max_abs_diff"] < 2e-3 for r in rows if r["sync/probe_checks"])
    assert all(0 <= r["rollout/lag_first_token_max"] == r["rollout/lag_max"] <= 2 for r in rows)
    assert json.load(open(os.path.join(run["out"], "summary.json")))["weight_updates"] == steps


@pytest.mark.slow
def test_two_nodes_learner_node_and_actor_node(killed_actor_run):
    """README's two-node launch (the resumed run of `killed_actor_run`): two torchrun agents make one run, the
    learner on one node and the actor on the other; it trains three steps, and every update crosses from one node's
    learner into the other node's engine (probe matches)."""
    texts = killed_actor_run["resumed_logs"]
    assert killed_actor_run["resumed_rcs"] == [0, 0], [t[-2000:] for t in texts]
    learner_node = [i for i, t in enumerate(texts) if "1 learner(s), 1 actor(s)" in t]
    actor_node = [i for i, t in enumerate(texts) if "[actor rank 1] pid" in t]
    assert len(learner_node) == len(actor_node) == 1 and learner_node != actor_node, [t[-2000:] for t in texts]
    out = killed_actor_run["out"]
    rows = [r for r in _metrics(out)[killed_actor_run["killed_rows"]:] if "rollout/groups" in r]
    assert len(rows) == 3 and sum(r["sync/probe_checks"] for r in rows) >= 2
    assert all(r["sync/probe_max_abs_diff"] < 2e-3 for r in rows if r["sync/probe_checks"])
    assert json.load(open(os.path.join(out, "summary.json")))["engines_loaded"] == 1


@pytest.mark.slow
def test_torchrun_stopped_engine_every_rank_fails_naming_the_actor(toy_model_dir, toy_data_dir, tmp_path):
    """SIGSTOP the actor's vLLM engine processes mid-run (--timeout_s 30): nothing errors on its own (the
    processes live, the gloo links stay up), yet every rank ends within about 40 s with an error that
    names the actor, and the stopped engine processes do not outlive the run."""
    out, proc, log = _torchrun_until_checkpoint(toy_model_dir, toy_data_dir, tmp_path, timeout_s=30)
    engine = []
    try:
        text = open(tmp_path / "log.txt").read()
        actor_pid = int(text.split("[actor rank 1] pid ")[1].split(":")[0])
        engine = _descendants(actor_pid)
        assert engine
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        t = time.time()
        rc = proc.wait(timeout=180)
        elapsed = time.time() - t
        while any(os.path.exists(f"/proc/{p}") for p in engine):  # killed by the actor rank, not left stopped
            assert time.time() - t < elapsed + 15, [p for p in engine if os.path.exists(f"/proc/{p}")]
            time.sleep(0.5)
    finally:
        for pid in engine:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = open(tmp_path / "log.txt").read()
    print(f"exited {rc} {elapsed:.1f}s after the SIGSTOP")
    assert rc != 0 and elapsed < 50, (rc, elapsed, text[-3000:])
    learner = [line for line in text.splitlines() if "[rank 0] FATAL" in line]
    actor = [line for line in text.splitlines() if "[actor rank 1] FATAL" in line]
    print(*learner[:1], *actor[:1], sep="\n")
    assert learner and "actor rank 1" in learner[0], text[-3000:]
    assert actor and "vLLM engine" in actor[0] and "did not finish a call" in actor[0], text[-3000:]


@pytest.mark.slow
def test_torchrun_two_fsdp2_learners_train_and_resume(toy_sft_model_dir, toy_data_dir, tmp_path):
    """torchrun, 2 learners (FSDP2 on gloo) + 1 actor: two steps with a checkpoint each (launched as two uneven
    nodes, the smaller joining first), then --resume for one more. The resumed run loads the sharded optimizer
    from the full saved state (this hung while the load broadcast on the default group, which the actor is in but
    never joins) and
    continues it: AdamW's step count goes on from 2 to 3, where a fresh optimizer would restart at 1.
    From the SFT start (the random model solves nothing, so its steps have no gradient at all). The
    SFT model solves a prompt's 4 samples all or none most of the time: in three runs of this test,
    10 of 51 prompts (about 1 in 5) gave a group to learn from, and one CI run hit the old cap of 16
    prompts with none (0.8^16 ~ 3% a step). Up to 80 prompts a step: 0.8^80 ~ 2e-8, and active
    sampling stops at the second useful group, so the cap costs nothing in the usual step."""
    out = str(tmp_path / "run")
    flags = ("--num_learners", "2", "--save_steps", "1", "--max_prompts_per_step_factor", "40", "--timeout_s", "60")

    def run(steps, *extra):
        _, cmd = _grpo_cmd(toy_sft_model_dir, toy_data_dir, out, "--num_training_steps", str(steps),
                           "--eval_every", "0", "--num_unique_prompts_per_step", "2", "--num_samples_per_prompt", "4",
                           *flags, *extra)
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "grpo.py", *cmd],
                              cwd=REPO, capture_output=True, text=True, timeout=400)

    def adam_state(step):
        state = torch.load(os.path.join(out, "checkpoints", f"step_{step}", "training_state.pt"), weights_only=False)
        return state["optimizer"]["state"].values()

    # The first two steps: an uneven two-node launch, the actor's node of 1 joining first (torchrun's node 0, its
    # process torchrun's rank 0), the learners' node of 2 second. The roles follow the nodes' sizes, not that order.
    rcs, (actor_node, learner_node) = _two_nodes(out, tmp_path, toy_sft_model_dir, toy_data_dir, "--num_training_steps",
                                                 "2", *flags, sizes=(1, 2))
    assert rcs == [0, 0], (actor_node[-3000:], learner_node[-3000:])
    assert "[actor rank 2] pid" in actor_node and "2 learner(s), 1 actor(s)" in learner_node, actor_node[-3000:]
    second = run(3, "--resume")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "start step 2" in second.stdout
    rows = [r for r in _metrics(out) if "rollout/groups" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout/groups"] >= 1 for r in rows)  # each step learned
    # both learners' shards reach the engine
    assert all(r["sync/probe_max_abs_diff"] < 1e-2 for r in rows if r["sync/probe_checks"])
    # The step's training stats are sums over both learners' bins: every response token of the kept
    # samples is trained once (learner 0's bins alone held about half of them).
    for r in rows:
        assert abs(r["train/trained_tokens"] - r["rollout/response_length"] * r["rollout/samples"]) < 0.5, r
        assert r["perf/actor_mfu"] <= 1.0 and r["perf/actor_mbu"] <= 1.0
    assert {int(s["step"]) for s in adam_state(2)} == {2}
    resumed = list(adam_state(3))
    assert {int(s["step"]) for s in resumed} == {3}
    assert any(float(s["exp_avg"].norm()) > 0 for s in resumed)


def test_final_model_goes_to_output_dir_in_hf_layout(toy_model_dir, tmp_path):
    """save_final_model (the end of a run): weights, config, tokenizer and the trained template in output_dir,
    in bf16 when training in bf16 (config.json says so), fp32 otherwise; the live model stays fp32."""
    import chat_template
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    state = grpo.gather_full_state(model, 1)
    for bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        out = str(tmp_path / f"bf16_{bf16}")
        grpo.save_final_model(grpo.Args(output_dir=out, chat_template="olmo3-think-release"), model, tok, state, bf16)
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
        assert {v.dtype for v in saved.values()} == {dtype}
        assert all(torch.equal(saved[k], state[k].to(dtype)) for k in saved)
        assert AutoConfig.from_pretrained(out).dtype == dtype and model.dtype == torch.float32
        assert AutoTokenizer.from_pretrained(out).chat_template == chat_template.TEMPLATES["olmo3-think-release"]
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ids = torch.tensor([tok.encode("1+1=2")])
        tol = 5e-2 if bf16 else 0.0
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=tol, rtol=tol)


def test_metrics_logger_prints_every_logging_steps_and_records_every_step(tmp_path, capsys):
    """--logging_steps N: the console gets a step line every N steps, after the last and at every evaluation;
    metrics.jsonl gets every step."""
    logger = grpo.MetricsLogger(grpo.Args(output_dir=str(tmp_path), logging_steps=3, num_training_steps=7))
    logger.log(0, {"eval/pass@1": 0.25, "eval/pass@4": 0.5}, kind="eval")
    for step in range(1, 8):
        logger.log(step, {"train/loss": 0.1})
    logger.log(7, {"eval/pass@1": 0.75, "eval/pass@4": 1.0}, kind="eval")
    logger.close()
    printed = [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["step 0", "step 3", "step 6", "step 7", "step 7"]
    recorded = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    expected = [(0, "eval"), *((step, "train") for step in range(1, 8)), (7, "eval")]
    assert [(r["step"], r["kind"]) for r in recorded] == expected


def test_two_actors_rates_sum_over_engines_and_mfu_is_a_mean():
    """Two engines run side by side: the run generates the sum of their rates, not all tokens over the sum
    of their times (the per-engine mean); MFU is flops over (elapsed x peak) summed over engines."""
    def stats(actor, tokens, seconds, flops, peak):
        return {"actor": actor, "gen_tokens": tokens, "elapsed": seconds, "flops": flops, "bytes": 0.0,
                "peak_flops": peak, "peak_bw": 1.0, "peak_source": "given", "max_num_seqs": 4}
    args = grpo.Args(async_steps=1)
    step1 = [stats(0, 100, 2.0, 40.0, 10.0), stats(1, 300, 3.0, 60.0, 10.0)]
    m = grpo.rollout_metrics([], Counter(), [], [], [], step1, args)
    assert m["perf/actor_tokens_per_s"] == pytest.approx(100 / 2 + 300 / 3)  # 150, not 400 / 5 = 80
    assert m["perf/actor_mfu"] == pytest.approx((40 + 60) / (2 * 10 + 3 * 10))  # 2.0 FLOP/s of 10 each
    step2 = [stats(0, 60, 1.0, 0.0, 10.0), stats(1, 0, 1.0, 0.0, 10.0)]
    totals = Counter()
    for stats_list in (step1, step2):
        grpo.add_actor_totals(totals, stats_list)
    # actor 0: 160 tokens in 3 s; actor 1: 300 tokens in 4 s
    assert grpo.engines_tokens_per_s(totals, "actor_") == pytest.approx(160 / 3 + 300 / 4)
    assert totals["actor_gen_tokens"] == 460 and totals["actor_elapsed"] == 7.0
    grpo.add_actor_totals(totals, [dict(stats(0, 500, 9.0, 0.0, 10.0), weight_loads=1, weight_load_s=0.5)],
                          loads_only=True)  # the last loads: no tokens, no seconds
    assert (totals["actor_gen_tokens"], totals["actor_weight_loads"], totals["weight_loaded/0"]) == (460, 1, 1)
