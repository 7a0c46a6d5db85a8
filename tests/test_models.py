"""fasttrain.models: exact sizes, shapes, channels_last end to end, initialisation, fine_tune, groups.

References are independent of the code under test: published parameter counts (torchvision's
model cards, the ResNet and Inception papers' architectures), the initialisers' defining
distributions, torch.optim.SGD for the weight-decay split. Inception v3 runs at 299 px with
batch 1-2 only, to keep the CPU cost down.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.errors import SettingError
from fasttrain.models import MODEL_NAMES, classifier_names, create_model, param_groups, reset_classifier

CL = torch.channels_last

# torchvision's published num_params for the same architectures, 1000 classes (Inception: aux included).
PUBLISHED_COUNTS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "inception_v3": 27_161_264,
}
# Classifier input features: fc (and AuxLogits.fc) each gain in_features + 1 per extra class.
CLASSIFIER_IN = {
    "resnet18": [512],
    "resnet34": [512],
    "resnet50": [2048],
    "resnet101": [2048],
    "resnet152": [2048],
    "inception_v3": [2048, 768],
}


@functools.cache
def _pristine(name: str, classes: int) -> nn.Module:
    """A model only read, never changed, by the tests that share it (construction is ~1 s)."""
    return create_model(name, classes)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _small_resnet(name="resnet18", classes=4, **kw) -> nn.Module:
    return create_model(name, classes, base_channels=8, **kw)


# The _v2 models' counts are TensorFlow's, measured on the seed's graph: tests/test_tf_names_resnet_v2.py.
@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if not n.endswith("_v2")])
def test_parameter_count_matches_the_standard_architecture(name):
    assert _count(_pristine(name, 1000)) == PUBLISHED_COUNTS[name]


@pytest.mark.parametrize("name", ["resnet50", "inception_v3"])
def test_1001_classes_grow_only_the_classifier_rows(name):
    a, b = _pristine(name, 1000).state_dict(), _pristine(name, 1001).state_dict()
    assert a.keys() == b.keys()
    prefixes = classifier_names(_pristine(name, 1000))
    changed = {k for k in a if a[k].shape != b[k].shape}
    assert changed == {f"{p}.{s}" for p in prefixes for s in ("weight", "bias")}
    for p in prefixes:
        assert b[f"{p}.weight"].shape[0] == a[f"{p}.weight"].shape[0] + 1
    extra = sum(n + 1 for n in CLASSIFIER_IN[name])
    assert _count(_pristine(name, 1001)) == PUBLISHED_COUNTS[name] + extra


def test_resnet_v1_5_puts_the_stride_on_the_3x3_convolution():
    block = create_model("resnet50", 10).layer2[0]
    assert block.conv1.stride == (1, 1) and block.conv1.kernel_size == (1, 1)
    assert block.conv2.stride == (2, 2) and block.conv2.kernel_size == (3, 3)
    assert block.downsample[0].stride == (2, 2)


@pytest.mark.parametrize("size", [32, 64])
def test_resnet_logits_shape_at_small_inputs(size):
    model = create_model("resnet50", 7, base_channels=16)
    x = torch.randn(2, 3, size, size)
    assert model.train()(x).shape == (2, 7)
    assert model.eval()(x).shape == (2, 7)


def test_inception_returns_aux_logits_in_train_mode_only():
    torch.manual_seed(0)
    model = create_model("inception_v3", 11)
    x = torch.randn(2, 3, 299, 299)
    with torch.no_grad():
        logits, aux = model.train()(x)
        assert logits.shape == (2, 11) and aux.shape == (2, 11)
        out = model.eval()(x[:1])
        assert isinstance(out, torch.Tensor) and out.shape == (1, 11)
        no_aux = create_model("inception_v3", 11, aux_logits=False).train()
        assert no_aux.AuxLogits is None
        out = no_aux(x)
        assert isinstance(out, torch.Tensor) and out.shape == (2, 11)


# --- channels_last ------------------------------------------------------------------------------


def _layout_violations(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Forward+backward under bf16 autocast; names of convs whose input or output is not NHWC."""
    bad = []

    def check(name):
        def hook(module, inputs, output):
            for what, t in (("input", inputs[0]), ("output", output)):
                if not t.is_contiguous(memory_format=CL):
                    bad.append(f"{name} {what} strides {t.stride()}")

        return hook

    handles = [
        m.register_forward_hook(check(n)) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)
    ]
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(o.dtype == torch.bfloat16 for o in outs)
        sum(o.float().square().mean() for o in outs).backward()
    finally:
        for h in handles:
            h.remove()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # Gradients keep the parameter's layout (what a flat gradient buffer's views rely on).
    assert all(p.grad.stride() == p.stride() for p in model.parameters())
    return bad


