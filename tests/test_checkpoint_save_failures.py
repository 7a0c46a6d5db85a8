"""A checkpoint save that fails (disk full ENOSPC, a file size limit EFBIG, EIO, a read-only file
system EROFS) loses nothing already written, leaves no file a resume could pick, and ends in one
line naming the newest checkpoint; a rerun resumes from it. Before, it ended in a traceback ("unexpected
pos 704 vs 598", never "disk full"), and on a read-only file system left `.ckpt-N.pt.tmp` behind."""

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from launch_helpers import run_torchrun, trainer, trainer_args, trainer_env

from fasttrain import checkpoint as ckpt
from fasttrain.data.synthetic import make_synthetic


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


FLAGS = ("--num_workers=0", "--checkpoint_every=2")


def _file_size_limit(limit: int):
    """preexec_fn: files this process writes stop at `limit` bytes with EFBIG (as `ulimit -f`)."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed by SIGXFSZ
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _files(run_dir):
    return {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name.startswith(("ckpt-", ".ckpt-"))}


def test_file_size_limit_mid_run_names_the_newest_checkpoint_and_a_rerun_resumes(data, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.run(
        trainer(data, run_dir, *FLAGS, "--max_steps=2"), env=trainer_env(), capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-3000:]
    kept = _files(run_dir)
    # 1 MB: config.json and the log lines fit, an 11 MB checkpoint does not.
    limited = subprocess.run(
        trainer(data, run_dir, *FLAGS, "--max_steps=4"),
        env=trainer_env(),
        capture_output=True,
        text=True,
        preexec_fn=_file_size_limit(1 << 20),
    )
    assert limited.returncode == 1 and "Traceback" not in limited.stderr, limited.stderr[-3000:]
    assert limited.stderr.strip().count("\n") == 0, limited.stderr
    assert f"cannot write checkpoint {run_dir / 'ckpt-4.pt'} (EFBIG: File too large)" in limited.stderr
    assert f"the newest checkpoint is {run_dir / 'ckpt-2.pt'}, which a rerun" in limited.stderr
    assert _files(run_dir) == kept  # nothing lost, nothing partial (no ckpt-4.pt, no .tmp)
    rerun = subprocess.run(
        trainer(data, run_dir, *FLAGS, "--max_steps=4"), env=trainer_env(), capture_output=True, text=True
    )
    assert rerun.returncode == 0 and "resuming from step 2" in rerun.stdout, rerun.stderr[-3000:]
    assert torch.load(run_dir / "ckpt-4.pt", weights_only=True)["step"] == 4


def test_both_ranks_stop_with_one_line_when_rank_0_cannot_save(data, tmp_path):
    run_dir = tmp_path / "run"
    job = ["-m", "fasttrain", *trainer_args(data, run_dir, *FLAGS, "--max_steps=4")]
    env = {"FASTTRAIN_TEST_FSIZE": str(1 << 20)}
    (agent,) = run_torchrun(["tests/fsize_limited.py", *job], env=env, timeout=180)
    errors = [ln for ln in agent.stdout.splitlines() if ln.startswith("fasttrain: error:")]
    assert len(errors) == 2, agent.stdout[-3000:]  # one line per rank, no gloo traceback from rank 1
    assert any("(EFBIG: File too large)" in ln for ln in errors), errors
    assert any("stopping with rank 0, which could not save" in ln for ln in errors), errors
    assert "[rank1]: Traceback" not in agent.stdout and "SIGABRT" not in agent.stdout, agent.stdout[-3000:]
    assert any("no earlier checkpoint is there, so a rerun starts from step 0" in ln for ln in errors)
    assert not list(run_dir.glob("*ckpt-*"))  # the first save (step 2) failed and left nothing


def test_both_ranks_stop_with_one_line_when_rank_0_cannot_write_config_json(data, tmp_path):
    # Only rank 0 writes config.json and run.json at start-up: when it could not, it stopped alone and
    # rank 1 went on into its first all-reduce (a gloo traceback; on NCCL a wait until the timeout).
    run_dir = tmp_path / "run"
    (run_dir / "config.json").mkdir(parents=True)  # a directory where the file should be
    job = ["-m", "fasttrain", *trainer_args(data, run_dir, *FLAGS, "--max_steps=2")]
    (agent,) = run_torchrun(job, timeout=180)
    errors = [ln for ln in agent.stdout.splitlines() if ln.startswith("fasttrain: error:")]
    assert len(errors) == 2, agent.stdout[-3000:]  # one line per rank
    assert any(ln.startswith("fasttrain: error: cannot write ") and "--train_dir" in ln for ln in errors)
    assert any("stopping with rank 0, which cannot write --train_dir" in ln for ln in errors), errors
    assert "[rank1]: Traceback" not in agent.stdout and "[rank0]: Traceback" not in agent.stdout
    # It names the file a user knows, not the temporary one it was written to (gone by then).
    assert any(f"cannot write {run_dir / 'config.json'} (Is a directory)" in ln for ln in errors), errors


def test_a_start_up_error_releases_the_run_directory(data, tmp_path):
    # train() called from Python: an error after the lock was taken (here a --checkpoint_dir that is not
    # there, found at the resume) left run.lock held until the caller's process ended, and every other
    # trainer on that directory was refused.
    from fasttrain.config import make_config
    from fasttrain.errors import FasttrainError
    from fasttrain.train import train

    run_dir = tmp_path / "run"
    cfg = make_config(
        data_dir=str(data), num_classes=4, batch_size=4, image_size=32, num_workers=0, max_steps=2,
        eval_at_end=False, tensorboard=False, train_dir=str(run_dir), device="cpu",
        checkpoint_dir=str(tmp_path / "not-there"),
    )  # fmt: skip
    with pytest.raises(FasttrainError, match="not-there"):
        train(cfg)
    # Another process (a lock is its process's: this one would get its own again) takes the directory;
    # before, it was refused "in use by another trainer".
    take = f"import pathlib, fasttrain.lock as l; l.RunLock.acquire(pathlib.Path({str(run_dir)!r}))"
    other = subprocess.run([sys.executable, "-c", take], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr[-2000:]


_DISK_FULL = textwrap.dedent(
    """
    # Runs in a mount namespace of its own, on a tmpfs mounted at argv[1]; prints one JSON line.
    import json, os, subprocess, sys
    run_dir, command = sys.argv[1] + "/run", json.loads(sys.argv[2])
    go = lambda steps: subprocess.run(command + ["--train_dir=" + run_dir, "--max_steps=%d" % steps],
                                      capture_output=True, text=True)
    first = go(2)
    stat = os.statvfs(sys.argv[1])
    size = os.path.getsize(run_dir + "/ckpt-2.pt")
    # Leave half a checkpoint free: the log lines and config.json fit, the next checkpoint does not.
    with open(sys.argv[1] + "/filler", "wb") as f:
        f.write(b"\\0" * (stat.f_bavail * stat.f_frsize - size // 2))
    kept = {n: open(run_dir + "/" + n, "rb").read().hex() for n in os.listdir(run_dir) if "ckpt" in n}
    full = go(4)
    after = {n: open(run_dir + "/" + n, "rb").read().hex() for n in os.listdir(run_dir) if "ckpt" in n}
    os.remove(sys.argv[1] + "/filler")
    rerun = go(4)
    print(json.dumps(dict(first=first.returncode, full=full.returncode, stderr=full.stderr,
                          same=kept == after, names=sorted(after), rerun=rerun.returncode,
                          rerun_out=rerun.stdout + rerun.stderr, final=sorted(os.listdir(run_dir)))))
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_disk_full_on_a_small_tmpfs(data, tmp_path):
    # A real ENOSPC: a 32 MB tmpfs in a user + mount namespace (no root needed where the kernel allows
    # unprivileged user namespaces), filled to half a checkpoint short of the next save.
    mount = tmp_path / "mnt"
    mount.mkdir()
    probe = ["unshare", "-rm", "mount", "-t", "tmpfs", "tmpfs", str(mount)]
    probe = subprocess.run(probe, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode().strip()}")
    command = trainer(data, tmp_path / "unused", *FLAGS)
    command = [arg for arg in command if not arg.startswith("--train_dir=")]
    script = f'mount -t tmpfs -o size=32m tmpfs "$1" && exec {sys.executable} -c "$2" "$1" "$3"'
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(mount), _DISK_FULL, json.dumps(command)],
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["first"] == 0 and result["full"] == 1, result
    stderr = result["stderr"]
    assert "Traceback" not in stderr and stderr.strip().count("\n") == 0, stderr
    assert "ckpt-4.pt (ENOSPC: No space left on device)" in stderr, stderr
    assert "/run/ckpt-2.pt, which a rerun of the same command resumes from" in stderr, stderr
    assert result["same"] and result["names"] == ["ckpt-2.pt", "ckpt-2.pt.sha256"], result
    assert result["rerun"] == 0 and "resuming from step 2" in result["rerun_out"], result["rerun_out"][-3000:]
    assert "ckpt-4.pt" in result["final"]


def _state(step):
    return {"model": {"w": torch.full((1000,), float(step))}, "step": step}


class _FailingFile:
    """The file under torch.save, refusing data past its first 100 bytes with OSError(code)."""

    def __init__(self, f, code: int):
        self.f, self.code = f, code

    def write(self, data):
        if self.f.tell() > 100:
            raise OSError(self.code, os.strerror(self.code))
        return self.f.write(data)

    def flush(self):
        self.f.flush()


@pytest.mark.parametrize(
    "code", [errno.ENOSPC, errno.EFBIG, errno.EIO, errno.EROFS], ids=["ENOSPC", "EFBIG", "EIO", "EROFS"]
)
def test_each_write_error_is_one_line_and_leaves_nothing_a_resume_picks(tmp_path, monkeypatch, code):
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_init = ckpt._Sink.__init__
    monkeypatch.setattr(ckpt._Sink, "__init__", lambda self, f: real_init(self, _FailingFile(f, code)))
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path, 2, _state(2))
    message = str(raised.value)
    assert f"cannot write checkpoint {tmp_path / 'ckpt-2.pt'} ({errno.errorcode[code]}: " in message
    assert f"the newest checkpoint is {tmp_path / 'ckpt-1.pt'}" in message and "\n" not in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_temporary_file_the_file_system_keeps_is_ignored_then_removed(tmp_path, monkeypatch):
    # A file system remounted read-only mid-save (ext4 errors=remount-ro): the data cannot be written
    # and the partial temporary file cannot be deleted either.
    ckpt.save_checkpoint(tmp_path, 1, _state(1))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(ckpt.os, "fsync", read_only)
    monkeypatch.setattr(ckpt.Path, "unlink", read_only)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path, 2, _state(2))
    monkeypatch.undo()
    assert "(EROFS: Read-only file system)" in str(raised.value)
    assert ".ckpt-2.pt.tmp could not be removed (a resume ignores it" in str(raised.value)
    assert (tmp_path / ".ckpt-2.pt.tmp").exists()
    assert ckpt.load_latest(tmp_path)[0]["step"] == 1
    assert ckpt.remove_temporaries(tmp_path) == [".ckpt-2.pt.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1.pt", "ckpt-1.pt.sha256"]
