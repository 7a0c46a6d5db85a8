"""FlatParameters: layout, views, in-place gradient accumulation, channels_last, reorder."""

import copy

import pytest
import torch
from torch import nn

from fasttrain.flat import ALIGN, SEGMENT_ALIGN, FlatParameters


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 6, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 5),
    )
    return model.to(memory_format=torch.channels_last)


def _groups(model):
    # Typical split: decay on conv/linear weights, none on BN and biases.
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay}, {"params": no_decay}]


def _inside(t, buffer):
    start = buffer.data_ptr()
    return start <= t.data_ptr() < start + buffer.numel() * buffer.element_size()


def _loss(model, x):
    return model(x).square().sum()


def test_layout_groups_contiguous_aligned_and_reversed():
    model = _model()
    groups = _groups(model)
    values = [p.detach().clone() for g in groups for p in g["params"]]
    flat = FlatParameters(groups)

    order = [p for p, _, _ in flat.segments]
    assert order == list(reversed(groups[0]["params"])) + list(reversed(groups[1]["params"]))
    (s0, e0), (s1, e1) = flat.group_ranges
    assert s0 == 0 and s1 % ALIGN == 0 and e0 <= s1
    padded = lambda n: -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN  # noqa: E731
    assert e1 - s1 == sum(padded(p.numel()) for p in groups[1]["params"])
    assert flat.params.numel() % ALIGN == 0 and flat.params.dtype == torch.float32
    offset = {id(p): o for p, o, _ in flat.segments}
    for p, value in zip([p for g in groups for p in g["params"]], values):
        assert torch.equal(p, value)  # values kept
        assert p.data_ptr() == flat.params.data_ptr() + 4 * offset[id(p)]
        assert p.grad.data_ptr() == flat.grad.data_ptr() + 4 * offset[id(p)]
        assert torch.count_nonzero(p.grad) == 0
    # Writing the flat buffer is writing the parameters.
    flat.params.fill_(3.0)
    assert all(bool((p == 3.0).all()) for p in model.parameters())


