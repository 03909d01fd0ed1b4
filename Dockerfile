# mlxq worker and gateway image (CPU MLX on Linux).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY worker ./worker
COPY mlxq ./mlxq
RUN pip install .

# The default Redis of docker-compose.yml; override with -e MLXQ_REDIS_URL=...
ENV MLXQ_REDIS_URL=redis://redis:6379/0
CMD ["mlxq", "--help"]
