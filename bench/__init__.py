"""fasttrain's benchmarks, run from the repository root (bench/results/README.md has the details).

    python -m bench.run [--smoke] [--out DIR]       the throughput suite: training rows, input
                                                    pipelines, optimizer kernels, torch.compile
    python -m bench.report DIR [MORE_DIR ...]       re-render (and merge) a bench.run folder
    python -m bench.bench_input --out DIR           input pipelines on the CPU, against tf.data
    python -m bench.photo_shards OUT_DIR            the real-photo shard set bench_input reads
    python -m pytest bench --benchmark-only         the microbenchmarks, bench/bench_<topic>.py

Shared by all of them (bench/common.py): the timer, the environment record and the copy bandwidth.
The modules import each other one way (run -> report, throughput, input_rows, mfu -> common);
tf_input.py imports tensorflow and bench/input_serve.py only, so it runs in a TensorFlow-only
interpreter (this package's __init__ imports nothing).
"""
