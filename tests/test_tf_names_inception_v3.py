"""The Inception seed's slim names (fasttrain.tf.names.inception_v3) against TensorFlow's own graph.

Fixtures (tests/data/make_tf_inception.py, TF 2.21 running the seed's graph ported to tf.compat.v1):
full_variables.json lists every variable of the full-size training graph at 1001 classes; the
reduced model's (depth 1/32, 11 classes) V2 checkpoint and TF's eval logits on fixed inputs check that our
forward pass computes TF's on the imported weights, raw and with the EMA shadows.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fasttrain.checkpoint import CheckpointError
from fasttrain.models.inception_v3 import Inception3
from fasttrain.tf.checkpoint import open_checkpoint, write_checkpoint
from fasttrain.tf.export import export_tensors
from fasttrain.tf.names import to_torch, variable_map
from fasttrain.tf.names.inception_v3 import layer_scope, zero_debias_names
from fasttrain.tf.state import load_run, load_tf_for_eval, model_state

DATA = Path(__file__).parent / "data" / "tf-inception"
CKPT = DATA / "reduced" / "model.ckpt-7"
DEPTH, CLASSES, BATCH, START_STEP = 1.0 / 32, 11, 4, 7  # as make_tf_inception.py
EMA = "/ExponentialMovingAverage"


def _tf_variables():
    return json.loads((DATA / "full_variables.json").read_text())


def _shape_in_tf(shape, layout):
    if layout == "conv":
        return [shape[2], shape[3], shape[1], shape[0]]
    if layout == "dense":
        return [shape[1], shape[0]]
    return list(shape)


def _full_size(bn_gamma: bool) -> Inception3:
    with torch.device("meta"):  # shapes only: no 27M-parameter initialisation
        return Inception3(1001, bn_gamma=bn_gamma)


@pytest.fixture(scope="module")
def full_seed_model():
    return _full_size(False)


def _model_variables(rows):
    """TF's model variables (what variable_map covers), in TF's creation order."""
    skip = (EMA, "/RMSProp", "/RMSProp_1", "/biased", "/local_step")
    return [(n, s) for n, s, _ in rows if n != "global_step" and not n.endswith(skip)]


def test_the_map_is_tfs_variable_list_with_its_shapes_in_order(full_seed_model):
    vmap = variable_map("inception_v3", full_seed_model)
    state = full_seed_model.state_dict()
    ours = [(v.name, _shape_in_tf(list(state[k].shape), v.layout)) for k, v in vmap.items()]
    assert ours == _model_variables(_tf_variables()["variables"])
    assert all(state[k].is_floating_point() for k in vmap)
    assert len(vmap) == sum(v.is_floating_point() for v in state.values())


def test_parameter_count_is_tfs(full_seed_model):
    assert sum(p.numel() for p in full_seed_model.parameters()) == _tf_variables()["trainable_parameters"]
    assert _tf_variables()["trainable_parameters"] == 27_145_970


def test_every_other_checkpoint_variable_is_named_from_the_map(full_seed_model):
    # EMA shadows of trainable variables and BN moving statistics, RMSProp's two slots of trainable
    # ones, the zero-debias state of each moving statistic, global_step: nothing else in the graph.
    vmap = variable_map("inception_v3", full_seed_model)
    trainable = {k for k, _ in full_seed_model.named_parameters()}
    expected = {"global_step"}
    for key, var in vmap.items():
        expected |= {var.name, var.name + EMA}
        if key in trainable:
            expected |= {var.name + "/RMSProp", var.name + "/RMSProp_1"}
    for names in zero_debias_names(full_seed_model).values():
        expected |= set(names.values())
    rows = _tf_variables()["variables"]
    assert {n for n, _, _ in rows} == expected
    assert {dtype for _, _, dtype in rows} == {"float32"}  # global_step and local_step included


def test_the_gamma_model_maps_gamma_as_ones_and_everything_else_alike(full_seed_model):
    gamma_model = _full_size(True)
    vmap = variable_map("inception_v3", gamma_model)
    ones = [k for k, v in vmap.items() if v.layout == "ones"]
    assert len(ones) == 96 and all(k.endswith(".bn.weight") for k in ones)
    assert vmap["Conv2d_1a_3x3.bn.weight"].name == "conv0/BatchNorm/gamma"
    rest = {k: v for k, v in vmap.items() if v.layout != "ones"}
    assert rest == variable_map("inception_v3", full_seed_model)


def test_layer_scopes_follow_slims_build_order():
    assert layer_scope("Mixed_7b.branch3x3_2a") == "mixed_8x8x2048a/branch3x3/Conv_1"  # the 1x3
    assert layer_scope("Mixed_7c.branch3x3dbl_3b") == "mixed_8x8x2048b/branch3x3dbl/Conv_3"  # the 3x1
    assert layer_scope("AuxLogits.conv0") == "aux_logits/proj"
    assert layer_scope("AuxLogits.fc") == "aux_logits/FC"
    with pytest.raises(ValueError, match="Mixed_9z"):
        layer_scope("Mixed_9z.branch1x1")


# --- forward on TF's weights ---------------------------------------------------------------------


def images(seed: int) -> np.ndarray:
    """make_tf_inception.images: (BATCH, 299, 299, 3) float32 in [-1, 1] from a stable NumPy stream."""
    u8 = np.random.RandomState(seed).randint(0, 256, size=(BATCH, 299, 299, 3)).astype(np.uint8)
    return u8.astype(np.float32) / np.float32(127.5) - np.float32(1.0)


def load_tf_values(model: torch.nn.Module, shadows: bool = False):
    """Set `model` from TF's own checkpoint reduced/model.ckpt-7 as a user's from-tf does (the V2
    reader fasttrain.tf.checkpoint, then tf_import.model_state: raw, or the EMA shadows); the reader."""
    reader = open_checkpoint(CKPT)
    model.load_state_dict(model_state(reader, "inception_v3", model, ema=shadows))
    return reader


@pytest.mark.parametrize("kind", ["raw", "ema"])
def test_forward_on_tf_weights_gives_tfs_logits(kind):
    model = Inception3(CLASSES, bn_gamma=False, depth_multiplier=DEPTH).eval()
    load_tf_values(model, shadows=kind == "ema")
    x = torch.from_numpy(images(0)).permute(0, 3, 1, 2)
    with torch.no_grad():
        ours = model(x).double().numpy()
        ours_cl = model.to(memory_format=torch.channels_last)(x.contiguous(memory_format=torch.channels_last))
    expected = np.load(DATA / "logits.npz")[kind].astype(np.float64)
    scale = np.abs(expected).max()
    # Not the seed's near-zero classifiers. The raw logits reach ~1e6: the fixture's 2 steps at LR 0.1
    # moved the weights away from the moving statistics they recorded, so eval-mode BN amplifies;
    # the comparison below is relative to that scale.
    assert scale > 1.0
    # Both sides are float32 through 94 conv -> BN layers in sequence; the two libraries sum each
    # convolution (up to K = 7*7... here at most 3*3*24 terms) in different orders, a relative
    # rounding of about sqrt(K) * 6e-8 per layer, which eval-mode BN and ReLU pass on unamplified
    # beyond the moving variance's rescaling. Measured: about 1e-6 of the logits' scale; 2e-5 leaves
    # a 10x margin and still fails on any real difference (a wrong padding or pool moves logits ~1e-1).
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(ours_cl.double().numpy(), expected, rtol=0, atol=2e-5 * scale)


def test_raw_and_ema_logits_differ_so_the_shadows_are_really_used():
    logits = np.load(DATA / "logits.npz")
    assert np.abs(logits["raw"] - logits["ema"]).max() > 0.05 * np.abs(logits["raw"]).max()


# --- the whole TF run in and out: tf_import on TF's own reduced/model.ckpt-7 ----------------------


class _Step:  # the TrainStep counter load_run sets
    def __init__(self):
        self.step_count = torch.zeros((), dtype=torch.int64)

    def state_dict(self):
        return {"step_count": self.step_count.clone()}

    def load_state_dict(self, state):
        self.step_count.copy_(state["step_count"])


class _Loader:
    num_records = BATCH

    def load_state_dict(self, state):
        self.state = state


def continued(prefix, log=None):
    """A Run of the seed's recipe (RMSProp, EMA, SlimBatchNorm) continuing the TF run at `prefix`."""
    from fasttrain.bn_buffers import BufferEMA
    from fasttrain.config import make_config
    from fasttrain.run import build_optimizer

    cfg = make_config(recipe="inception_v3", batch_size=BATCH, optimizer_impl="torch")
    model = Inception3(CLASSES, bn_gamma=cfg.inception_bn_gamma, depth_multiplier=DEPTH)
    run = SimpleNamespace(
        model=model,
        optimizer=build_optimizer(cfg, model),
        bn_ema=BufferEMA(model, cfg.ema_decay),
        step=_Step(),
        loader=_Loader(),
        info=SimpleNamespace(world_size=1),
    )
    load_run(open_checkpoint(prefix), cfg, run, log or (lambda _: None))
    return cfg, run


