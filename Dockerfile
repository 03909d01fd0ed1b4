# mlxq worker and gateway image (CPU MLX on Linux).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# g++ and make compile the paged-attention CPU extension (cmake and nanobind come from PyPI)
RUN apt-get update && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY worker ./worker
COPY mlxq ./mlxq
# the worker and the gateway are extras (a bare `pip install mlxq` is the producer)
RUN pip install '.[worker,gateway]' && rm -rf /src/*
# run from a directory without the sources: `python -m mlxq` there imports the installed package
WORKDIR /srv
# Build the paged-attention extension into the image (else the first worker start does, ~30 s;
# if it cannot, the worker logs why and uses the gather attention path).
ENV MLXQ_CACHE_DIR=/opt/mlxq-cache
RUN mlxq build-ext || echo "mlxq: the paged-attention extension was not built; workers use the gather path"

# The default Redis of docker-compose.yml; override with -e MLXQ_REDIS_URL=...
ENV MLXQ_REDIS_URL=redis://redis:6379/0
CMD ["mlxq", "--help"]
