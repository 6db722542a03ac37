# syntax=docker/dockerfile:1
# devicemq: the MQTT broker, configured only through DEVICEMQ_* environment
# variables (README "Configuration"); docker-compose.yml runs it with Kafka,
# Redis, Prometheus and Grafana.
#
#   docker build -t devicemq .
#   docker run -p 1883:1883 -p 9883:9883 \
#     -e DEVICEMQ_PERSISTENCE_REDIS_URL=redis://redis:6379/0 \
#     -e DEVICEMQ_PERSISTENCE_KAFKA_BOOTSTRAP=kafka:9092 \
#     -e DEVICEMQ_AUTH_PASSWORD_FILE=/var/lib/devicemq/passwd \
#     -e DEVICEMQ_AUTH_INITIAL_USER=devicemq -e DEVICEMQ_AUTH_INITIAL_PASSWORD devicemq
#
# Secure by default (SECURITY.md): without authentication configured the
# broker listens on the container's loopback only, out of reach of -p; set
# DEVICEMQ_LISTENER_HOST=0.0.0.0 to run it open on purpose.

# ---- build: wheels of devicemq and its dependencies (uvloop, hiredis, ...);
# devicemq's hot modules compiled with mypyc (setup.py), hence gcc here only.
# DEVICEMQ_COMPILE (a build argument): auto compiles when it can and builds the
# pure Python otherwise (the image always builds; the runtime stage's
# `devicemq --version` line says which); 1 fails the build rather than ship
# the pure Python unnoticed; 0 never compiles.
FROM python:3.11-slim AS build
ARG DEVICEMQ_COMPILE=auto
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN DEVICEMQ_COMPILE="$DEVICEMQ_COMPILE" pip wheel --wheel-dir /wheels .

# ---- runtime: the installed package, no sources, no compilers, non-root
# (`devicemq --version` prints how many hot modules run compiled)
FROM python:3.11-slim
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DEVICEMQ_LISTENER_PORT=1883 \
    DEVICEMQ_METRICS_ENABLED=true \
    DEVICEMQ_METRICS_HOST=0.0.0.0 \
    DEVICEMQ_METRICS_PORT=9883 \
    DEVICEMQ_DATA_DIR=/var/lib/devicemq
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels devicemq \
    && python -c "import uvloop, prometheus_client, app.serve" \
    && devicemq --version \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/devicemq --create-home devicemq \
    && install -d -o devicemq -g devicemq -m 0700 /var/lib/devicemq/admin
USER devicemq
WORKDIR /var/lib/devicemq
# 18083: the admin API and console (admin.host is loopback unless set, as in
# docker-compose.yml); /var/lib/devicemq/admin: its token file's volume there.
EXPOSE 1883 9883 18083
# /health answers 200 while the process runs (no curl in the image: urllib).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DEVICEMQ_METRICS_PORT', '9883'), timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["devicemq"]
CMD ["run"]
