"""--bn_kernels=triton: kernels/batch_norm.py's BatchNorm (+ residual add) (+ ReLU) and its wiring into the
ResNets (fasttrain/models/bn_act.py), against torch's BatchNorm in float64 (an independent reference:
torch's own batch_norm and autograd, not the kernels' equations), on the CPU under Triton's
interpreter and, where CUDA is, compiled at a ResNet-50 layer's size and inside a CUDA graph.

Tolerances. The kernels compute in float32 from the same inputs the float64 reference gets:
- fp32 tensors: each output is a short chain of fp32 operations on O(1) values, and the statistics are
  sums of at most a few hundred terms merged pairwise, so a relative error of a few 1e-7 per value and
  about 1e-6 for the sums; rtol 1e-5 with atol 1e-5 of the tensor's scale leaves a 10x margin and
  still fails on any wrong term (a biased running variance is off by 1/(M-1), several percent here).
- bf16 tensors: outputs are rounded to bf16 (8 significant bits): on a GPU to nearest, within 2^-9 of
  the value; Triton's interpreter truncates, within 2^-8. So `_bf16_close`: rtol 2^-7 per element, with
  atol 2^-12 of the scale for values near 0 (whose float32 computation carries the larger terms'
  rounding). The parameter gradients and the statistics stay float32: 1e-5 (1e-4 for sums of 100,352).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fasttrain.kernels import batch_norm_layout
from fasttrain.kernels.batch_norm import bn_act
from fasttrain.kernels.common import HAVE_TRITON
from kernel_helpers import DEVICES, _triton_interpreter  # noqa: F401  (an autouse fixture)

from fasttrain.compile import compile_wanted
from fasttrain.config import make_config
from fasttrain.config_checks import ConfigError
from fasttrain.errors import SettingError
from fasttrain.models import create_model
from fasttrain.models.bn_act import use_bn_kernels

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
CL = torch.channels_last


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=CL)


def _reference(x, weight, bias, residual, running_mean, running_var, momentum, eps, relu, dy, y_kernel):
    """(y, running_mean, running_var, dx, dweight, dbias, dresidual) by torch in float64.

    The ReLU's mask is the kernels' (y_kernel > 0), after checking that it differs from float64's only
    where the ReLU's input is within rounding of 0 (in float32, a few 1e-7 of the scale): at a real
    layer's size a few of its millions of inputs fall there, and one element on the other side moves
    its channel's gradient sums by a whole dy, far more than their rounding."""
    leaves = [
        t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)
    ]
    x64, w64, b64, r64 = leaves
    rm, rv = running_mean.double(), running_var.double()
    z = F.batch_norm(x64, rm, rv, w64, b64, training=True, momentum=momentum, eps=eps)
    if r64 is not None:
        z = z + r64
    mask = torch.ones_like(z)
    if relu:
        mask = (y_kernel.detach().cpu() > 0).double()
        flipped = mask != (z > 0).double()
        scale = z.abs().max().item()
        assert z.detach()[flipped].abs().max().item() <= 1e-5 * scale if flipped.any() else True, (
            f"{int(flipped.sum())} ReLU masks differ from float64's away from 0"
        )
    wanted = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(z, wanted, dy.double() * mask))
    dx, dw, db, dr = (next(grads) if t is not None else None for t in leaves)
    return (torch.relu(z) if relu else z).detach(), rm, rv, dx, dw, db, dr


def _close(actual, expected, rtol):
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=rtol * scale)


def _bf16_close(actual, expected):
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=2**-7, atol=2**-12 * scale)


