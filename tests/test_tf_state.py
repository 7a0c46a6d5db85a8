"""fasttrain.tf.state, fasttrain.tf.export and the TF official v1.5 names
(fasttrain/tf/names/resnet_v15.py): a trained state (weights, BN statistics, RMSProp or Momentum slots,
weight and BN EMA, step) exported to a V2 checkpoint and continued from it comes back exactly, in TF's
layouts (checked element by element, not through the code under test); TF official ResNet-50's
published variable names and shapes; each mismatch (another model, a missing, extra or misshapen
variable, the other optimizer's slots) is one CheckpointError naming the variable; end to end (slow), a
run continued from its TF export takes the same steps as fasttrain's own resume, and fasttrain.evaluate
gives its source's numbers on it."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from launch_helpers import ENV, command

from fasttrain.bn_buffers import BufferEMA
from fasttrain.checkpoint import CheckpointError
from fasttrain.data.synthetic import make_synthetic
from fasttrain.models import create_model
from fasttrain.optim import FusedMomentum, FusedRMSPropTF
from fasttrain.tf.checkpoint import open_checkpoint, write_checkpoint
from fasttrain.tf.export import export_tensors
from fasttrain.tf.names import to_tf, variable_map
from fasttrain.tf.state import load_run, model_state


def trained(kind="rmsprop", seed=0, num_classes=5):
    """A ResNet-18 (8 channels wide) whose every state is non-trivial: two optimizer steps on random
    gradients, BN statistics and their EMA moved."""
    torch.manual_seed(seed)
    model = create_model("resnet18", num_classes, base_channels=8)
    params = list(model.parameters())
    groups = [{"params": params, "weight_decay": 1e-4}]
    if kind == "rmsprop":
        opt = FusedRMSPropTF(groups, lr=0.1, ema_decay=0.9, impl="torch")
    else:
        opt = FusedMomentum(groups, lr=0.1, ema_decay=0.9, impl="torch")
    bn_ema = BufferEMA(model, 0.9)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        with torch.no_grad():
            for b in model.buffers():
                if b.is_floating_point():
                    b.add_(torch.rand_like(b))
        bn_ema.update(opt.applied_steps, torch.zeros(()))
    return model, opt, bn_ema


class _Step:
    def __init__(self):
        self.step_count = torch.zeros((), dtype=torch.int64)

    def state_dict(self):
        return {"step_count": self.step_count.clone()}

    def load_state_dict(self, state):
        self.step_count.copy_(state["step_count"])


class _Loader:
    num_records = 100

    def load_state_dict(self, state):
        self.state = state


def fresh_run(kind="rmsprop", num_classes=5):
    model, opt, bn_ema = trained(kind, seed=1, num_classes=num_classes)
    return SimpleNamespace(
        model=model,
        optimizer=opt,
        bn_ema=bn_ema,
        step=_Step(),
        loader=_Loader(),
        info=SimpleNamespace(world_size=1, rank=0, is_main=True, distributed=False),
    )


def config(kind="rmsprop"):
    return SimpleNamespace(
        model_name="resnet18", optimizer=kind, ema_decay=0.9, batch_size=4, grad_accum_steps=1, epoch_size=0
    )


def export(tmp_path, kind="rmsprop", step=30):
    model, opt, bn_ema = trained(kind)
    tensors, notes = export_tensors("resnet18", model, opt, bn_ema, step, kind)
    assert notes == []
    return write_checkpoint(tmp_path / "tf" / f"model.ckpt-{step}", tensors), (model, opt, bn_ema)


@pytest.mark.parametrize("kind", ["rmsprop", "momentum"])
def test_export_then_continue_is_the_identity(tmp_path, kind):
    prefix, (model, opt, bn_ema) = export(tmp_path, kind)
    run, logs = fresh_run(kind), []
    assert load_run(open_checkpoint(prefix.parent), config(kind), run, logs.append) == 30
    for key, value in model.state_dict().items():
        assert torch.equal(run.model.state_dict()[key], value) or not value.is_floating_point(), key
    want, got = opt.state_dict()["state"], run.optimizer.state_dict()["state"]
    for i in want:
        for slot in want[i]:
            if slot != "step":
                assert torch.equal(got[i][slot], want[i][slot]), (i, slot)
        assert int(got[i]["step"]) == 30  # the EMA's num_updates is TF's global_step
    for name, shadow in bn_ema.state_dict().items():
        assert torch.equal(run.bn_ema.state_dict()[name], shadow), name
    assert int(run.step.step_count) == 30
    assert run.loader.state == {"epoch": 1, "batch": 0}  # 25 steps an epoch (100 records, batch 4)
    assert "epoch 1 starts again from its first batch" in logs[0]


def test_tf_layouts_and_slot_names_element_by_element(tmp_path):
    prefix, (model, opt, bn_ema) = export(tmp_path)
    ckpt = open_checkpoint(prefix)
    conv = model.conv1.weight.detach().numpy()  # (O, I, H, W)
    kernel = ckpt.get("resnet_model/conv2d/kernel")  # (H, W, I, O)
    assert kernel.shape == (7, 7, 3, 8)
    for o, i, h, w in [(0, 0, 0, 0), (7, 2, 6, 1), (3, 1, 2, 5)]:
        assert kernel[h, w, i, o] == conv[o, i, h, w]
    fc = model.fc.weight.detach().numpy()  # (out, in)
    dense = ckpt.get("resnet_model/dense/kernel")  # (in, out)
    assert dense.shape == (64, 5) and dense[17, 3] == fc[3, 17]
    ms = opt.state_dict()["state"][0]["square_avg"].numpy()  # parameter 0 is conv1.weight
    assert ckpt.get("resnet_model/conv2d/kernel/RMSProp")[1, 2, 0, 4] == ms[4, 0, 1, 2]
    ema = opt.state_dict()["state"][0]["ema"].numpy()
    assert ckpt.get("resnet_model/conv2d/kernel/ExponentialMovingAverage")[1, 2, 0, 4] == ema[4, 0, 1, 2]
    mean_shadow = bn_ema.state_dict()["bn1.running_mean"].numpy()
    assert np.array_equal(
        ckpt.get("resnet_model/batch_normalization/moving_mean/ExponentialMovingAverage"), mean_shadow
    )
    assert ckpt.get("global_step").dtype == np.int64  # the ResNet seeds' global_step


def test_tf_official_resnet50_names_and_shapes():
    """TF official (2018) ResNet-50 v1.5: conv2d ... conv2d_52, batch_normalization ... _52, dense;
    the first block's projection is made before its conv1 (conv2d_1 is the 1x1 64 -> 256)."""
    model = create_model("resnet50", 1001)
    vmap = variable_map("resnet50", model)
    state = model.state_dict()
    shapes = {v.name: to_tf(state[k].numpy(), v.layout).shape for k, v in vmap.items()}
    names = set(shapes)
    assert shapes["resnet_model/conv2d/kernel"] == (7, 7, 3, 64)
    assert shapes["resnet_model/conv2d_1/kernel"] == (1, 1, 64, 256)  # stage 1's projection
    assert shapes["resnet_model/conv2d_2/kernel"] == (1, 1, 64, 64)
    assert shapes["resnet_model/dense/kernel"] == (2048, 1001)
    assert len([n for n in names if n.endswith("/kernel")]) == 54  # 53 convolutions + dense
    assert {"resnet_model/conv2d_52/kernel", "resnet_model/batch_normalization_52/moving_variance"} <= names
    assert "resnet_model/conv2d_53/kernel" not in names
    assert vmap["layer1.0.downsample.0.weight"].name == "resnet_model/conv2d_1/kernel"
    assert vmap["layer1.0.conv1.weight"].name == "resnet_model/conv2d_2/kernel"
    assert vmap["layer1.0.downsample.1.weight"].name == "resnet_model/batch_normalization_1/gamma"
    assert vmap["layer4.2.conv3.weight"].name == "resnet_model/conv2d_52/kernel"
    assert vmap["fc.bias"].name == "resnet_model/dense/bias"


