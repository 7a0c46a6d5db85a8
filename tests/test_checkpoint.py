"""Checkpoint files: atomic writes, numeric keep-last-K, checksums, fallback, refusing unsafe pickles."""

import errno
import os
import pickle
import re

import pytest
import torch

from fasttrain import checkpoint as ckpt


def _state(step):
    return {"model": {"w": torch.full((3,), float(step))}, "step": step, "optimizer": {}, "ema": {}}


def test_round_trip_is_plain_weights_only(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, _state(7))
    assert path.name == "ckpt-7.pt"
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], torch.full((3,), 7.0))
    assert (tmp_path / "ckpt-7.pt.sha256").read_text().split()[0] == ckpt._sha256(path)


def test_keeps_newest_k_in_numeric_order(tmp_path):
    for step in (8, 9, 10, 11, 100):
        ckpt.save_checkpoint(tmp_path, step, _state(step), keep=3)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10, 11, 100]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".sha256") == [
        "ckpt-10.pt.sha256",
        "ckpt-100.pt.sha256",
        "ckpt-11.pt.sha256",
    ]


def test_pruning_never_deletes_a_newer_checkpoint(tmp_path):
    # A run that fell back past a corrupt ckpt-5.pt to ckpt-3.pt saves 4: with keep=1 the old rule
    # (newest by number) deleted ckpt-4.pt, the one good checkpoint, and kept the corrupt one.
    ckpt.save_checkpoint(tmp_path, 3, _state(3), keep=1)
    (tmp_path / "ckpt-5.pt").write_bytes(b"garbage")
    ckpt.save_checkpoint(tmp_path, 4, _state(4), keep=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 5]
    assert (tmp_path / "ckpt-5.pt").read_bytes() == b"garbage"  # left for the user to look at
    ckpt.save_checkpoint(tmp_path, 5, _state(5), keep=1)  # reaching step 5 replaces it
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5]
    assert ckpt.load_latest(tmp_path)[0]["step"] == 5


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    newest = ckpt.save_checkpoint(tmp_path, 2, _state(2))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    messages = []
    state, path = ckpt.load_latest(tmp_path, log=messages.append)
    assert state["step"] == 1 and path.name == "ckpt-1.pt"
    assert "ckpt-2.pt does not match its checksum" in messages[0]


def test_truncated_checkpoint_without_sidecar_is_reported(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    newest = ckpt.save_checkpoint(tmp_path, 2, _state(2))
    newest.with_name(newest.name + ".sha256").unlink()
    newest.write_bytes(newest.read_bytes()[:100])
    messages = []
    state, _ = ckpt.load_latest(tmp_path, log=messages.append)
    assert state["step"] == 1 and "cannot read checkpoint" in messages[0]


class _RunsCode:
    def __reduce__(self):
        return (os.mkdir, (str(_RunsCode.marker),))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    _RunsCode.marker = tmp_path / "pwned"
    path = tmp_path / "ckpt-5.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": _RunsCode(), "step": 5}, f)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_checkpoint(path)
    assert not _RunsCode.marker.exists()


def test_a_file_that_is_no_checkpoint_gets_a_readable_reason(tmp_path):
    # torch's message starts with advice to retry with weights_only=False: never pass that on.
    path = tmp_path / "ckpt-5.pt"
    path.write_text("garbage\n")
    with pytest.raises(
        ckpt.CheckpointError,
        match="refusing to load .*: it is not a checkpoint of tensors and plain data, or it is corrupt",
    ):
        ckpt.load_checkpoint(path)


@pytest.mark.parametrize("bad, words", [("missing.pt", "does not exist"), (".", "is a directory")])
def test_bad_paths(tmp_path, bad, words):
    with pytest.raises(ckpt.CheckpointError, match=words):
        ckpt.load_checkpoint(tmp_path / bad)


def test_not_a_fasttrain_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(1)}, tmp_path / "x.pt")
    with pytest.raises(ckpt.CheckpointError, match="not a fasttrain checkpoint"):
        ckpt.load_checkpoint(tmp_path / "x.pt")


