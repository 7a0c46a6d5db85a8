"""fasttrain/lock.py: one trainer per --train_dir. Two trainers on one directory both ran, their
checkpoints interleaved (different seeds, one run's ckpt-N beside the other's) and one died with
FileNotFoundError; now the second stops at once naming the first's pid and host. The lock dies with its
process (fcntl), so a crashed run never blocks the next, and only rank 0 takes it, so a torchrun job
never blocks itself."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from launch_helpers import kill_tree, run_torchrun, trainer, trainer_args, trainer_env, wait_for_step

from fasttrain.data.synthetic import make_synthetic
from fasttrain.errors import SettingError
from fasttrain.lock import LOCK_NAME, RunLock, ensure_run_id, read_run_id, same_run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    make_synthetic(root, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)
    return root


def test_second_trainer_on_a_directory_stops_at_once_naming_the_first(data, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        trainer(data, run_dir, "--num_workers=0", "--max_steps=100000", "--checkpoint_every=2"),
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(run_dir, 3, first)
        second = subprocess.run(
            trainer(data, run_dir, "--num_workers=0", "--max_steps=4", "--seed=7"),
            env=trainer_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert second.stderr.strip().count("\n") == 0, second.stderr
        holder = f"(pid {first.pid} on host {socket.gethostname()}"
        assert f"is in use by another trainer {holder}" in second.stderr, second.stderr
        assert "resuming" not in second.stdout  # it stopped before reading or writing anything there
        assert json.loads((run_dir / "config.json").read_text())["seed"] != 7
    finally:
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr[-3000:]  # the first run never noticed
    assert "stopped by SIGTERM" in stdout


_HOLD = textwrap.dedent(
    """
    import os, sys, time
    from fasttrain.lock import RunLock
    RunLock.acquire(sys.argv[1])
    if os.fork() == 0:  # a child holding the descriptor, as a DataLoader worker does
        time.sleep(60)
        os._exit(0)
    print("locked", flush=True)
    time.sleep(60)
    """
)


def test_the_lock_dies_with_its_process_even_while_its_children_live(tmp_path):
    # An inherited flock would stay held by the forked child; a SIGKILLed trainer's DataLoader
    # workers live on for up to 5 s, which would stop a torchrun restart of the same job.
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], env=trainer_env(), stdout=subprocess.PIPE, text=True
    )
    children = subprocess.CompletedProcess([], 0, "")
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SettingError, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            RunLock.acquire(tmp_path)
        children = subprocess.run(["pgrep", "-P", str(holder.pid)], capture_output=True, text=True)
        child = int(children.stdout.split()[0])
        holder.kill()
        holder.wait()
        os.kill(child, 0)  # still alive, and holding the inherited descriptor
        lock = RunLock.acquire(tmp_path)  # a dead holder's lock is gone: no stale lock to clear
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        kill_tree(holder.pid)
        if children.stdout.split():
            kill_tree(child)


def test_a_leftover_lock_file_is_not_a_lock(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"pid": 999999, "host": "elsewhere"}\n')  # no process holds it
    lock = RunLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.slow
def test_a_restarted_torchrun_job_gets_the_lock_of_its_killed_rank_0(data, tmp_path):
    # Rank 0 (the lock holder) is SIGKILLed; torchrun restarts both ranks, and the new rank 0 must
    # take the lock while the old one's DataLoader workers may still be alive.
    run_dir = tmp_path / "run"
    args = trainer_args(data, run_dir, "--num_workers=2", "--max_steps=12", "--checkpoint_every=4")
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + ["--max-restarts=1", "-m", "fasttrain", *args],
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(run_dir, 5, agent, limit=180)
    record = json.loads((run_dir / LOCK_NAME).read_text())
    os.kill(record["pid"], signal.SIGKILL)
    stdout, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 0, stderr[-3000:]
    assert "resuming from step 4" in stdout and "is in use by another trainer" not in stderr
    assert torch.load(run_dir / "ckpt-12.pt", weights_only=True)["step"] == 12
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] != record["pid"]


def test_every_rank_of_a_job_stops_with_one_line_when_the_directory_is_in_use(data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)], env=trainer_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        job = ["-m", "fasttrain", *trainer_args(data, run_dir, "--max_steps=2")]
        (agent,) = run_torchrun(job, timeout=180)
    finally:
        kill_tree(holder.pid)
    assert agent.returncode != 0
    refusal = f"fasttrain: error: --train_dir {run_dir} is in use by another trainer (pid {holder.pid}"
    assert refusal in agent.stdout, agent.stdout[-3000:]
    assert "stopping with rank 0, which cannot use --train_dir" in agent.stdout
    # Each rank ends with its line and exit 2 (torchrun's own summary follows: the job failed).
    assert "SIGABRT" not in agent.stdout and "terminate called" not in agent.stdout, agent.stdout[-3000:]
    assert "exitcode  : 2" in agent.stdout, agent.stdout[-3000:]


def test_a_file_system_without_locks_gets_a_note_not_a_refusal(tmp_path, monkeypatch):
    # NFSv3 without lockd answers ENOLCK: training there must still work.
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr("fasttrain.lock.fcntl.lockf", no_locks)
    notes = []
    RunLock.acquire(tmp_path, log=notes.append).release()
    assert notes == [
        f"note: cannot lock {tmp_path / LOCK_NAME} ({os.strerror(errno.ENOLCK)}); nothing stops a second "
        "trainer from using this --train_dir at the same time"
    ]


def test_a_run_gets_one_identity_kept_across_resumes(tmp_path):
    run_id = ensure_run_id(tmp_path, "elsewhere")
    first = json.loads((tmp_path / "run.json").read_text())
    assert len(first["run_id"]) == 32 and first["started_from"] == "elsewhere" and first["run_id"] == run_id
    assert ensure_run_id(tmp_path) == run_id == read_run_id(tmp_path)  # a resume: the same run


@pytest.mark.parametrize("text", ['{"run_id": "3f2a', "[1, 2]", '{"run_id": 7}'])
def test_a_run_json_without_a_run_id_is_kept_aside_with_a_note(tmp_path, text):
    # A run.json torn by a full disk, or edited by hand, was replaced by a new identity without a word.
    (tmp_path / "run.json").write_text(text)
    notes = []
    run_id = ensure_run_id(tmp_path, log=notes.append)
    assert read_run_id(tmp_path) == run_id and (tmp_path / "run.json.unreadable").read_text() == text
    assert len(notes) == 1 and f"{tmp_path / 'run.json'} holds no run_id" in notes[0]
    assert "kept as run.json.unreadable" in notes[0]
    notes.clear()
    assert ensure_run_id(tmp_path, log=notes.append) == run_id and notes == []  # the next resume: quiet
    (tmp_path / "run.json").write_text(text)  # damaged again: the first one kept aside stays
    ensure_run_id(tmp_path, log=notes.append)
    assert (tmp_path / "run.json.unreadable").read_text() == text
    assert (tmp_path / "run.json.unreadable-2").read_text() == text and "run.json.unreadable-2" in notes[0]


def test_a_run_json_that_cannot_be_read_is_an_error_not_damage(tmp_path, monkeypatch):
    # EACCES or EIO (a network file system) is not a damaged file: it was set aside and a new run_id
    # made, and the evaluator then took the run's own checkpoints for another run's.
    import pathlib

    (tmp_path / "run.json").write_text('{"run_id": "' + "a" * 32 + '"}')
    real = pathlib.Path.read_bytes

    def unreadable(self):
        if self.name == "run.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", unreadable)
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: unreadable(self).decode())
    with pytest.raises(PermissionError):
        ensure_run_id(tmp_path, log=lambda line: None)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_same_run_by_directory_or_by_identity(tmp_path):
    a, b, copy, legacy = (tmp_path / n for n in ("a", "b", "copy", "legacy"))
    for d in (a, b):
        d.mkdir()
        ensure_run_id(d)
    copy.mkdir()
    (copy / "run.json").write_text((a / "run.json").read_text())
    legacy.mkdir()  # a run from before run.json
    assert same_run(a, a / "ckpt-4.pt") and same_run(a, copy / "ckpt-4.pt")
    assert not same_run(a, b / "ckpt-4.pt") and not same_run(a, legacy / "ckpt-4.pt")
    assert same_run(legacy, legacy / "ckpt-4.pt") and not same_run(legacy, a / "ckpt-4.pt")


def test_a_train_dir_that_is_a_file_is_named_so(tmp_path):
    # mkdir's "(File exists)" was the whole message: the user had given a file, and read it as a clash.
    from fasttrain.errors import SettingError
    from fasttrain.lock import claim_run_dir

    (tmp_path / "afile").write_text("")
    with pytest.raises(SettingError, match=r"train_dir .*afile is a file, not a directory; pass a directory"):
        claim_run_dir(tmp_path / "afile")


def test_a_data_cache_dir_that_is_a_file_is_named_so(tmp_path):
    # The demo data set's cache given as a file: "(File exists)" was all the message said of it.
    from types import SimpleNamespace

    from fasttrain.config import make_config
    from fasttrain.data_dir import prepare_data_dir
    from fasttrain.errors import SettingError

    (tmp_path / "afile").write_text("")
    cfg = make_config(data_cache_dir=str(tmp_path / "afile"), device="cpu")
    info = SimpleNamespace(local_rank=0, world_size=1)
    with pytest.raises(SettingError, match=r"in .*afile \(.*afile is a file\); set data_cache_dir"):
        prepare_data_dir(cfg, info, lambda line: None)
