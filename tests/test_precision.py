"""Precision policy and the on-device loss scaler, checked against torch.amp.GradScaler."""

import pytest
import torch

from fasttrain.config import make_config
from fasttrain.precision import DynamicLossScaler, grads_not_finite, resolve_precision


def _run_both(grads, growth_interval):
    """Feed the same gradient sequence to GradScaler+SGD and to DynamicLossScaler; compare each step."""
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=1.0)
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=growth_interval)
    ours = DynamicLossScaler(torch.device("cpu"), enabled=True, growth_interval=growth_interval)
    for g in grads:
        reference.scale(torch.tensor(1.0))  # GradScaler's lazy initialisation of its scale
        param.grad = g.clone()  # taken as the already-scaled gradient
        reference.unscale_(opt)
        found_ref = sum(v.item() for v in reference._found_inf_per_device(opt).values())
        before = param.detach().clone()
        reference.step(opt)
        reference.update()
        found = grads_not_finite(g, torch.tensor(1.0))
        ours.update(found)
        assert found.item() == found_ref
        assert ours.scale.item() == reference.get_scale()
        assert torch.equal(param.detach(), before) == bool(found_ref)  # GradScaler skipped exactly then
    return ours


def test_overflow_halves_and_skips_clean_steps_double():
    inf, nan = float("inf"), float("nan")
    pattern = [1, 1, inf, 1, 1, 1, 1, nan, nan, 1, 1, 1, 1, 1, 1, 1]
    grads = [torch.tensor([v, 0.5, -0.25, 2.0]) for v in pattern]
    ours = _run_both(grads, growth_interval=3)
    assert ours.skipped_steps.item() == 3


def test_growth_after_2000_clean_steps():
    grads = [torch.ones(4)] * 2001
    ours = _run_both(grads, growth_interval=2000)
    assert ours.scale.item() == 2.0**17 and ours.growth_tracker.item() == 1


def test_disabled_scaler_stays_at_one_but_counts_skips():
    scaler = DynamicLossScaler(torch.device("cpu"), enabled=False)
    scaler.update(torch.tensor(1.0))
    scaler.update(torch.tensor(0.0))
    assert scaler.scale.item() == 1.0 and scaler.skipped_steps.item() == 1


def test_nonfinite_loss_alone_is_caught():
    assert grads_not_finite(torch.zeros(3), torch.tensor(float("nan"))).item() == 1.0
    assert grads_not_finite(torch.zeros(3), torch.tensor(2.0)).item() == 0.0


def test_cpu_policy():
    p = resolve_precision(make_config(), torch.device("cpu"))
    assert (p.name, p.channels_last, p.cuda_graph, p.autocast) == ("fp32", False, False, False)
    p = resolve_precision(make_config(precision="bf16", channels_last=True), torch.device("cpu"))
    assert (p.dtype, p.channels_last) == (torch.bfloat16, True)
    with pytest.raises(ValueError, match="cuda_graph=false"):
        resolve_precision(make_config(cuda_graph=True), torch.device("cpu"))


def test_a_resume_across_precisions_keeps_this_runs_own_loss_scale():
    # A bf16 run (scaler disabled: scale 1) resumed where auto picks fp16 (an A100 run on a V100): the
    # scale of 1 was loaded, and small fp16 gradients underflowed for the ~32,000 steps growth takes.
    cpu = torch.device("cpu")
    bf16 = DynamicLossScaler(cpu, enabled=False)
    bf16.update(torch.tensor(1.0))  # one skipped step: that count carries over
    fp16 = DynamicLossScaler(cpu, enabled=True)
    fp16.load_state_dict(bf16.state_dict())
    assert fp16.scale.item() == 2.0**16 and fp16.growth_tracker.item() == 0 and fp16.skipped_steps.item() == 1
    # The other way, the disabled scaler stays at 1 (it logged the fp16 run's 65536 before).
    backed_off = DynamicLossScaler(cpu, enabled=True)
    backed_off.update(torch.tensor(1.0))  # 2^15
    disabled = DynamicLossScaler(cpu, enabled=False)
    disabled.load_state_dict(backed_off.state_dict())
    assert disabled.scale.item() == 1.0
    # The same precision: the saved state exactly, and for files written before the flag as well.
    again = DynamicLossScaler(cpu, enabled=True)
    again.load_state_dict(backed_off.state_dict())
    assert again.scale.item() == 2.0**15
    older = {k: v for k, v in bf16.state_dict().items() if k != "enabled"}
    fp16_older = DynamicLossScaler(cpu, enabled=True)
    fp16_older.load_state_dict(older)
    assert fp16_older.scale.item() == 2.0**16
    older_fp16 = {k: v for k, v in backed_off.state_dict().items() if k != "enabled"}
    fp16_older.load_state_dict(older_fp16)
    assert fp16_older.scale.item() == 2.0**15
