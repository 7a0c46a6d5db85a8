"""`torchrun ... -m fasttrain` on CPU ranks (gloo over loopback): 4 ranks, buckets vs torch DDP,
a two-node rendezvous on one machine, a killed worker resumed by --max-restarts, a SIGTERM on
one rank that every rank agrees on, ranks that do not all see the checkpoint rank 0 resumes from,
two ranks' evaluations scoring the checkpoint's model, a resume on another world size and batch,
each rank's own random stream, and the demo's data on two nodes that share no cache."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import free_port, run_torchrun

from fasttrain.data.synthetic import make_synthetic

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}  # PYTHONPATH: conftest.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=48, classes=4, seed=5)
    return root


def torchrun(nproc: int, *args, extra: tuple = (), nnodes: int = 1, node_rank: int = 0, port: int = 0):
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra]
    if nnodes == 1:
        launcher.append("--standalone")  # c10d rendezvous on a free loopback port; survives restarts
    else:
        launcher += [
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=fasttrain-test",
        ]
    return launcher + ["-m", "fasttrain", *args]


def fasttrain_args(data, run_dir, *more):
    return [
        f"--data_dir={data}",
        f"--train_dir={run_dir}",
        "--num_classes=4",
        "--batch_size=4",
        "--image_size=32",
        "--num_workers=0",
        "--log_every=2",
        "--max_eval_batches=2",
        *more,
    ]


def test_four_ranks_train_and_evaluate(data, tmp_path):
    out = subprocess.run(
        torchrun(4, *fasttrain_args(data, tmp_path / "run", "--max_steps=4")),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 x cpu" in out.stdout and "global batch 16" in out.stdout
    assert out.stdout.count("step 4, loss = ") == 1  # only rank 0 logs
    assert "validation top-1" in out.stdout


def _final_params(run_dir: Path, step: int) -> dict:
    return torch.load(run_dir / f"ckpt-{step}.pt", weights_only=True)["model"]


def _buckets_then_ddp(data, tmp_path, *more) -> dict[str, tuple[subprocess.CompletedProcess, dict]]:
    """Two ranks, 20 steps with --grad_sync buckets and then ddp: {sync: (output, final parameters)}."""
    runs = {}
    for sync in ("buckets", "ddp"):
        run_dir = tmp_path / sync
        args = fasttrain_args(
            data,
            run_dir,
            "--max_steps=20",
            f"--grad_sync={sync}",
            "--bucket_cap_mb=0.25",
            "--checkpoint_every=20",
            *more,
        )
        out = subprocess.run(torchrun(2, *args), env=ENV, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[sync] = (out, _final_params(run_dir, 20))
    return runs


def _assert_same_parameters(a_params: dict, b_params: dict) -> None:
    for name, a in a_params.items():
        if a.is_floating_point():
            b = b_params[name]
            # DDP divides by the world size before its sum, buckets fold 1/world into the update:
            # rounding may differ in the last bit, which 20 momentum steps must not grow past 1e-6.
            assert (a - b).abs().max() <= 1e-6 * max(a.abs().max().item(), 1e-6), name


def test_buckets_and_ddp_end_with_the_same_parameters(data, tmp_path):
    runs = _buckets_then_ddp(data, tmp_path, "--no-eval_at_end")
    _assert_same_parameters(runs["buckets"][1], runs["ddp"][1])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_buckets_and_ddp_captured_on_two_gpus_end_with_the_same_parameters(data, tmp_path):
    # The whole step, NCCL all-reduces included, captured in a CUDA graph on each of two GPUs: the one
    # place real sums run inside a graph (one GPU has no second rank). Both runs must also get past
    # leaving the process group, which hangs while a graph holding NCCL work is alive (pytorch#115388).
    runs = _buckets_then_ddp(data, tmp_path, "--precision=fp32", "--deterministic", "--max_eval_batches=1")
    for out, _ in runs.values():
        assert "2 x cuda" in out.stdout and "cuda-graph" in out.stdout, out.stdout[:2000]
    _assert_same_parameters(runs["buckets"][1], runs["ddp"][1])


def test_two_nodes_on_one_machine(data, tmp_path):
    port = free_port()
    args = fasttrain_args(data, tmp_path / "run", "--max_steps=4", "--no-eval_at_end")
    nodes = [
        subprocess.Popen(
            torchrun(1, *args, nnodes=2, node_rank=r, port=port),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outputs]
    assert "2 x cpu" in outputs[0][0] + outputs[1][0]
    assert (tmp_path / "run" / "ckpt-4.pt").exists()


def _workers(agent: subprocess.Popen) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _reached(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line), default=0)


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, limit: float = 180) -> None:
    deadline = time.time() + limit
    while _reached(run_dir) < step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert _reached(run_dir) >= step, "the job never reached the step"


def test_killed_worker_is_restarted_and_resumes(data, tmp_path):
    run_dir = tmp_path / "run"
    args = fasttrain_args(data, run_dir, "--max_steps=40", "--checkpoint_every=4", "--no-eval_at_end")
    agent = subprocess.Popen(
        torchrun(2, *args, extra=("--max-restarts=1",)),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(run_dir, 8, agent)
    os.kill(_workers(agent)[-1], signal.SIGKILL)
    stdout, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 0, stderr[-3000:]
    assert "resuming from step " in stdout
    assert torch.load(run_dir / "ckpt-40.pt", weights_only=True)["step"] == 40


def test_sigterm_on_one_rank_stops_every_rank_at_one_step(data, tmp_path):
    run_dir = tmp_path / "run"
    args = fasttrain_args(
        data, run_dir, "--max_steps=100000", "--checkpoint_every=100000", "--no-eval_at_end"
    )
    agent = subprocess.Popen(
        torchrun(2, *args), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for_step(run_dir, 4, agent)
    os.kill(_workers(agent)[-1], signal.SIGTERM)  # the last worker: not the one that logs and saves
    stdout, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 0, stderr[-3000:]
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped by ")]
    assert len(stopped) == 1, stdout
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert [p.name for p in run_dir.glob("ckpt-*.pt")] == [f"ckpt-{step}.pt"]


def _first_run_on_node0(data, tmp_path, run: str) -> None:
    """Per-node storage: node0 and node1 are the ranks' working directories; a 2-step run in node0/run."""
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir()
    first = [
        sys.executable,
        "-m",
        "fasttrain",
        *fasttrain_args(data, run, "--max_steps=2", "--no-eval_at_end"),
    ]
    out = subprocess.run(first, cwd=tmp_path / "node0", env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def _per_node_job(data, tmp_path):
    """A 2-rank job whose rank k works in tmp_path/node<k> with --train_dir=run; it must end, not hang."""
    script = tmp_path / "pernode.sh"
    script.write_text(
        f'#!/bin/sh\ncd {tmp_path}/node$LOCAL_RANK && exec {sys.executable} -m fasttrain "$@"\n'
    )
    script.chmod(0o755)
    args = fasttrain_args(data, "run", "--max_steps=4", "--no-eval_at_end")
    (job,) = run_torchrun(["--no-python", str(script), *args], timeout=120)
    assert "killed after" not in job.stdout, job.stdout[-3000:]
    assert job.returncode != 0
    return job


def test_a_checkpoint_only_rank_0_sees_stops_every_rank_naming_it(data, tmp_path):
    # Per-node storage: each rank's train_dir is its own directory, and only rank 0's holds a
    # checkpoint. Rank 1 had started fresh beside rank 0's resume, and the job hung at the end.
    _first_run_on_node0(data, tmp_path, "run")
    job = _per_node_job(data, tmp_path)
    assert "rank 1 cannot read run/ckpt-2.pt" in job.stdout, job.stdout[-3000:]
    assert "train_dir must be on storage every rank sees" in job.stdout


def test_a_tf_run_only_rank_0_sees_stops_every_rank(data, tmp_path):
    # The same with a TF run in rank 0's train_dir: rank 0 continued it while rank 1, deciding on its
    # own, went to look for fasttrain checkpoints in a collective rank 0 never made (a hang).
    from fasttrain.tf.convert import main as convert

    _first_run_on_node0(data, tmp_path, "src")
    tf_prefix = tmp_path / "node0" / "run" / "model.ckpt-2"
    assert convert(["to-tf", str(tmp_path / "node0" / "src" / "ckpt-2.pt"), "--out", str(tf_prefix)]) == 0
    job = _per_node_job(data, tmp_path)
    assert "stopping with rank 1, which cannot read run" in job.stdout, job.stdout[-3000:]


def _validation_row(run_dir: Path, source: str | None = None) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    row = [r for r in rows if r.get("split") == "validation" and r.get("source") == source][-1]
    return {k: row[k] for k in ("step", "top1", "ema_top1", "count")}


def test_two_ranks_evaluate_the_model_the_checkpoint_holds(data, tmp_path):
    # Each rank's BN running statistics and BN-EMA shadows differ (its own batches); a checkpoint keeps
    # rank 0's, and a resume gives them to every rank. Each rank had scored its shard with its own.
    def train(run_dir):
        args = fasttrain_args(data, run_dir, "--max_steps=24", "--checkpoint_every=12", "--deterministic")
        out = subprocess.run(
            torchrun(2, *args, "--max_eval_batches=0", "--model=resnet18", "--base_channels=8"),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return _validation_row(run_dir)

    whole = train(tmp_path / "whole")
    evaluate = [sys.executable, "-m", "fasttrain.evaluate", str(tmp_path / "whole")]
    out = subprocess.run(evaluate, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert whole == _validation_row(tmp_path / "whole", source="evaluate")
    resumed = tmp_path / "resumed"  # stopped at step 12: its checkpoint, config and identity
    resumed.mkdir()
    for name in ("ckpt-12.pt", "ckpt-12.pt.sha256", "config.json", "run.json"):
        shutil.copy(tmp_path / "whole" / name, resumed / name)
    assert train(resumed) == whole


def test_a_resume_on_another_world_size_and_batch_goes_on_at_the_same_record(data, tmp_path):
    # 96 records: 2 ranks of 4 read 40 in 5 steps. One process of 12 goes on at record 36 (40 rounded
    # down to its batch; 4 read again), and epoch 0's 8 batches of 12 end after 5 more steps. A
    # position kept as rank 0's count of batches (5 of 12) ended epoch 0 after 3 more: 84 records.
    run_dir = tmp_path / "run"
    args = fasttrain_args(data, run_dir, "--max_steps=5", "--no-eval_at_end", "--log_every=1")
    out = subprocess.run(torchrun(2, *args), env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    more = fasttrain_args(
        data, run_dir, "--max_steps=12", "--no-eval_at_end", "--log_every=1", "--batch_size=12"
    )
    out = subprocess.run([sys.executable, "-m", "fasttrain", *more], env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "note: data position: the checkpoint had read 40 records of epoch 0 (5 batches of 4 on each of 2 "
        "ranks); this run goes on in epoch 0 at record 36 (its last 4 are read again)"
    ) in out.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    epochs = {r["step"]: r["epoch"] for r in rows if "epoch" in r}
    assert [epochs[s] for s in range(6, 13)] == [0] * 5 + [1] * 2


def test_each_rank_draws_its_own_dropout_masks(data, tmp_path):
    # Every rank seeded torch with --seed and drew the same (Inception's dropout: the same masks on every
    # rank); the seed's towers draw their own.
    args = fasttrain_args(data, tmp_path / "run", "--max_steps=2", "--no-eval_at_end", "--deterministic")
    out = subprocess.run(torchrun(2, *args), env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rng = torch.load(tmp_path / "run" / "ckpt-2.pt", weights_only=True)["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])


def test_the_demo_on_two_nodes_builds_its_data_on_each(tmp_path):
    # Each node its own FASTTRAIN_CACHE (torchrun's GROUP_RANK is the node's rank): only global rank 0
    # built the demo set, and node 1 stopped at once with "data directory ... does not exist".
    script = tmp_path / "node.sh"
    script.write_text(
        f'#!/bin/sh\nFASTTRAIN_CACHE={tmp_path}/cache$GROUP_RANK exec {sys.executable} -m fasttrain "$@"\n'
    )
    script.chmod(0o755)
    args = ["--recipe=demo", f"--train_dir={tmp_path / 'run'}", "--max_steps=1", "--no-eval_at_end"]
    small = ["--model=resnet18", "--base_channels=8", "--image_size=32", "--batch_size=4", "--num_workers=0"]
    nodes = run_torchrun(["--no-python", str(script), *args, *small], nproc=1, nnodes=2, timeout=180)
    assert [n.returncode for n in nodes] == [0, 0], [n.stdout[-2000:] for n in nodes]
    assert all((tmp_path / f"cache{r}" / "demo-imagenet-v1" / "DONE").exists() for r in (0, 1))