def _edit(prefix, change):
    ckpt = open_checkpoint(prefix)
    tensors = {n: ckpt.get(n) for n in ckpt.shapes()}
    change(tensors)
    return write_checkpoint(prefix.parent / "edited" / "model.ckpt-1", tensors)


def test_mismatches_are_one_line_naming_the_variable(tmp_path):
    prefix, _ = export(tmp_path)
    model = create_model("resnet18", 5, base_channels=8)

    def fails(path, pattern, target=model, name="resnet18"):
        with pytest.raises(CheckpointError, match=pattern) as err:
            model_state(open_checkpoint(path), name, target)
        assert "\n" not in str(err.value)

    wider = create_model("resnet18", 5, base_channels=16)
    fails(
        prefix,
        r"variable resnet_model/conv2d/kernel has shape \(7, 7, 3, 8\), the model's is \(7, 7, 3, 16\)",
        wider,
    )
    # ResNet-34's third stage-1 block takes conv2d_5, ResNet-18's stage-2 projection (1x1, 8 -> 16).
    deeper = create_model("resnet34", 5, base_channels=8)
    fails(
        prefix,
        r"conv2d_5/kernel has shape \(1, 1, 8, 16\), the model's is \(3, 3, 8, 8\)",
        deeper,
        "resnet34",
    )
    missing = _edit(prefix, lambda t: t.pop("resnet_model/batch_normalization_3/beta"))
    fails(missing, r"variable resnet_model/batch_normalization_3/beta is missing")
    extra = _edit(
        prefix, lambda t: t.update({"resnet_model/conv2d_99/kernel": np.zeros((1, 1, 8, 8), np.float32)})
    )
    fails(extra, r"variable resnet_model/conv2d_99/kernel is not in the model")
    other = _edit(
        prefix, lambda t: [t.clear(), t.update({"conv0/weights": np.zeros((3, 3, 3, 32), np.float32)})]
    )
    fails(other, r"none of its variables is there \(.*the checkpoint holds e.g. conv0/weights\)")


