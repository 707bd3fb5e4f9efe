# One image for every service of docker-compose.yml: the coordinator, the worker agents and the
# one-shot `somatize submit` job. The services give their own commands (there is no ENTRYPOINT).
#
#   docker compose build                 # torch's CPU-only wheels (torch==2.13.0 matches
#                                        # 2.13.0+cpu): a much smaller image on x86_64
#   docker compose build --build-arg TORCH_INDEX_URL=
#                                        # PyPI's torch instead (the CUDA build on x86_64)
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# tcmalloc for the workers' filter daemons (worker/daemon/allocator.py): a sharded step takes
# 0.6x of what it takes with glibc's malloc. bubblewrap for their sandbox
# (worker/confinement/sandbox.py): where the container may make namespaces it is the one taken;
# under Docker's default seccomp profile it may not, and a root worker gives each job's daemon
# a uid of its own instead (--sandbox uid: python and the packages live in /usr/local, which
# any uid may read).
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        libtcmalloc-minimal4 bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# The dependencies first, from the project's list and the pins alone: an edit of the source
# reuses this layer, torch included.
COPY pyproject.toml constraints.txt /app/
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/requirements.txt \
    && pip install -c constraints.txt ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r /tmp/requirements.txt

# Then the source (not the examples: the job service mounts its job file).
COPY . /app
RUN pip install --no-deps -c constraints.txt . \
    && useradd --create-home --uid 10001 somatize \
    && mkdir -p /state /results \
    && chown somatize:somatize /state /results

# /state and /results belong to the unprivileged user, so fresh named volumes there do too.
# The coordinator and the job run as it; docker-compose runs the workers as root, which is
# what lets them sandbox job code (a uid per daemon, or bubblewrap's user namespace).
USER somatize
VOLUME ["/state", "/results"]
EXPOSE 8765