@pytest.mark.parametrize("name,size", [("resnet18", 32), ("resnet50", 64), ("inception_v3", 299)])
def test_channels_last_end_to_end_under_bf16_autocast(name, size):
    torch.manual_seed(0)
    kw = {} if name == "inception_v3" else {"base_channels": 16}
    model = create_model(name, 10, **kw).to(memory_format=CL).train()
    # Batch 2: train-mode BN needs more than one value per channel (the aux head's map is 1x1).
    x = torch.randn(2, 3, size, size).to(memory_format=CL)
    assert _layout_violations(model, x) == []


def test_layout_check_catches_an_activation_turned_back_to_nchw():
    # The check must be able to fail: make layer1 return NCHW-contiguous activations.
    model = _small_resnet().to(memory_format=CL)
    model.layer1.register_forward_hook(lambda m, i, out: out.contiguous())
    bad = _layout_violations(model, torch.randn(2, 3, 32, 32).to(memory_format=CL))
    flagged = {entry.split(" strides")[0] for entry in bad}
    assert {"layer2.0.conv1 input", "layer2.0.downsample.0 input"} <= flagged
    assert not any(entry.startswith(("conv1 ", "layer1.")) for entry in flagged)


# --- initialisation ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "inception_v3"])
def test_initialisation_is_deterministic_under_a_seed(name):
    def build(seed):
        torch.manual_seed(seed)
        return create_model(name, 10).state_dict()

    a, b, c = build(3), build(3), build(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    stem = next(iter(a))  # conv1.weight / Conv2d_1a_3x3.conv.weight
    assert not torch.equal(a[stem], c[stem]) and not torch.equal(a["fc.weight"], c["fc.weight"])


def test_resnet_initialisation_follows_kaiming_fan_out_and_zero_init_residual():
    torch.manual_seed(0)
    model = create_model("resnet50", 1000)
    w = model.layer3[0].conv2.weight  # 256 -> 256, 3x3: fan_out = 256 * 9
    assert w.std().item() == pytest.approx(math.sqrt(2.0 / (256 * 9)), rel=0.01)  # 590k draws: ~0.1%
    for block in model.layer1:
        assert torch.all(block.bn3.weight == 0) and torch.all(block.bn1.weight == 1)
    assert torch.all(model.bn1.weight == 1) and torch.all(model.layer1[0].downsample[1].weight == 1)
    bound = math.sqrt(6.0 / (2048 + 1000))  # Glorot uniform
    assert model.fc.weight.abs().max().item() <= bound and torch.all(model.fc.bias == 0)
    assert model.fc.weight.std().item() == pytest.approx(bound / math.sqrt(3.0), rel=0.01)
    plain = create_model("resnet18", 10, zero_init_residual=False)
    assert torch.all(plain.layer1[0].bn2.weight == 1)


def test_inception_initialisation_is_tf_truncated_normal():
    torch.manual_seed(0)
    model = create_model("inception_v3", 1000)
    # A normal truncated at +-2 std has std 0.87962566 * std (TF's truncated_normal).
    for w, std in (
        (model.Mixed_6b.branch7x7dbl_2.conv.weight, 0.1),
        (model.AuxLogits.conv1.conv.weight, 0.01),
        (model.fc.weight, 0.001),
        (model.AuxLogits.fc.weight, 0.001),
    ):
        assert w.abs().max().item() <= 2 * std
        assert w.std().item() == pytest.approx(0.87962566 * std, rel=0.02)  # >= 114k draws
    assert torch.all(model.fc.bias == 0) and torch.all(model.Mixed_7c.branch_pool.bn.weight == 1)


def test_batchnorm_defaults_are_the_seeds_and_overridable():
    def bns(model):
        return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]

    assert all((m.momentum, m.eps) == (pytest.approx(0.003), 1e-5) for m in bns(_small_resnet()))
    inception = _pristine("inception_v3", 10)
    assert all((m.momentum, m.eps) == (pytest.approx(0.0003), 0.001) for m in bns(inception))
    tuned = _small_resnet(bn_momentum=0.1, bn_eps=1e-3)
    assert all((m.momentum, m.eps) == (0.1, 1e-3) for m in bns(tuned))
    assert inception.dropout.p == pytest.approx(0.2)


# --- training, fine_tune, parameter groups ------------------------------------------------------