def _export(run, cfg, prefix):
    tensors, notes = export_tensors(
        "inception_v3", run.model, run.optimizer, run.bn_ema, int(run.step.step_count), cfg.optimizer
    )
    assert not notes
    return write_checkpoint(prefix, tensors)


def test_from_tf_to_tf_from_tf_is_the_identity(tmp_path):
    cfg, run = continued(CKPT)
    counts = {k: int(v) for k, v in run.model.state_dict().items() if k.endswith("num_batches_tracked")}
    assert set(counts.values()) == {2}  # the fixture's 2 real steps before global_step was set to 7
    prefix = _export(run, cfg, tmp_path / "tf" / "model.ckpt-7")
    tf_ckpt, ours = open_checkpoint(CKPT), open_checkpoint(prefix)
    assert ours.shapes() == tf_ckpt.shapes()  # every variable TF wrote, names, shapes and dtypes
    for name in tf_ckpt.shapes():
        want, got = np.asarray(tf_ckpt.get(name)), np.asarray(ours.get(name))
        assert got.dtype == want.dtype == np.float32, name  # global_step and local_step too
        if name.endswith("/biased"):
            # moving * (1 - decay^2) recomputed in float32: TF divided biased by the same factor
            # (its own pow); two roundings of a float32 product, measured 9.5e-8 relative.
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    _, again = continued(prefix)
    for a, b in ((run.model, again.model), (run.optimizer, again.optimizer), (run.bn_ema, again.bn_ema)):
        _assert_same(a.state_dict(), b.state_dict())
    assert int(again.step.step_count) == START_STEP


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def _edited(tmp_path, change):
    ckpt = open_checkpoint(CKPT)
    tensors = {n: np.asarray(ckpt.get(n)) for n in ckpt.shapes()}
    change(tensors)
    return write_checkpoint(tmp_path / "edited" / "model.ckpt-7", tensors)


