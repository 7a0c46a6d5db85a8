"""FusedRMSPropTF's and FusedMomentum's state_dict (fasttrain/optim.py): a round trip resumes
identically, bit for bit, whatever the flat layout of the optimizer it is loaded into; a resume trains
with its own settings, not the checkpoint's; a state without EMA or of another shape is one clear
error. The helpers and the implementations are test_optim.py's.
"""

import io

import pytest
import torch
from test_optim import IMPLS, _build, _grads, _groups, _params, _set_grads, _triton_interpreter  # noqa: F401
from torch import nn

from fasttrain.optim import FusedMomentum, FusedRMSPropTF


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["rmsprop", "momentum"])
def test_state_dict_round_trip_resumes_identically(kind, impl):
    params = _params()
    lr = torch.tensor(0.1)
    opt = _build(kind, impl, params, lr)
    gen = torch.Generator().manual_seed(4)
    grads = [_grads(params, gen) for _ in range(8)]
    for i in range(4):
        _set_grads(params, grads[i], i)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)

    resumed = [nn.Parameter(p.detach().clone()) for p in params]  # the weights come from the model
    resumed[0].data = resumed[0].data.to(memory_format=torch.channels_last)
    new_lr = torch.tensor(0.5)
    opt2 = _build(kind, impl, resumed, new_lr)
    opt2.flat.reorder(resumed[::-1])  # a different layout: the state dict must not depend on it
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.param_groups[0]["lr"] is new_lr and float(new_lr) == pytest.approx(0.1)

    for i in range(4, 8):
        _set_grads(params, grads[i], i)
        _set_grads(resumed, grads[i], i)
        opt.step()
        opt2.step()
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
    for a, b in zip(opt.ema_parameters(), opt2.ema_parameters()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], opt2.state_dict()["state"]
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])


def test_a_resume_trains_with_its_own_settings_not_the_checkpoints():
    # TF's Saver restores variables into the graph the flags built: a resume with another weight decay,
    # epsilon, momentum or RMSProp decay uses the new ones. torch's load_state_dict put the saved ones
    # back, while the resume's note said they had changed.
    old = FusedRMSPropTF(_groups(_params(), 4e-5), lr=0.1, decay=0.9, momentum=0.9, eps=1.0, impl="torch")
    saved = old.state_dict()
    new_settings = dict(lr=0.1, decay=0.99, momentum=0.5, eps=0.1, impl="torch")
    resumed_params, fresh_params = _params(), _params()
    resumed = FusedRMSPropTF(_groups(resumed_params, 1e-4), **new_settings)
    resumed.load_state_dict(saved)  # a fresh state, saved by an optimizer with other settings
    fresh = FusedRMSPropTF(_groups(fresh_params, 1e-4), **new_settings)
    assert [g["weight_decay"] for g in resumed.param_groups] == [1e-4, 0.0]
    assert {k: resumed.param_groups[0][k] for k in ("decay", "momentum", "eps")} == {
        "decay": 0.99,
        "momentum": 0.5,
        "eps": 0.1,
    }
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        grads = _grads(resumed_params, gen)
        _set_grads(resumed_params, grads, i)
        _set_grads(fresh_params, grads, i)
        resumed.step()
        fresh.step()
    for p, q in zip(resumed_params, fresh_params):
        assert torch.equal(p, q)


def test_load_state_dict_without_ema_is_a_clear_error():
    params = _params()
    opt = FusedMomentum(params, lr=0.1, ema_decay=None)
    with pytest.raises(ValueError, match="no 'ema' for parameter 0"):
        FusedMomentum(_params(), lr=0.1, ema_decay=0.9).load_state_dict(opt.state_dict())


def test_load_state_dict_refuses_a_state_of_another_shape():
    # copy_ broadcasts: a scalar momentum buffer in a foreign checkpoint filled parameter 0's whole
    # buffer with that one value and the run went on.
    opt = FusedMomentum(_params(), lr=0.1, ema_decay=0.9)
    saved = opt.state_dict()
    first = next(iter(saved["state"]))
    saved["state"][first]["momentum_buffer"] = torch.tensor(5.0)
    fresh = FusedMomentum(_params(), lr=0.1, ema_decay=0.9)
    with pytest.raises(ValueError, match=r"'momentum_buffer' of parameter 0 is \(\), not \("):
        fresh.load_state_dict(saved)