def _run_case(device, shape, dtype, relu, residual, affine, generator, mean=0.0, std=1.0, layout="cl"):
    """The kernels' (y, running_mean, running_var, dx, dweight, dbias, dres) and _reference's. layout:
    "cl" (x, residual, dy channels_last), "nchw" (all three NCHW), "expanded-dy" (dy a stride-0
    expansion of an (N, C, 1, 1) tensor, as a global pool's backward hands it over)."""
    N, C, H, W = shape
    lay = _cl if layout != "nchw" else (lambda t: t.contiguous())
    x = lay((torch.randn(shape, generator=generator) * std + mean).to(dtype)).to(device)
    # affine: True (weight and bias), False (neither) or "bias" (the slim batch norm's beta only)
    weight = torch.randn(C, generator=generator).to(device) if affine is True else None
    bias = torch.randn(C, generator=generator).to(device) if affine else None
    res = lay(torch.randn(shape, generator=generator).to(dtype)).to(device) if residual else None
    rm = torch.randn(C, generator=generator).to(device)
    rv = (torch.rand(C, generator=generator) + 0.5).to(device)
    if layout == "expanded-dy":
        dy = torch.randn(N, C, 1, 1, generator=generator).to(dtype).to(device).expand(shape)
    else:
        dy = lay(torch.randn(shape, generator=generator).to(dtype)).to(device)
    inputs = [t.requires_grad_() if t is not None else None for t in (x, weight, bias, res)]
    rm_k, rv_k = rm.clone(), rv.clone()
    y = bn_act(
        inputs[0], inputs[1], inputs[2], rm_k, rv_k, momentum=0.1, eps=1e-3, residual=inputs[3], relu=relu
    )
    assert y.dtype == dtype and (y.is_contiguous() if layout == "nchw" else y.is_contiguous(memory_format=CL))
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(y, wanted, dy))
    grads = [next(got) if t is not None else None for t in inputs]
    ref = _reference(
        x.cpu(),
        *(t if t is None else t.cpu() for t in (weight, bias, res)),
        rm.cpu(),
        rv.cpu(),
        0.1,
        1e-3,
        relu,
        dy.cpu(),
        y,
    )
    return (y, rm_k, rv_k, *grads), ref