def test_inconsistent_zero_debias_state_is_one_line_naming_the_variable(tmp_path):
    model = Inception3(CLASSES, bn_gamma=False, depth_multiplier=DEPTH)
    biased = "conv2/BatchNorm/conv2/BatchNorm/moving_variance/biased"

    def stale(t):  # the biased value of one step earlier: what a mixed-up checkpoint would hold
        t[biased] = t[biased] * np.float32((1 - 0.9997**1) / (1 - 0.9997**2))

    with pytest.raises(CheckpointError, match=f"variable {biased} is not moving_variance") as err:
        model_state(open_checkpoint(_edited(tmp_path, stale)), "inception_v3", model)
    assert "\n" not in str(err.value)
    step = "mixed_35x35x256a/branch1x1/Conv/BatchNorm/mixed_35x35x256a/branch1x1/Conv/BatchNorm/"

    def unequal(t):
        t[step + "moving_mean/local_step"] = np.float32(3)

    with pytest.raises(CheckpointError, match=f"variable {step}moving_mean/local_step is"):
        model_state(open_checkpoint(_edited(tmp_path, unequal)), "inception_v3", model)


def test_no_zero_debias_state_starts_the_count_at_0_and_loss_averages_are_left_behind(tmp_path):
    def pre_012_with_loss_averages(t):
        for name in [n for n in t if n.endswith(("/biased", "/local_step"))]:
            del t[name]
        t["tower_0/cross_entropy_loss/avg"] = np.float32(2.5)  # the seed's loss averages

    notes = []
    _, run = continued(_edited(tmp_path, pre_012_with_loss_averages), notes.append)
    state = run.model.state_dict()
    assert {int(v) for k, v in state.items() if k.endswith("num_batches_tracked")} == {0}
    assert any("no zero-debias state" in n for n in notes)
    assert any("1 variables of the TF run have no use here" in n and "tower_0/" in n for n in notes)


def test_evaluation_loads_raw_weights_and_the_shadows_with_the_count():
    from fasttrain.bn_buffers import BufferEMA
    from fasttrain.config import make_config
    from fasttrain.run import build_optimizer

    cfg = make_config(recipe="inception_v3", optimizer_impl="torch")
    model = Inception3(CLASSES, bn_gamma=False, depth_multiplier=DEPTH)
    optimizer, bn_ema = build_optimizer(cfg, model), BufferEMA(model, cfg.ema_decay)
    assert load_tf_for_eval(open_checkpoint(CKPT), "inception_v3", model, optimizer, bn_ema) == START_STEP
    reader = open_checkpoint(CKPT)
    vmap = variable_map("inception_v3", model)
    name = "Mixed_6b.branch7x7_2.conv.weight"
    shadow = to_torch(np.asarray(reader.get(vmap[name].name + EMA)), "conv")
    ema = dict(
        zip([n for n, _ in model.named_parameters()], optimizer.ema_parameters(list(model.parameters())))
    )
    np.testing.assert_array_equal(ema[name].numpy(), shadow)
    np.testing.assert_array_equal(
        bn_ema.state_dict()["Conv2d_1a_3x3.bn.running_var"].numpy(),
        reader.get("conv0/BatchNorm/moving_variance" + EMA),
    )
    assert int(model.state_dict()["Mixed_7c.branch_pool.bn.num_batches_tracked"]) == 2
