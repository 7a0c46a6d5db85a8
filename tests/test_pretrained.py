"""fasttrain.pretrained: --pretrained_model_checkpoint_path given a file that is not a fasttrain
checkpoint. A plain state_dict (torchvision's names, or a DDP-wrapped model's) is taken, fine_tune with
another head too; another trainer's file, a list, a fasttrain file without a state_dict and a
state_dict of other names each end in one CheckpointError saying what the file holds and how to keep
its weights. (Moved from test_resume.py, which tests the trainer's resume.)"""

import dataclasses

import pytest
import torch
from test_resume import assert_same_tensors

from fasttrain.checkpoint import CheckpointError
from fasttrain.config import make_config
from fasttrain.models import create_model
from fasttrain.pretrained import restore_pretrained


def _pretrained(path, **flags):
    model = create_model("resnet18", 5, base_channels=8)
    cfg = make_config(
        model="resnet18", base_channels=8, num_classes=5, pretrained_model_checkpoint_path=str(path)
    )
    logs = []
    restore_pretrained(model, dataclasses.replace(cfg, **flags), logs.append)
    return model, logs


def test_a_plain_state_dict_is_taken_with_torchvisions_names(tmp_path):
    # torch.save(model.state_dict(), path), as torchvision's weight files are: it used to end in "is not a
    # fasttrain checkpoint (no 'model' and 'step' entries)".
    torch.manual_seed(1)
    source = create_model("resnet18", 5, base_channels=8)
    assert "layer1.0.conv1.weight" in source.state_dict()  # torchvision's names (fasttrain/models/resnet.py)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    ddp = {f"module.{k}": v for k, v in source.state_dict().items()}  # a DDP-wrapped model's names
    torch.save(ddp, tmp_path / "ddp.pt")
    for name in ("weights.pt", "ddp.pt"):
        model, logs = _pretrained(tmp_path / name)
        assert_same_tensors(model.state_dict(), source.state_dict(), name)
        assert logs == [f"restored weights from {tmp_path / name}"]
    model, _ = _pretrained(tmp_path / "weights.pt", fine_tune=True, num_classes=7)  # another head
    assert torch.equal(model.conv1.weight, source.conv1.weight)


@pytest.mark.parametrize(
    "content, words",
    [
        (
            {"state_dict": "SD", "epoch": 3},
            "holds a dict of 'state_dict', 'epoch', neither a fasttrain checkpoint",
        ),
        ([1, 2], "holds list, neither a fasttrain checkpoint nor a state_dict"),
    ],
)
def test_another_file_says_how_to_keep_the_weights(tmp_path, content, words):
    weights = create_model("resnet18", 5, base_channels=8).state_dict()
    path = tmp_path / "trainer.pt"
    torch.save(
        {k: weights if v == "SD" else v for k, v in content.items()}
        if isinstance(content, dict)
        else content,
        path,
    )
    with pytest.raises(CheckpointError) as err:
        _pretrained(path)
    message = str(err.value)
    assert words in message and "\n" not in message, message
    wrap = f"torch.load({str(path)!r})['state_dict']" if isinstance(content, dict) else "model.state_dict()"
    assert f"save the weights alone, torch.save({wrap}, 'weights.pt'), and pass that file" in message


def test_a_fasttrain_file_without_a_state_dict_is_one_error(tmp_path):
    # {"model": 5, "step": 0} ended in "'int' object has no attribute 'items'".
    torch.save({"model": 5, "step": 0}, tmp_path / "odd.pt")
    with pytest.raises(CheckpointError, match="odd.pt holds no state_dict under 'model'"):
        _pretrained(tmp_path / "odd.pt")
    torch.save({0: torch.zeros(1)}, tmp_path / "int_keys.pt")  # ended in a TypeError in str.join
    with pytest.raises(CheckpointError, match="neither a fasttrain checkpoint nor a state_dict"):
        _pretrained(tmp_path / "int_keys.pt")


def test_a_state_dict_of_other_names_names_both(tmp_path):
    weights = {
        f"backbone.{k}": v for k, v in create_model("resnet18", 5, base_channels=8).state_dict().items()
    }
    torch.save(weights, tmp_path / "timm.pt")
    with pytest.raises(
        CheckpointError, match=r"missing conv1\.weight, .*; it has backbone\.bn1\.bias, .* instead"
    ):
        _pretrained(tmp_path / "timm.pt")


def test_the_fine_tune_hint_comes_only_when_the_classifier_alone_differs(tmp_path):
    # A resnet34 run's checkpoint given to a resnet18 was told "unexpected layer1.2.bn1.bias, ... (pass
    # fine_tune to re-initialise the classifier)": fine_tune does not make another body fit.
    deeper = create_model("resnet34", 5, base_channels=8)
    torch.save(
        {"model": deeper.state_dict(), "step": 3, "config": {"model": "resnet34"}}, tmp_path / "r34.pt"
    )
    for flags in ({}, {"fine_tune": True}):
        with pytest.raises(CheckpointError) as err:
            _pretrained(tmp_path / "r34.pt", **flags)
        message = str(err.value)
        assert f"{tmp_path / 'r34.pt'} does not fit model resnet18 (it is a resnet34 checkpoint): " in message
        assert "unexpected layer1.2." in message and "pass fine_tune" not in message, message
    wider = create_model("resnet18", 7, base_channels=8)  # the classifier alone differs: the hint is right
    torch.save({"model": wider.state_dict(), "step": 3, "config": {"model": "resnet18"}}, tmp_path / "r18.pt")
    with pytest.raises(CheckpointError) as err:
        _pretrained(tmp_path / "r18.pt")
    message = str(err.value)
    assert "does not fit model resnet18: shapes differ for fc.weight, fc.bias" in message, message
    assert message.endswith("(pass fine_tune to re-initialise the classifier)")
    model, _ = _pretrained(tmp_path / "r18.pt", fine_tune=True)
    assert torch.equal(model.conv1.weight, wider.conv1.weight)
