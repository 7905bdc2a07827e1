# dedupworker: `docker build -t dedupworker .`, then e.g.
#   docker run --rm -e DEDUPWORKER_DSN=postgresql://... dedupworker run myservice.handlers:Handler
# The image holds no configuration and no secrets: everything comes from DEDUPWORKER_*
# variables (or flags) at run time. Handlers come from your own image built FROM this one
# (pip install your package), or from the bundled examples/ (examples.recorder:RecordCalls).
# No `# syntax=` line: nothing here needs more than the Dockerfile frontend built into BuildKit
# and the legacy builder, and that line makes BuildKit pull a frontend image before building.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dedupworker ./dedupworker
# Every transport's extra (boto3 for sqs, confluent-kafka for kafka), into a virtualenv that
# the runtime stage copies; a non-editable install, so the source tree stays behind.
# BUILD_CA_CERTS (PEM text, empty by default) is for a build behind a TLS-intercepting proxy:
# pip trusts it beside the system's CAs in this RUN alone, and only /opt/venv leaves this stage,
# so the runtime image never holds it (scripts/image-check checks that).
ARG BUILD_CA_CERTS=""
RUN if [ -n "$BUILD_CA_CERTS" ]; then \
        { cat /etc/ssl/certs/ca-certificates.crt; printf '%s\n' "$BUILD_CA_CERTS"; } >/tmp/ca.pem; \
        export PIP_CERT=/tmp/ca.pem; \
    fi; \
    pip install ".[sqs,kafka]" && rm -f /tmp/ca.pem

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
RUN groupadd --system --gid 10001 dedupworker \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin dedupworker
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# Example handlers, importable as examples.* from the working directory.
COPY examples ./examples
RUN python -m compileall -q /app/examples
# PYTHONDONTWRITEBYTECODE: everything is compiled above, and the root filesystem may be
# read-only (Kubernetes readOnlyRootFilesystem, compose read_only).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DEDUPWORKER_METRICS_PORT=9100
USER 10001:10001
EXPOSE 9100
# No curl in a slim image: python asks the worker's /healthz (200 while the handler loop moves).
# Only `dedupworker run` serves it; one-shot commands (migrate, enqueue) exit before it matters.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('DEDUPWORKER_METRICS_PORT', '9100'), timeout=4)"]
ENTRYPOINT ["dedupworker"]
CMD ["--help"]
