"""Every check of `python -m fasttrain selfcheck`, in the order of the table (one row each)."""

from fasttrain.selfcheck.data_checks import check_fused_decode
from fasttrain.selfcheck.step_checks import (
    check_bn_kernels,
    check_compiled_graph,
    check_eager_step,
    check_fp16_overflow,
    check_graph_replay,
    check_no_host_sync,
    check_optimizer_chunked,
    check_optimizer_triton,
    check_padded_stem,
)
from fasttrain.selfcheck.system_checks import (
    check_buckets_vs_ddp,
    check_dali_cpu,
    check_dali_mixed,
    check_throughput_eager,
    check_throughput_graph,
)

CHECKS = {
    "optimizer-chunked": check_optimizer_chunked,
    "optimizer-triton": check_optimizer_triton,
    "eager-step": check_eager_step,
    "graph-replay": check_graph_replay,
    "compiled-graph": check_compiled_graph,
    "padded-stem": check_padded_stem,
    "bn-kernels": check_bn_kernels,
    "fp16-overflow": check_fp16_overflow,
    "no-host-sync": check_no_host_sync,
    "buckets-vs-ddp": check_buckets_vs_ddp,
    "fused-decode": check_fused_decode,
    "dali-cpu": check_dali_cpu,
    "dali-mixed": check_dali_mixed,
    "throughput-eager": check_throughput_eager,
    "throughput-graph": check_throughput_graph,
}
