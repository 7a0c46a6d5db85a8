"""FusedRMSPropTF and FusedMomentum as torch.optim.Optimizers: against torch.optim.SGD and a float64 NumPy
transcription of TensorFlow's RMSProp + EMA, per parameter over a mixed-shape list, for each
implementation (reference, chunked fast path, Triton interpreter); skip on overflow; EMA swap;
dispatch; a step off the CPU that makes no host read (traced on the meta device, the Triton kernels
through their custom ops' fake implementations); torch.compile of the Triton step. (The state_dict
round trip: test_optim_state.py.)

Tolerances: atol 2e-6 + rtol 1e-6 against float64, as in test_rmsprop_tf.py (measured error there
<= 1.2e-6 after 10 steps); 1e-6 against torch.optim.SGD, which computes the same fp32 operations
(observed difference: 0 or 1 ulp).
"""

import copy

import numpy as np
import pytest
import torch
from fasttrain.kernels.common import HAVE_TRITON
from torch import nn

from fasttrain.optim import FusedMomentum, FusedRMSPropTF, select_impl

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
IMPLS = ["torch", "chunked", pytest.param("triton", marks=needs_triton)]
STEPS = 12
LRS = [0.1 * 0.85**i for i in range(STEPS)]


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    # impl="triton" on CPU tensors runs in Triton's interpreter; the kernels read this at launch.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _params(seed=0):
    """Mixed shapes: a channels_last conv weight, BN-like vectors, a matrix, odd sizes, a scalar."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5, 3, 3), (7,), (7,), (10, 13), (10,), (127,), (1,), ()]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params[0].data = params[0].data.to(memory_format=torch.channels_last)
    return params


def _groups(params, weight_decay):
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def _grads(params, gen, scale=1.0):
    return [torch.randn(p.shape, generator=gen) * scale for p in params]


def _set_grads(params, grads, step):
    for p, g in zip(params, grads):
        if step % 2:
            p.grad = g.clone()  # a fresh tensor, as a caller computing gradients elsewhere would
        else:
            p.grad.copy_(g)  # into the flat view, as backward does


# --- RMSProp vs TensorFlow's equations (float64 NumPy, per parameter)


@pytest.mark.parametrize("impl", IMPLS)
def test_rmsprop_tf_matches_tensorflow_per_parameter(impl):
    params = _params()
    order = [p for g in _groups(params, 4e-5) for p in g["params"]]
    lr = torch.tensor(LRS[0])  # a device tensor updated in place, as the trainer does
    opt = FusedRMSPropTF(_groups(params, 4e-5), lr=lr, ema_decay=0.999, impl=impl)
    expected = [
        {"w": p.detach().double().numpy().copy(), "ms": np.ones(p.shape), "mom": np.zeros(p.shape)}
        for p in order
    ]
    for s in expected:
        s["ema"] = s["w"].copy()
    gen = torch.Generator().manual_seed(1)
    for i, step_lr in enumerate(LRS):
        lr.fill_(step_lr)
        grads = _grads(order, gen, scale=8.0)
        _set_grads(order, grads, i)
        opt.step(grad_scale=torch.tensor(0.125))
        decay = min(0.999, (1.0 + i + 1) / (10.0 + i + 1))
        for s, g, wd in zip(expected, grads, [4e-5 if p.dim() > 1 else 0.0 for p in order]):
            g = g.double().numpy() * 0.125 + wd * s["w"]
            s["ms"] += (g * g - s["ms"]) * (1 - 0.9)
            s["mom"] = s["mom"] * 0.9 + g * step_lr / np.sqrt(s["ms"] + 1.0)
            s["w"] -= s["mom"]
            s["ema"] -= (s["ema"] - s["w"]) * (1 - decay)

    state = opt.state_dict()["state"]
    emas = opt.ema_parameters()
    for i, (p, s) in enumerate(zip(order, expected)):
        for key, actual in (
            ("w", p),
            ("ms", state[i]["square_avg"]),
            ("mom", state[i]["momentum_buffer"]),
            ("ema", emas[i]),
        ):
            assert actual.shape == p.shape
            np.testing.assert_allclose(
                actual.detach().double().numpy(), s[key], rtol=1e-6, atol=2e-6, err_msg=f"{key} of {i}"
            )
        assert int(state[i]["step"]) == STEPS
    assert params[0].is_contiguous(memory_format=torch.channels_last)


# --- Momentum vs torch.optim.SGD


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_torch_sgd(impl, nesterov):
    params = _params()
    expected = [nn.Parameter(p.detach().clone()) for p in params]
    opt = FusedMomentum(_groups(params, 1e-4), lr=LRS[0], momentum=0.9, nesterov=nesterov, impl=impl)
    sgd = torch.optim.SGD(_groups(expected, 1e-4), lr=LRS[0], momentum=0.9, nesterov=nesterov)
    gen = torch.Generator().manual_seed(2)
    order = [p for g in opt.param_groups for p in g["params"]]
    for i, lr in enumerate(LRS):
        for group in opt.param_groups + sgd.param_groups:
            group["lr"] = lr
        grads = _grads(params, gen)
        _set_grads(params, grads, i)
        for q, g in zip(expected, grads):
            q.grad = g.clone()
        opt.step()
        sgd.step()
    for p, q in zip(params, expected):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    state = opt.state_dict()["state"]
    for i, p in enumerate(order):
        q = expected[[id(x) for x in params].index(id(p))]
        torch.testing.assert_close(
            state[i]["momentum_buffer"], sgd.state[q]["momentum_buffer"], rtol=0, atol=1e-6
        )


def test_momentum_with_model_backward_and_zero_grad():
    # Used exactly like torch.optim: zero_grad, backward into the flat views, step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 3))
    model = model.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    opt = FusedMomentum(model.parameters(), lr=0.05, weight_decay=1e-4)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(8, 3, 6, 6).to(memory_format=torch.channels_last)
    for i in range(5):
        for m, o in ((model, opt), (reference, sgd)):
            o.zero_grad()
            if i == 3:
                m.zero_grad(set_to_none=True)  # fresh autograd tensors must still be consumed
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)  # observed <= 2.4e-7
    assert all(p.grad.data_ptr() != 0 and p.grad.stride() == p.stride() for p in model.parameters())


# --- skip on overflow


def _build(kind, impl, params, lr):
    if kind == "rmsprop":
        return FusedRMSPropTF(_groups(params, 4e-5), lr=lr, ema_decay=0.99, impl=impl)
    return FusedMomentum(_groups(params, 1e-4), lr=lr, nesterov=True, ema_decay=0.99, impl=impl)


def _snapshot(opt):
    buffers = [opt.flat.params, *opt._buffers.values(), opt.applied_steps]
    return [b.clone() for b in buffers]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["rmsprop", "momentum"])
def test_found_inf_skips_bit_for_bit_and_resumes_as_if_never_taken(kind, impl):
    skipping, plain = _params(), _params()
    lr_a, lr_b = torch.tensor(0.1), torch.tensor(0.1)
    opt, ref = _build(kind, impl, skipping, lr_a), _build(kind, impl, plain, lr_b)
    gen = torch.Generator().manual_seed(3)
    for i in range(6):
        grads = _grads(skipping, gen)
        if i == 3:
            before = _snapshot(opt)
            _set_grads(skipping, [g.fill_(float("inf")) for g in grads], 0)
            opt.step(grad_scale=0.5, found_inf=torch.tensor(1.0))
            after = _snapshot(opt)
            for b, a in zip(before, after):
                assert torch.equal(b.reshape(-1).view(torch.uint8), a.reshape(-1).view(torch.uint8))
            continue
        _set_grads(skipping, grads, 0)
        _set_grads(plain, grads, 0)
        opt.step(grad_scale=0.5, found_inf=torch.tensor(0.0))
        ref.step(grad_scale=0.5)
    for a, b in zip(_snapshot(opt), _snapshot(ref)):
        assert torch.equal(a, b)
    assert int(opt.applied_steps) == 5


# --- EMA, dispatch, API


def test_swap_ema_swaps_in_and_restores():
    params = _params()
    opt = FusedRMSPropTF(params, lr=0.1, ema_decay=0.9)
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        _set_grads(params, _grads(params, gen), i)
        opt.step()
    weights = [p.detach().clone() for p in params]
    emas = [e.clone() for e in opt.ema_parameters()]
    assert not all(torch.equal(w, e) for w, e in zip(weights, emas))
    with pytest.raises(KeyError), opt.swap_ema():
        assert all(torch.equal(p, e) for p, e in zip(params, emas))
        raise KeyError("evaluation failed")  # restored even then
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(e, x) for e, x in zip(opt.ema_parameters(), emas))


def test_ema_parameters_in_a_requested_order():
    params = _params()
    opt = FusedMomentum(_groups(params, 0.0), lr=0.1, ema_decay=0.9)  # groups reorder the params
    for p in params:
        p.grad.fill_(1.0)
    opt.step()
    emas = opt.ema_parameters(params)  # model order, e.g. to pair with model.named_parameters()
    assert [e.shape for e in emas] == [p.shape for p in params]
    for p, e in zip(params, emas):
        # First step: d = min(0.9, 2/11), so ema = w_old + (1 - d) * (w_new - w_old) = w_new + d*lr*1.
        torch.testing.assert_close(e, p.detach() + 2 / 11 * 0.1, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="not in these flat buffers"):
        opt.ema_parameters([nn.Parameter(torch.zeros(2))])


def test_dispatch(monkeypatch):
    assert select_impl("auto", torch.device("cpu")) == "chunked"  # the fast torch path
    assert select_impl("chunked", torch.device("cpu")) == "chunked"
    assert select_impl("torch", torch.device("cpu")) == "torch"  # the reference, on request
    assert FusedRMSPropTF(_params(), lr=0.1).impl == "chunked"
    with pytest.raises(ValueError, match="must be one of"):
        select_impl("fused", torch.device("cpu"))
    if HAVE_TRITON:
        assert select_impl("triton", torch.device("cpu")) == "triton"  # interpreter is on
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
            FusedMomentum(_params(), lr=0.1, impl="triton")


@pytest.mark.parametrize("impl", ["chunked", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("kind", ["rmsprop", "momentum"])
def test_step_off_the_cpu_reads_nothing_back(kind, impl):
    # On the meta device every host read (.item(), bool(tensor)) raises, so a step that completes
    # there is one a CUDA graph can capture: found_inf, lr, grad_scale and the EMA's n stay on the device.
    # impl="triton" runs the kernels' custom ops, which trace through their fake implementations.
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in [(7, 5, 3, 3), (7,), (1000003,)]]
    for p in params:
        p.grad = torch.empty_like(p)
    lr = torch.tensor(0.1, device="meta")
    opt = _build(kind, impl, params, lr)
    assert opt.impl == impl
    opt.step(grad_scale=torch.tensor(0.5, device="meta"), found_inf=torch.zeros((), device="meta"))
    opt.step(grad_scale=0.5)
    with pytest.raises(RuntimeError, match="meta"):
        bool(opt.applied_steps == 2)  # the meta device does refuse host reads


@needs_triton
def test_torch_compile_of_the_triton_step_matches_eager():
    # The kernels are torch custom ops with fake implementations, so Dynamo traces the whole step
    # into one graph (fullgraph: no graph break) that Inductor compiles around the opaque op calls.
    # Tensor lr, grad_scale and found_inf as the trainer passes them; the compiled step must write
    # the same bits as the eager one, skipped step included. (~5 s with Inductor's cache warm, ~13 s cold.)
    eager_params, compiled_params = _params(), _params()
    lr_eager, lr_compiled = torch.tensor(0.1), torch.tensor(0.1)
    eager = _build("rmsprop", "triton", eager_params, lr_eager)
    compiled = _build("rmsprop", "triton", compiled_params, lr_compiled)
    scale, found_inf = torch.tensor(0.5), torch.zeros(())

    @torch.compile(fullgraph=True, dynamic=False)
    def compiled_step():
        compiled.step(grad_scale=scale, found_inf=found_inf)

    gen = torch.Generator().manual_seed(8)
    for i, lr in enumerate(LRS[:4]):
        grads = _grads(eager_params, gen)
        lr_eager.fill_(lr)
        lr_compiled.fill_(lr)
        found_inf.fill_(float(i == 2))
        _set_grads(eager_params, grads, 0)
        _set_grads(compiled_params, grads, 0)
        eager.step(grad_scale=scale, found_inf=found_inf)
        compiled_step()
    assert compiled.applied_steps.item() == 3
    for a, b in zip(_snapshot(eager), _snapshot(compiled)):
        assert torch.equal(a, b)


def test_param_groups_are_fixed_at_construction():
    opt = FusedMomentum(_params(), lr=0.1)
    with pytest.raises(RuntimeError, match="pass every parameter group to the constructor"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_cuda_graph_captured_step_matches_eager(monkeypatch, impl):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda")
    eager_params = [nn.Parameter(p.detach().to(device)) for p in _params()]
    graph_params = [nn.Parameter(p.detach().clone()) for p in eager_params]
    lr_eager, lr_graph = torch.tensor(0.1, device=device), torch.tensor(0.1, device=device)
    eager = FusedRMSPropTF(eager_params, lr=lr_eager, ema_decay=0.999, impl=impl)
    graphed = FusedRMSPropTF(graph_params, lr=lr_graph, ema_decay=0.999, impl=impl)
    scale, found_inf = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile outside capture
        graphed.step(grad_scale=scale, found_inf=torch.ones((), device=device))
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        graphed.step(grad_scale=scale, found_inf=found_inf)
    gen = torch.Generator().manual_seed(6)
    for i, lr in enumerate(LRS):
        grads = [g.to(device) for g in _grads(eager_params, gen)]
        lr_eager.fill_(lr)
        lr_graph.fill_(lr)
        found_inf.fill_(float(i == 4))
        _set_grads(eager_params, grads, 0)
        _set_grads(graph_params, grads, 0)
        eager.step(grad_scale=scale, found_inf=found_inf)
        graph.replay()
    if impl == "auto":
        assert eager.impl == "triton" or torch.cuda.get_device_capability() < (7, 0)
    for a, b in zip(_snapshot(eager), _snapshot(graphed)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("Optimizer", [FusedMomentum, FusedRMSPropTF])
def test_one_element_flags_and_lr_as_torch_s_grad_scaler_makes_them(Optimizer):
    # A found_inf of shape (1,) (GradScaler's) made step() raise after the update had moved the weights,
    # the count behind; an lr of shape (1,) broke the state_dict round trip half-way.
    params = _params()
    opt = Optimizer(params, lr=torch.tensor([0.1]), ema_decay=0.9, impl="torch")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(found_inf=torch.zeros(1))
    opt.step(found_inf=torch.ones(1))  # skipped
    assert opt.applied_steps.item() == 1
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0]["lr"].shape == (1,) and opt.param_groups[0]["lr"].item() == pytest.approx(0.1)


def test_frozen_parameters_are_no_optimizer_s():
    # A parameter with requires_grad=False got a zero gradient each step: weight decay and momentum moved
    # it (torch.optim and TF's apply_gradients leave it alone).
    from fasttrain.models import param_groups

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    groups = param_groups(model, weight_decay=0.1, no_decay_bn_bias=True)
    assert all(p.requires_grad for g in groups for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == 5
    with pytest.raises(ValueError, match=r"parameter 0 \(4, 3\) has requires_grad=False"):
        FusedMomentum([model[0].weight, model[0].bias], lr=0.1, weight_decay=0.1, impl="torch")