def test_a_text_file_is_named_as_no_torch_file(tmp_path):
    # torch's own reason here is a bare KeyError, which read "cannot read checkpoint ...: 101".
    path = tmp_path / "ckpt-5.pt"
    path.write_text("hello")
    with pytest.raises(ckpt.CheckpointError, match="is not a torch checkpoint file"):
        ckpt.load_checkpoint(path)


@pytest.mark.parametrize(
    "state, words",
    [
        # Each of these loaded, then ended in a traceback where it was used (an int's .items(), a
        # str's .shape, int("two")).
        ({"model": 5, "step": 0}, "holds no state_dict under 'model' (parameter names to tensors)"),
        ({"model": {"conv1.weight": "x"}, "step": 0}, "holds no state_dict under 'model'"),
        ({"model": {0: torch.zeros(1)}, "step": 0}, "holds no state_dict under 'model'"),
        ({"model": {"w": torch.zeros(1)}, "step": "two"}, "its 'step' is 'two', not a step number"),
        ({"model": {"w": torch.zeros(1)}, "step": -1}, "its 'step' is -1, not a step number"),
        # The bookkeeping a resume reads first: a ValueError from dict() in changed_settings before.
        ({"model": {"w": torch.zeros(1)}, "step": 0, "config": ["x"]}, "its 'config' is not a table of"),
        ({"model": {"w": torch.zeros(1)}, "step": 0, "config": {1: 2}}, "its 'config' keys are not all"),
        ({"model": {"w": torch.zeros(1)}, "step": 0, "world_size": "2"}, "its 'world_size' is not a number"),
        ({"model": {"w": torch.zeros(1)}, "step": 0, "epoch_size": 1.5}, "its 'epoch_size' is not a number"),
        ({"model": {"w": torch.zeros(1)}, "step": 0, "run_id": 7}, "its 'run_id' is not a run identity"),
    ],
)
def test_a_checkpoint_of_the_wrong_structure_is_refused_and_the_run_falls_back(tmp_path, state, words):
    ckpt.save_checkpoint(tmp_path, 4, _state(4))
    torch.save(state, tmp_path / "ckpt-8.pt")
    with pytest.raises(ckpt.CheckpointError, match=re.escape(words)):
        ckpt.load_checkpoint(tmp_path / "ckpt-8.pt")
    logs = []
    loaded, path = ckpt.load_latest(tmp_path, log=logs.append)
    assert path.name == "ckpt-4.pt" and loaded["step"] == 4
    assert any("ckpt-8.pt" in line and words in line for line in logs), logs


_PHASES = ["torch.save", "fsync", "sidecar", "replace", "dir-fsync"]


@pytest.mark.parametrize("phase", _PHASES)
def test_crash_at_each_phase_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, phase):
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_replace = os.replace
    if phase == "torch.save":
        monkeypatch.setattr(ckpt.torch, "save", boom)
    elif phase == "fsync":
        monkeypatch.setattr(ckpt.os, "fsync", boom)
    elif phase == "sidecar":
        monkeypatch.setattr(ckpt, "write_atomic", boom)
    elif phase == "replace":
        monkeypatch.setattr(
            ckpt.os, "replace", lambda a, b: boom() if str(b).endswith(".pt") else real_replace(a, b)
        )
    else:
        monkeypatch.setattr(ckpt, "_fsync_dir", boom)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path, 2, _state(2))
    monkeypatch.undo()
    assert "ENOSPC: No space left on device" in str(raised.value)
    if phase != "dir-fsync":
        assert f"the newest checkpoint is {tmp_path / 'ckpt-1.pt'}," in str(raised.value)
    # The old checkpoint is byte-identical and still loads; no temporary file is left behind.
    assert ckpt.load_latest(tmp_path)[0]["step"] == (2 if phase == "dir-fsync" else 1)
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_save_over_an_older_file_of_its_step_is_not_called_written(tmp_path, monkeypatch):
    # A resume that fell back past a damaged ckpt-4.pt saves step 4 again; when that save failed, the
    # file already there made the message say "was written but its directory could not be synced".
    ckpt.save_checkpoint(tmp_path, 2, _state(2))
    ckpt.save_checkpoint(tmp_path, 4, _state(4))
    (tmp_path / "ckpt-4.pt").write_bytes(b"truncated")
    assert ckpt.load_latest(tmp_path)[1].name == "ckpt-2.pt"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "torch_save_to", full)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path, 4, _state(4))
    assert "was written" not in str(raised.value)
    assert f"cannot write checkpoint {tmp_path / 'ckpt-4.pt'} (ENOSPC" in str(raised.value)
    # and the checkpoint a rerun resumes from is step 2's: the damaged step-4 file is fallen back past.
    assert f"the newest checkpoint is {tmp_path / 'ckpt-2.pt'}, which a rerun" in str(raised.value)