def test_continuing_with_the_other_optimizer_names_the_slot(tmp_path):
    prefix, _ = export(tmp_path, "momentum")
    with pytest.raises(
        CheckpointError, match=r"/RMSProp of optimizer rmsprop is missing \(it was trained with momentum\)"
    ):
        load_run(open_checkpoint(prefix), config("rmsprop"), fresh_run("rmsprop"), print)


def test_ema_weights_are_the_shadows(tmp_path):
    prefix, (model, opt, bn_ema) = export(tmp_path)
    state = model_state(
        open_checkpoint(prefix), "resnet18", create_model("resnet18", 5, base_channels=8), ema=True
    )
    names = [n for n, _ in model.named_parameters()]
    for name, shadow in zip(names, opt.ema_parameters(list(model.parameters()))):
        assert torch.equal(state[name], shadow), name
    for name, shadow in bn_ema.state_dict().items():
        assert torch.equal(state[name], shadow), name


@pytest.mark.slow
def test_a_continued_tf_run_takes_the_steps_fasttrains_resume_takes(tmp_path):
    """Train 14 steps; separately 12, export to TF, continue to 14 from the TF checkpoint: steps 13
    and 14 (the start of epoch 2, where a fasttrain resume reads the same batches) are the same losses
    and end in the same weights, slots and EMA, bit for bit."""
    from fasttrain.tf.convert import main as convert

    data = tmp_path / "data"
    make_synthetic(data, train_shards=2, val_shards=1, per_shard=24, classes=4, seed=3)  # 12 steps/epoch
    flags = ("--max_steps=14", "--checkpoint_every=12")
    ref = subprocess.run(command(data, tmp_path / "a", *flags), env=ENV, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert (
        convert(
            ["to-tf", str(tmp_path / "a" / "ckpt-12.pt"), "--out", str(tmp_path / "tf" / "model.ckpt-12")]
        )
        == 0
    )
    cont = command(data, tmp_path / "b", *flags, f"--checkpoint_dir={tmp_path / 'tf'}")
    out = subprocess.run(cont, env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "continuing TensorFlow run" in out.stdout

    def losses(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and r["step"] > 12}

    assert losses("b") == losses("a") and len(losses("a")) == 2
    # The same command again on the TF run's own directory (the ResNet seed's Estimator restores its
    # --output_dir): it continued nothing and trained from step 0 beside the TF files.
    shutil.copytree(tmp_path / "tf", tmp_path / "c")
    again = subprocess.run(command(data, tmp_path / "c", *flags), env=ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "holds a TensorFlow run" in again.stdout and "continuing TensorFlow run" in again.stdout
    assert losses("c") == losses("a")
    a, b = (torch.load(tmp_path / r / "ckpt-14.pt", weights_only=True) for r in ("a", "b"))
    for part in ("model", "bn_ema", "ema"):
        for key in a[part]:
            # num_batches_tracked has no TF variable (and no use with a set BN momentum)
            assert torch.equal(a[part][key], b[part][key]) or "num_batches" in key, (part, key)
    for i, slots in a["optimizer"]["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, b["optimizer"]["state"][i][slot]), (i, slot)

    # The evaluator on the TF checkpoint (raw weights and EMA shadows) gives its source's numbers.
    def evaluated(checkpoint):
        cmd = [
            sys.executable,
            "-m",
            "fasttrain.evaluate",
            str(tmp_path / "a"),
            "--checkpoint",
            str(checkpoint),
        ]
        out = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1].split(": ", 1)[1]

    assert "EMA" in evaluated(tmp_path / "a" / "ckpt-12.pt")
    assert evaluated(tmp_path / "tf") == evaluated(tmp_path / "a" / "ckpt-12.pt")


def test_a_recipe_takes_the_checkpoints_class_count_and_width(tmp_path):
    from fasttrain.config import make_config
    from fasttrain.tf.state import config_for

    prefix, _ = export(tmp_path)
    cfg = config_for(make_config(recipe="demo"), open_checkpoint(prefix))  # demo: 10 classes, 16 wide
    assert (cfg.num_classes, cfg.base_channels, cfg.label_offset) == (5, 8, -1)
    seed_like = _edit(
        prefix, lambda t: t.update({"resnet_model/dense/kernel": np.zeros((64, 1001), np.float32)})
    )
    cfg = config_for(make_config(recipe="demo"), open_checkpoint(seed_like))
    assert (cfg.num_classes, cfg.label_offset) == (1001, 0)  # the seeds' class 0 is background


def test_pretrained_from_a_tf_checkpoint_and_fine_tune(tmp_path):
    from fasttrain.config import make_config
    from fasttrain.pretrained import restore_pretrained

    prefix, (source, _, _) = export(tmp_path)
    flags = dict(model="resnet18", base_channels=8, pretrained_model_checkpoint_path=str(prefix.parent))
    model, logs = create_model("resnet18", 5, base_channels=8), []
    restore_pretrained(model, make_config(num_classes=5, **flags), logs.append)
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value) or not value.is_floating_point(), key
    assert logs == [f"restored weights from {prefix.parent}"]

    other = create_model("resnet18", 7, base_channels=8)
    with pytest.raises(
        CheckpointError, match=r"dense/kernel has shape \(64, 5\), the model's is \(64, 7\) \(pass"
    ):
        restore_pretrained(other, make_config(num_classes=7, **flags), print)
    torch.manual_seed(0)
    restore_pretrained(other, make_config(num_classes=7, fine_tune=True, **flags), print)
    assert torch.equal(other.conv1.weight, source.conv1.weight) and other.fc.weight.shape == (7, 64)
    assert torch.all(other.fc.bias == 0)  # re-initialised as at construction


def test_checkpoint_dir_of_a_tf_run_until_the_run_has_its_own(tmp_path):
    from fasttrain.checkpoint import save_checkpoint
    from fasttrain.resume import restore_run

    prefix, _ = export(tmp_path)
    cfg = SimpleNamespace(**vars(config()), checkpoint_dir=str(prefix.parent))
    run, logs = fresh_run(), []
    assert restore_run(cfg, run, run_dir=tmp_path / "run", log=logs.append) == 30
    assert "continuing TensorFlow run" in logs[0]

    save_checkpoint(tmp_path / "run", 31, {"model": {}, "step": 31, "data": [{}], "rng": []})
    loaded = []
    run.load_state_dict, run.load_rank_state = loaded.append, lambda data, rng: None
    assert restore_run(cfg, run, run_dir=tmp_path / "run", log=logs.append) == 31  # its own, not TF's
    assert loaded[0]["step"] == 31 and logs[-1].startswith("resuming from step 31")
