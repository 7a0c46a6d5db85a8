# fasttrain on NVIDIA's PyTorch container, which brings CUDA, cuDNN, NCCL, DALI and NVIDIA apex.
#   docker build -t fasttrain .
#   docker run --gpus all --ipc=host --rm -v /data/imagenet-tfrecords:/data:ro -v $PWD/runs:/runs \
#       fasttrain torchrun --nproc_per_node=4 -m fasttrain --recipe inception_v3 --data_dir /data \
#       --train_dir /runs/incv3
# 25.12: PyTorch 2.10.0a0, CUDA 13.1, Python 3.12 (NVIDIA's release notes). fasttrain's CPU test suite
# passes on PyPI's torch 2.10.0 and 2.7.0 builds under Python 3.12; this image itself has not been built
# here (no Docker engine). Another release: docker build --build-arg BASE=nvcr.io/nvidia/pytorch:YY.MM-py3 .
ARG BASE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE}

WORKDIR /opt/fasttrain
COPY setup.py pyproject.toml README.md ./
COPY fasttrain ./fasttrain
COPY kernels ./kernels
COPY bench ./bench
COPY tests ./tests
# --no-deps: torch, triton, numpy and DALI come with the container and must not be replaced by
# PyPI builds. The rest of the small dependencies are installed explicitly. A base without DALI gets
# the PyPI build for its torch's CUDA major version (nvidia-dali-cuda120 or -cuda130). The check and the
# numba warm-up run from / so that they import the installed fasttrain, whose __pycache__ folders
# then hold the compiled kernels the runs load (from /opt/fasttrain they would import ./fasttrain).
RUN pip install --no-cache-dir google-crc32c protobuf tqdm tensorboard pytest-benchmark simplejpeg numba \
 && pip install --no-cache-dir --no-deps . \
 && (python -c "import nvidia.dali" 2>/dev/null \
     || pip install --no-cache-dir "nvidia-dali-cuda$(python -c 'import torch; print(torch.version.cuda.split(".")[0])')0") \
 && cd / \
 && python -c "import fasttrain, fasttrain.kernels, fasttrain.train, nvidia.dali; print('fasttrain ok')" \
 && python -m fasttrain.data warm-up

WORKDIR /workspace
ENV PYTHONUNBUFFERED=1
CMD ["python", "-m", "fasttrain", "--help"]