def test_a_torch_saved_object_that_runs_code_is_refused_without_torchs_advice(tmp_path):
    # torch.save's zip format: torch 2.6+ says "unsupported GLOBAL" after advising to retry with
    # weights_only=False, which would run the file's code; the check for the older wording
    # ("Unsupported global") missed it and passed that advice on.
    _RunsCode.marker = tmp_path / "pwned"
    path = tmp_path / "ckpt-5.pt"
    torch.save({"model": _RunsCode(), "step": 5}, path)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.load_checkpoint(path)
    assert "it holds Python objects that would run code when unpickled" in str(raised.value)
    assert "weights_only" not in str(raised.value) and "\n" not in str(raised.value)
    assert not _RunsCode.marker.exists()


@pytest.mark.parametrize(
    "torch_says",
    [
        "Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely "
        "succeed, but it can result in arbitrary code execution.\n\nUnsupported global: GLOBAL posix.system",
        "Weights only load failed. In PyTorch 2.6 ... `weights_only` set to `False` ...\n\n\n"
        "Trying to load unsupported GLOBAL posix.system whose module posix is blocked.",
        "Weights only load failed. ... weights_only=False ...\nSomething new in a later torch\n",
    ],
    ids=["torch<2.6", "torch2.6+", "unknown"],
)
def test_no_wording_of_torchs_refusal_passes_on_its_advice(tmp_path, torch_says):
    message = ckpt._load_failure(tmp_path / "x.pt", torch_says)
    assert message.startswith(f"refusing to load {tmp_path / 'x.pt'}: ") and "weights_only" not in message


def test_an_empty_checksum_file_is_a_reason_not_a_traceback(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    ckpt.save_checkpoint(tmp_path, 2, _state(2))
    (tmp_path / "ckpt-2.pt.sha256").write_text("")  # was an IndexError from split()[0]
    messages = []
    state, _ = ckpt.load_latest(tmp_path, log=messages.append)
    assert state["step"] == 1
    assert f"checksum file {tmp_path / 'ckpt-2.pt.sha256'} is empty or malformed" in messages[0]


def test_an_unreadable_newest_checkpoint_stops_the_resume_naming_it(tmp_path, monkeypatch):
    # A permission problem (a copy made by another user) says nothing about the file's content:
    # falling back to an older checkpoint would silently redo the steps in between. Was a
    # PermissionError traceback. Root reads any file, so the refusal is injected where the file is opened.
    ckpt.save_checkpoint(tmp_path, 1, _state(1))
    newest = ckpt.save_checkpoint(tmp_path, 2, _state(2))
    real_open = open

    def guarded_open(path, *args, **kwargs):
        if str(path) == str(newest):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "open", guarded_open, raising=False)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.load_latest(tmp_path, log=lambda line: None)
    assert str(raised.value) == (
        f"cannot read {newest} (Permission denied); fix its permissions or the file system, or move "
        "the checkpoint away"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_checkpoint_file_is_one_line(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, _state(1))
    path.chmod(0)
    with pytest.raises(ckpt.CheckpointError, match="Permission denied"):
        ckpt.load_checkpoint(path)