def test_channels_last_layout_kept_and_backward_accumulates_in_place():
    model = _model()
    reference = copy.deepcopy(model)  # plain parameters, autograd's own .grad tensors
    flat = FlatParameters(_groups(model))
    conv = model[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    grad_ptrs = {id(p): p.grad.data_ptr() for p in model.parameters()}

    x = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    for _ in range(2):  # the second backward must add to the first
        _loss(model, x).backward()
        _loss(reference, x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        # Same tensor as before backward (accumulated in place, not stolen or copied), with the
        # parameter's strides, inside the flat buffer.
        assert p.grad.data_ptr() == grad_ptrs[id(p)] and _inside(p.grad, flat.grad)
        assert p.grad.stride() == p.stride()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    assert conv.grad.is_contiguous(memory_format=torch.channels_last)


def test_zero_grad_keeps_views():
    model = _model()
    flat = FlatParameters(_groups(model))
    _loss(model, torch.randn(1, 3, 8, 8)).backward()
    assert flat.grad.abs().sum() > 0
    views = [p.grad for p in model.parameters()]
    flat.zero_grad()
    assert flat.grad.abs().sum() == 0
    assert all(p.grad is v for p, v in zip(model.parameters(), views))


def test_adopt_grads_copies_fresh_and_zeroes_missing():
    model = _model()
    flat = FlatParameters(_groups(model))
    params = list(model.parameters())
    flat.grad.fill_(7.0)
    fresh = torch.randn_like(params[0])
    params[0].grad = fresh  # e.g. a caller computing gradients elsewhere
    params[1].grad = None  # e.g. model.zero_grad(set_to_none=True)
    flat.adopt_grads()
    assert _inside(params[0].grad, flat.grad) and torch.equal(params[0].grad, fresh)
    assert _inside(params[1].grad, flat.grad) and torch.count_nonzero(params[1].grad) == 0
    assert bool((params[2].grad == 7.0).all())


def test_reorder_moves_every_buffer_and_repoints_views():
    model = _model()
    groups = _groups(model)
    flat = FlatParameters(groups)
    state = flat.new_state(1.0)
    assert bool((state == 1.0).all())
    _loss(model, torch.randn(2, 3, 8, 8)).backward()
    params = [p for g in groups for p in g["params"]]
    for i, view in enumerate(flat.views(state)):
        view.fill_(float(i))
    before = {id(p): (p.detach().clone(), p.grad.clone()) for p in params}
    addresses = (flat.params.data_ptr(), flat.grad.data_ptr(), state.data_ptr())
    ranges = list(flat.group_ranges)

    ready_order = list(reversed(params))[1:]  # a partial order: the missing one goes last
    flat.reorder(ready_order)

    assert (flat.params.data_ptr(), flat.grad.data_ptr(), state.data_ptr()) == addresses
    assert flat.group_ranges == ranges
    group0, group1 = ({id(p) for p in g["params"]} for g in groups)
    missing = params[-1]  # the last registered, so it belongs to group 1
    expected = [id(p) for p in ready_order if id(p) in group0]
    expected += [id(p) for p in ready_order if id(p) in group1] + [id(missing)]
    assert [id(p) for p, _, _ in flat.segments] == expected
    for i, (p, view) in enumerate(zip(params, flat.views(state))):
        value, grad = before[id(p)]
        assert torch.equal(p, value) and torch.equal(p.grad, grad) and bool((view == i).all())
        assert _inside(p, flat.params) and _inside(p.grad, flat.grad) and p.stride() == value.stride()
    offsets = {id(p): o for p, o, _ in flat.segments}
    assert all(p.data_ptr() == flat.params.data_ptr() + 4 * offsets[id(p)] for p in params)
    # Backward still lands in the (moved) views.
    flat.zero_grad()
    _loss(model, torch.randn(2, 3, 8, 8)).backward()
    assert all(_inside(p.grad, flat.grad) for p in params)
    assert flat.grad.abs().sum() > 0


def test_rejects_non_fp32_and_duplicate_parameters():
    with pytest.raises(ValueError, match=r"parameter 1 \(3,\) is torch.float16"):
        FlatParameters([{"params": [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3).half())]}])
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="appears twice"):
        FlatParameters([{"params": [p]}, {"params": [p]}])
    flat = FlatParameters([{"params": [nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ValueError, match="not in these buffers"):
        flat.reorder([p])


def _misaligned(views, buffer, what):
    # Every view starts SEGMENT_ALIGN elements (64 bytes) into the buffer from its start; the
    # buffers themselves come from the allocator (256-byte aligned on CUDA, 64 on the CPU).
    return [f"{what} {tuple(v.shape)}" for v in views if (v.data_ptr() - buffer.data_ptr()) % 64]


@pytest.mark.parametrize("name", ["resnet50_v2", "inception_v3"])
def test_every_parameter_view_starts_on_64_bytes(name):
    # The seeds' 1001 classes put an odd-length fc.bias first in the no-decay group: before the
    # fix 152 of resnet50_v2's 153 views (and 291 of inception_v3's 292) were only 4-byte aligned,
    # and fp32 convolutions on them failed on an H200 with "misaligned address".
    from fasttrain.models import create_model, param_groups

    model = create_model(name, 1001, base_channels=4 if name.startswith("resnet") else 64)
    flat = FlatParameters(param_groups(model, 1e-4, no_decay_bn_bias=True))
    params = [p for p, _, _ in flat.segments]
    assert flat.params.data_ptr() % 64 == 0 and flat.grad.data_ptr() % 64 == 0
    assert _misaligned(params, flat.params, "param") == []
    assert _misaligned([p.grad for p in params], flat.grad, "grad") == []
    state = flat.new_state(1.0)
    assert _misaligned(flat.views(state), state, "state") == []
    flat.reorder(list(reversed(params)))  # the observed gradient order, as the buckets install it
    assert _misaligned(list(model.parameters()), flat.params, "param after reorder") == []
    assert _misaligned([p.grad for p in model.parameters()], flat.grad, "grad after reorder") == []


def test_pads_hold_their_fill_after_reorder():
    model = _model()
    flat = FlatParameters(_groups(model))
    state = flat.new_state(1.0)
    for p in model.parameters():
        p.data.fill_(7.0)
        p.grad.fill_(3.0)
    state.fill_(5.0)
    for view in flat.views(state):
        view.fill_(5.0)
    params = [p for p, _, _ in flat.segments]
    flat.reorder([params[1], params[0], *params[2:]])
    used = torch.zeros(flat.params.numel(), dtype=torch.bool)
    for _, offset, numel in flat.segments:
        used[offset : offset + numel] = True
    assert (~used).any(), "this model's layout has pads"
    assert torch.all(flat.params[~used] == 0) and torch.all(flat.grad[~used] == 0)
    assert torch.all(state[~used] == 1.0)
    assert all(torch.all(p == 7.0) and torch.all(p.grad == 3.0) for p in model.parameters())
