# One image for web, workers and Flower. CPU torch by default; for GPUs build with
#   --build-arg TORCH_SPEC="torch==2.13.0"  on a CUDA base image (see docs/deployment.md).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends ffmpeg procps espeak-ng && rm -rf /var/lib/apt/lists/*
WORKDIR /srv/encore
COPY requirements.txt requirements.lock ./
COPY scripts/disable_torchaudio_ext.py scripts/
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir "$TORCH_SPEC" \
 && pip install --no-cache-dir -r requirements.txt -c requirements.lock \
 && python scripts/disable_torchaudio_ext.py
COPY . .
ENV ENCORE_ARTIFACT_DIR=/data/artifacts PYTHONUNBUFFERED=1
CMD ["gunicorn", "-c", "gunicorn.conf.py"]
