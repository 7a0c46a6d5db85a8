"""Triton kernels, installed as `fasttrain.kernels` (a bare `kernels` package would collide).

One kernel per file, each with its exact equations in the module docstring, a private @triton.jit
kernel, a public launcher that checks device, dtype, contiguity and shape, and a pure-torch reference
with identical semantics (the specification the kernel is tested against):

- rmsprop_tf: TensorFlow's RMSProp + L2 weight decay + loss-scale unscale/skip + EMA, one pass.
- momentum:   TensorFlow's Momentum (= torch SGD) + the same extras, one pass.
- chunked:    both updates again, the fast path where Triton does not run: on the CPU a numba-compiled
              loop (cpu.py), on CUDA below compute capability 7.0 in-place torch ops over chunks.
- batch_norm (+ batch_norm_backward): training BatchNorm (+ residual add) (+ ReLU) on channels_last
              activations in four kernels forward and backward (--bn_kernels triton; an autograd
              Function, tested against torch's BatchNorm in float64 rather than a reference of its own).

Kernels run on CUDA devices of compute capability >= 7.0 and, under TRITON_INTERPRET=1, on CPU
tensors (how CI tests them). Each launcher runs its kernel as a torch custom op
(`torch.ops.fasttrain.rmsprop_tf_update`, `torch.ops.fasttrain.momentum_update`) with a fake
implementation, so the update traces on the meta device and compiles under torch.compile.
Choosing between kernel and reference happens in fasttrain.optim.
"""
