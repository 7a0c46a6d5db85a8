"""fasttrain: a fast, honest ImageNet trainer in PyTorch (TFRecord input, TF-exact RMSProp + EMA)."""

from setuptools import setup

setup(
    name="fasttrain",
    version="0.1.0",
    description="Fast ImageNet training in PyTorch on TensorFlow-models TFRecord shards",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "fasttrain",
        "fasttrain.data",
        "fasttrain.data.jpeg",
        "fasttrain.models",
        "fasttrain.selfcheck",
        "fasttrain.tf",
        "fasttrain.tf.names",
        "fasttrain.kernels",
    ],
    # `kernels` is a generic top-level name other packages use: install it as fasttrain.kernels.
    package_dir={"fasttrain.kernels": "kernels"},
    install_requires=[
        "torch>=2.7",  # the oldest release the test suite has been run with (README, "Versions")
        "numpy>=1.24",
        "pillow>=10",  # writes the demo's synthetic JPEGs
        "simplejpeg>=1.7",  # libjpeg-turbo with its fast IDCT: TensorFlow's decode_jpeg pixels
        # libturbojpeg 3 (bundled by this wheel, called through ctypes): the cropped decode of TF's
        # decode_and_crop_jpeg (fasttrain/data/jpeg/decode.py). Pinned: fasttrain relies on the bundled
        # library's TurboJPEG 3 ABI, not on the wheel's Python API. x86-64 Linux is where the GPU nodes
        # are; elsewhere the window is cut from the full decode.
        'turbojpeg==0.0.2; platform_system == "Linux" and platform_machine == "x86_64"',
        "numba>=0.59",  # TF1 resize + colour kernels (fasttrain/data), the CPU optimizer (kernels/cpu.py)
        "google-crc32c>=1.5",
        "protobuf>=4.21",
        "tqdm>=4.60",
        # TensorBoard event files (torch.utils.tensorboard's SummaryWriter), on by default
        "tensorboard>=2.10",
        "triton>=3.3; platform_system == 'Linux'",  # torch 2.7 ships with 3.3
    ],
    extras_require={
        "dali": ["nvidia-dali-cuda120>=1.44"],
        "plot": ["matplotlib>=3.5"],  # python -m fasttrain.plot
        # bench/bench_input.py: the real-photo shard set (skimage.data) and the plain PyTorch row.
        "bench": ["scikit-image>=0.21", "tfrecord>=1.14"],
        # No DALI: its tests run its CPU mode only and skip without it; DALI 2.4 with the CUDA libraries
        # it pulls in is about 0.95 GB installed, +39% on a test venv (README, "Run the test suite").
        # `pip install ".[test,dali]"` runs them too, as CI does.
        "test": [
            "pytest>=7",
            # 5.3.1: the first that runs under pytest 9.2 (5.2.3 failed every benchmark: no `_nodeid`)
            "pytest-benchmark>=5.3.1",
            "matplotlib>=3.5",
            "ruff>=0.5",
            "scikit-image>=0.21",  # tests/test_bench_input.py: the photo shard writer
            "tfrecord>=1.14",  # ... read back by an independent TFRecord reader
        ],
    },
    entry_points={"console_scripts": ["fasttrain=fasttrain.__main__:main"]},
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
