# KVStream proxy image: slim, non-root, with a healthcheck.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    # Inside the container KVStream must listen on all interfaces to be reachable through
    # the published port; docker-compose.yml publishes it on the host's loopback only.
    KVSTREAM_SERVER__HOST=0.0.0.0 \
    KVSTREAM_SERVER__PORT=8080

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvstream ./kvstream
RUN pip install . && useradd --create-home --uid 10001 kvstream

USER kvstream
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["kvstream", "serve"]
