# fasttrain on NVIDIA's PyTorch container, which brings CUDA, cuDNN, NCCL, DALI and NVIDIA apex.
#   docker build -t fasttrain .
#   docker run --gpus all --ipc=host --rm -v /data/imagenet-tfrecords:/data:ro -v $PWD/runs:/runs \
#       fasttrain torchrun --nproc_per_node=4 -m fasttrain --recipe inception_v3 --data_dir /data \
#       --train_dir /runs/incv3
ARG BASE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE}

WORKDIR /opt/fasttrain
COPY setup.py pyproject.toml README.md ./
COPY fasttrain ./fasttrain
COPY kernels ./kernels
COPY bench ./bench
COPY tests ./tests
# --no-deps: torch, triton, numpy and DALI come with the container and must not be replaced by
# PyPI builds. The rest of the small dependencies are installed explicitly.
RUN pip install --no-cache-dir google-crc32c protobuf tqdm pytest-benchmark \
 && pip install --no-cache-dir --no-deps . \
 && python -c "import fasttrain, fasttrain.kernels, nvidia.dali; print('fasttrain ok')"

WORKDIR /workspace
ENV PYTHONUNBUFFERED=1
CMD ["python", "-m", "fasttrain", "--help"]