def test_a_few_steps_on_a_fixed_batch_reduce_the_loss():
    torch.manual_seed(0)
    model = _small_resnet(classes=4, bn_momentum=0.1).train()
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 4
    opt = torch.optim.SGD(param_groups(model, 1e-4, True), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_inception_trains_both_heads_on_a_fixed_batch():
    torch.manual_seed(0)
    model = create_model("inception_v3", 3).train()
    x, y = torch.randn(2, 3, 299, 299), torch.tensor([0, 2])
    # Small LR: with train-mode BN over a batch of 2, larger steps (0.05+) diverge after two steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses = []
    for _ in range(3):
        logits, aux = model(x)
        main, side = F.cross_entropy(logits, y), F.cross_entropy(aux, y)
        opt.zero_grad()
        (main + 0.4 * side).backward()
        opt.step()
        losses.append((main.item(), side.item()))
    (main0, side0), (main2, side2) = losses[0], losses[-1]
    assert main2 < 0.8 * main0 and side2 < 0.8 * side0, losses


@pytest.mark.parametrize("name", ["resnet18", "inception_v3"])
def test_reset_classifier_touches_only_the_classifier(name):
    torch.manual_seed(0)
    model = create_model(name, 10)
    expected = ["fc"] if name == "resnet18" else ["fc", "AuxLogits.fc"]
    assert classifier_names(model) == expected
    with torch.no_grad():  # stand-in for trained weights: nothing equals its initial value
        for p in model.parameters():
            p.add_(torch.rand_like(p) + 1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reset_classifier(model)
    after = model.state_dict()
    in_classifier = lambda k: any(k.startswith(p + ".") for p in expected)
    assert all(torch.equal(before[k], after[k]) for k in before if not in_classifier(k))
    for p in expected:
        assert torch.all(after[f"{p}.bias"] == 0)
        assert after[f"{p}.weight"].abs().max() < 0.5  # re-drawn, not the shifted (> 1) values


def test_create_model_rejects_bad_options_in_one_sentence():
    with pytest.raises(SettingError, match="unknown model 'resnet49'"):
        create_model("resnet49", 10)
    with pytest.raises(SettingError, match="base_channels"):
        create_model("inception_v3", 10, base_channels=16)


def _named_split(model):
    # Independent criterion: conv kernels (4-d) and fc matrices (2-d) decay; BN and biases do not.
    decay = [n for n, p in model.named_parameters() if p.dim() in (2, 4)]
    exempt = [n for n, p in model.named_parameters() if p.dim() == 1]
    return decay, exempt


@pytest.mark.parametrize("name", ["resnet18", "inception_v3"])
def test_param_groups_split_bn_and_bias_in_registration_order(name):
    model = _pristine(name, 10)
    names = {id(p): n for n, p in model.named_parameters()}
    (single,) = param_groups(model, 4e-5, no_decay_bn_bias=False)
    assert single["weight_decay"] == 4e-5 and [names[id(p)] for p in single["params"]] == list(
        dict(model.named_parameters())
    )
    decay, exempt = param_groups(model, 4e-5, no_decay_bn_bias=True)
    assert (decay["weight_decay"], exempt["weight_decay"]) == (4e-5, 0.0)
    assert ([names[id(p)] for p in decay["params"]], [names[id(p)] for p in exempt["params"]]) == (
        _named_split(model)
    )
    n_bn = sum(1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert len(exempt["params"]) == 2 * n_bn + len(classifier_names(model))  # gamma, beta; fc biases


def test_no_decay_bn_exempts_batch_norm_only_as_tf_official_resnet():
    # resnet_run_loop.py's exclude_batch_norm: L2 on every trainable variable whose name lacks
    # 'batch_normalization', the dense bias included. The v1.5 recipe decayed BN's gamma and beta too.
    from fasttrain.config import make_config

    model = _pristine("resnet18", 10)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, exempt = param_groups(model, 1e-4, no_decay_bn_bias=False, no_decay_bn=True)
    bn = {
        n
        for m_name, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
        for n in (f"{m_name}.weight", f"{m_name}.bias")
    }
    assert {names[id(p)] for p in exempt["params"]} == bn and exempt["weight_decay"] == 0.0
    assert "fc.bias" in {names[id(p)] for p in decay["params"]}
    for recipe in ("resnet50_v1.5", "resnet101_v1.5"):
        cfg = make_config(recipe=recipe)
        assert (cfg.no_decay_bn, cfg.no_decay_bn_bias, cfg.weight_decay) == (True, False, 1e-4)


def test_param_groups_drive_torch_sgd_weight_decay():
    model = _small_resnet()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
            p.grad = torch.zeros_like(p)
    torch.optim.SGD(param_groups(model, 0.5, no_decay_bn_bias=True), lr=1.0).step()
    for n, p in model.named_parameters():  # w -= lr * (g + wd * w): 1 -> 0.5 where decayed
        assert torch.all(p == (0.5 if p.dim() > 1 else 1.0)), n
