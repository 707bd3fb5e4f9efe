# One image for every service of docker-compose.yml: the coordinator, the worker agents and the
# one-shot `somatize submit` job. The services give their own commands (there is no ENTRYPOINT).
#
#   docker compose build                 # the pins of constraints.txt, from PyPI
#   docker compose build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#                                        # torch's CPU-only wheels (torch==2.13.0 matches
#                                        # 2.13.0+cpu), a much smaller image on x86_64
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . /app

RUN pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} . \
    && useradd --create-home --uid 10001 somatize \
    && mkdir -p /state \
    && chown somatize:somatize /state

# /state belongs to the unprivileged user, so a fresh named volume mounted there does too.
USER somatize
VOLUME ["/state"]
EXPOSE 8765 9000