CASES = [
    # shape, relu, residual, affine: channels not a power of 2 nor a multiple of the tile's, odd M
    pytest.param((3, 5, 7, 3), True, False, True, id="bn-relu"),
    pytest.param((2, 70, 5, 3), True, True, True, id="bn-add-relu"),
    pytest.param((4, 6, 3, 3), False, False, True, id="bn"),
    pytest.param((2, 9, 4, 5), False, True, True, id="bn-add"),
    pytest.param((3, 4, 5, 5), True, False, False, id="bn-relu-no-affine"),
    pytest.param((2, 7, 3, 5), True, False, "bias", id="bn-relu-bias-only"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, relu, residual, affine", CASES)
@pytest.mark.parametrize("tiles", ["one-tile", "many-programs", "many-partials"])
def test_bn_act_matches_torch_batch_norm_in_float64(
    device, shape, relu, residual, affine, tiles, monkeypatch
):
    if tiles != "one-tile":  # several tiles per program, several programs, a masked last tile
        monkeypatch.setattr(batch_norm_layout, "INTERPRETER_TILE", 16)
        monkeypatch.setattr(batch_norm_layout, "INTERPRETER_PROGRAMS", 3)
    if tiles == "many-partials":  # 30-40 programs' partials, merged 4 at a time: the merge's own loop
        monkeypatch.setattr(batch_norm_layout, "INTERPRETER_PROGRAMS", 40)
        monkeypatch.setattr(batch_norm_layout, "MERGE_BLOCK_P", 4)
    g = torch.Generator().manual_seed(sum(shape))
    got, ref = _run_case(device, shape, torch.float32, relu, residual, affine, g)
    for name, a, e in zip(("y", "running_mean", "running_var", "dx", "dweight", "dbias", "dres"), got, ref):
        assert (a is None) == (e is None), name
        if a is not None:
            _close(a.cpu(), e, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nchw", "expanded-dy"])
@pytest.mark.parametrize("shape", [(3, 6, 4, 5), (4, 6, 1, 1)], ids=["4x5", "1x1"])
def test_other_layouts_come_back_in_their_own(device, layout, shape):
    # The kernels index channels_last rows: an NCHW x and residual are copied in, and y, dx and the
    # residual's gradient go back NCHW (a model without channels_last keeps its layout); a stride-0 dy
    # (a global pool's backward) is read whole. (N, C, 1, 1) is both layouts at once.
    g = torch.Generator().manual_seed(11)
    got, ref = _run_case(device, shape, torch.float32, True, True, True, g, layout=layout)
    y, dx, dres = got[0], got[3], got[6]
    for t in (y, dx, dres):
        assert t.is_contiguous() if layout == "nchw" else t.is_contiguous(memory_format=CL)
    for a, e in zip(got, ref):
        _close(a.cpu(), e, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy
def test_non_finite_values_come_out_as_torch_s_do(device):
    # A NaN in the residual or an inf in x: torch's relu(NaN) is NaN, so the step's overflow check
    # sees it; a ReLU that returned 0 for it would hand the step a finite loss.
    g = torch.Generator().manual_seed(12)
    x, res = (
        _cl(torch.randn(2, 3, 4, 4, generator=g)).to(device),
        _cl(torch.randn(2, 3, 4, 4, generator=g)).to(device),
    )
    w, b = torch.randn(3, generator=g).to(device), torch.randn(3, generator=g).to(device)
    res[0, 1, 0, 0] = float("nan")
    x_inf = x.clone()
    x_inf[1, 2, 3, 3] = float("inf")
    for xx, rr in ((x, res), (x_inf, None)):
        y = bn_act(xx, w, b, None, None, momentum=0.1, eps=1e-5, residual=rr)
        want = F.batch_norm(xx, None, None, w, b, True, 0.1, 1e-5)
        want = torch.relu(want if rr is None else want + rr)
        assert torch.equal(y.isnan(), want.isnan()) and y.isnan().any()


def test_a_second_derivative_is_refused_not_silently_wrong():
    x = _cl(torch.randn(2, 3, 4, 4)).requires_grad_()
    w = torch.randn(3, requires_grad=True)
    y = bn_act(x, w, torch.zeros(3), None, None, momentum=0.1, eps=1e-5)
    # torch's own would go on to the second derivative; without it, w's would be silently wrong.
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad((y * torch.randn_like(y)).sum(), x, create_graph=True)


@pytest.mark.parametrize("device", DEVICES)
def test_bn_act_in_bf16_rounds_only_its_outputs(device):
    g = torch.Generator().manual_seed(3)
    got, ref = _run_case(device, (2, 12, 5, 4), torch.bfloat16, True, True, True, g)
    y, rm, rv, dx, dw, db, dres = got
    for a, e in ((y, ref[0]), (dx, ref[3]), (dres, ref[6])):
        _bf16_close(a.cpu(), e)
    for a, e in ((rm, ref[1]), (rv, ref[2]), (dw, ref[4]), (db, ref[5])):
        _close(a.cpu(), e, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_hold_when_the_mean_dwarfs_the_spread(device, monkeypatch):
    # mean 1000, std 0.01: E[x^2] - E[x]^2 in float32 would lose every digit of the variance (1e-4
    # against 1e6 * 6e-8); the pairwise (Chan) merges keep it to about 1e-4 of itself.
    monkeypatch.setattr(batch_norm_layout, "INTERPRETER_TILE", 16)
    monkeypatch.setattr(batch_norm_layout, "INTERPRETER_PROGRAMS", 3)
    g = torch.Generator().manual_seed(5)
    got, ref = _run_case(device, (4, 3, 6, 6), torch.float32, False, False, True, g, mean=1000.0, std=0.01)
    y, rm, rv = got[:3]
    _close(rv.cpu(), ref[2], 1e-3)
    _close(y.cpu(), ref[0], 1e-2)  # y = xhat * w + b: xhat ~ 1 carries the fp32 inputs' 6e-5 / 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_bn_act_hands_out_the_batch_mean_and_biased_variance(device, monkeypatch):
    # What Inception's slim batch norm averages itself (TF's zero-debiased moving averages).
    monkeypatch.setattr(batch_norm_layout, "INTERPRETER_TILE", 16)
    monkeypatch.setattr(batch_norm_layout, "INTERPRETER_PROGRAMS", 3)
    g = torch.Generator().manual_seed(9)
    x = _cl(torch.randn(3, 6, 5, 3, generator=g) * 2 + 1).to(device)
    bias = torch.randn(6, generator=g).to(device)
    mean, var = torch.full((6,), float("nan"), device=device), torch.full((6,), float("nan"), device=device)
    bn_act(x, None, bias, None, None, momentum=0.0, eps=1e-3, batch_stats=(mean, var))
    x64 = x.cpu().double()
    _close(mean.cpu(), x64.mean((0, 2, 3)), 1e-5)
    _close(var.cpu(), x64.var((0, 2, 3), unbiased=False), 1e-5)


def test_bn_act_refuses_what_it_cannot_compute():
    x = _cl(torch.randn(2, 3, 2, 2))
    with pytest.raises(ValueError, match="residual"):
        bn_act(x, None, None, None, None, momentum=0.1, eps=1e-5, residual=x.to(torch.float64))
    with pytest.raises(ValueError, match="more than one value"):
        bn_act(torch.randn(1, 3, 1, 1), None, None, None, None, momentum=0.1, eps=1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        bn_act(x, torch.ones(4), torch.zeros(4), None, None, momentum=0.1, eps=1e-5)
    with pytest.raises(ValueError, match="come in a pair"):
        bn_act(x, None, None, torch.zeros(3), None, momentum=0.1, eps=1e-5)
    with pytest.raises(ValueError, match=r"weight must be .* got \(3,\) torch.float32 with strides \(2,\)"):
        bn_act(x, torch.ones(6)[::2], torch.zeros(3), None, None, momentum=0.1, eps=1e-5)
    with pytest.raises(ValueError, match="running_mean must be a contiguous torch.float32"):
        bn_act(x, None, None, torch.zeros(3, dtype=torch.float64), torch.ones(3), momentum=0.1, eps=1e-5)


def _train(model, steps, x, labels):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["resnet50", "resnet18", "resnet50_v2"])
def test_a_resnet_trains_with_the_kernels_as_with_torch_s_batch_norm(name):
    # Every block's BN + add + ReLU through the kernels: the same losses, weights and running statistics
    # as torch's ops after 3 SGD steps, bn_momentum 0.5 so that a wrong running update shows. In float64
    # (the kernels then compute in float64): in float32 these tiny nets (4 channels wide, BN over 16
    # values in layer4) put a ReLU input within rounding of 0 on the other side now and then, which moves
    # a bias gradient by several percent; in float64 the two agree to 3e-10 (seen), so 1e-8 holds with a
    # margin and a misplaced add or ReLU (O(1)), or a wrong gradient term, fails it.
    def build():
        torch.manual_seed(0)
        model = create_model(name, 10, base_channels=4, bn_momentum=0.5, zero_init_residual=False)
        return model.to(torch.float64, memory_format=CL)

    torch.manual_seed(1)
    x, labels = _cl(torch.randn(4, 3, 64, 64, dtype=torch.float64)), torch.randint(0, 10, (4,))
    eager, fused = build(), build()
    marked = use_bn_kernels(fused, torch.device("cpu"))
    assert marked == sum(type(m) is torch.nn.BatchNorm2d for m in fused.modules())
    losses = _train(fused, 3, x, labels), _train(eager, 3, x, labels)
    torch.testing.assert_close(*losses, rtol=1e-8, atol=0)
    fused_state, eager_state = fused.state_dict(), eager.state_dict()
    for key, value in eager_state.items():
        scale = value.abs().max().item() if value.is_floating_point() else 0
        torch.testing.assert_close(fused_state[key], value, rtol=1e-8, atol=1e-8 * scale, msg=key)
    # Eval mode runs torch's ops on the running statistics: bit-identical outputs.
    fused.eval(), eager.eval()
    fused.load_state_dict(eager_state)
    with torch.no_grad():
        assert torch.equal(fused(x), eager(x))


def test_inception_v3_s_slim_batch_norm_trains_with_the_kernels_as_with_torch_s():
    # The seed's beta-only batch norm through the kernels, its zero-debiased moving averages fed by the
    # batch statistics they hand back: 2 SGD steps (dropout drawn alike) in float64 agree to 8e-11
    # (seen); 1e-8 as for the ResNets.
    def build():
        torch.manual_seed(0)
        model = create_model("inception_v3", 10, inception_bn_gamma=False, bn_momentum=0.5)
        return model.to(torch.float64, memory_format=CL)

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        losses = []
        for _ in range(2):
            torch.manual_seed(5)  # the dropout masks
            logits, aux = model(x)
            loss = F.cross_entropy(logits, labels) + 0.4 * F.cross_entropy(aux, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(1)
    x, labels = _cl(torch.randn(2, 3, 299, 299, dtype=torch.float64)), torch.randint(0, 10, (2,))
    eager, fused = build(), build()
    assert use_bn_kernels(fused, torch.device("cpu")) == 96  # every BasicConv2d's, the aux head's too
    torch.testing.assert_close(train(fused), train(eager), rtol=1e-8, atol=0)
    fused_state = fused.state_dict()
    for key, value in eager.state_dict().items():
        scale = value.abs().max().item() if value.is_floating_point() else 0
        torch.testing.assert_close(fused_state[key], value, rtol=1e-8, atol=1e-8 * scale, msg=key)


def test_the_settings_that_cannot_go_with_the_kernels_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="--compile"):
        make_config(model="resnet50", bn_kernels="triton", compile=True)
    with pytest.raises(ConfigError, match="--sync_bn"):
        make_config(model="resnet50", bn_kernels="triton", sync_bn=True, compile=False)
    with pytest.raises(ConfigError, match="channels_last"):
        make_config(model="resnet50", bn_kernels="triton", channels_last=False)
    cfg = make_config(model="resnet50", bn_kernels="triton")
    # --compile's default (on for CUDA) gives way to the kernels, which replace what it fuses.
    assert not compile_wanted(cfg.compile, torch.device("cuda"), False, cfg.bn_kernels)
    assert compile_wanted(None, torch.device("cuda"), False, "torch")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SettingError, match="TRITON_INTERPRET") as err:
        use_bn_kernels(create_model("resnet18", 10, base_channels=4), torch.device("cpu"))
    assert err.value.settings == ("bn_kernels",)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1; use --bn_kernels=torch"):
        bn_act(torch.randn(2, 3, 2, 2), None, None, None, None, momentum=0.1, eps=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("per_sm", [None, 8])  # one wave (counted from the registers); a fixed 8
def test_bn_act_at_a_resnet_50_layer_s_size_and_in_a_cuda_graph(residual, per_sm, monkeypatch):
    # ResNet-50's layer1 output at batch 32: M = 100,352 rows of 256 channels, bf16, many programs.
    monkeypatch.setattr(batch_norm_layout, "PROGRAMS_PER_SM", per_sm)
    g = torch.Generator().manual_seed(7)
    got, ref = _run_case("cuda", (32, 256, 56, 56), torch.bfloat16, True, residual, True, g)
    for i in (0, 3):  # y, dx: bf16
        _bf16_close(got[i].cpu(), ref[i])
    for i in (1, 2, 4, 5):  # the statistics and the parameter gradients (sums of 100,352 terms)
        _close(got[i].cpu(), ref[i], 1e-4)
    # Captured and replayed: the same output as the eager call.
    x = _cl(torch.randn(8, 64, 28, 28, device="cuda", dtype=torch.bfloat16))
    w, b = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    rm, rv = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    eager = bn_act(x, w, b, rm.clone(), rv.clone(), momentum=0.1, eps=1e-5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bn_act(x, w, b, rm.clone(), rv.clone(), momentum=0.1, eps=1e-5)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = bn_act(x, w, b, rm, rv, momentum=0.1, eps=1e-5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
